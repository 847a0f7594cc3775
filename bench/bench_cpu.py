"""Benchmark: eager PyTorch vs accel vs torch.compile on CPU workloads, side by side.

    python bench/bench_cpu.py [--quick] [--runs N] [--only NAME[,NAME]] [--no-tuned]
                              [--threads N] [--keep-store]

Workloads (``--only`` takes the names in brackets):

1. [chain]      ``sin(x) * exp(-x * x) + 0.5 * tanh(x)`` on 16M float32
2. [bias_gelu]  ``F.gelu(x + b, approximate="tanh")``, x [8192, 1024], b [1024]
3. [add_ln]     ``F.layer_norm(x + r, [1024], w, b)``, x, r [8192, 1024]
4. [softmax]    ``torch.softmax(x * 0.125, dim=-1)``, x [8192, 1024]
5. [rmsnorm]    ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w``, x [8192, 1024]
6. [mlp_fwd]    MLP block forward under ``torch.no_grad()``: LayerNorm(x + Linear(GELU(Linear(x))))
                1024 -> 4096 -> 1024, batch 2048 (torch.nn modules, one copy per backend)
7. [mlp_train]  the same block forward + backward, loss = out.sum(); gradients compared
8. [gpt2_train] the accel demo's GPT-2 training step (accel.demo.train_step on DEFAULTS);
                loss and every parameter gradient compared
9-11. [bias_gelu_bf16, add_ln_bf16, softmax_f16] workloads 2-4 in bfloat16 / float16 (not
                in the geometric mean, which is the eight's)
12. [gpt2_adamw] workload 8 followed by ``torch.optim.AdamW.step()`` (torch.compile: the
                model compiled, the optimizer eager); loss and every parameter compared
                (not in the geometric mean)

Prints markdown tables:

1. per workload, median ms of N runs after warm-up with eager, accel and torch.compile timed
   round-robin in one process; the memory-bandwidth floor (read every input once + write
   every output once, over the STREAM-triad bandwidth measured with torch; "-" for the
   MLP / GPT-2 workloads); eager/accel, compile/accel, floor/accel (accel's fraction of the
   floor) and whether accel's and torch.compile's results (and gradients) match eager's
   (``torch.testing.assert_close`` defaults); the geometric mean of compile/accel.
   The table is run twice: with glibc malloc's default settings (this process), and in a
   subprocess with tuned glibc malloc settings, which apply to every backend alike (each
   workload's tuned run right after its default one);
   1c: the memory-bound workloads timed again, each backend 4 calls in a row per turn, the
   first not counted (each counted call pays for the cache lines its own backend's previous
   call left dirty, as in a loop of it; in tables 1 and 1b it pays for another backend's);
2. cold start (this process, fresh accel store, empty Inductor cache): accel's regions
   compiled and seconds per region, accel's first call, torch.compile's first call, and
   what accel ran per call (regions, native kernels, eager replays);
3. warm start: per workload a new process with the same accel store and Inductor cache (and
   with glibc's defaults the same command again, which finds its pool record);
   first iteration minus that process's steady state, for eager, accel and torch.compile
   (after importing dynamo and Inductor and one full garbage collection, timed apart).

An accel call is timed as one unit, ``with accel.eager(): out = fn(...)``: leaving the
block flushes the pending region, so the result is complete when the block ends.
Where accel cannot fuse something it runs eagerly; the result must still match.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

#: accel's own allocator tuning: at import (and at its first enable) it applies mallopt
#: settings like TUNED_MALLOC's to the whole process (eager and torch.compile included); off
#: here unless set, before accel is imported, so that table 1 is glibc's defaults and table
#: 1b the tuning, for all alike (children inherit it)
_ACCEL_MALLOC = "ACCEL_MALLOC_TUNING"
os.environ.setdefault(_ACCEL_MALLOC, "0")

# _common puts this checkout's accel first on sys.path: import it before accel
from _common import (_cell, _err, _pct, _ratio, accel_fn, interleaved_ms, machine, measure,
                     table, triad_bandwidth)
from workloads import EXTRA, WORKLOADS, title

import accel  # noqa: E402

#: glibc malloc tunables for the tuned table: keep large blocks in the heap (no mmap per
#: allocation), never give freed memory back, grow the heap in 1 GiB steps, so a freed
#: tensor's pages are reused without first-touch page faults
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
                "MALLOC_TOP_PAD_": str(1 << 30)}
_MALLOC_VARS = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "ACCEL_MALLOC_TUNING")


def _pool_in_use() -> bool:
    """accel's regions took their large CPU outputs from its output pool in this process
    (accel versions with one)."""
    from accel import allocator

    return getattr(allocator, "pool_stats", lambda: {})().get("capacity_bytes", 0) > 0


#: calls in a row per turn in the memory-bound workloads' second timing (table 1c)
IN_A_ROW = 4


def _tiny(x):
    return -x


# ------------------------------------------------------------------------ measuring

class _Collect(logging.Handler):
    """Keeps the messages of accel's logger (its fallback warnings) for the report."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage().splitlines()[0][:200])


def _graph_breaks() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return sum(counters["graph_break"].values())


#: accel's warnings in this process (it warns once per kind of fallback and process)
COLLECT = _Collect()


def run_table(names, runs: int) -> list:
    """Measure each workload (see :func:`_common.measure`), one after another; a workload
    whose setup or eager run fails gets an ``error`` entry."""
    results = []
    collect = COLLECT
    logging.getLogger("accel").addHandler(collect)
    try:
        for name in names:
            collect.messages.clear()
            bw = triad_bandwidth(3)  # the best of all is the floor's bandwidth
            breaks = _graph_breaks()
            try:
                spec = WORKLOADS[name][1]()
                r = measure(title(name), spec.eager, spec.accel, spec.compile, runs, warmup=1,
                            exact=spec.exact, detail=True,
                            in_a_row=IN_A_ROW if spec.in_bytes is not None else 0)
            except Exception as e:  # noqa: BLE001 - reported, the other workloads go on
                results.append({"key": name, "name": title(name), "error": _err(e)})
                continue
            r.update(key=name, in_bytes=spec.in_bytes, warnings=list(collect.messages), triad=bw,
                     graph_breaks=_graph_breaks() - breaks, pool=_pool_in_use())
            results.append(r)
            del spec
            gc.collect()
    finally:
        logging.getLogger("accel").removeHandler(collect)
    return results


def floor_ms(r: dict, bw: float):
    return (r["in_bytes"] + r["out_bytes"]) / bw * 1e3 if r.get("in_bytes") is not None else None


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def time_table(results, bw) -> tuple:
    """(markdown table, geometric mean of compile/accel over the issue's workloads, or
    None)."""
    _EXTRA_TITLES = {title(n) for n in EXTRA}
    rows, ratios = [], []
    for r in results:
        if "error" in r:
            rows.append([r["name"], r["error"]] + [""] * 8)
            continue
        te, ta, tc = r["ms"]["eager"], r["ms"]["accel"], r["ms"]["compile"]
        fl = floor_ms(r, bw)
        if isinstance(ta, float) and isinstance(tc, float) and r["name"] not in _EXTRA_TITLES:
            ratios.append(tc / ta)
        rows.append([r["name"], _cell(te), _cell(ta), _cell(tc), _cell(fl) if fl else "-",
                     _ratio(te, ta), _ratio(tc, ta), _pct(fl, ta) if fl else "-",
                     r["checks"]["accel"], r["checks"]["compile"]])
    head = ["workload", "eager ms", "accel ms", "compile ms", "floor ms", "eager/accel",
            "compile/accel", "floor/accel", "accel == eager", "compile == eager"]
    return table(head, rows), geomean(ratios)


def malloc_settings(env=os.environ) -> str:
    s = {k: v for k, v in env.items() if k.startswith(_MALLOC_VARS)}
    text = ", ".join(f"{k}={v}" for k, v in sorted(s.items()))
    return "glibc malloc defaults" + (f", {text}" if text else "") \
        if set(s) <= {_ACCEL_MALLOC} and s.get(_ACCEL_MALLOC, "0") == "0" else text


# ------------------------------------------------------------------------ children

def _child_env(extra=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_EAGER", "ACCEL_DISABLE")}
    env.update(extra or {})
    return env


def _child(args, extra_env=None, timeout=900):
    """Run this script with ``args``; its last stdout line, parsed as JSON (or an error)."""
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    try:
        p = subprocess.run(cmd, env=_child_env(extra_env), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    sys.stderr.write(p.stderr)  # mismatch details, warnings
    if p.returncode:
        err = " ".join(p.stderr.split())[-200:].replace("|", "/")
        return {"error": f"exit {p.returncode}: {err}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


_RESULT = "@@bench-cpu-result "


def serve(runs: int) -> None:
    """The tuned-malloc subprocess: reads workload names from stdin, one a line, and
    answers each with a result line (``_RESULT`` + JSON of :func:`run_table`'s entry)."""
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        print(_RESULT + json.dumps(run_table([name], runs)[0]), flush=True)


class Server:
    """This script as a subprocess (with ``env`` added to the environment) serving
    :func:`serve`: each workload's default and tuned measurements are taken back to back, so
    a machine load that changes during the run hits both alike."""

    def __init__(self, child_args, env):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_serve",
                                   *child_args], env=_child_env(env), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, bufsize=1)

    def run(self, name: str) -> dict:
        try:
            self.p.stdin.write(name + "\n")
            self.p.stdin.flush()
            for line in self.p.stdout:
                if line.startswith(_RESULT):
                    return json.loads(line[len(_RESULT):])
                sys.stderr.write(line)  # whatever else the child printed
        except (OSError, ValueError) as e:
            return {"key": name, "name": title(name), "error": _err(e)}
        return {"key": name, "name": title(name),
                "error": f"error: tuned subprocess exited ({self.p.wait()})"}

    def close(self) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _source_hash():
    """A hash of accel's checkout (its package and kernel headers: names, sizes, mtimes), to
    tell whether it was edited while the benchmark ran (accel's store key covers its
    sources, so a warm-start process then compiles again)."""
    h = hashlib.sha256()
    pkg = os.path.dirname(os.path.abspath(accel.__file__))
    for top in (pkg, os.path.join(os.path.dirname(pkg), "include", "accel")):
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".pyx", ".h", ".cuh")):
                    try:
                        st = os.stat(os.path.join(folder, name))
                    except OSError:
                        continue
                    h.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def warm_child(name: str, runs: int) -> dict:
    """In a new process with warm stores: first call of each backend, then the steady state
    (median of ``runs`` interleaved). torch._dynamo and Inductor are imported first, and timed
    apart: accel's first TorchDispatchMode call imports dynamo, torch.compile both. Then a
    full garbage collection, also timed apart: the imports leave the collector due one over
    the heap they built (about 200 ms here), which otherwise lands in whichever first call
    allocates enough objects to trigger it (accel's, which builds its trie nodes: 245-285 ms
    over its steady state then, against 43 after the collection)."""
    t0 = time.perf_counter()
    importlib.import_module("torch._dynamo")
    t1 = time.perf_counter()
    importlib.import_module("torch._inductor.compile_fx")
    out = {"import_ms": (t1 - t0) * 1e3, "import_inductor_ms": (time.perf_counter() - t1) * 1e3,
           "first_ms": {}, "source_hash": _source_hash()}
    spec = WORKLOADS[name][1]()
    t0 = time.perf_counter()
    gc.collect()  # the garbage-collection debt of the imports and the spec (see above)
    out["gc_ms"] = (time.perf_counter() - t0) * 1e3
    fns = {"eager": spec.eager, "accel": spec.accel, "compile": spec.compile}
    for k in list(fns):
        before = accel.stats()
        t0 = time.perf_counter()
        try:
            fns[k]()
        except Exception as e:  # noqa: BLE001
            out["first_ms"][k] = _err(e)
            del fns[k]
            continue
        out["first_ms"][k] = (time.perf_counter() - t0) * 1e3
        if k == "accel":
            after = accel.stats()
            out["accel_first"] = {s: after[s] - before[s] for s in after}
    out["steady_ms"] = interleaved_ms(fns, runs)
    return out


# ------------------------------------------------------------------------ report

def cold_table(results) -> str:
    rows = []
    for r in results:
        if "error" in r:
            continue
        s, pc, first = r["accel_first"], r["accel_per_call"], r["first_ms"]
        n = s.get("compiles", 0)
        rows.append([r["name"], str(n), str(s.get("compile_failures", 0)),
                     str(s.get("memory_hits", 0) + s.get("store_hits", 0)),
                     f"{s['compile_time_s'] / n:.2f}" if n else "-",
                     _cell(first.get("accel", r["checks"]["accel"])),
                     f"{first['compile'] / 1e3:.1f}" if "compile" in first else r["checks"]["compile"],
                     str(r["graph_breaks"]),
                     f"{pc.get('flushes', 0):.0f}", f"{pc.get('kernel_runs', 0):.0f}",
                     f"{pc.get('eager_replays', 0):.0f}"])
    return table(["workload", "accel regions compiled", "compile failures", "hits",
                  "accel s / region", "accel first call ms", "compile first call s",
                  "dynamo graph breaks", "accel regions / call", "native kernels / call",
                  "eager replays / call"], rows)


def warm_table(warm, cold, again=None) -> str:
    """Table 3: ``warm`` (name -> warm_child's result); ``again``: the same commands run a
    second time (their pool records written by the first: one more column)."""
    rows = []
    cold = {r["key"]: r for r in cold}
    for name, w in warm.items():
        if "error" in w:
            rows.append([title(name), w["error"]] + [""] * (8 if again else 7))
            continue
        st = w["steady_ms"]

        def d(k, w=w):
            a, b = w["first_ms"].get(k), w["steady_ms"].get(k)
            return f"{a - b:.1f}" if isinstance(a, float) and isinstance(b, float) else str(a)

        a = (again or {}).get(name) or {"error": "-"}
        again_cell = [] if again is None else [a["error"] if "error" in a else d("accel", a)]
        s = w.get("accel_first", {})
        c = cold.get(name, {}).get("first_ms", {}).get("compile")
        rows.append([title(name), f"{w['import_ms']:.0f} / {w['import_inductor_ms']:.0f} / "
                     f"{w.get('gc_ms', 0):.0f}",
                     d("eager"), d("accel"),
                     *again_cell,
                     _cell(st.get("accel")), f"{s.get('store_hits', 0)} / {s.get('compiles', 0)}",
                     d("compile"), _cell(st.get("compile")),
                     f"{c / 1e3:.1f}" if isinstance(c, float) else "-"])
    return table(["workload", "import dynamo / inductor, then gc.collect() ms (not counted)",
                  "eager first-steady ms",
                  "accel first-steady ms",
                  *(["accel first-steady ms, the command again"] if again else []),
                  "accel steady ms", "accel store hits / compiles",
                  "compile first-steady ms (warm cache)", "compile steady ms",
                  "compile first call s, cold (table 2)"], rows)


def _pool_note(default, tuned) -> str:
    """Where accel's regions took their large CPU outputs, per table."""
    def where(rs):
        used = {r.get("pool") for r in rs if "error" not in r}
        return None if len(used) != 1 else used.pop()
    d, t = where(default), where(tuned)
    pool = ("from its pool of reused blocks (ACCEL_CPU_POOL=auto, on where glibc maps each "
            "large block afresh; it changes no other allocation), so that they do not "
            "page-fault where eager's and torch.compile's do")
    heap = ("from the heap, as eager's and torch.compile's (ACCEL_CPU_POOL=auto turns the "
            "pool off where the heap reuses freed memory), and at each flush a region's live "
            "outputs take the blocks of its dead intermediates (buffer reuse)")
    if d is None or t is None:
        return ""
    if d == t:
        return f"In both tables accel's large outputs came {pool if d else heap}."
    return (f"In table 1 accel's large outputs came {pool if d else heap}; in 1b "
            f"{pool if t else heap}.")


def row_table(default, tuned) -> str:
    """Table 1c: the in-a-row medians (``row_ms``) with both allocator settings."""
    tuned = {r["key"]: r for r in tuned}
    rows = []
    for r in default:
        t = tuned.get(r["key"], {})
        if "row_ms" not in r:
            continue
        cells = [r["name"]]
        for x in (r, t):
            ms = x.get("row_ms")
            if ms is None:
                cells += ["-"] * 4
                continue
            cells += [_cell(ms["eager"]), _cell(ms["accel"]), _cell(ms["compile"]),
                      _ratio(ms["compile"], ms["accel"])]
        rows.append(cells)
    head = ["workload", "eager ms", "accel ms", "compile ms", "compile/accel",
            "tuned: eager ms", "accel ms", "compile ms", "compile/accel"]
    return table(head, rows)


def alloc_table(default, tuned) -> str:
    tuned = {r["key"]: r for r in tuned}
    rows = []
    for r in default:
        t = tuned.get(r["key"])
        if "error" in r or not t or "error" in t:
            continue
        cells = [r["name"]]
        for k in ("eager", "accel", "compile"):
            a, b = r["ms"][k], t["ms"][k]
            cells.append(f"{_cell(a)} -> {_cell(b)}" + (f" ({b / a:.2f}x)" if
                         isinstance(a, float) and isinstance(b, float) else ""))
        rows.append(cells)
    return table(["workload", "eager ms default -> tuned", "accel ms default -> tuned",
                  "compile ms default -> tuned"], rows)


def _coverage_notes(results) -> list:
    """One line per workload where accel fell back: deferred nothing, replayed regions
    eagerly, or did not match eager."""
    lines = []
    for r in results:
        if "error" in r:
            continue
        pc, s = r["accel_per_call"], r["accel_first"]
        if isinstance(r["ms"]["accel"], str):
            lines.append(f"- {r['name']}: accel raised ({r['ms']['accel']})")
            continue
        what = []
        if not pc.get("flushes"):
            what.append("deferred nothing (every op ran eagerly)")
        elif pc.get("eager_replays"):
            what.append(f"{pc['eager_replays']:.0f} of {pc['flushes']:.0f} regions per call "
                        "replayed eagerly (fallback)")
        if s.get("compile_failures"):
            what.append(f"{s['compile_failures']} compile failure(s)")
        if r["checks"]["accel"] != "yes":
            what.append(f"result: {r['checks']['accel']}")
        if what:
            lines.append(f"- {r['name']}: " + "; ".join(what))
    return lines


def _warnings(results) -> list:
    lines = []
    for r in results:
        for m in dict.fromkeys(r.get("warnings", ())):
            lines.append(f"- {r['name']}: {m}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer runs (a few minutes)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per cell (default 10, "
                   "--quick 3)")
    p.add_argument("--only", default=None, help="comma-separated workloads: " + ", ".join(WORKLOADS))
    p.add_argument("--no-tuned", action="store_true",
                   help="skip the table with tuned glibc malloc settings")
    p.add_argument("--threads", type=int, default=None, help="torch (and accel) CPU threads")
    p.add_argument("--keep-store", action="store_true",
                   help="keep the fresh accel store and Inductor cache this run creates")
    p.add_argument("--_serve", dest="serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_warm", dest="warm_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runs = args.runs or (3 if args.quick else 10)
    names = list(WORKLOADS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        bad = [n for n in names if n not in WORKLOADS]
        if bad:
            p.error(f"unknown workload(s) {', '.join(bad)}; known: {', '.join(WORKLOADS)}")
    if os.environ.get("ACCEL_EAGER", "").strip().lower() not in ("", "0", "false", "no", "off"):
        p.error("unset ACCEL_EAGER: the eager baseline must run without accel")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        serve(runs)
        return 0
    if args.warm_child:
        print(json.dumps(warm_child(args.warm_child, runs)))
        return 0

    t_start = time.perf_counter()
    # a fresh accel store and Inductor cache for this run, shared with the children
    base = os.environ.get("ACCEL_CACHE_DIR") or tempfile.gettempdir()
    os.makedirs(base, mode=0o700, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="bench-cpu-", dir=base)
    os.environ["ACCEL_CACHE_DIR"] = os.path.join(run_dir, "accel")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(run_dir, "inductor")
    child_args = ["--runs", str(runs), *(["--threads", str(args.threads)] if args.threads else [])]
    try:
        return _report(args, names, runs, child_args, run_dir, t_start)
    finally:
        if args.keep_store:
            print(f"\nstores kept in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _report(args, names, runs, child_args, run_dir, t_start) -> int:
    print(f"# accel CPU benchmark{' (--quick)' if args.quick else ''}\n\n{machine()}\n")
    print(f"Fresh accel store {os.environ['ACCEL_CACHE_DIR']}, fresh Inductor cache "
          f"(TORCHINDUCTOR_CACHE_DIR) {os.environ['TORCHINDUCTOR_CACHE_DIR']}.\n")
    load0 = _load()
    print(f"Load average at the start: {load0} (1, 5, 15 min; {os.cpu_count()} cores). "
          "Other processes on the machine slow every backend alike only within one interleaved "
          "round; compare numbers taken under similar load.\n")
    bw0 = triad_bandwidth(runs)

    # one-time costs, kept out of the first workload's numbers
    t0 = time.perf_counter()
    importlib.import_module("torch._dynamo")  # accel's first meta evaluation and compile do
    t_dyn = time.perf_counter() - t0
    logging.getLogger("accel").addHandler(COLLECT)
    x = torch.ones(4)
    accel.reset_stats()
    small = os.environ.get("ACCEL_EAGER_SMALL_REGIONS")
    os.environ["ACCEL_EAGER_SMALL_REGIONS"] = "0"  # a kernel built: a small region builds none
    t0 = time.perf_counter()
    accel_fn(_tiny)(x)
    t_acc = time.perf_counter() - t0
    if small is None:
        del os.environ["ACCEL_EAGER_SMALL_REGIONS"]
    else:
        os.environ["ACCEL_EAGER_SMALL_REGIONS"] = small
    s = accel.stats()
    t0 = time.perf_counter()
    filtered = accel.dispatch.wait()  # built in the background since that call
    t_filter = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.compile(_tiny)(x)
    t_ind = time.perf_counter() - t0
    print(f"One-time set-up before the workloads (not in any cell): import torch._dynamo "
          f"{t_dyn:.1f} s; first accel call (-x on 4 floats: {s['compiles']} compiled, "
          f"{s['compile_failures']} failed) {t_acc:.1f} s; then waiting for the dispatch "
          f"filter {t_filter:.1f} s (loaded: {filtered}); first torch.compile call (same) "
          f"{t_ind:.1f} s.\n")
    setup_warnings = [{"name": "set-up (-x on 4 floats)", "warnings": list(COLLECT.messages)}]
    logging.getLogger("accel").removeHandler(COLLECT)
    accel.reset_stats()
    src = _source_hash()

    results = []
    tuned = None if args.no_tuned else []
    server = Server(child_args, TUNED_MALLOC) if tuned is not None else None
    try:
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
            results += run_table([name], runs)
            if server:
                tuned.append(server.run(name))
    finally:
        if server:
            server.close()
    bws = [bw0] + [r["triad"] for r in results + (tuned or []) if "triad" in r]
    bw = max(bws)
    print(f"STREAM triad (torch.add(b, c, alpha=s, out=a), 3 x 64 MiB float32): "
          f"{bw / 1e9:.2f} GB/s, the best of {len(bws)} measurements (at the start: "
          f"{bw0 / 1e9:.2f} GB/s, best of {runs + 2}; then before each workload in each "
          "process, best of 5): the floor's bandwidth\n")
    tab, gm = time_table(results, bw)
    print(f"## 1. Time per call, {malloc_settings()} (median ms of {runs}, after warm-up, "
          "backends interleaved)\n")
    print(tab)
    print(f"\ngeometric mean of compile/accel: {gm:.2f}x" if gm else "\ngeometric mean: -")
    print("\nfloor = bytes that must move (read every input once + write every output once) / "
          "triad bandwidth; floor/accel = accel's fraction of it. compile = torch.compile, "
          "default Inductor, warmed up. Gradients are compared for the fwd+bwd workloads.\n")
    sys.stdout.flush()

    if tuned:
        print("## 1b. The same with tuned glibc malloc settings: "
              f"{malloc_settings({**os.environ, **TUNED_MALLOC})} (a subprocess, same stores; each workload "
              "measured right after its default-settings run above)\n")
        tab, gm = time_table(tuned, bw)
        print(tab)
        print(f"\ngeometric mean of compile/accel: {gm:.2f}x" if gm else "\ngeometric mean: -")
        print("\nAllocator effect (median ms, default -> tuned; same settings for every "
              "backend):\n")
        print(alloc_table(results, tuned))
        print("\nglibc returns blocks above MALLOC_MMAP_THRESHOLD_ (by default 128 KiB, "
              "adapting up to 32 MiB) to the kernel on free, so each fresh large output is "
              "mmap'ed again and first-touch page-faulted. PyTorch's CPU performance "
              "guides recommend jemalloc or tcmalloc (LD_PRELOAD); these glibc tunables "
              "are the dependency-free equivalent." + (
                  f" accel applies similar settings itself ({_ACCEL_MALLOC}, on by default: "
                  "mallopt at its first enable, for the whole process, so eager code and "
                  "torch.compile in that process gain too); off in both tables here."
                  if os.environ.get(_ACCEL_MALLOC) == "0" else "") + " " + _pool_note(results, tuned)
              + "\n")

    print(f"## 1c. The memory-bound workloads timed {IN_A_ROW} calls in a row per turn "
          f"(median ms of {runs}; the first call of each turn not counted)\n")
    print(row_table(results, tuned or []))
    print("\nA memory-bound call's time depends on the call before it: the dirty cache "
          "lines of that call's outputs are written back while it runs (none after "
          "accel's non-temporal stores of outputs larger than the cache). In tables 1 and "
          "1b every call follows another backend's, and pays for that backend's lines; "
          "here every counted call follows its own backend's, and pays for its own, as "
          "in a loop of it.\n")

    print("## 2. Cold start: this process, fresh accel store, empty Inductor cache\n")
    print(cold_table(results))
    print("\naccel s / region = accel.stats()['compile_time_s'] / compiles on the workload's "
          "first call; hits = regions found already compiled (in memory: an earlier workload "
          "had the same region). Per call = in the timed runs: regions flushed, run as native "
          "kernels, replayed eagerly (fallback). Ops accel does not fuse run eagerly and are "
          "not counted.\n")
    notes = _coverage_notes(results)
    if notes:
        print("What accel did:\n\n" + "\n".join(notes) + "\n")
    warns = _warnings(setup_warnings + results)
    if warns:
        print("accel warnings (fallbacks):\n\n" + "\n".join(warns) + "\n")
    sys.stdout.flush()

    warm_runs = min(runs, 5)  # the steady state here is only the baseline of the first call
    warm, warm_again, warm_tuned = {}, {}, {}
    for name in names:  # each workload's processes back to back (a load change hits all)
        args_w = ["--_warm", name, "--runs", str(warm_runs), *child_args[2:]]
        warm[name] = _child(args_w)
        # the same command again: its first process recorded the output pool's blocks at
        # exit, which this one's import faults in ahead (accel.allocator.prefill)
        warm_again[name] = _child(args_w)
        if tuned is not None:
            warm_tuned[name] = _child(args_w, {_ACCEL_MALLOC: "1"})
    print(f"## 3. Warm start: a new process per workload, same accel store and Inductor "
          f"cache, {malloc_settings()} (steady = median of {warm_runs} after the first call)\n")
    print(warm_table(warm, results, warm_again))
    if warm_tuned:
        print(f"\n## 3b. Warm start as 3, with accel's own malloc tuning ({_ACCEL_MALLOC}=1, its "
              "default: mallopt at `import accel`, for every backend in the process)\n")
        print(warm_table(warm_tuned, results))
    runs_w = [(n, w) for w_all in (warm, warm_again, warm_tuned) for n, w in w_all.items()]
    recompiled = sorted({n for n, w in runs_w if w.get("accel_first", {}).get("compiles")})
    if recompiled:
        edited = sorted({n for n, w in runs_w if w.get("source_hash") not in (None, src)})
        why = (f"accel's checkout was edited during this run (before the warm-start process of "
               f"{', '.join(edited)} started), and its store key covers its sources"
               if edited else "accel's store key is not stable across processes?")
        print(f"\nNote: warm-start processes compiled regions again ({', '.join(recompiled)}): "
              f"{why}.")
    print("\nfirst-steady = the first call in the new process minus that process's steady "
          "state: for accel, its first enable (registering the dispatch filter's unboxed "
          "kernels: `import accel` opened the store, found the filter and registered its "
          "fallbacks in the background), trie misses, meta "
          "evaluations, store look-ups and loads, and the first touches of fresh outputs (with "
          "glibc's defaults, of the output pool's blocks, which its steady state reuses, unless "
          "the command ran before: then its import faulted in, in the background, the blocks "
          "its last process recorded in the store); for torch.compile, tracing and loading "
          "from the Inductor cache.")
    print(f"\ntotal benchmark time {time.perf_counter() - t_start:.0f} s; load average "
          f"{_load()} (at the start: {load0})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
