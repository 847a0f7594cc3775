"""Where a GPU workload's time goes under accel: host time per call (no synchronization),
time per call with synchronization, the kernels' own GPU time (torch.profiler), and the
host's hottest Python functions (cProfile).

    python bench/profile_gpu.py [--only NAME[,NAME]] [--top N]
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



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="chain,rmsnorm,gpt2_train")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    for name in a.only.split(","):
        spec = G.WORKLOADS[name][1]()
        for label in ("eager", "accel", "compile"):
            f = getattr(spec, label)
            for _ in range(3):
                f()
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
                print(ev.table(sort_by="device_time_total", row_limit=10))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            spec.accel()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
        del spec
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
