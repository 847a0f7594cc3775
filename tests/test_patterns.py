"""Pattern replacement (accel.patterns), accel's own ops (accel.library) and constant folding:
each rewrite shown on a traced graph (targets before/after), applied exactly once, and the
rewritten graph run against eager; near misses that must not match; stale serialized patterns."""
import json
import logging
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import accel.patterns as P
from accel.graph import trace_region
from accel.ops import SCALAR, TENSOR, _kind
from accel.passes import PASSES, constant_folding, dce
from devices import DEVICES

accel_ops = torch.ops.accel
DTYPES = (torch.float32, torch.float64)


class _Recorder(TorchDispatchMode):
    """Records aten calls as a region would: tensors wired as ("x", j) / ("o", i), nonzero
    numbers in tensor or scalar positions as runtime scalars ("s", k), the rest constants."""

    def __init__(self, inputs):
        super().__init__()
        self.keep = list(inputs)  # keeps ids unique
        self.refs = {id(t): ("x", i) for i, t in enumerate(inputs)}
        self.calls, self.scalars, self.n_out = [], [], 0

    def _tmpl(self, func, arg, v):
        if isinstance(v, torch.Tensor):
            return self.refs[id(v)]
        if (type(v) in (int, float) and v and v == v
                and _kind(func._schema.name.split("::")[1], arg) in (TENSOR, SCALAR)):
            self.scalars.append(v)
            return ("s", len(self.scalars) - 1)
        return ("c", tuple(v) if isinstance(v, list) else v)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = {a.name: a for a in func._schema.arguments}
        targs = tuple(self._tmpl(func, a, v) for a, v in zip(func._schema.arguments, args))
        tkw = {k: self._tmpl(func, schema[k], v) for k, v in kwargs.items()}
        new = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in new:
            self.refs[id(t)] = ("o", self.n_out)
            self.n_out += 1
            self.keep.append(t)
        self.calls.append((func, targs, tkw, len(new)))
        return out


def record(fn, *inputs):
    """``fn`` traced as accel traces a region, after :func:`run_passes`; its scalars."""
    rec = _Recorder(inputs)
    with rec:
        out = fn(*inputs)
    live = tuple(rec.refs[id(t)][1] for t in tree_leaves(out))
    types = [("f" if type(s) is float else "i") + ("-" if s < 0 else "+") for s in rec.scalars]
    tr = trace_region(rec.calls, list(inputs), rec.n_out, live, types)
    for name, p in PASSES:  # the pipeline up to (not including) the patterns pass
        if name == "patterns":
            break
        p(tr.gm)
    return tr.gm, rec.scalars


def targets(gm):
    return [str(n.target).replace("<built-in function getitem>", "getitem")
            for n in gm.graph.nodes if n.op == "call_function"]


BID = "prims.broadcast_in_dim.default"


def check(fn, inputs, before, after, **close):
    """Trace ``fn``; check its targets, that the patterns make one replacement (given the
    runtime scalars' values), the targets after, and the rewritten graph against eager."""
    gm, sc = record(fn, *inputs)
    if before is not None:
        assert targets(gm) == before, gm.graph
    assert P.apply_patterns(gm, sc) == 1, gm.graph
    assert targets(gm) == after, gm.graph
    want = fn(*inputs)
    got = gm(*inputs, *sc)
    for g, w in zip(got, tree_leaves(want)):
        torch.testing.assert_close(g, w, **close)
    return gm, sc


def _rows(shape, dtype):
    """Random rows with -inf entries, a row of -inf only, and values whose exp overflows."""
    x = torch.randn(shape, dtype=dtype) * 4
    x.view(-1)[::7] = float("-inf")
    x[..., 0] = 90.0  # exp(90) overflows float32
    x.view(-1, shape[-1])[1] = float("-inf")
    return x


# -- accel.library -----------------------------------------------------------------------------
def test_library_ops_fake_and_reference():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    for op, args in [(accel_ops.online_softmax.default, (x, [1])),
                     (accel_ops.var_mean.default, (x, [0, 2], 1.0)),
                     (accel_ops.silu.default, (x,)), (accel_ops.gelu_tanh.default, (x.mT,)),
                     (accel_ops.vec_erf.default, (x.float(),))]:
        res = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert set(res.values()) == {"SUCCESS"}, res
    amax, sumexp = accel_ops.online_softmax(x, [-1])
    torch.testing.assert_close(amax, x.amax(-1))
    torch.testing.assert_close(sumexp, (x - amax[..., None]).exp().sum(-1))
    var, mean = accel_ops.var_mean(x, [0, 2], 1.0)
    torch.testing.assert_close((var, mean), torch.var_mean(x, (0, 2), correction=1))
    torch.testing.assert_close(accel_ops.silu(x), x * torch.sigmoid(x))
    rows = torch.tensor([[float("-inf"), 1.0], [float("-inf")] * 2, [1.0, float("inf")]])
    a, s = accel_ops.online_softmax(rows, [1])  # the special values kernels must reproduce
    assert a.tolist()[0] == 1.0 and s.tolist()[0] == 1.0
    assert a.tolist()[1:] == [float("-inf"), float("inf")] and s[1:].isnan().all()
    with pytest.raises(RuntimeError):
        accel_ops.online_softmax(x, [])


def test_vec_erf_reference_is_atens_vectorized_erf():
    """accel.library.vec_erf: Abramowitz & Stegun 7.1.26 with ATen's sign handling, within
    4e-7 of the exact erf in float32 (1.5e-7 in exact arithmetic); float64 is torch.erf."""
    x = torch.cat([torch.linspace(-6, 6, 4001), torch.tensor([0.0, -0.0, float("inf"),
                                                               float("-inf"), float("nan")])])
    y = accel_ops.vec_erf(x)
    assert (y[:-5].double() - torch.erf(x[:-5].double())).abs().max() < 4e-7
    assert y[-5:-1].tolist() == [y[-5].item(), -y[-5].item(), 1.0, -1.0] and y[-1].isnan()
    assert y[-5].abs() < 1e-7 and torch.signbit(y[-4]) and not torch.signbit(y[-5])
    torch.testing.assert_close(accel_ops.vec_erf(x.double()), torch.erf(x.double()), rtol=0, atol=0,
                               equal_nan=True)


def _grad_of_gelu(x, g):
    return torch.ops.aten.gelu_backward(g, x)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, torch.float64))
def test_exact_gelu_on_the_cpu_takes_atens_vectorized_erf(dtype):
    """The exact GELU and its backward trace (accel.decompositions._gelu, _gelu_backward) to
    accel.vec_erf on float32 and 16-bit CPU tensors, computed in float32 (torch.compile's CPU
    code and ATen's vectorized GELU take that erf); float64 and the tanh GELU keep their
    decompositions. The traced graphs match eager's GELU within the default tolerances."""
    x, g = torch.randn(8, 16, dtype=dtype) * 3, torch.randn(8, 16, dtype=dtype)
    erf = "prims.erf.default" if dtype == torch.float64 else "accel.vec_erf.default"
    for fn, inputs in ((torch.nn.functional.gelu, [x]), (_grad_of_gelu, [x, g])):
        gm, sc = record(fn, *inputs)
        ts = targets(gm)
        n_prims_erf = ts.count("prims.erf.default")
        assert ts.count(erf) == 1 and n_prims_erf == (erf == "prims.erf.default"), gm.graph
        if dtype in (torch.float16, torch.bfloat16):  # computed in float32, rounded once
            assert ts[-1] == "prims.convert_element_type.default", gm.graph
        torch.testing.assert_close(gm(*inputs, *sc)[0], fn(*inputs))
    gm, _ = record(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), x)
    assert "accel.vec_erf.default" not in targets(gm)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="ATen's vectorized erf (FMA) is compiled for AVX2 and AVX-512 only")
def test_float16_gelu_kernel_is_bitwise_eagers():
    """On the CPU eager computes a float16 GELU with ATen's vectorized erf, or, for a
    contiguous tensor on a CPU with AVX512-FP16, with oneDNN's (its float32 GELU, rounded).
    accel's kernel gives ATen's bits on column-major tensors (which oneDNN never takes)
    forward, and backward but for about one element in 10^5 an ulp away (2 of 30 seeds had
    one such element of 65536: where the float32 result lies near a rounding boundary of
    float16, an ulp of the float32 exp or erf shows). On a contiguous tensor it gives ATen's
    bits where eager runs ATen's kernel; where eager runs oneDNN's, its backward takes
    oneDNN's order of operations (accel.decompositions._gelu_backward) and gives eager's
    bits but for 13-23 of 65536 elements (seeds 0-3; 430-480 with ATen's order), its forward
    within ``assert_close`` (oneDNN's AVX-512 forward is an approximation of its own)."""
    import accel
    from accel.decompositions import _onednn_gelu

    def column_major(t):
        return t.detach().t().contiguous().t()

    gen = torch.Generator().manual_seed(0)  # seed 0 has one such element
    x = (torch.randn(64, 1024, generator=gen) * 3).half().requires_grad_()
    g = torch.randn(64, 1024, generator=gen).half()
    want = torch.nn.functional.gelu(x)
    (want_dx,) = torch.autograd.grad(want, x, g)
    xc = column_major(x).requires_grad_()
    aten = torch.nn.functional.gelu(xc)
    (aten_dx,) = torch.autograd.grad(aten, xc, column_major(g))
    accel.dispatch.wait()  # the filter loaded or off, not loading between the two calls

    def under_accel(t, dy):
        before = accel.stats()["kernel_runs"]
        with accel.eager():
            y = torch.nn.functional.gelu(t)
            (dx,) = torch.autograd.grad(y, t, dy)
        assert accel.stats()["kernel_runs"] - before == 2
        return y, dx

    got, got_dx = under_accel(x, g)
    got_c, got_c_dx = under_accel(xc, column_major(g))
    assert torch.equal(got_c, aten)
    assert (got_c_dx != aten_dx).sum() <= got_dx.numel() // 10 ** 4
    if _onednn_gelu(x):
        assert (got_dx != want_dx).sum() <= got_dx.numel() // 10 ** 3
    else:
        assert torch.equal(got, want)
        assert (got_dx != want_dx).sum() <= got_dx.numel() // 10 ** 4
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_dx, want_dx)


# -- the replacements ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_to_online_softmax(dtype):
    before = ["prims.amax.default", BID, BID, "prims.sub.default", "prims.exp.default",
              "prims.sum.default", BID, BID, "prims.div.default"]
    after = ["accel.online_softmax.default", "getitem", "getitem", BID, "prims.sub.default",
             "prims.exp.default", BID, "prims.div.default"]
    gm, _ = check(lambda x: torch.softmax(x, -1), [_rows((6, 33), dtype)], before, after,
                  equal_nan=True)
    op = next(n for n in gm.graph.nodes if n.target is accel_ops.online_softmax.default)
    assert op.args[1] == [1] and [u.args[1] for u in op.users] == [0, 1]
    check(lambda x: torch.softmax(x, 1), [_rows((2, 5, 3), dtype)], before, after, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_to_online_softmax(dtype):
    before = ["prims.amax.default", BID, BID, "prims.sub.default", "prims.exp.default",
              "prims.sum.default", BID, "prims.log.default", BID, "prims.sub.default"]
    after = ["accel.online_softmax.default", "getitem", "getitem", BID, "prims.sub.default",
             "prims.log.default", BID, "prims.sub.default"]
    check(lambda x: torch.log_softmax(x, -1), [_rows((6, 33), dtype)], before, after,
          equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_uses_welford_var_mean(dtype):
    x, w, b = (torch.randn(s, dtype=dtype) for s in ((4, 3, 8), (3, 8), (3, 8)))
    x += 10.0  # a mean far from 0 (where E[x^2] - E[x]^2 would cancel)
    tail = ["prims.add.default", "prims.rsqrt.default", BID, "prims.sub.default", BID,
            "prims.mul.default", BID, "prims.mul.default", BID, "prims.add.default"]
    before = ["prims.var.default", BID, "prims.sum.default", BID, "prims.div.default"] + tail
    after = ["accel.var_mean.default", "getitem", "getitem", BID, BID] + tail
    gm, sc = check(lambda x, w, b: torch.nn.functional.layer_norm(x, (3, 8), w, b, eps=1e-5),
                   [x, w, b], before, after)
    op = next(n for n in gm.graph.nodes if n.target is accel_ops.var_mean.default)
    assert op.args[1:] == ([1, 2], 0.0) and sc == [1e-5]


@pytest.mark.parametrize("keepdim", [False, True])
def test_var_mean_any_dims_and_correction(keepdim):
    x = torch.randn(5, 6, 7, dtype=torch.float64)
    keep = [BID] if keepdim else []
    before = ["prims.var.default", *keep, "prims.sum.default", *keep, "prims.div.default"]
    after = ["accel.var_mean.default", "getitem", "getitem", *keep, *keep]
    gm, _ = check(lambda x: torch.var_mean(x, (0, 2), correction=1, keepdim=keepdim), [x],
                  before, after)
    op = next(n for n in gm.graph.nodes if n.target is accel_ops.var_mean.default)
    assert op.args[1:] == ([0, 2], 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_keeps_one_reduction(dtype):
    x = torch.randn(4, 3, 64, dtype=dtype)
    fn = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    before = ["prims.mul.default", "prims.sum.default", BID, "prims.div.default",
              "prims.add.default", "prims.rsqrt.default", BID, "prims.mul.default"]
    after = ["prims.mul.default", "prims.sum.default", "prims.div.default", "prims.add.default",
             "prims.rsqrt.default", BID, "prims.mul.default"]
    gm, _ = check(fn, [x], before, after)
    assert targets(gm).count("prims.sum.default") == 1  # one reduction; no var_mean


@pytest.mark.parametrize("fn", [lambda x: x * torch.sigmoid(x), lambda x: torch.sigmoid(x) * x,
                                torch.nn.functional.silu])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu(fn, dtype):
    x = torch.randn(8, 16, dtype=dtype) * 10
    x[0, :3] = torch.tensor([float("inf"), float("-inf"), 200.0])
    sigmoid = ["prims.neg.default", "prims.exp.default", "prims.add.default", "prims.div.default"]
    check(fn, [x], sigmoid + ["prims.mul.default"], ["accel.silu.default"], equal_nan=True)


def _gelu_bench(x):  # bench/bench_pointwise.py
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def _gelu_hf(input):  # transformers' NewGELUActivation
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (input + 0.044715 * torch.pow(input, 3.0))))


MUL, ADD = "prims.mul.default", "prims.add.default"
#: 0.5 * x; x * x * x (pow(x, 3.0) after specialize_pow); * 0.044715; x +; * sqrt(2/pi);
#: tanh; + 1; *
GELU = [MUL, MUL, MUL, MUL, ADD, MUL, "prims.tanh.default", ADD, MUL]


@pytest.mark.parametrize("fn", [_gelu_bench, _gelu_hf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_polynomial_with_scalar_guards(fn, dtype):
    x = torch.randn(8, 16, dtype=dtype) * 3
    gm, sc = check(fn, [x], GELU, ["accel.gelu_tanh.default"])
    # the constants are runtime scalars here: valid only for these values
    guards = {0: 0.5, 1: 0.044715, 2: math.sqrt(2 / math.pi), 3: sc[3]}  # sc[3]: 1 or 1.0
    assert gm.meta["accel_scalar_guards"] == guards
    gm, sc = record(fn, x)
    assert P.apply_patterns(gm) == 0  # values unknown: no match


def test_gelu_tanh_aten_decomposition_needs_no_guard():
    gm, _ = check(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), [torch.randn(4, 8)],
                  None, ["accel.gelu_tanh.default"])  # the same ops as GELU, in another order
    assert "accel_scalar_guards" not in gm.meta


def test_chained_matches_rewire():
    x = torch.randn(4, 8)
    gm, _ = record(lambda x: torch.sigmoid(x * torch.sigmoid(x)) * (x * torch.sigmoid(x)), x)
    assert P.apply_patterns(gm) == 2 and targets(gm) == ["accel.silu.default"] * 2
    torch.testing.assert_close(gm(x)[0], torch.nn.functional.silu(torch.nn.functional.silu(x)))


def test_replacements_are_logged(caplog):
    gm, _ = record(lambda x: torch.softmax(x, -1), torch.randn(4, 8))
    with caplog.at_level(logging.DEBUG, logger="accel.passes"):
        P.apply_patterns(gm)
    assert any("pattern softmax" in r.getMessage() for r in caplog.records)


# -- near misses --------------------------------------------------------------------------------
def _no_match(fn, *inputs, scalars=None):
    gm, sc = record(fn, *inputs)
    before = targets(gm)
    assert P.apply_patterns(gm, sc if scalars else None) == 0
    assert targets(gm) == before


def test_softmax_near_misses():
    x = torch.randn(5, 5)
    e = lambda x: torch.exp(x - x.amax(1, keepdim=True))  # noqa: E731
    # softmax's structure, but the max over dim 1 and the sum over dim 0: the parameter
    # read off the two reductions disagrees
    _no_match(lambda x: e(x) / e(x).sum(0, keepdim=True), x)
    # the max also used outside the softmax: not a closed subgraph
    _no_match(lambda x: (torch.softmax(x, 1), x.amax(1)), x)


def test_softmax_with_transposed_broadcast_is_rejected_by_the_retrace():
    """Same ops, wiring and reduction dims as softmax over dim 1 of a square matrix, but the
    row max broadcast along columns: only re-tracing for these shapes sees the difference."""
    gm, _ = record(lambda x: torch.softmax(x, 1), torch.randn(5, 5))
    bid = next(n for n in gm.graph.nodes if n.target is torch.ops.prims.broadcast_in_dim.default)
    assert bid.args[1:] == ([5, 1], [0])
    bid.args = (bid.args[0], [1, 5], [1])
    bid.meta["val"] = bid.meta["val"].new_empty((1, 5))
    before = targets(gm)
    assert P.apply_patterns(gm) == 0 and targets(gm) == before


def test_pointwise_near_misses():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    _no_match(lambda x, y: x * torch.sigmoid(y), x, y)  # two inputs where the pattern has one
    # a truncated constant (FastGELU-style 0.79788456): the re-trace's literal differs
    _no_match(lambda x: 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x**3))), x,
              scalars=True)
    _no_match(lambda x: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6), x)  # no mean
    # the eps slot holds a tensor, not a scalar: the replacement would broadcast it wrongly
    _no_match(lambda x, t: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + t), x,
              torch.rand(4, 1))


# -- serialized patterns ----------------------------------------------------------------------
def test_serialized_patterns_are_current():
    stale = [r.name for r in P.REPLACEMENTS if not P.is_current(r)]
    assert not stale, f"stale patterns {stale}: run python -m accel.patterns --regenerate"
    assert {p.rep.name for p in P.load_patterns()} == {r.name for r in P.REPLACEMENTS}


def test_stale_pattern_is_detected(tmp_path, monkeypatch):
    r = next(r for r in P.REPLACEMENTS if r.name == "silu")
    d = json.loads(P.serialize(r))
    assert d["nodes"][3][3][0] == 1.0  # add(1.0, exp)
    d["nodes"][3][3][0] = 2.0
    (tmp_path / "silu.json").write_text(json.dumps(d))
    monkeypatch.setattr(P, "PATTERN_DIR", str(tmp_path))
    assert not P.is_current(r)
    os.remove(tmp_path / "silu.json")
    assert not P.is_current(r)
    assert P.main(["--check"]) == 1


def test_pattern_pass_runs_after_the_normalizing_passes():
    """Patterns are normalized by the passes before them: only the GPU's rounding of products
    other kernels add (a change of target, ``prims.mul`` to ``accel.mul_rn``, which the
    patterns must not see) follows them."""
    assert [name for name, _ in PASSES][-2:] == ["patterns", "round_products_across_kernels"]


# -- constant folding -------------------------------------------------------------------------
def test_constant_folding():
    def fn(x, s):
        c = torch.full((4, 8), 2.0) * 3.0 + 1.0  # uniform: folds to full(7.0)
        k = torch.scalar_tensor(s) * 2.0  # s is a runtime scalar: not a constant
        ramp = torch.arange(8.0) * 2.0  # not uniform: stays
        return x * c + k + ramp

    tr = trace_region([(fn, (("x", 0), ("s", 0)), {}, 1)], [torch.empty(4, 8)], 1, (0,), ["f+"])
    gm = tr.gm
    before = targets(gm)
    assert before[:4] == ["prims.empty_strided.default", "aten.full_like.default",
                          "prims.mul.default", "prims.add.default"]
    assert constant_folding(gm) == 1 and dce(gm) > 0
    after = targets(gm)
    assert after[0] == "prims.full.default" and "aten.full_like.default" not in after
    full = next(n for n in gm.graph.nodes if n.target is torch.ops.prims.full.default)
    assert full.args == ([4, 8], 7.0) and full.kwargs["dtype"] == torch.float32
    assert "aten.scalar_tensor.default" in after and "prims.iota.default" in after
    assert constant_folding(gm) == 0
    gm.recompile()
    x = torch.randn(4, 8)
    torch.testing.assert_close(gm(x, 1.5)[0], fn(x, 1.5))


# -- merged dims (group norm) -------------------------------------------------------------------
@pytest.mark.parametrize("affine", [True, False])
def test_sink_collapse_views_moves_merges_below_elementwise_ops_and_reductions(affine):
    """Group norm computed on ``[N, groups, C / groups, H, W]`` ends in a merge back to
    ``[N, C, H, W]`` (a ``collapse_view``), which the lowering cannot read; the pass moves
    it below the activation's elementwise ops (their other operands split back) and into
    a full reduction (over the split dims), so that only the region's outputs are merges,
    which the lowering stores as the split dims. The values stay eager's."""
    from accel.passes import sink_collapse_views

    aten = torch.ops.aten

    def fn(x, w, b):
        y = aten.native_group_norm.default(x, w, b, 2, 8, 12, 2, 1e-5)[0]
        z = aten.silu.default(y)
        return z, aten.sum.default(z * y)

    x = torch.randn(2, 8, 3, 4) * 3 + 1
    w, b = (torch.randn(8), torch.randn(8)) if affine else (None, None)
    ext = [x] + ([w, b] if affine else [])
    refs = (("x", 0), ("x", 1) if affine else ("c", None), ("x", 2) if affine else ("c", None))
    calls = [(fn, refs, {}, 2)]
    gm = trace_region(calls, ext, 2, (0, 1), []).gm

    def merges_read(g):
        return [n for n in g.graph.nodes if n.target is torch.ops.prims.collapse_view.default
                and any(u.op != "output" for u in n.users)]

    assert "aten.as_strided.default" not in targets(gm)  # accel's group norm: no as_strided
    assert merges_read(gm)
    assert sink_collapse_views(gm) > 0
    assert not merges_read(gm), gm.code
    gm.recompile()
    got = gm(*ext)
    want = fn(x, w, b)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_group_norm_and_its_activation_run_as_one_kernel(device):
    """GroupNorm (affine, a 4-d input) and SiLU, forward: one kernel (its region ran
    eagerly: the decomposition's ``as_strided`` and merged dims did not lower)."""
    import accel

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.GroupNorm(4, 32), torch.nn.SiLU()).to(device)
    x = torch.randn(8, 32, 16, 16, device=device)
    accel.reset_stats()
    with torch.no_grad():
        with accel.eager():
            y = m(x)
        torch.testing.assert_close(y, m(x))
    s = accel.stats()
    assert s["kernel_runs"] == 1 and s["eager_replays"] == 0, s


def test_sink_collapse_views_folds_merges_and_splits_that_undo_each_other():
    """A chain of merges, splits and squeezes is one row-major reshape: the pass writes it
    as the fewest of them (a 4-d group norm's backward merges ``[N, G, C/G, H, W]`` dim by
    dim and splits ``H * W`` back; its 2-d one squeezes a size-1 dim after the merge),
    so that the merge left reaches the output, where the lowering stores it split."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from accel.passes import sink_collapse_views

    prims = torch.ops.prims
    reshapes = (prims.collapse_view.default, prims.split_dim.default, prims.squeeze.default)

    def chain(x, y):
        a = prims.split_dim(prims.collapse_view(prims.collapse_view(x, 3, 4), 1, 2), 2, 4)
        b = prims.squeeze(prims.collapse_view(y, 1, 2), [2])
        return torch.exp(a), b * 2

    x, y = torch.randn(2, 3, 5, 4, 6), torch.randn(4, 4, 8, 1)
    gm = make_fx(chain, tracing_mode="fake")(x, y)
    assert sum(n.target in reshapes for n in gm.graph.nodes) == 5
    assert sink_collapse_views(gm) > 0
    gm.recompile()
    left = [(n.target, n.args[1:]) for n in gm.graph.nodes if n.target in reshapes]
    # [2, 3, 5, 4, 6] -> [2, 15, 4, 6]: one merge, below exp; [4, 4, 8, 1] -> [4, 32]: one
    assert sorted(left, key=str) == sorted([(prims.collapse_view.default, (1, 2)),
                                            (prims.collapse_view.default, (1, 3))], key=str), gm.code
    for got, want in zip(gm(x, y), chain(x, y)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("shape,dtype", [((4, 32), torch.float32), ((4, 32, 8, 8), torch.float32),
                                         ((2, 32, 4, 3, 5), torch.float64), ((4, 32, 8, 8), torch.bfloat16)],
                         ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_group_norm_training_step_runs_as_kernels(shape, dtype, device):
    """GroupNorm and SiLU forward and backward, the parameters' gradients accumulated into
    existing ``.grad`` tensors (``copy_``): two kernels, no region run eagerly (the
    backward's merges fed the copies, and ran eagerly), values as eager's. On a GPU (an
    H200) the step ran as three kernels (its backward runs on autograd's device thread;
    with the gradients set to None, two), and a 16-bit group norm runs eagerly
    (``accel.ops.RUNS_EAGERLY``): its activation's regions alone are kernels."""
    import accel

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.GroupNorm(4, 32), torch.nn.SiLU()).to(device, dtype)
    with torch.no_grad():
        m[0].weight.normal_()
        m[0].bias.normal_()
    x0 = torch.randn(shape, dtype=dtype, device=device) * 3 + 1

    def step():
        x = x0.clone().requires_grad_()
        y = m(x)
        (y * y).mean().backward()
        return [y.detach(), x.grad, m[0].weight.grad.clone(), m[0].bias.grad.clone()]

    m.zero_grad(set_to_none=False)
    want = step()
    m.zero_grad(set_to_none=False)
    accel.reset_stats()
    with accel.eager():
        got = step()
    s = accel.stats()
    if device == "cuda" and dtype == torch.bfloat16:
        assert s["eager_replays"] == 0, s
    else:
        assert s["kernel_runs"] == (2 if device == "cpu" else 3) and s["eager_replays"] == 0, s
    torch.testing.assert_close(got, want)


def test_a_write_into_a_fresh_tensor_is_kept_and_runs_eagerly(monkeypatch):
    """torch's ``constant_pad_nd`` decomposition writes ``x`` into a slice of a filled
    tensor (``prims.copy_to``, nobody using its result): dce and cse keep such a write
    (dropped, the region returned the fill alone), and the lowering refuses it (the region
    runs eagerly)."""
    from torch._decomp import decomposition_table

    import accel.graph
    from accel.lowering import lower
    from accel.lower_expr import LoweringError
    from accel.loop_ir import BufferSpec

    pad = torch.ops.aten.constant_pad_nd.default
    table = {**accel.graph._kernel_tagged(), pad: decomposition_table[pad]}  # (accel's own: a cat)
    monkeypatch.setattr(accel.graph, "_kernel_tagged", lambda: table)
    tr = trace_region([(lambda x: pad(x * 2, [-1, 2], 0.0), (("x", 0),), {}, 1)], [torch.empty(6, 10)],
                      1, (0,), [])
    assert "prims.copy_to.default" in targets(tr.gm)
    for _, p in PASSES:
        p(tr.gm)
    assert "prims.copy_to.default" in targets(tr.gm)
    with pytest.raises(LoweringError, match="a write the loop IR does not express"):
        lower(tr.gm, [BufferSpec(torch.float32, (6, 10), (10, 1), False)],
              [BufferSpec(torch.float32, (6, 11), (11, 1), True)], [])
