"""pytest-benchmark versions of the benchmarks: eager vs accel vs torch.compile, grouped by
workload. ``test_pointwise``: bench_pointwise.py's (a) and (b); ``test_cpu``: the
workloads of bench_cpu.py but those whose calls change their own state (an optimizer step:
each call's result differs from the last, so a result compares only at each backend's
first call, as bench_cpu.py does).

    python -m pytest bench/ --benchmark-only

All backends run under the allocator settings accel applies to the process at its first
enable (see below). Not part of the test suite (``testpaths`` is ``tests``); each backend's result (and, for the
training workloads, every gradient) is checked against eager's before it is timed. accel
must match; a torch.compile mismatch is recorded in the benchmark's ``extra_info`` and
warned about, not failed (its numerics are torch's business). Few rounds: these are for
tracking, bench_cpu.py is the careful measurement.
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from _common import accel_fn, check  # noqa: E402
from workloads import STATEFUL, WORKLOADS as CPU_WORKLOADS  # noqa: E402
from bench_pointwise import CHAIN_N, GELU_SHAPE, chain, gelu  # noqa: E402

import accel  # noqa: E402

# accel tunes glibc malloc for the whole process at import, torch imported first, else at
# its first enable (ACCEL_MALLOC_TUNING, on by default): enable it once here, so every test,
# eager ones included, runs under the same allocator settings whatever the order
with accel.eager():
    pass

WORKLOADS = {"chain_16M_f32": (chain, (CHAIN_N,)), "gelu_8192x3072_f32": (gelu, GELU_SHAPE)}
BACKENDS = ["eager", "accel", "compile"]
_compiled = {}


@pytest.fixture(scope="module", params=list(WORKLOADS))
def workload(request):
    fn, shape = WORKLOADS[request.param]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return request.param, fn, x, fn(x)


def _backend(name, fn):
    if name == "eager":
        return fn
    if name == "accel":
        return accel_fn(fn)
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pointwise(benchmark, workload, backend):
    wname, fn, x, ref = workload
    benchmark.group = wname
    run = _backend(backend, fn)
    try:
        out = run(x)  # warm-up: accel compiles or loads, torch.compile compiles
    except Exception as e:  # noqa: BLE001 - torch.compile may fail on some setups
        if backend == "compile":
            pytest.skip(f"torch.compile failed: {type(e).__name__}: {e}")
        raise
    torch.testing.assert_close(out, ref)
    del out
    benchmark.pedantic(run, args=(x,), rounds=5, iterations=1, warmup_rounds=1)


@pytest.fixture(scope="module", params=[w for w in CPU_WORKLOADS if w not in STATEFUL])
def cpu_workload(request):
    spec = CPU_WORKLOADS[request.param][1]()
    return request.param, spec, spec.eager()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu(benchmark, cpu_workload, backend):
    wname, spec, ref = cpu_workload
    benchmark.group = f"cpu_{wname}"
    run = {"eager": spec.eager, "accel": spec.accel, "compile": spec.compile}[backend]
    try:
        out = run()  # warm-up: accel compiles or loads, torch.compile compiles
    except Exception as e:  # noqa: BLE001 - torch.compile may fail on some setups
        if backend == "compile":
            pytest.skip(f"torch.compile failed: {type(e).__name__}: {e}")
        raise
    verdict = check(wname, backend, out, ref, exact=spec.exact() if spec.exact else None)
    benchmark.extra_info["matches_eager"] = verdict
    if not verdict.startswith("yes"):
        if backend == "compile":
            warnings.warn(f"torch.compile differs from eager on {wname}: {verdict}", stacklevel=1)
        else:
            pytest.fail(f"{backend} differs from eager on {wname}: {verdict}")
    del out
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)
