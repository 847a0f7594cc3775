"""pytest-benchmark versions of bench_pointwise.py's (a) and (b): eager vs accel vs
torch.compile, grouped by workload.

    python -m pytest bench/ --benchmark-only

Not part of the test suite (``testpaths`` is ``tests``); each backend's result is checked
against eager's before it is timed.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench_pointwise import CHAIN_N, GELU_SHAPE, accel_fn, chain, gelu  # noqa: E402

WORKLOADS = {"chain_16M_f32": (chain, (CHAIN_N,)), "gelu_8192x3072_f32": (gelu, GELU_SHAPE)}
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


@pytest.mark.parametrize("backend", ["eager", "accel", "compile"])
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
