"""Where accel's host time goes in the demo's GPT-2 training step, per step: the flushes
(of which the runtime's ``execute``, and of that the launches themselves and the
predictions kept for launching ahead), the kernels launched ahead at regions' first calls,
and the calls recorded on an autograd device thread (CUDA backward) -- each as µs a
step and calls a step, next to the whole step's time under eager and accel.

Each part is timed by wrapping the function with ``time.perf_counter`` (about 0.1 µs a
call on the dev VM is the wrapper's own); parts nest (``execute`` is inside the flush).
First, unwrapped, the host's time per iteration of a small loop: a five-call region on a
[4, 8] tensor (``softmax(x * 0.125)``, ``+ 1``, ``tanh``, ``sum``), then a matmul that
flushes it, eager and under accel (best of three medians).

``--ops`` instead: the host's µs a step and a call of each top-level aten op
(torch.profiler's CPU time, an op's own recording or flush included; the profiler adds a
few µs a call on both sides), eager and accel side by side, the largest differences
first. ``--cprofile``: the same for each Python function and builtin's own time
(cProfile; a builtin's includes the C++ below it, not the Python it calls back).

``--tiny``: a GPT-2 of 32 channels, 2 heads, a batch of one 8-token sequence instead of the
demo's, whose step is host-bound on the CPU as the demo's is on a GPU (a proxy for the
GPU's host cost on a machine without one; one thread).

    python bench/host_parts.py [--device cpu|cuda] [--steps 30] [--tiny] [--ops | --cprofile]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import _common  # puts this checkout's accel first on sys.path
_common.intercept_every_step()  # it times interception itself
import torch

import accel
from accel import dispatch, interceptor, launch


_pc = time.perf_counter
TIMES: dict = {}


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = _pc()
        try:
            return fn(*args, **kwargs)
        finally:
            acc = TIMES.setdefault(name, [0.0, 0])
            acc[0] += _pc() - t0
            acc[1] += 1

    return wrapper


def _wrap_parts() -> None:
    """Time the parts (module globals and the worker's method, looked up at each call)."""
    interceptor._flush_region = _timed("flush", interceptor._flush_region)
    interceptor.execute = _timed("  execute", interceptor.execute)
    launch.launch_kernel = _timed("    launch", launch.launch_kernel)
    launch.predict = _timed("    predict (for launching ahead)", launch.predict)
    interceptor.speculate = _timed("launch ahead at a first call", interceptor.speculate)
    init = interceptor._Worker.__init__

    def worker_init(self, region):
        init(self, region)
        self.replay_fn = _timed("device thread: record a call", self.replay_fn)

    interceptor._Worker.__init__ = worker_init


def small_region_loop(dev, n: int = 2000) -> None:
    """Print µs per iteration of the five-call region and its flushing matmul."""
    x = torch.randn(4, 8, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def body():
        for _ in range(10):
            torch.tanh(torch.softmax(x * 0.125, -1) + 1).sum(-1)
            torch.mm(x.t(), x)

    def with_accel():
        with accel.eager():
            body()

    best = {}
    for _ in range(3):
        for name, fn in (("eager", body), ("accel", with_accel)):
            fn()
            sync()
            ts = []
            for _ in range(n // 10):
                t0 = _pc()
                fn()
                ts.append(_pc() - t0)
            sync()
            best[name] = min(best.get(name, 1e9), statistics.median(ts) / 10 * 1e6)
    print(f"five-call region + flushing matmul on {dev}: eager {best['eager']:.1f} µs, "
          f"accel {best['accel']:.1f} µs an iteration")


def _steps(me, ma, ids, labels, sync):
    def eager():
        me.zero_grad(set_to_none=True)
        me(ids, labels=labels).loss.backward()
        sync()

    def with_accel():
        with accel.eager():
            ma.zero_grad(set_to_none=True)
            ma(ids, labels=labels).loss.backward()
        sync()

    return (("eager", eager), ("accel", with_accel))


def _diff_table(per: dict, steps: int, label: str) -> None:
    (e_ops, _), (a_ops, _) = per["eager"], per["accel"]
    rows = []
    for k in set(e_ops) | set(a_ops):
        (et, en), (at, an) = e_ops.get(k, (0.0, 0)), a_ops.get(k, (0.0, 0))
        rows.append(((at - et) / steps, k, et / steps, en / steps, at / steps, an / steps))
    rows.sort(key=lambda r: -abs(r[0]))
    print(f"| {label} | eager µs a step | calls | µs a call | accel µs a step | calls | µs a call "
          "| accel - eager µs a step |\n|---|---|---|---|---|---|---|---|")
    for d, k, et, en, at, an in rows[:30]:
        print(f"| {k} | {et:.0f} | {en:.0f} | {et / en if en else 0:.1f} | {at:.0f} | {an:.0f} | "
              f"{at / an if an else 0:.1f} | {d:+.0f} |")


def py_costs(me, ma, ids, labels, sync, steps: int) -> int:
    """Print the own time a step of each Python function and builtin (cProfile: on Python
    3.12 and later, every thread's, autograd's device thread included), eager and accel,
    by the difference a step."""
    import cProfile
    import os
    import pstats

    per = {}
    for name, fn in _steps(me, ma, ids, labels, sync):
        for _ in range(5):
            fn()
        pr = cProfile.Profile()
        t0 = _pc()
        pr.enable()
        for _ in range(steps):
            fn()
        pr.disable()
        wall = (_pc() - t0) / steps
        st = pstats.Stats(pr).stats
        ops = {}
        for (file, line, func), (cc, nc, tt, ct, callers) in st.items():
            k = f"{os.path.basename(file)}:{line}({func})" if file != "~" else func
            acc = ops.setdefault(k, [0.0, 0])
            acc[0] += tt * 1e6
            acc[1] += nc
        per[name] = (ops, wall)
        print(f"{name}: {wall * 1e3:.3f} ms a step under cProfile")
    _diff_table(per, steps, "function")
    return 0


def op_costs(me, ma, ids, labels, sync, steps: int) -> int:
    """Print the host's µs a step and a call of each aten op (top-level calls: an op's
    own inner calls are inside its time), eager and accel, by the difference a step."""
    from torch.profiler import ProfilerActivity, profile

    per = {}
    for name, fn in _steps(me, ma, ids, labels, sync):
        for _ in range(5):
            fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = _pc()
            for _ in range(steps):
                fn()
            wall = (_pc() - t0) / steps
        top = sorted((ev for ev in prof.events() if ev.name.startswith("aten::")),
                     key=lambda e: (e.time_range.start, -e.time_range.end))
        ops, ends = {}, {}
        for ev in top:  # top-level: not inside an earlier op's span on the same thread
            if ev.time_range.start < ends.get(ev.thread, -1):
                continue
            ends[ev.thread] = ev.time_range.end
            acc = ops.setdefault(ev.name, [0.0, 0])
            acc[0] += ev.time_range.elapsed_us()
            acc[1] += 1
        per[name] = (ops, wall)
    (e_ops, e_wall), (a_ops, a_wall) = per["eager"], per["accel"]
    print(f"GPT-2 step under torch.profiler: eager {e_wall * 1e3:.3f} ms, accel {a_wall * 1e3:.3f} ms; "
          f"top-level aten ops {sum(v[0] for v in e_ops.values()) / steps / 1e3:.3f} ms and "
          f"{sum(v[0] for v in a_ops.values()) / steps / 1e3:.3f} ms a step")
    _diff_table(per, steps, "op")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ops", action="store_true", help="host µs per aten op, eager vs accel")
    p.add_argument("--cprofile", action="store_true", help="own time per Python function, eager vs accel")
    p.add_argument("--tiny", action="store_true", help="a host-bound GPT-2 (32 channels, 8 tokens)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base, ids, labels = _common.gpt2(dev, args.tiny)
    me, ma = copy.deepcopy(base), copy.deepcopy(base)
    dispatch.wait()
    if args.ops or args.cprofile:
        return (op_costs if args.ops else py_costs)(me, ma, ids, labels, sync, args.steps)
    small_region_loop(dev)
    _wrap_parts()

    phases = {}

    def step(model):
        t0 = _pc()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels).loss
        t1 = _pc()
        loss.backward()
        return t0, t1

    def eager():
        t0, t1 = step(me)
        sync()
        phases.setdefault("eager", []).append((t1 - t0, _pc() - t1))

    def with_accel():
        with accel.eager():
            t0, t1 = step(ma)
        sync()
        phases.setdefault("accel", []).append((t1 - t0, _pc() - t1))

    for _ in range(5):
        eager()
        with_accel()
    TIMES.clear()
    phases.clear()
    before = accel.stats()
    ts = {"eager": [], "accel": []}
    for _ in range(args.steps):
        for name, fn in (("eager", eager), ("accel", with_accel)):
            t0 = _pc()
            fn()
            ts[name].append(_pc() - t0)
    n = args.steps
    print(f"GPT-2 step on {dev}: eager {statistics.median(ts['eager']) * 1e3:.3f} ms, "
          f"accel {statistics.median(ts['accel']) * 1e3:.3f} ms (medians of {n})")
    for name, ph in phases.items():
        print(f"  {name}: forward {statistics.median(p[0] for p in ph) * 1e3:.3f} ms, backward "
              f"(and the flush, synchronized) {statistics.median(p[1] for p in ph) * 1e3:.3f} ms")
    after = accel.stats()
    print(f"  accel: {(after['flushes'] - before['flushes']) / n:.1f} flushes a step; "
          f"{(after['small_region_calls'] - before['small_region_calls']) / n:.1f} calls a step run "
          "eagerly as small regions' first calls")
    print("| part | µs a step | calls a step | µs a call |\n|---|---|---|---|")
    for name, (t, k) in TIMES.items():
        print(f"| {name} | {t / n * 1e6:.0f} | {k / n:.1f} | {t / k * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
