"""When in a synchronized call accel's kernel starts: for the memory-bound workloads of
``bench_gpu.py`` (softmax, bias + GELU, residual add + LayerNorm, RMSNorm), the median µs of
a whole call under ``accel.eager()`` (``torch.cuda.synchronize()`` included), of the host's
time from the call to the launch of its kernel (launched ahead, at the region's first
call), and of the wait in the synchronization after the call returned; with launching
ahead on and off, next to eager's call and two references: a device-to-device copy of
one input's bytes and an empty synchronization, timed alike. The kernel's own time is
``bench_gpu.py``'s "kernels ms" column.

On a CPU (for the host's side on a machine without a GPU) the workloads run on [64, 64]
and launching ahead is ``all`` (small regions fused): there the launch runs the kernel,
so "to launch" is the host's time before it. Without launching ahead the kernel is
launched by the flush, in the native core, and "to launch" is not timed ("-").

    python bench/launch_latency.py [cuda|cpu] [--calls 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _common  # puts this checkout's accel first on sys.path
_common.intercept_every_step()  # it times interception itself
import torch

import accel
import workloads as W
from accel import launch

_LAUNCHED: list = []


def _noting_launch(orig):
    def launch(*args):
        if not _LAUNCHED:
            _LAUNCHED.append(time.perf_counter())
        return orig(*args)
    return launch


def timed(fn, args, sync, calls: int) -> tuple:
    """Median µs of (the whole call with its synchronization, the host's time to the first
    kernel launch, the synchronization's wait after the call returned)."""
    for _ in range(5):
        fn(*args)
        sync()
    whole, to_launch, wait = [], [], []
    for _ in range(calls):
        _LAUNCHED.clear()
        t0 = time.perf_counter()
        fn(*args)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        whole.append(t2 - t0)
        wait.append(t2 - t1)
        if _LAUNCHED:
            to_launch.append(_LAUNCHED[0] - t0)
    med = lambda v: statistics.median(v) * 1e6 if v else float("nan")  # noqa: E731
    return med(whole), med(to_launch), med(wait)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args(argv)
    dev = args.device
    rows, cols = (16384, 4096) if dev == "cuda" else (64, 64)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    on = "cuda" if dev == "cuda" else "all"
    if dev != "cuda":  # tiny regions: fused and launched ahead all the same
        os.environ.update(ACCEL_LAUNCH_AHEAD_MIN_MB="0", ACCEL_EAGER_SMALL_REGIONS="0")

    def rn(*shape, seed=0):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dev)

    cases = {
        "softmax(x * 0.125)": (W.scaled_softmax, (rn(rows, cols),)),
        "bias + tanh-GELU": (W.bias_gelu, (rn(rows, cols), rn(cols, seed=1))),
        "residual add + LayerNorm": (W.add_layernorm, (rn(rows, cols), rn(rows, cols, seed=1),
                                                       rn(cols, seed=2), rn(cols, seed=3))),
        "RMSNorm": (W.rmsnorm, (rn(rows, cols), rn(cols, seed=1))),
    }
    launch.launch_kernel = _noting_launch(launch.launch_kernel)
    accel.dispatch.wait()
    src = rn(rows, cols)
    dst = torch.empty_like(src)
    print(f"# Time to the kernel's launch, {dev} [{rows}, {cols}] float32 "
          f"(median µs of {args.calls} calls)\n")
    print(f"copy of one input: {timed(lambda: dst.copy_(src), (), sync, args.calls)[0]:.1f} µs; "
          f"an empty synchronization: {timed(lambda: None, (), sync, args.calls)[0]:.1f} µs\n")
    print("| workload | launch ahead | accel µs | to launch µs | wait µs | eager µs | "
          "launched ahead / flushes |")
    print("|---|---|---|---|---|---|---|")
    for ahead in (on, "off"):
        os.environ["ACCEL_LAUNCH_AHEAD"] = ahead  # read at each enable
        for name, (f, a) in cases.items():
            def under_accel(*xs, f=f):
                with accel.eager():
                    return f(*xs)

            before = accel.stats()
            whole, to_launch, wait = timed(under_accel, a, sync, args.calls)
            after = accel.stats()
            eager = timed(f, a, sync, args.calls)[0]
            tl = "-" if to_launch != to_launch else f"{to_launch:.1f}"
            print(f"| {name} | {ahead} | {whole:.1f} | {tl} | {wait:.1f} | {eager:.1f} | "
                  f"{after['speculative_launches'] - before['speculative_launches']} / "
                  f"{after['flushes'] - before['flushes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
