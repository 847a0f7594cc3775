"""Where a GPU workload's time goes under accel: host time per call (no synchronization),
time per call with synchronization, the kernels' own GPU time (torch.profiler), and the
host's hottest Python functions (cProfile); ``--timeline``: when within a call the kernel
is launched.

    python bench/profile_gpu.py [--only NAME[,NAME]] [--top N] [--host | --timeline]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as G  # noqa: E402
from _common import intercept_every_step  # noqa: E402

intercept_every_step()  # where interception's time goes

import accel  # noqa: E402



def host_costs(n: int = 200) -> None:
    """Host µs per call of the chain on a tiny CUDA tensor (the GPU idle): eager, no-op
    dispatch modes, accel; and accel's parts (recording, flush, stream lookup)."""
    from bench_pointwise import NoOpMode, NoOpModeNoDynamoWrap
    from accel import interceptor

    x = torch.randn(4, device="cuda")
    chain = G.B.chain

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, time.perf_counter() - t0)
            torch.cuda.synchronize()
        return best / n * 1e6

    def in_mode(make):
        def run():
            with make():
                chain(x)
        return run

    mode = interceptor.AccelMode()

    def record_only():
        with mode:
            chain(x)
            interceptor._state.region.reset()

    class AllocMode(NoOpModeNoDynamoWrap):  # what any deferral costs: the mode, an output
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return torch.empty_strided((4,), (1,), device=x.device)

    rows = {"eager": lambda: chain(x), "no-op mode": in_mode(NoOpMode),
            "no-op mode (no dynamo wrap)": in_mode(NoOpModeNoDynamoWrap),
            "mode allocating each output, no kernel": in_mode(AllocMode),
            "accel.eager()": in_mode(accel.eager), "accel record only (mode reused)": record_only,
            "enable()+disable() alone": lambda: (accel.enable(), accel.disable()),
            "torch.cuda.current_stream(0).cuda_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
            "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0)}
    for k, fn in rows.items():
        print(f"host {k:45s} {timed(fn):9.1f} us/call (chain: 8 aten calls)")


def _warmed(names, warmup: int):
    """For each workload of ``names`` and each backend: (workload, backend, its synchronized
    callable called ``warmup`` times, the workload's Spec); the Spec is dropped and the
    CUDA cache emptied after its last backend."""
    for name in names:
        spec = G.WORKLOADS[name][1]()
        for label in ("eager", "accel", "compile"):
            f = getattr(spec, label)
            for _ in range(warmup):
                f()
            yield name, label, f, spec
        del spec
        torch.cuda.empty_cache()


def launch_timeline(names=("chain", "rmsnorm", "softmax", "add_ln"), calls: int = 60) -> None:
    """When in a synchronized call each backend's work reaches the GPU: µs from the call's
    start to accel's kernel launch (launched ahead, at the region's first call, or at the
    flush), to the host's return, and to the end of ``torch.cuda.synchronize()`` (medians
    of ``calls`` calls, one backend after another)."""
    from accel import launch as launch_mod

    marks = []
    launch = launch_mod.launch_kernel

    def timed_launch(*a):
        marks.append(time.perf_counter())
        return launch(*a)

    launch_mod.launch_kernel = timed_launch
    try:
        for name, label, f, _ in _warmed(names, 5):
            rows = []
            for _ in range(calls):
                marks.clear()
                t0 = time.perf_counter()
                getattr(f, "unsynced", f)()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                rows.append(((marks[0] - t0) if marks else float("nan"), t1 - t0, t2 - t0))
            med = [sorted(r[i] for r in rows)[calls // 2] * 1e6 for i in range(3)]
            print(f"timeline {name:8s} {label:8s} launch at {med[0]:7.1f} us  host returns "
                  f"{med[1]:7.1f} us  synchronized {med[2]:7.1f} us")
    finally:
        launch_mod.launch_kernel = launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="workloads, comma-separated (default: chain,rmsnorm,gpt2_train; "
                   "with --timeline chain,rmsnorm,softmax,add_ln)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--host", action="store_true", help="host costs only")
    p.add_argument("--cprofile", action="store_true", help="also the host's hottest functions")
    p.add_argument("--timeline", action="store_true",
                   help="only when each backend's work reaches the GPU within a call")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    if a.timeline:
        launch_timeline(*([a.only.split(",")] if a.only else []))
        return 0
    host_costs()
    if a.host:
        return 0
    for name, label, f, spec in _warmed((a.only or "chain,rmsnorm,gpt2_train").split(","), 3):
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                f()
        ev = prof.key_averages()
        gpu = sum(e.device_time_total for e in ev) / 5 / 1e3
        print(f"{name:10s} {label:8s} synced call {sorted(ts)[10] * 1e3:8.3f} ms  "
              f"gpu kernels {gpu:8.3f} ms")
        if label == "accel":
            print(ev.table(sort_by="device_time_total", row_limit=12, max_name_column_width=40))
            if a.cprofile:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(20):
                    spec.accel()
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
