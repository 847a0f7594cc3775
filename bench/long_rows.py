"""Rows longer than a GPU row kernel keeps in registers, and group norm's groups: eager,
accel and torch.compile, ms per call back to back (CUDA events over 20 calls, the median of
15 such, the median of three rounds), each backend's result checked against eager's.
``--scalar``: accel's block loops without their 16-byte vector variant (the code before
the thirty-eighth round, for an A/B in one lease).

    python bench/long_rows.py [--shapes 2048x32768,4096x24576,1024x65536]
                              [--dtypes float32,bfloat16,float16] [--scalar]
                              [--rows softmax,RMSNorm,LayerNorm,residual,GroupNorm]

``--rows``: only these rows (each compiles a kernel per backend: on a lent GPU, device
time), by the first word of their names.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import accel
from _common import accel_fn, check, intercept_every_step, table

intercept_every_step()  # every call intercepted: the kernels are what is timed

from accel.codegen.cuda import CudaRenderer  # noqa: E402

ROWS = {
    "softmax": lambda x, r, w, b: torch.softmax(x * 0.125, -1),
    "RMSNorm": lambda x, r, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    "LayerNorm": lambda x, r, w, b: F.layer_norm(x, [x.shape[-1]], w, b),
    "residual + LayerNorm": lambda x, r, w, b: F.layer_norm(x + r, [x.shape[-1]], w, b),
}
GROUP_NORM_SHAPES = [(64, 256, 64, 64), (32, 512, 64, 64)]
ROW_NAMES = [n.split()[0] for n in ROWS] + ["GroupNorm"]


def back_to_back_ms(fn, args, calls: int = 20, reps: int = 15) -> float:
    """Median ms per call of ``calls`` calls queued back to back, over ``reps`` such runs."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def measure(name: str, fn, args) -> list:
    """One row: eager / accel / torch.compile ms, compile/accel, and each result's check."""
    backends = {"eager": fn, "accel": accel_fn(fn), "compile": torch.compile(fn)}
    ref = fn(*args)
    checks = {}
    for k, f in backends.items():
        for _ in range(3):
            out = f(*args)
        checks[k] = check(name, k, out, ref)
    runs = {k: [] for k in backends}
    for _ in range(3):
        for k, f in backends.items():
            runs[k].append(back_to_back_ms(f, args))
    ms = {k: statistics.median(v) for k, v in runs.items()}
    return [name, f"{ms['eager']:.3f}", f"{ms['accel']:.3f}", f"{ms['compile']:.3f}",
            f"{ms['eager'] / ms['accel']:.2f}x", f"{ms['compile'] / ms['accel']:.2f}x",
            checks["accel"], checks["compile"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2048x32768,4096x24576,1024x65536")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--scalar", action="store_true")
    p.add_argument("--rows", default=None, help="comma-separated: " + ", ".join(ROW_NAMES))
    a = p.parse_args(argv)
    wanted = set(ROW_NAMES if a.rows is None else a.rows.split(","))
    if wanted - set(ROW_NAMES):
        p.error(f"unknown rows {sorted(wanted - set(ROW_NAMES))}; known: {', '.join(ROW_NAMES)}")
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    if a.scalar:
        CudaRenderer._block_loop_vars = lambda self, nest, ir: None
    # before any timing: until the dispatch filter is loaded every call takes the dispatch
    # mode's Python path, and a row of six ops (RMSNorm) is then bound by the host
    if not accel.dispatch.wait():
        print("no dispatch filter here: accel's calls take the dispatch mode's path", file=sys.stderr)
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in [getattr(torch, d) for d in a.dtypes.split(",")]:
        for shape in [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")]:
            x, r = (torch.randn(shape, generator=g).to("cuda", dtype) for _ in range(2))
            w, b = (torch.randn(shape[-1], generator=g).to("cuda", dtype) for _ in range(2))
            for name, fn in ROWS.items():
                if name.split()[0] not in wanted:
                    continue
                rows.append(measure(f"{name} {list(shape)} {str(dtype)[6:]}", fn, (x, r, w, b)))
                print(rows[-1], file=sys.stderr, flush=True)
    # float32 only: a GPU's 16-bit group norm runs eagerly
    for shape in GROUP_NORM_SHAPES if "GroupNorm" in wanted else ():
        x = torch.randn(shape, generator=g).to("cuda")
        w, b = (torch.randn(shape[1], generator=g).to("cuda") for _ in range(2))
        rows.append(measure(f"GroupNorm(32) + SiLU {list(shape)}",
                            lambda x, w, b: F.silu(F.group_norm(x, 32, w, b)), (x, w, b)))
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"# Long rows on {torch.cuda.get_device_name()}{' (scalar block loops)' if a.scalar else ''}\n")
    print(table(["workload", "eager ms", "accel ms", "compile ms", "eager/accel", "compile/accel",
                 "accel == eager", "compile == eager"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
