"""Benchmark: eager PyTorch vs accel vs torch.compile, side by side, on CPU.

    python bench/bench_pointwise.py [--quick] [--runs N]

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
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# measure the accel of this checkout, not whichever one is installed
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "accel")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import accel  # noqa: E402

MiB = 1 << 20
CHAIN_N = 16 * MiB  # 16M float32 elements = 64 MiB
GELU_SHAPE = (8192, 3072)


def chain(x):
    return torch.sin(x) * torch.exp(-x * x) + 0.5 * torch.tanh(x)


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def accel_fn(fn):
    """``fn`` run under accel, complete on return."""
    def run(*args):
        with accel.eager():
            out = fn(*args)
        return out
    return run


def median_ms(fn, runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"CPU: {cpu}; {os.cpu_count()} cores; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); accel {accel.__version__} "
            f"({os.path.dirname(accel.__file__)}); "
            f"Python {platform.python_version()}")


def triad_bandwidth(runs: int) -> float:
    """STREAM triad a = b + s*c on 64 MiB float32 tensors: best bytes/s (3 x 64 MiB moved)."""
    n = 64 * MiB // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best = float("inf")
    for _ in range(runs + 2):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best


def try_compile(fn, *args):
    """``(compiled fn, None)`` warmed up, or ``(None, error text)``."""
    try:
        cf = torch.compile(fn)
        cf(*args)
        return cf, None
    except Exception as e:  # noqa: BLE001 - reported in the table
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"


def _cell(ms) -> str:
    return f"{ms:.2f}" if isinstance(ms, float) else str(ms)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def bench_workload(name, fn, args, runs, nbytes, bw, check) -> list:
    """One table row: eager, accel, compile, floor, ratios, accel-vs-eager check."""
    ref = fn(*args)
    t_e = median_ms(lambda: fn(*args), runs)
    af = accel_fn(fn)
    try:
        check(af(*args), ref)
        ok = "yes"
    except AssertionError as e:
        ok = "MISMATCH"
        print(f"accel differs from eager on {name}: {e}", file=sys.stderr)
    t_a = median_ms(lambda: af(*args), runs)
    cf, err = try_compile(fn, *args)
    t_c = median_ms(lambda: cf(*args), runs) if cf else f"error: {err}"
    floor = nbytes / bw * 1e3 if nbytes else "-"
    return [name, _cell(t_e), _cell(t_a), _cell(t_c), _cell(floor), _ratio(t_e, t_a),
            _ratio(t_c, t_a), _ratio(t_a, floor), ok]


def _close(a, b):
    torch.testing.assert_close(a, b)


def gpt2_row(runs):
    from accel.demo import build_model, make_batch, train_step
    import copy

    model = build_model()
    ids, labels = make_batch()
    me, ma, mc = model, copy.deepcopy(model), copy.deepcopy(model)

    def check(loss_a, loss_e):
        torch.testing.assert_close(loss_a, loss_e)

    def step_e():
        return train_step(me, ids, labels)

    def step_a():
        with accel.eager():
            return train_step(ma, ids, labels)

    def step_c(cm=[None]):
        if cm[0] is None:
            cm[0] = torch.compile(mc)
        return train_step(cm[0], ids, labels)

    row = ["(c) GPT-2 train iter (demo: 2L, 128d, 4x64)"]
    ref = step_e()
    t_e = median_ms(step_e, runs)
    try:
        check(step_a(), ref)
        ok = "yes"
    except AssertionError as e:
        ok = "MISMATCH"
        print(f"accel differs from eager on GPT-2 loss: {e}", file=sys.stderr)
    t_a = median_ms(step_a, runs)
    try:
        step_c()
        t_c = median_ms(step_c, runs)
    except Exception as e:  # noqa: BLE001
        t_c = f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return row + [_cell(t_e), _cell(t_a), _cell(t_c), "-", _ratio(t_e, t_a), _ratio(t_c, t_a),
                  "-", ok]


class NoOpMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_call(n: int, repeats: int) -> list:
    """(d): µs per ``y = x + 1.0`` on a 4-element tensor: no mode, no-op mode, accel."""
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

    res = {"no mode (eager)": median_ms(loop, repeats) * 1e3 / n,
           "no-op TorchDispatchMode": median_ms(in_mode(NoOpMode), repeats) * 1e3 / n}
    in_mode(accel.eager)()  # compile the capped regions
    accel.reset_stats()
    res["accel.eager()"] = median_ms(in_mode(accel.eager), repeats, warmup=0) * 1e3 / n
    flushes = accel.stats()["flushes"] / repeats
    noop = res["no-op TorchDispatchMode"]
    rows = [[k, f"{v:.2f}", f"{v - noop:+.2f}" if k == "accel.eager()" else ""]
            for k, v in res.items()]
    rows[-1][0] += f" ({flushes:.0f} flushes per {n} calls)"
    return rows


def first_call_child(runs: int) -> None:
    """In a fresh process: time the first accelerated call of (a), then the steady state."""
    x = torch.randn(CHAIN_N, generator=torch.Generator().manual_seed(0))
    af = accel_fn(chain)
    t0 = time.perf_counter()
    af(x)
    first = time.perf_counter() - t0
    steady = median_ms(lambda: af(x), runs, warmup=0)
    print(json.dumps({"first_ms": first * 1e3, "steady_ms": steady, **accel.stats()}))


def first_call(runs: int) -> list:
    """(e): cold (empty store) and warm (same store) first calls, each in a new process."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="accel-bench-") as d:
        env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_EAGER", "ACCEL_DISABLE")}
        env["ACCEL_CACHE_DIR"] = os.path.join(d, "store")
        for label in ("cold (empty store)", "warm (same store)"):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_first-call",
                                "--runs", str(runs)], env=env, capture_output=True, text=True)
            if p.returncode:
                rows.append([label, f"error: exit {p.returncode}: {p.stderr.strip()[-200:]}"] + [""] * 5)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append([label, f"{r['first_ms']:.1f}", f"{r['steady_ms']:.2f}", str(r["compiles"]),
                         str(r["store_hits"]), f"{r['compile_time_s']:.2f}",
                         f"{r['load_time_s'] * 1e3:.2f}"])
    return rows


def table(head, rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer runs (about a minute)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per cell")
    p.add_argument("--_first-call", dest="child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runs = args.runs or (3 if args.quick else 10)
    if args.child:
        first_call_child(runs)
        return 0
    t_start = time.perf_counter()
    print(f"# accel benchmark{' (--quick)' if args.quick else ''}\n\n{machine()}\n")
    bw = triad_bandwidth(runs)
    print(f"STREAM triad (torch.add(b, c, alpha=s, out=a), 3 x 64 MiB float32): "
          f"{bw / 1e9:.2f} GB/s (best of {runs + 2})\n")

    torch.manual_seed(0)
    x = torch.randn(CHAIN_N)
    g = torch.randn(GELU_SHAPE)
    rows = [
        bench_workload("(a) sin*exp+tanh chain, 16M f32", chain, (x,), runs, 2 * x.nbytes, bw, _close),
        bench_workload("(b) tanh-GELU, [8192, 3072] f32", gelu, (g,), runs, 2 * g.nbytes, bw, _close),
    ]
    del x, g
    try:
        rows.append(gpt2_row(runs))
    except ImportError as e:
        rows.append(["(c) GPT-2 train iter", f"skipped: {e}"] + [""] * 7)
    print(f"## Time per call (median ms of {runs} after warm-up)\n")
    print(table(["workload", "eager ms", "accel ms", "compile ms", "floor ms", "eager/accel",
                 "compile/accel", "accel/floor", "accel == eager"], rows))
    print("\nfloor = bytes moved (read input + write output) / triad bandwidth; "
          "compile = torch.compile(fn), default inductor, warmed up.\n")

    n = 20000
    print(f"## (d) Per-call cost: `y = x + 1.0` on a 4-element tensor, {n} calls "
          f"(median of {runs})\n")
    print(table(["mode", "µs per call", "accel added vs no-op mode (µs)"], per_call(n, runs)))
    print("\nFlushes come from the region cap ACCEL_MAX_REGION "
          f"(= {os.environ.get('ACCEL_MAX_REGION', 256)}) and the end of the block.\n")

    print(f"## (e) First call of (a) in a new process (steady = median of {runs} after it)\n")
    print(table(["run", "first call ms", "steady ms", "compiles", "store hits", "compile s",
                 "load ms"], first_call(runs)))
    print(f"\ntotal benchmark time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
