"""Benchmark: eager PyTorch vs accel vs torch.compile, side by side, on CPU.

    python bench/bench_pointwise.py [--quick] [--runs N] [--threads N]

Prints markdown tables:

1. time per call (median ms over N runs after warm-up) of
   (a) the chain ``sin(x) * exp(-x * x) + 0.5 * tanh(x)`` on 16M float32,
   (b) GPT-2's tanh-GELU written out in pointwise ops on [8192, 3072] float32,
   (c) the accel demo's GPT-2 training iteration (forward + backward),
   with the ratios eager/accel and compile/accel, and the memory-bandwidth floor: the
   bytes the workload must move (read input + write output) over the STREAM-triad
   bandwidth measured with torch;
2. (d) the per-call interception cost on a 4-element tensor: no mode, a no-op
   TorchDispatchMode and accel.eager();
3. (e) the first call of (a) in a fresh process with an empty kernel store (cold) and
   again with the same store (warm), against the steady state.

An accel call is timed as one unit, ``with accel.eager(): out = fn(x)``: leaving the
block flushes the pending region, so the result is complete when the block ends.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# _common puts this checkout's accel first on sys.path: import it before accel
from _common import (MiB, accel_fn, compare, interleaved_ms, machine, median_ms,  # noqa: F401
                     table, triad_bandwidth)

import accel  # noqa: E402

CHAIN_N = 16 * MiB  # 16M float32 elements = 64 MiB
GELU_SHAPE = (8192, 3072)


def chain(x):
    return torch.sin(x) * torch.exp(-x * x) + 0.5 * torch.tanh(x)


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def pointwise_row(name, fn, x, runs, bw) -> list:
    """(a), (b): ``fn(x)``; floor = read x + write the result at triad bandwidth."""
    cf = torch.compile(fn)
    return compare(name, lambda: fn(x), lambda: accel_fn(fn)(x), lambda: cf(x), runs,
                   floor_ms=2 * x.nbytes / bw * 1e3)


def gpt2_row(runs) -> list:
    """(c): the demo's GPT-2 forward + backward on three copies of one model; the loss is
    checked (the demo itself checks every gradient)."""
    import copy

    from accel.demo import build_model, make_batch, train_step

    model = build_model()
    ids, labels = make_batch()
    ma, mc = copy.deepcopy(model), torch.compile(copy.deepcopy(model))

    def step_a():
        with accel.eager():
            return train_step(ma, ids, labels)

    from accel.demo import DEFAULTS as d

    return compare(f"(c) GPT-2 train iter (demo: {d['layers']}L, {d['embd']}d, "
                   f"{d['batch']}x{d['seq']})",
                   lambda: train_step(model, ids, labels), step_a,
                   lambda: train_step(mc, ids, labels), runs)


class NoOpMode(TorchDispatchMode):
    """Calls through. Like every TorchDispatchMode subclass (accel's included), torch wraps
    its ``__torch_dispatch__`` in ``torch._disable_dynamo``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class NoOpModeNoDynamoWrap(TorchDispatchMode):
    """The same, opting out of that wrapper (``_should_skip_dynamo`` False)."""

    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_call(n: int, runs: int) -> list:
    """(d): µs per ``y = x + 1.0`` on a 4-element tensor: no mode, no-op modes, accel."""
    x = torch.ones(4)

    def loop():
        y = None
        for _ in range(n):
            y = x + 1.0
        return y

    def in_mode(make):
        def run():
            with make():
                loop()
        return run

    fns = {"no mode (plain eager)": loop, "no-op TorchDispatchMode": in_mode(NoOpMode),
           "no-op mode, _should_skip_dynamo() False": in_mode(NoOpModeNoDynamoWrap),
           "accel.eager()": in_mode(accel.eager)}
    for fn in fns.values():
        fn()  # warm-up: accel compiles its capped regions
    accel.reset_stats()
    us = {k: v * 1e3 / n for k, v in interleaved_ms(fns, runs, min).items()}
    flushes = accel.stats()["flushes"] / runs
    noop = us["no-op TorchDispatchMode"]
    rows = [[k, f"{v:.2f}", f"{v - noop:+.2f}" if k == "accel.eager()" else ""]
            for k, v in us.items()]
    rows[-1][0] += f" ({flushes:.0f} flushes per {n} calls)"
    return rows


def first_call_child(runs: int, preimport: bool) -> None:
    """In a fresh process: time the first accelerated call of (a), then the steady state.
    ``preimport``: import torch._dynamo first (the first call of any TorchDispatchMode
    subclass does, through torch's ``_disable_dynamo`` wrapper), to show accel's own part."""
    t0 = time.perf_counter()
    if preimport:
        importlib.import_module("torch._dynamo")
    imp = time.perf_counter() - t0
    x = torch.randn(CHAIN_N, generator=torch.Generator().manual_seed(0))
    af = accel_fn(chain)
    t0 = time.perf_counter()
    af(x)
    first = time.perf_counter() - t0
    steady = median_ms(lambda: af(x), runs, warmup=0)
    print(json.dumps({"first_ms": first * 1e3, "steady_ms": steady, "import_ms": imp * 1e3,
                      **accel.stats()}))


def first_call(runs: int, threads) -> list:
    """(e): cold (empty store) and warm (same store) first calls, each in a new process."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="accel-bench-") as d:
        env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_EAGER", "ACCEL_DISABLE")}
        env["ACCEL_CACHE_DIR"] = os.path.join(d, "store")
        for label, extra in (("cold (empty store)", []), ("warm (same store)", []),
                             ("warm, torch._dynamo imported before", ["--_preimport"])):
            cmd = [sys.executable, os.path.abspath(__file__), "--_first-call", "--runs", str(runs),
                   *extra, *(["--threads", str(threads)] if threads else [])]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode:
                err = " ".join(p.stderr.split())[-200:].replace("|", "/")
                rows.append([label, f"error: exit {p.returncode}: {err}"] + [""] * 5)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            if extra:
                label += f" ({r['import_ms']:.0f} ms, not counted)"
            rows.append([label, f"{r['first_ms']:.1f}", f"{r['steady_ms']:.2f}", str(r["compiles"]),
                         str(r["store_hits"]), f"{r['compile_time_s']:.2f}",
                         f"{r['load_time_s'] * 1e3:.2f}"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer runs (about a minute)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per cell")
    p.add_argument("--threads", type=int, default=None, help="torch (and accel) CPU threads")
    p.add_argument("--_first-call", dest="child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_preimport", dest="preimport", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runs = args.runs or (3 if args.quick else 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        first_call_child(runs, args.preimport)
        return 0
    t_start = time.perf_counter()
    print(f"# accel benchmark{' (--quick)' if args.quick else ''}\n\n{machine()}\n")
    bw = triad_bandwidth(runs)
    print(f"STREAM triad (torch.add(b, c, alpha=s, out=a), 3 x 64 MiB float32): "
          f"{bw / 1e9:.2f} GB/s (best of {runs + 2})\n")

    torch.manual_seed(0)
    rows = [pointwise_row("(a) sin*exp+tanh chain, 16M f32", chain, torch.randn(CHAIN_N), runs, bw),
            pointwise_row("(b) tanh-GELU, [8192, 3072] f32", gelu, torch.randn(GELU_SHAPE), runs,
                          bw)]
    try:
        rows.append(gpt2_row(runs))
    except ImportError as e:
        rows.append(["(c) GPT-2 train iter", f"skipped: {e}"] + [""] * 7)
    print(f"## Time per call (median ms of {runs}, after warm-up, backends interleaved)\n")
    print(table(["workload", "eager ms", "accel ms", "compile ms", "floor ms", "eager/accel",
                 "compile/accel", "accel/floor", "accel == eager"], rows))
    print("\nfloor = bytes moved (read input + write output) / triad bandwidth; "
          "compile = torch.compile(fn), default inductor, warmed up.\n")

    n = 20000
    print(f"## (d) Per-call cost: `y = x + 1.0` on a 4-element tensor, {n} calls "
          f"(best of {max(runs, 10)}, backends interleaved)\n")
    print(table(["mode", "µs per call", "accel added vs no-op mode (µs)"], per_call(n, max(runs, 10))))
    print("\nFlushes come from the region cap ACCEL_MAX_REGION "
          f"(= {os.environ.get('ACCEL_MAX_REGION', 256)}) and the end of the block.\n")

    print(f"## (e) First call of (a) in a new process (steady = median of {runs} after it)\n")
    print(table(["run", "first call ms", "steady ms", "compiles", "store hits", "compile s",
                 "load ms"], first_call(runs, args.threads)))
    print(f"\ntotal benchmark time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
