"""Benchmark: eager PyTorch vs accel vs torch.compile on an NVIDIA GPU, side by side.

    python bench/bench_gpu.py [--quick] [--runs N] [--only NAME[,NAME]]

The CPU benchmark's workloads at GPU sizes (bench_cpu.py): the chain on 64M float32;
bias + tanh-GELU, residual add + LayerNorm, scaled softmax and RMSNorm on [16384, 4096];
the MLP block forward and forward + backward at batch 8192; the demo's GPT-2 step; and
three of the memory-bound workloads in 16-bit floats (bfloat16, float16). Each backend's
call ends with ``torch.cuda.synchronize()``; results are checked against eager. The floor
is the bytes each workload must move over a measured device-to-device copy (of 1 GiB, best
of 10); next to it, a copy of each workload's bytes timed as the workloads are (each call
synchronized), the floor with a call's launch and synchronization in it. The memory-bound
workloads are also timed back to back (50 calls, one synchronize).
Also: cold compile seconds per region (fresh store), and in a new process with the warm
store, the first call's time over the steady state.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cpu as B  # noqa: E402
import workloads as W  # noqa: E402
from _common import _ratio, accel_fn, machine, measure, median_ms, table  # noqa: E402

import accel  # noqa: E402

DEV = "cuda"
CHAIN_N, ROWS, D = 64 << 20, 16384, 4096
MLP_D, MLP_HIDDEN, MLP_BATCH = 1024, 4096, 8192
BF16 = torch.bfloat16
#: untimed rounds of every backend before the timed ones (an idle GPU clocks its SMs down:
#: 345 MHz seen on the H100 at rest; and a workload's first rounds follow its correctness
#: check); the timed rounds are 20 (--quick) or 40: a call takes well under a millisecond
WARMUP = 10


def synced(fn):
    """``fn`` followed by ``torch.cuda.synchronize()`` (``run.unsynced``: ``fn`` alone)."""
    def run():
        out = fn()
        torch.cuda.synchronize()
        return out
    run.unsynced = fn
    return run


def copy_bandwidth(runs: int = 10) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted)."""
    a = torch.empty(1 << 28, device=DEV)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def synced_copy_ms(nbytes: int, runs: int) -> float:
    """Median milliseconds of a device-to-device copy that moves ``nbytes`` (read + write
    counted), each call synchronized as the workloads' are: the floor as the per-call timing
    sees it (a call's launch and synchronization included: any implementation pays them)."""
    n = max(nbytes // 8, 1)  # float32 elements: read n * 4 + write n * 4 bytes
    src = torch.empty(n, device=DEV)
    dst = torch.empty_like(src)
    return median_ms(synced(lambda: dst.copy_(src)), max(runs, 10), warmup=3)


def kernel_ms(fn, calls: int = 3) -> float:
    """GPU time of one call of ``fn``: the summed duration of its kernels (torch.profiler),
    without the host's time before and between them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
    return sum(e.device_time_total for e in prof.key_averages()) / calls / 1e3


def back_to_back_ms(fn, calls: int = 50, runs: int = 3) -> float:
    """Milliseconds per call of ``fn`` (unsynchronized) issued ``calls`` times in a row and
    synchronized once, best of ``runs``: the throughput measure (the host's work for a
    call overlaps the previous call's kernels), as ``triton.testing.do_bench`` times."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def fn_spec(fn, *args):
    af, cf = accel_fn(fn), torch.compile(fn)
    return W.Spec(synced(lambda: fn(*args)), synced(lambda: af(*args)), synced(lambda: cf(*args)),
                  sum(a.nbytes for a in args))


def mlp_spec(train: bool):
    model = W.mlp_model(MLP_D, MLP_HIDDEN).to(DEV)
    x = _randn(MLP_BATCH, MLP_D, seed=1)
    me, ma, mc = W._three(model)
    cm = torch.compile(mc)

    def step(m, params_of):
        if not train:
            with torch.no_grad():
                return m(x)
        m.zero_grad(set_to_none=True)
        loss = m(x).sum()
        loss.backward()
        return loss.detach(), W._grads(params_of)

    def step_a():
        with accel.eager():
            return step(ma, ma)

    m64 = copy.deepcopy(model).double()

    def exact():  # the float64 oracle
        x64 = x.double()
        if not train:
            with torch.no_grad():
                return m64(x64)
        m64.zero_grad(set_to_none=True)
        loss = m64(x64).sum()
        loss.backward()
        return loss.detach(), W._grads(m64)

    return W.Spec(synced(lambda: step(me, me)), synced(step_a), synced(lambda: step(cm, mc)),
                  exact=exact)


def gpt2_spec():
    from accel.demo import build_model, make_batch, train_step

    model = build_model().to(DEV)
    ids, labels = (t.to(DEV) for t in make_batch())
    me, ma, mc = W._three(model)
    cm = torch.compile(mc)

    def step(m, params_of):
        return train_step(m, ids, labels), W._grads(params_of)

    def step_a():
        with accel.eager():
            return step(ma, ma)

    return W.Spec(synced(lambda: step(me, me)), synced(step_a), synced(lambda: step(cm, mc)))


WORKLOADS = {
    "chain": ("1 sin*exp+tanh chain, 64M f32", lambda: fn_spec(W.chain, _randn(CHAIN_N))),
    "bias_gelu": (f"2 bias + tanh-GELU, [{ROWS}, {D}] f32",
                  lambda: fn_spec(W.bias_gelu, _randn(ROWS, D), _randn(D, seed=1))),
    "add_ln": (f"3 residual add + LayerNorm, [{ROWS}, {D}] f32",
               lambda: fn_spec(W.add_layernorm, _randn(ROWS, D), _randn(ROWS, D, seed=1),
                               _randn(D, seed=2), _randn(D, seed=3))),
    "softmax": (f"4 softmax(x * 0.125), [{ROWS}, {D}] f32", lambda: fn_spec(W.scaled_softmax, _randn(ROWS, D))),
    "rmsnorm": (f"5 RMSNorm, [{ROWS}, {D}] f32", lambda: fn_spec(W.rmsnorm, _randn(ROWS, D), _randn(D, seed=1))),
    "mlp_fwd": (f"6 MLP block fwd, {MLP_BATCH}x{MLP_D}->{MLP_HIDDEN}", lambda: mlp_spec(False)),
    "mlp_train": (f"7 MLP block fwd+bwd, {MLP_BATCH}x{MLP_D}->{MLP_HIDDEN}", lambda: mlp_spec(True)),
    "gpt2_train": ("8 GPT-2 train step (demo)", gpt2_spec),
    # 16-bit floats (not among the eight: outside the geometric mean)
    "bias_gelu_bf16": (f"9 bias + tanh-GELU, [{ROWS}, {D}] bf16",
                       lambda: fn_spec(W.bias_gelu, _randn(ROWS, D, dtype=BF16),
                                       _randn(D, seed=1, dtype=BF16))),
    "add_ln_bf16": (f"10 residual add + LayerNorm, [{ROWS}, {D}] bf16",
                    lambda: fn_spec(W.add_layernorm, *(_randn(*s, seed=k, dtype=BF16) for k, s in
                                                       enumerate([(ROWS, D), (ROWS, D), (D,), (D,)])))),
    "softmax_f16": (f"11 softmax(x * 0.125), [{ROWS}, {D}] f16",
                    lambda: fn_spec(W.scaled_softmax, _randn(ROWS, D, dtype=torch.float16))),
}


def warm_child(name: str, runs: int, backend: str = "accel") -> None:
    """In a new process: the first call of ``backend`` ("accel" with the warm store, or
    "eager": the process's own first-call costs, cuBLAS and kernel loading included) and
    its steady state. "accel_after_eager": accel's, after one eager call has paid the
    process's own first-call costs (as in bench_cpu.py's warm start): accel's alone."""
    spec = WORKLOADS[name][1]()
    gc.collect()  # what building the spec (importing dynamo) left due: bench_cpu.warm_child
    if backend == "accel_after_eager":
        spec.eager()
        backend = "accel"
    fn = getattr(spec, backend)
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1e3
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"first_ms": first, "steady_ms": sorted(ts)[len(ts) // 2], **accel.stats()}))


def _warm_run(name: str, backend: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_warm", name, "--_backend", backend,
           "--runs", "5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": "error: " + (out.stderr.strip().splitlines() or ["?"])[-1][:80]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--only", default=None)
    p.add_argument("--_warm", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_backend", default="accel", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    runs = args.runs or (20 if args.quick else 40)
    if args._warm:
        warm_child(args._warm, runs, args._backend)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    names = args.only.split(",") if args.only else list(WORKLOADS)
    print(f"# accel GPU benchmark\n\n{machine()}; GPU: {torch.cuda.get_device_name()}\n")
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write, best of 10)\n")
    t0 = time.perf_counter()
    filtered = accel.dispatch.wait()  # before any timing: the steady state has it
    print(f"dispatch filter built or loaded in {time.perf_counter() - t0:.1f} s (loaded: {filtered})\n")
    rows, ratios, cold, b2b = [], [], [], []
    for name in names:
        title, make = WORKLOADS[name]
        spec = make()
        before = accel.stats()
        r = measure(title, spec.eager, spec.accel, spec.compile, runs, warmup=WARMUP, detail=True,
                    exact=spec.exact)
        after = accel.stats()
        nc = after["compiles"] - before["compiles"]
        cold.append([title, str(nc), f"{(after['compile_time_s'] - before['compile_time_s']) / max(nc, 1):.2f}",
                     f"{r['first_ms'].get('accel', float('nan')):.0f}",
                     f"{r['first_ms'].get('compile', float('nan')) / 1e3:.1f}"])
        te, ta, tc = (r["ms"][k] for k in ("eager", "accel", "compile"))
        floor = (spec.in_bytes + r["out_bytes"]) / bw * 1e3 if spec.in_bytes else None
        fl = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
        ka, kc = kernel_ms(spec.accel), kernel_ms(spec.compile)
        cs = synced_copy_ms(spec.in_bytes + r["out_bytes"], runs) if floor else None
        rows.append([title, fl(te), fl(ta), fl(tc), fl(floor) if floor else "-",
                     _ratio(te, ta), _ratio(tc, ta),
                     f"{floor / ta * 100:.0f} %" if floor and isinstance(ta, float) else "-",
                     fl(cs) if cs else "-",
                     f"{cs / ta * 100:.0f} %" if cs and isinstance(ta, float) else "-",
                     f"{cs / tc * 100:.0f} %" if cs and isinstance(tc, float) else "-",
                     f"{ka:.3f}", f"{kc:.3f}", f"{floor / ka * 100:.0f} %" if floor else "-",
                     r["checks"]["accel"], r["checks"]["compile"]])
        if isinstance(ta, float) and isinstance(tc, float) and name not in W.EXTRA:  # the eight
            ratios.append(tc / ta)
        if floor:
            be, ba, bc = (back_to_back_ms(f.unsynced) for f in (spec.eager, spec.accel, spec.compile))
            b2b.append([title, f"{be:.3f}", f"{ba:.3f}", f"{bc:.3f}", f"{floor:.3f}",
                        f"{floor / ba * 100:.0f} %", f"{floor / bc * 100:.0f} %", _ratio(bc, ba)])
        del spec
        torch.cuda.empty_cache()
    print(f"## Time per call (median ms of {runs}, backends interleaved, synchronized)\n")
    print(table(["workload", "eager ms", "accel ms", "compile ms", "floor ms", "eager/accel",
                 "compile/accel", "floor/accel", "copy ms (synchronized)", "copy/accel",
                 "copy/compile", "accel kernels ms", "compile kernels ms",
                 "floor/accel kernels", "accel == eager", "compile == eager"], rows))
    print("\n(kernels ms: the GPU time of one call's kernels, torch.profiler; the per-call "
          "times above include the host's time before the first launch. copy ms: a "
          "device-to-device copy moving the workload's bytes, timed as the workloads are, "
          "each call synchronized: the floor with a call's launch and synchronization in it; "
          "copy/accel, copy/compile: each one's fraction of it)\n")
    print(f"\ngeometric mean of compile/accel (workloads 1-8): {B.geomean(ratios):.2f}x\n"
          if ratios else "")
    if b2b:
        print("## Back to back: 50 calls, one synchronize (ms per call, best of 3)\n")
        print(table(["workload", "eager ms", "accel ms", "compile ms", "floor ms", "floor/accel",
                     "floor/compile", "compile/accel"], b2b))
        print()
    print("## Cold start (fresh store in this process)\n")
    print(table(["workload", "regions compiled", "s / region", "accel first call ms",
                 "compile first call s"], cold))
    print("\n## Warm start: a new process with the same store\n")
    warm = []
    for name in names:
        # the last: the third's command again, which reads the working set its first
        # process recorded at exit (accel.runtime.prefetch_working_set), as a rerun script does
        runs = [_warm_run(name, b) for b in ("accel", "eager", "accel_after_eager", "accel_after_eager")]
        bad = next((r["error"] for r in runs if "error" in r), None)
        if bad is not None:
            warm.append([WORKLOADS[name][0], bad, "", "", "", "", ""])
            continue
        w = runs[0]
        warm.append([WORKLOADS[name][0], *(f"{r['first_ms'] - r['steady_ms']:.1f}" for r in runs),
                     f"{w['steady_ms']:.2f}", f"{w['store_hits']} / {w['compiles']}"])
    print(table(["workload", "accel first - steady ms", "eager first - steady ms (own process)",
                 "accel first - steady ms, after one eager call", "the same, the command again",
                 "accel steady ms", "store hits / compiles"], warm))
    print("\n(first column: accel's first call is the process's first GPU work, CUDA, cuBLAS "
          "and torch's kernel loading included, as eager's in the second; third: one eager "
          "call first, so accel's own first-call work alone: store look-ups, loads, trie; "
          "fourth: the third's command run again, its working set read ahead at import)")
    return 0


if __name__ == "__main__":
    if "ACCEL_CACHE_DIR" not in os.environ:
        os.environ["ACCEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="accel-gpu-bench-")
    raise SystemExit(main())
