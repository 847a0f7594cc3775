"""Shape-generic kernels against static ones: back-to-back µs per call of column and whole
reductions (a column sum, mean and variance, a whole mean) under accel, each call flushed,
with ``ACCEL_GENERIC_KERNELS=0`` (every region built for its sizes) and ``1`` (one kernel
for every row count), each in a fresh process with a fresh store, alternating.

    python bench/generic_kernels.py [cpu|cuda] [--rounds N]

A cell is the best of 5 timings of 50 calls (CUDA events on a GPU); the table prints each
variant's range over the rounds.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

PROGRAMS = {"x.sum(0)": lambda x: x.sum(0), "(x * 2).mean(0)": lambda x: (x * 2).mean(0),
            "x.var(0)": lambda x: x.var(0), "(x * x).mean()": lambda x: (x * x).mean()}
SHAPES = {"cuda": [(16384, 4096), (4096, 16384), (8192, 1024), (100000, 96), (500, 1024)],
          "cpu": [(8192, 1024), (100000, 96), (500, 1024)]}


def _child(device: str) -> None:
    os.environ["ACCEL_STEP_SAMPLING"] = "off"
    os.environ["ACCEL_RECOMPILE_LIMIT"] = "0"
    import torch

    import accel

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for shape in SHAPES[device]:
        x = torch.randn(shape, device=device)
        for name, p in PROGRAMS.items():
            with accel.eager():
                p(x)  # (built, or served by a shared kernel)
            best = float("inf")
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                with accel.eager():
                    ys = []
                    for _ in range(50):
                        ys.append(p(x))
                        accel.flush()
                sync()
                best = min(best, (time.perf_counter() - t0) / 50 * 1e6)
            print(f"{name}\t{list(shape)}\t{best:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.device)
        return
    cells = {}
    for _ in range(args.rounds):
        for generic in ("0", "1"):
            env = dict(os.environ, ACCEL_GENERIC_KERNELS=generic, ACCEL_CACHE_DIR=tempfile.mkdtemp())
            out = subprocess.run([sys.executable, __file__, args.device, "--child"], env=env,
                                 capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                name, shape, us = line.split("\t")
                cells.setdefault((name, shape), {}).setdefault(generic, []).append(float(us))
    print(f"back-to-back µs a call, {args.device}, best of 5 x 50 calls, {args.rounds} rounds\n")
    print("| workload | static kernels | shared kernels |\n|---|---|---|")
    for (name, shape), v in cells.items():
        r = ["-".join(f"{f(v[g]):.1f}" for f in (min, max)) for g in ("0", "1")]
        print(f"| `{name}` {shape} | {r[0]} | {r[1]} |")


if __name__ == "__main__":
    main()
