"""Helpers shared by the benchmark scripts in bench/: machine description, STREAM-triad
bandwidth, interleaved (round-robin) timing, checking results against eager, table rows and
markdown tables.

Importing this module puts the checkout's ``accel`` first on ``sys.path``, so the scripts
measure the accel of this tree, not whichever one is installed.
"""
from __future__ import annotations

import itertools
import os
import platform
import statistics
import sys
import time

import torch

# measure the accel of this checkout, not whichever one is installed
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "accel")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import accel  # noqa: E402

MiB = 1 << 20

# The benchmarks time kernels over sweeps of shapes of one region (long rows, layouts), each
# call a step: the recompile limit, for programs whose shapes keep changing, would run the
# later shapes eagerly (accel.runtime._may_build).
os.environ.setdefault("ACCEL_RECOMPILE_LIMIT", "0")


def intercept_every_step() -> None:
    """Turn accel's step sampling off for this process (unless ACCEL_STEP_SAMPLING is set):
    the scripts that take accel's host cost apart time interception itself, which sampling
    turns off in the host-bound steps they time (accel/sampling.py). Call before enabling."""
    os.environ.setdefault("ACCEL_STEP_SAMPLING", "off")


def sampling_warmup() -> int:
    """Calls of an accelerated workload that bring accel's step sampling to its first
    decision (its warm-up and first trial, and the second trial that confirms an "off"
    verdict, a few steps to spare; 0 with sampling off), so that what is timed next is
    accel's steady state."""
    from accel import config, sampling

    if config.flag("ACCEL_STEP_SAMPLING") == "off":
        return 0
    return sampling.QUIET_STEPS + 2 * len(sampling.TRIAL) + 4


def gpt2(device, tiny: bool = False):
    """The demo's GPT-2 and batch on ``device``: (model, input_ids, labels). ``tiny``: 32
    channels, 2 heads, one 8-token sequence, and one torch thread: a step as host-bound on
    the CPU as the demo's is on a GPU (a proxy for the GPU's host cost)."""
    from accel.demo import build_model, make_batch

    if tiny:
        torch.set_num_threads(1)
        model, (ids, labels) = build_model(embd=32, heads=2, seq=8), make_batch(batch=1, seq=8)
    else:
        model, (ids, labels) = build_model(), make_batch()
    return model.to(device), ids.to(device), labels.to(device)


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


def _err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:60]}"


def interleaved_ms(fns: dict, runs: int, stat=statistics.median, in_a_row: int = 1,
                   samples: bool = False):
    """``stat`` (median) of each callable's ms over ``runs`` timed calls, timed round-robin
    (fair under a varying machine load), each round in the next of the callables' orders
    (every permutation, for up to four; else rotations), so that each follows each of the
    others about equally often. Each is already warmed up; one that raises gets its error
    text instead.

    A call's time depends on what the call before it left in the caches: dirty lines of its
    outputs, which whoever comes next writes back (none after non-temporal stores). With
    ``in_a_row`` = 1 each turn is one call, charged for its predecessor's lines (on the dev
    VM accel's RMSNorm kernel took 1.5 ms after eager's RMSNorm and 1.0 after its own). With
    ``in_a_row`` = k > 1 each turn is k calls in a row, the first not counted: each counted
    call follows the same callable's, so each pays for its own lines, as in a loop of it.
    ``samples``: also return each callable's ms of every counted call, in order (a tuple)."""
    times = {k: [] for k in fns}
    keys = list(fns)
    orders = (list(itertools.permutations(keys)) if len(keys) <= 4
              else [keys[i:] + keys[:i] for i in range(len(keys))])
    counted = max(in_a_row - 1, 1)
    for r in range(-(-runs // counted)):
        for k in orders[r % len(orders)]:
            fn = fns[k]
            for j in range(in_a_row):
                if isinstance(times[k], str):
                    break
                t0 = time.perf_counter()
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - reported in the table
                    times[k] = _err(e)
                    break
                if j or in_a_row == 1:
                    times[k].append(time.perf_counter() - t0)
    out = {k: v if isinstance(v, str) else stat(v) * 1e3 for k, v in times.items()}
    if samples:
        return out, {k: v if isinstance(v, str) else [t * 1e3 for t in v] for k, v in times.items()}
    return out


def _cell(ms) -> str:
    return f"{ms:.2f}" if isinstance(ms, float) else str(ms)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def _pct(part, whole) -> str:
    """``part / whole`` as a percentage, or "-"."""
    return f"{100 * part / whole:.0f} %" if isinstance(part, float) and isinstance(whole, float) \
        else "-"


def check(name: str, label: str, out, ref, detail: bool = False, exact=None) -> str:
    """"yes" if ``out`` matches ``ref`` (``torch.testing.assert_close`` defaults, NaN where
    ``ref`` has NaN; nested tuples / dicts, e.g. a loss and its gradients, are compared item
    by item), else "MISMATCH" with the details on stderr (``detail``: and, in the returned
    text, which item and the greatest differences).

    ``exact``: the same computation in float64 (nested like ``ref``). Where eager's own
    result is outside the default tolerance of it (float32 rounding in a long reduction,
    e.g. a bias gradient summed over thousands of rows), that, rounded to ``out``'s dtypes,
    is the oracle instead, with the same tolerance: "yes (float64 oracle)"; where neither
    eager's nor ``out`` is within it (a gradient summed over 8192 rows of cancelling
    terms), ``out`` passes if no tensor of it is farther from the float64 result (greatest
    absolute difference) than eager's: "yes (as near float64 as eager)"; where one is, the
    detail names the first such tensor and both distances."""
    try:
        torch.testing.assert_close(out, ref, equal_nan=True)
        return "yes"
    except (AssertionError, TypeError, ValueError) as e:
        err = e
    farther = None
    if exact is not None:
        exact = _like(exact, ref)
        try:
            torch.testing.assert_close(ref, exact, equal_nan=True)
        except (AssertionError, TypeError, ValueError):  # eager is off: the exact result decides
            try:
                torch.testing.assert_close(out, exact, equal_nan=True)
                return "yes (float64 oracle)"
            except (AssertionError, TypeError, ValueError) as e:
                err = e
            farther = _farther(out, ref, exact)
            if farther is None:
                return "yes (as near float64 as eager)"
            farther = f"farther from float64 than eager: {farther}"
    print(f"{label} differs from eager on {name}: {err}" + (f"\n{farther}" if farther else ""),
          file=sys.stderr)
    if not detail:
        return "MISMATCH"
    return f"MISMATCH ({farther or _mismatch_detail(str(err))})"


def _farther(out, ref, exact):
    """``None`` where every floating tensor of ``out`` is at most as far from ``exact``
    (greatest absolute difference, in float64) as its counterpart in ``ref``, and every
    other leaf equals ``ref``'s (nested alike: torch.utils._pytree); else what differs: the
    first farther tensor's path and both distances ("[1]['fc1.weight'] 2.95e-04 against
    eager's 2.80e-04"), or "structure" / the path of an unequal leaf."""
    from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

    (lo, so), (lr, sr), (le, se) = (tree_flatten(t) for t in (out, ref, exact))
    if so != sr or sr != se:
        return "structure"
    paths = [keystr(p) for p, _ in tree_flatten_with_path(ref)[0]]
    for path, o, r, e in zip(paths, lo, lr, le):
        if not isinstance(o, torch.Tensor) or not o.is_floating_point():
            if not (torch.equal(o, r) if isinstance(o, torch.Tensor) else o == r):
                return f"{path} differs"
            continue
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"{path} shape or dtype"
        e = e.to(o.device, torch.float64)
        d_out, d_ref = ((t.double() - e).abs().max().item() if t.numel() else 0.0 for t in (o, r))
        if not d_out <= d_ref:  # NaN: not
            return f"{path} {d_out:.2e} against eager's {d_ref:.2e}"
    return None


def _close(a, b) -> bool:
    try:
        torch.testing.assert_close(a, b)
        return True
    except (AssertionError, TypeError, ValueError):
        return False


def _like(x, like):
    """``x`` with each tensor cast to the dtype of its counterpart in ``like``."""
    if isinstance(x, torch.Tensor):
        return x.to(like.dtype)
    if isinstance(x, dict):
        return {k: _like(v, like[k]) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_like(v, w) for v, w in zip(x, like))
    return x


def _mismatch_detail(msg: str) -> str:
    """"item, abs A, rel R" from an assert_close message (what it finds of it)."""
    parts = []
    for line in msg.splitlines():
        line = line.strip()
        if line.startswith("The failure occurred for item"):
            parts.insert(0, line.rsplit(" ", 1)[-1])
        for key, short in (("Greatest absolute difference: ", "abs "),
                           ("Greatest relative difference: ", "rel ")):
            if line.startswith(key):
                try:
                    parts.append(short + f"{float(line[len(key):].split()[0]):.1e}")
                except ValueError:
                    pass
    return ", ".join(parts).replace("|", "/") or msg.splitlines()[0][:60]


def _stats_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def measure(name, eager, accelerated, compiled, runs, warmup: int = 0,
            detail: bool = False, exact=None, in_a_row: int = 0) -> dict:
    """Run and time one workload. ``eager``, ``accelerated``, ``compiled``: zero-argument
    callables returning the result; the accel and compiled results are checked against
    eager's. Each is called once first (accel compiles or loads, torch.compile compiles: that
    call's time is ``first_ms``), then accel alone until its step sampling has decided
    (:func:`sampling_warmup`), then ``warmup`` more rounds, then ``runs`` interleaved timed
    rounds. If the accel or compiled one raises, its error text replaces its time.
    ``detail``: mismatch checks say where and by how much; ``exact``: a zero-argument
    callable computing the result in float64 (see :func:`check`); ``in_a_row`` > 1: then
    ``runs`` more timed calls each, that many in a row per turn (see :func:`interleaved_ms`).

    Returns a dict: ``ms`` (median per backend, or error text), ``checks`` ("yes",
    "MISMATCH" or error text), ``first_ms``, ``accel_first`` (accel counters of its first
    call) and ``accel_per_call`` (accel counters per timed call), ``out_bytes`` (bytes of the
    tensors in eager's result), ``row_ms`` (with ``in_a_row``: medians of the calls in a row,
    as ``ms``)."""
    t0 = time.perf_counter()
    ref = eager()
    first = {"eager": (time.perf_counter() - t0) * 1e3}
    out_bytes = sum(t.nbytes for t in _tensors(ref))
    fns = {"eager": eager, "accel": accelerated}
    checks, accel_first = {}, {}
    for k, fn in (("accel", accelerated), ("compile", compiled)):
        before = accel.stats()
        t0 = time.perf_counter()
        try:
            out = fn()  # warm-up: accel compiles or loads, torch.compile compiles
        except Exception as e:  # noqa: BLE001
            checks[k] = _err(e)
            fns.pop(k, None)
            continue
        first[k] = (time.perf_counter() - t0) * 1e3
        if k == "accel":
            accel_first = _stats_delta(before, accel.stats())
        fns[k] = fn
        checks[k] = check(name, k, out, ref, detail,
                          exact() if exact is not None and not _close(out, ref) else None)
        del out
    del ref
    if "accel" in fns:
        for _ in range(sampling_warmup()):
            fns["accel"]()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    before = accel.stats()
    t = interleaved_ms(fns, runs)
    per_call = {k: v / max(runs, 1) for k, v in _stats_delta(before, accel.stats()).items()}
    ms = {"eager": t["eager"], "accel": t.get("accel", checks["accel"]),
          "compile": t.get("compile", checks["compile"])}
    out = {"name": name, "ms": ms, "checks": checks, "first_ms": first,
           "accel_first": accel_first, "accel_per_call": per_call, "out_bytes": out_bytes}
    if in_a_row > 1:
        t = interleaved_ms(fns, runs, in_a_row=in_a_row)
        out["row_ms"] = {k: t.get(k, checks.get(k)) for k in ms}
    return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def compare(name, eager, accelerated, compiled, runs, floor_ms=None, exact=None) -> list:
    """One table row. ``eager``, ``accelerated``, ``compiled``: zero-argument callables
    returning the result; the accel and compiled results are checked against eager's
    (assert_close defaults; ``exact``: the float64 oracle where eager is off, see
    :func:`check`). Each is warmed up first; if the accel or compiled one raises, the error
    goes in its cell."""
    r = measure(name, eager, accelerated, compiled, runs, exact=exact)
    te, ta, tc = r["ms"]["eager"], r["ms"]["accel"], r["ms"]["compile"]
    floor = floor_ms if floor_ms is not None else "-"
    return [name, _cell(te), _cell(ta), _cell(tc), _cell(floor), _ratio(te, ta), _ratio(tc, ta),
            _ratio(ta, floor), r["checks"]["accel"]]


def device_workloads_args(doc: str):
    """The command line of a script timing memory-bound workloads on one device
    (``[cpu|cuda] [--runs N]``), parsed, with accel intercepting every call
    (:func:`intercept_every_step`), the machine printed and the dispatch filter built or
    loaded (:func:`accel.dispatch.wait`: accel's steady state has it; a run that times
    accel while it builds times the dispatch mode's path). Returns (device, shape:
    [8192, 1024] on the CPU and [16384, 4096] on a GPU, a synchronize for the device, runs,
    a test of a workload's name: ``--only a,b`` keeps those)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    args = ap.parse_args()
    intercept_every_step()
    dev = args.device
    shape = (16384, 4096) if dev == "cuda" else (8192, 1024)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    only = set(filter(None, args.only.split(",")))
    print(machine())
    t0 = time.perf_counter()
    filtered = accel.dispatch.wait()  # before any timing: the steady state has it
    print(f"dispatch filter built or loaded in {time.perf_counter() - t0:.1f} s (loaded: {filtered})")
    return dev, shape, sync, args.runs, lambda name: not only or name in only


def run_as(kind: str, f, args, sync):
    """``f(*args)`` as backend ``kind`` runs it (under :func:`accel.eager` for "accel",
    plainly for "eager" and "compile"), then ``sync()``; returns the result."""
    if kind == "accel":
        with accel.eager():
            out = f(*args)
    else:
        out = f(*args)
    sync()
    return out


#: the head of :func:`compare_kernels`' rows
KERNELS_HEAD = ["workload", "eager ms", "accel ms", "compile ms", "floor ms", "eager/accel",
                "compile/accel", "floor/accel", "accel == eager", "accel kernels / eager replays"]


def compare_on(name, fn, p, sync, runs) -> list:
    """:func:`compare_kernels`' row for ``fn(p)`` of one input ``p``: eager, accel
    (:func:`run_as`) and ``torch.compile(fn)``, each call followed by ``sync()``."""
    compiled = torch.compile(fn)

    def call(kind, f):
        return lambda: run_as(kind, f, (p,), sync)

    return compare_kernels(name, call("eager", fn), call("accel", fn), call("compile", compiled), runs)


def compare_kernels(name, eager, accelerated, compiled, runs, exact=None) -> list:
    """:func:`compare`'s row, with what accel ran in it: its kernel runs and eager replays
    (the columns of :data:`KERNELS_HEAD`)."""
    accel.reset_stats()
    row = compare(name, eager, accelerated, compiled, runs, exact=exact)
    st = accel.stats()
    return row + [f"{st['kernel_runs']} / {st['eager_replays']}"]


def table(head, rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
