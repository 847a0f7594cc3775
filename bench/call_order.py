"""Per synchronized call, the memory-bound GPU workloads of bench_gpu.py timed three ways in
one process: interleaved call by call (bench_gpu.py's way: eager, accel, torch.compile,
eager, ...), in rotating blocks of 10 calls per backend, and 40 calls in a row per backend.
Each way's median ms and fraction of the floor (the workload's bytes over the best 1 GiB
device-to-device copy), after 5 untimed calls of each backend. Shows how much of a
per-call time is the order the calls come in (a GPU's clocks, caches and TLBs, the
allocator) rather than the backend. ``--profiler``: then bench_gpu.py's kernel timing
(torch.profiler with CUDA activities) of accel and torch.compile, and 40 in a row again.

    python bench/call_order.py [chain,bias_gelu,add_ln,softmax,rmsnorm] [--profiler]
"""
from __future__ import annotations

import statistics
import sys
import time

import bench_gpu as G  # puts this checkout's accel first on sys.path
import torch
from _common import intercept_every_step, interleaved_ms, median_ms

intercept_every_step()  # it times interception itself, call by call

import accel

_MEMORY_BOUND = "chain,bias_gelu,add_ln,softmax,rmsnorm"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    profile = "--profiler" in argv
    argv = [a for a in argv if a != "--profiler"]
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    accel.dispatch.wait()
    bw = G.copy_bandwidth()
    print("| workload | order | eager ms | accel ms | compile ms | floor ms | floor/accel | floor/compile |")
    print("|---|---|---|---|---|---|---|---|")
    for name in (argv[0] if argv else _MEMORY_BOUND).split(","):
        spec = G.WORKLOADS[name][1]()
        fns = {"eager": spec.eager, "accel": spec.accel, "compile": spec.compile}
        for f in fns.values():
            for _ in range(5):
                f()
        out = spec.eager()
        outs = out if isinstance(out, (tuple, list)) else [out]
        floor = (spec.in_bytes + sum(t.nbytes for t in outs)) / bw * 1e3
        del out, outs
        ways = {"interleaved": interleaved_ms(fns, 30)}
        blocks = {b: [] for b in fns}
        for _ in range(4):
            for b, f in fns.items():
                blocks[b] += [_timed(f) for _ in range(10)]
        ways["blocks of 10"] = {b: statistics.median(v) * 1e3 for b, v in blocks.items()}
        ways["40 in a row"] = {b: median_ms(f, 40, warmup=5) for b, f in fns.items()}
        if profile:  # bench_gpu.py's kernel times (torch.profiler), then the same again
            G.kernel_ms(spec.accel), G.kernel_ms(spec.compile)
            ways["40 in a row, after torch.profiler"] = {b: median_ms(f, 40, warmup=5)
                                                         for b, f in fns.items()}
        for way, ms in ways.items():
            print(f"| {name} | {way} | {ms['eager']:.3f} | {ms['accel']:.3f} | {ms['compile']:.3f} | "
                  f"{floor:.3f} | {floor / ms['accel'] * 100:.0f} % | {floor / ms['compile'] * 100:.0f} % |")
        del spec, fns
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
