"""accel against torch's own OpInfo database: every pointwise OpInfo, run eagerly and under
``accel.eager()``, must give the same results (float: ``assert_close`` defaults with
``equal_nan``; integer/bool: bit-exact), raise the same exception type, and leave the
inputs alone. In-place variants run on clones; out= variants for a handful of ops.

To keep the run short, all samples of one (op, dtype) run in one ``accel.eager()`` block,
i.e. one region and (usually) one compile. If that region does not run as a kernel (a
compile failure or a fallback), the samples are re-run one region each, so one sample's
unsupported feature cannot hide another sample's wrong kernel.
"""
import math

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

import accel

# ---------------------------------------------------------------------------------------
# KNOWN_BUGS: accel bugs found by this file, as strict xfails. Key: (kind, id) where kind is
# "functional", "inplace" or "out" and id is the test id ("sin-float32"). Remove an entry
# once the bug is fixed (strict=True makes a fixed bug fail the run as XPASS).
# ---------------------------------------------------------------------------------------
KNOWN_BUGS = {
}

# ---------------------------------------------------------------------------------------
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bool)
MAX_SAMPLES = 8

#: pointwise OpInfos that are not UnaryUfuncInfo / BinaryUfuncInfo
POINTWISE_NAMES = {
    "where", "clamp", "lerp", "addcmul", "addcdiv", "masked_fill", "clone", "contiguous",
    "zero_", "logaddexp2", "nn.functional.gelu", "nn.functional.hardswish",
    "nn.functional.leaky_relu", "nn.functional.silu", "nn.functional.mish",
    "nn.functional.elu", "nn.functional.hardtanh", "nn.functional.hardsigmoid",
    "nn.functional.softplus", "nn.functional.relu", "nn.functional.relu6",
    "nn.functional.celu", "nn.functional.selu", "nn.functional.threshold", "logit",
    "sigmoid", "xlogy", "float_power", "nan_to_num", "true_divide", "fill",
}
#: random ops, CUDA-only jiterator ops
SKIP_NAMES = {"nn.functional.rrelu", "rrelu", "jiterator_unary", "jiterator_binary",
              "jiterator_binary_return_by_ref", "jiterator_2inputs_2outputs",
              "jiterator_4inputs_with_extra_args"}
#: ops whose out= variant is tested
OUT_OPS = {"sin", "exp", "abs", "neg", "sqrt", "sigmoid", "add", "sub", "mul",
           "div.no_rounding_mode", "maximum", "eq", "bitwise_and", "where", "clamp", "lerp",
           "addcmul"}


def _opid(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _selected_ops():
    ops = []
    for op in op_db:
        if "special." in op.name or op.name in SKIP_NAMES:
            continue
        if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)) or op.name in POINTWISE_NAMES:
            ops.append(op)
    return ops


OPS = _selected_ops()


def _cases(kind, ops=OPS):
    out = []
    for op in ops:
        dts = op.supported_dtypes("cpu")
        for dt in DTYPES:
            if dt not in dts:
                continue
            cid = f"{_opid(op)}-{str(dt).replace('torch.', '')}"
            marks = ()
            reason = KNOWN_BUGS.get((kind, cid))
            if reason is not None:
                marks = (pytest.mark.xfail(reason=reason, strict=True),)
            out.append(pytest.param(op, dt, id=cid, marks=marks))
    return out


def _samples(op, dtype, cap=MAX_SAMPLES):
    torch.manual_seed(0)
    s = list(op.sample_inputs("cpu", dtype))
    if len(s) > cap:  # spread over the list: the late samples hold kwargs like alpha=
        n = len(s)
        s = [s[i] for i in sorted({round(k * (n - 1) / (cap - 1)) for k in range(cap)})]
    return s


# -- comparison -------------------------------------------------------------------------
def assert_same(actual, expected, what=""):
    """accel's result vs eager's: floats assert_close (defaults, equal_nan), ints/bools
    exact, same structure and types."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual)}"
        if expected.is_floating_point() or expected.is_complex():
            torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}")
        else:
            torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{what}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), what
    else:
        assert type(actual) is type(expected) and actual == expected, f"{what}: {actual!r} != {expected!r}"


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - compared by type with accel's
        return ("err", e)


def _check(actual, expected, what):
    if expected[0] == "err":
        assert actual[0] == "err", (
            f"{what}: eager raised {type(expected[1]).__name__}: {expected[1]}, accel did not")
        assert type(actual[1]) is type(expected[1]), (
            f"{what}: eager raised {type(expected[1]).__name__}, accel {type(actual[1]).__name__}: {actual[1]}")
    else:
        assert actual[0] == "ok", (
            f"{what}: accel raised {type(actual[1]).__name__}: {actual[1]}; eager did not")
        assert_same(actual[1], expected[1], what)


def _run_and_compare(make_calls, n):
    """``make_calls()`` returns n zero-argument callables (fresh state each time). Run them
    eagerly, then all under one accel.eager() region; if that region does not run as a
    kernel, also one region per call."""
    expected = [_outcome(c) for c in make_calls()]
    before = accel.stats()
    calls = make_calls()
    with accel.eager():
        actual = [_outcome(c) for c in calls]
    after = accel.stats()
    for i in range(n):
        _check(actual[i], expected[i], f"sample {i} (batched)")
    fell_back = (after["compile_failures"] > before["compile_failures"]
                 or after["eager_replays"] > before["eager_replays"])
    if fell_back and n > 1:
        calls = make_calls()
        for i, c in enumerate(calls):
            with accel.eager():
                a = _outcome(c)
            _check(a, expected[i], f"sample {i} (alone)")


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    return x


# -- tests ------------------------------------------------------------------------------
def test_selection_is_broad():
    assert len(OPS) >= 150
    names = {_opid(o) for o in OPS}
    for n in ("sin", "add", "mul", "where", "clamp", "lerp", "addcmul", "nn.functional.gelu",
              "nn.functional.silu", "logit", "nn.functional.softplus"):
        assert n in names


@pytest.mark.parametrize("op,dtype", _cases("functional"))
def test_functional(op, dtype):
    samples = _samples(op, dtype)
    if not samples:
        pytest.skip("no samples")
    snapshot = [(_clone_tree(s.input), _clone_tree(s.args), _clone_tree(s.kwargs)) for s in samples]

    def make_calls():
        return [lambda s=s: op.op(s.input, *s.args, **s.kwargs) for s in samples]

    _run_and_compare(make_calls, len(samples))
    for i, (s, snap) in enumerate(zip(samples, snapshot)):  # inputs left alone
        assert_same((s.input, s.args, s.kwargs), snap, f"sample {i} inputs after the call")


@pytest.mark.parametrize("op,dtype", _cases("inplace", [o for o in OPS if o.inplace_variant]))
def test_inplace(op, dtype):
    samples = _samples(op, dtype)
    fn = op.inplace_variant
    ok = []
    for s in samples:  # the samples eager accepts in place (no promotion past self, ...)
        if not isinstance(s.input, torch.Tensor):
            continue
        try:
            fn(s.input.clone(), *s.args, **s.kwargs)
        except Exception:  # noqa: BLE001
            continue
        ok.append(s)
    if not ok:
        pytest.skip("eager accepts no sample in place")

    def make_calls():
        calls = []
        for s in ok:
            x = s.input.clone()  # outside accel: an external input written in place

            def call(s=s, x=x):
                r = fn(x, *s.args, **s.kwargs)
                return (r is x, x)
            calls.append(call)
        return calls

    _run_and_compare(make_calls, len(ok))


@pytest.mark.parametrize("op,dtype", _cases("out", [o for o in OPS if _opid(o) in OUT_OPS]))
def test_out(op, dtype):
    assert op.supports_out
    samples = _samples(op, dtype, cap=4)
    ok = []
    for s in samples:
        try:
            r = op.op(s.input, *s.args, **s.kwargs)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(r, torch.Tensor):
            ok.append((s, r.shape, r.dtype))
    if not ok:
        pytest.skip("no sample with a tensor result")

    def make_calls():
        calls = []
        for s, shape, dt in ok:
            o = torch.full(shape, 7, dtype=dt)

            def call(s=s, o=o):
                r = op.op(s.input, *s.args, **s.kwargs, out=o)
                return (r is o, o)
            calls.append(call)
        return calls

    _run_and_compare(make_calls, len(ok))


def _op(name):
    return next(o for o in OPS if _opid(o) == name)


@pytest.mark.parametrize("name", ["sin", "add", "mul", "where", "nn.functional.gelu", "clamp",
                                  "lerp", "addcmul"])
def test_kernel_really_runs(name):
    """On an ordinary sample (float32, non-empty), a kernel runs and matches eager."""
    op = _op(name)
    sample = next(s for s in _samples(op, torch.float32, cap=100)
                  if isinstance(s.input, torch.Tensor) and s.input.numel() > 1)
    expected = op.op(sample.input, *sample.args, **sample.kwargs)
    accel.reset_stats()
    with accel.eager():
        actual = op.op(sample.input, *sample.args, **sample.kwargs)
    st = accel.stats()
    assert st["kernel_runs"] >= 1, st
    assert st["eager_replays"] == 0, st
    assert_same(actual, expected)


@pytest.mark.parametrize("name", ["sin", "add", "mul"])
def test_out_resized(name):
    """An empty out= tensor is resized by eager (no warning for numel 0); accel must too."""
    op = _op(name)
    s = next(s for s in _samples(op, torch.float32, cap=100)
             if isinstance(s.input, torch.Tensor) and s.input.numel() > 1)
    expected = op.op(s.input, *s.args, **s.kwargs)
    o = torch.empty(0)
    with accel.eager():
        r = op.op(s.input, *s.args, **s.kwargs, out=o)
    assert r is o
    assert_same(o, expected)
