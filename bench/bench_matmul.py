"""float32 CPU matmuls: eager's kernel (MKL's sgemm) against accel's (include/accel/gemm.h),
one product at a time, on the shapes of the demo's GPT-2 step and bench_cpu.py's MLP block.

For each shape: median ms of eager and of accel (the call under ``accel.eager()``, so
accel's cost of entering the block counts), GFLOP/s, and how many of accel's results equal
eager's bit for bit (and the largest difference, where they do not). Timed round-robin.

    python bench/bench_matmul.py [--runs 30]
"""
from __future__ import annotations

import argparse

import torch

from _common import accel_fn, interleaved_ms, machine, table

import accel  # noqa: E402  (after _common: this checkout's accel)
from accel import config, dispatch  # noqa: E402

# (label, op, shapes of its arguments, transposed operands)
CASES = [
    ("GPT-2 qkv projection (addmm)", "addmm", (1024, 256, 768), ""),
    ("GPT-2 MLP up (addmm)", "addmm", (1024, 256, 1024), ""),
    ("GPT-2 MLP down (addmm)", "addmm", (1024, 1024, 256), ""),
    ("GPT-2 lm_head (mm, weight^T)", "mm", (1024, 256, 1000), "b"),
    ("GPT-2 weight gradient (mm, x^T)", "mm", (1024, 1024, 256), "a"),
    ("GPT-2 attention scores (bmm)", "bmm", (32, 128, 64, 128), "b"),
    ("MLP block fc1 (addmm)", "addmm", (2048, 1024, 4096), ""),
    ("MLP block fc2 (addmm)", "addmm", (2048, 4096, 1024), ""),
    ("small (mm)", "mm", (128, 128, 128), ""),
]


def operands(op, dims, trans, g):
    """The arguments of one case: (M, K, N) or, for bmm, (batch, M, K, N)."""
    if op == "bmm":
        B, M, K, N = dims
        a = torch.randn(B, M, K, generator=g)
        b = (torch.randn(B, N, K, generator=g).transpose(1, 2) if "b" in trans
             else torch.randn(B, K, N, generator=g))
        return (a, b), 2 * B * M * N * K
    M, K, N = dims
    a = torch.randn(K, M, generator=g).t() if "a" in trans else torch.randn(M, K, generator=g)
    b = torch.randn(N, K, generator=g).t() if "b" in trans else torch.randn(K, N, generator=g)
    if op == "addmm":
        return (torch.randn(N, generator=g), a, b), 2 * M * N * K
    return (a, b), 2 * M * N * K


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args(argv)
    print(machine())
    if not dispatch.wait(600):
        print("no dispatch filter here: accel runs eager's matmuls")
    with accel.eager():
        mode = config.flag("ACCEL_CPU_MATMUL")
        on = dispatch.set_matmul(mode)
    print(f"accel's matmul kernel (ACCEL_CPU_MATMUL={mode}): {'on' if on else 'off'}\n")
    g = torch.Generator().manual_seed(0)
    rows = []
    for label, op, dims, trans in CASES:
        fn = getattr(torch, op)
        xs, flops = operands(op, dims, trans, g)
        ref = fn(*xs)
        before = dispatch.matmuls()
        out = accel_fn(fn)(*xs)
        ran = dispatch.matmuls() - before
        same = (out == ref).float().mean().item()
        diff = (out - ref).abs().max().item()
        ms = interleaved_ms({"eager": lambda: fn(*xs), "accel": lambda: accel_fn(fn)(*xs)}, args.runs)
        te, ta = ms["eager"], ms["accel"]
        rows.append([label, "x".join(map(str, dims)), f"{te:.3f}", f"{ta:.3f}",
                     f"{flops / te / 1e6:.0f}", f"{flops / ta / 1e6:.0f}", f"{te / ta:.2f}x",
                     "yes" if ran else "no (eager's)", f"{same * 100:.1f} %" + ("" if same == 1 else f", max diff {diff:.1e}")])
    print(table(["product", "shape", "eager ms", "accel ms", "eager GFLOP/s", "accel GFLOP/s",
                 "eager/accel", "accel's kernel", "bits equal to eager's"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
