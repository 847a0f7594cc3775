"""accel against torch's own OpInfo database.

Every pointwise OpInfo (UnaryUfuncInfo, BinaryUfuncInfo, or a name in POINTWISE_NAMES), for
each of float32/float64/int32/int64/bool it supports on CPU, runs its samples eagerly and
under ``accel.eager()``; results must match (floats: ``assert_close`` defaults with
``equal_nan``; integer/bool: exact), an eager exception must be an accel exception of the
same type, and functional calls must leave their inputs alone. In-place variants run on
clones (when eager accepts the sample); out= variants for the ops in OUT_OPS.

Speed: a kernel build costs ~0.35 s whatever its size, so all jobs of one op (every dtype,
functional + in-place + out=) run in ONE ``accel.eager()`` block, computed once and shared
by that op's parametrized tests. If the block does not run entirely as kernels (a compile
failure or an eager replay), it is bisected: halves re-run as their own regions, down to
single samples, so one sample's unsupported feature cannot hide another's wrong kernel.
Every run's results are checked (a replay must be right too).
"""
import math

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

import accel
from accel.ops import HALF  # 16-bit floats: their samples also carry a float64 reference (_oracle)

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.bool)
MAX_SAMPLES = 8
HALF_SAMPLES = 4  # (their kernels are float32's but for the loads and stores: fewer samples)

#: (device, pytest marks): every suite runs on each; CUDA skips cleanly without a GPU
DEVICES = [("cpu", ()), ("cuda", (pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="no CUDA device"),))]

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
#: random ops; CUDA-only jiterator ops
SKIP_NAMES = {"nn.functional.rrelu", "rrelu", "jiterator_unary", "jiterator_binary",
              "jiterator_binary_return_by_ref", "jiterator_2inputs_2outputs",
              "jiterator_4inputs_with_extra_args"}
#: ops whose out= variant is tested
OUT_OPS = {"sin", "exp", "abs", "neg", "sqrt", "sigmoid", "add", "sub", "mul",
           "div.no_rounding_mode", "maximum", "eq", "bitwise_and", "where", "clamp", "lerp",
           "addcmul"}
OUT_SAMPLES = 4


def _opid(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _dtname(dt):
    return str(dt).replace("torch.", "")


def _selected_ops():
    ops = []
    for op in op_db:
        if "special." in op.name or op.name in SKIP_NAMES:
            continue
        if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)) or op.name in POINTWISE_NAMES:
            ops.append(op)
    return ops


OPS = _selected_ops()
_BY_ID = {_opid(o): o for o in OPS}


def _dtypes(op, device="cpu"):
    dts = op.supported_dtypes(device)
    return [dt for dt in DTYPES if dt in dts]


def _cases(kind, ops=OPS):
    """(opid, dtype, device) for each op, dtype and device; CUDA cases skip without a GPU."""
    out = []
    for device, marks in DEVICES:
        for op in ops:
            for dt in _dtypes(op, device if marks == () else "cpu"):
                out.append(pytest.param(_opid(op), dt, device, marks=marks,
                                        id=f"{_opid(op)}-{_dtname(dt)}-{device}"))
    return out


def _samples(op, dtype, cap=MAX_SAMPLES, requires_grad=False, device="cpu"):
    """Up to ``cap`` samples, spread over the list (late samples hold kwargs like alpha=)."""
    torch.manual_seed(0)
    s = list(op.sample_inputs(device, dtype, requires_grad=requires_grad))
    if len(s) > cap:
        n = len(s)
        s = [s[i] for i in sorted({round(k * (n - 1) / max(cap - 1, 1)) for k in range(cap)})]
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
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), what
        for k in expected:
            assert_same(actual[k], expected[k], f"{what}[{k!r}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), what
    else:
        assert type(actual) is type(expected) and actual == expected, f"{what}: {actual!r} != {expected!r}"


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - compared by type with eager's
        return ("err", e)


def _check(actual, expected, what):
    if expected[0] == "err":
        assert actual[0] == "err", (
            f"{what}: eager raised {type(expected[1]).__name__}: {expected[1]}; accel did not")
        assert type(actual[1]) is type(expected[1]), (
            f"{what}: eager raised {type(expected[1]).__name__}, accel "
            f"{type(actual[1]).__name__}: {actual[1]}")
    else:
        assert actual[0] == "ok", (
            f"{what}: accel raised {type(actual[1]).__name__}: {actual[1]}; eager did not")
        assert_same(actual[1], expected[1], what)


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


# -- jobs -------------------------------------------------------------------------------
class Job:
    """One call to compare. ``prepare()`` returns a fresh zero-argument callable (fresh
    clones for in-place / out=), so the call can run any number of times."""

    def __init__(self, kind, dtype, idx, sample, prepare):
        self.kind, self.dtype, self.idx, self.sample, self.prepare = kind, dtype, idx, sample, prepare
        self.expected = None
        self.reference = None  # optional: the same call evaluated in float64 (see _oracle)
        self.runs = []  # (label, outcome)
        self.snapshot = None
        ts = list(_tensors((sample.input, sample.args, sample.kwargs)))
        # samples mixing 0-dim and n-dim tensors sit together, so that bisection isolates
        # a shared unsupported feature in few compiles
        self.order = (kind, any(t.dim() == 0 for t in ts) and any(t.dim() > 0 for t in ts),
                      _dtname(dtype), idx)

    def label(self):
        return f"{self.kind} {_dtname(self.dtype)} sample {self.idx}"


def _f64_reference(fn, s, pair=False):
    """The call with every floating tensor of the sample in float64 (for ``_oracle``);
    ``pair``: as the in-place and out= jobs return it, ``(True, result)``."""
    def reference():
        x, args, kwargs = _cast_tree((s.input, s.args, s.kwargs), torch.float64)
        r = fn(x, *args, **kwargs)
        return (True, r) if pair else r
    return reference


def _functional_job(op, dtype, i, s):
    def prepare():
        return lambda: op.op(s.input, *s.args, **s.kwargs)
    j = Job("functional", dtype, i, s, prepare)
    j.snapshot = _clone_tree((s.input, s.args, s.kwargs))
    if dtype in HALF:
        j.reference = _f64_reference(op.op, s)
    return j


def _inplace_job(op, dtype, i, s):
    fn = op.inplace_variant

    def prepare():
        x = s.input.clone()  # made outside accel: an external input written in place

        def call():
            r = fn(x, *s.args, **s.kwargs)
            return (r is x, x)
        return call
    j = Job("inplace", dtype, i, s, prepare)
    if dtype in HALF:
        j.reference = _f64_reference(fn, s, pair=True)
    return j


def _out_job(op, dtype, i, s, shape, rdt):
    def prepare():
        o = torch.full(shape, 7, dtype=rdt)

        def call():
            r = op.op(s.input, *s.args, **s.kwargs, out=o)
            return (r is o, o)
        return call
    j = Job("out", dtype, i, s, prepare)
    if dtype in HALF:
        j.reference = _f64_reference(op.op, s, pair=True)
    return j


def _make_jobs(op, device="cpu"):
    jobs = []
    for dt in _dtypes(op, device):
        samples = _samples(op, dt, HALF_SAMPLES if dt in HALF else MAX_SAMPLES, device=device)
        for i, s in enumerate(samples):
            jobs.append(_functional_job(op, dt, i, s))
            if op.inplace_variant is not None and isinstance(s.input, torch.Tensor):
                try:  # only the samples eager accepts in place
                    op.inplace_variant(s.input.clone(), *s.args, **s.kwargs)
                except Exception:  # noqa: BLE001
                    pass
                else:
                    jobs.append(_inplace_job(op, dt, i, s))
        if _opid(op) in OUT_OPS:
            for i, s in enumerate(samples[:OUT_SAMPLES]):
                r = _outcome(lambda: op.op(s.input, *s.args, **s.kwargs))
                if r[0] == "ok" and isinstance(r[1], torch.Tensor):
                    jobs.append(_out_job(op, dt, i, s, r[1].shape, r[1].dtype))
    return jobs


def _run_group(jobs, label):
    """Run ``jobs`` in one accel.eager() block; bisect if it did not run as kernels only."""
    calls = [j.prepare() for j in jobs]
    before = accel.stats()
    crash = None
    try:
        with accel.eager():
            outs = [_outcome(c) for c in calls]
    except Exception as e:  # noqa: BLE001 - a flush that raises: accel's bug
        crash = ("err", e)
    after = accel.stats()
    kinds = sorted({j.kind for j in jobs})
    if crash is None:
        for j, o in zip(jobs, outs):
            j.runs.append((label, o))
    elif len(kinds) == 1:  # blame a crash on one kind's jobs only
        for j in jobs:
            j.runs.append((label + ", crashed at flush", crash))
    fell_back = (crash is not None
                 or after["compile_failures"] > before["compile_failures"]
                 or after["eager_replays"] > before["eager_replays"])
    if fell_back and len(kinds) > 1:
        for k in kinds:
            _run_group([j for j in jobs if j.kind == k], label + f", {k} only")
    elif fell_back and len(jobs) > 1:
        h = len(jobs) // 2
        _run_group(jobs[:h], "split")
        _run_group(jobs[h:], "split")


_RESULTS = {}


def run_jobs(jobs):
    """Run ``jobs`` eagerly (``expected``), then under accel in one block (bisected on
    fallback); returns them sorted."""
    jobs = sorted(jobs, key=lambda j: j.order)
    for j in jobs:
        j.expected = _outcome(j.prepare())
    if jobs:
        _run_group(jobs, "batched")
    return jobs


def op_jobs(opid, device="cpu"):
    """All jobs of one op on one device, run eagerly and under accel (once per session)."""
    if (opid, device) not in _RESULTS:
        _RESULTS[opid, device] = run_jobs(_make_jobs(_BY_ID[opid], device))
    return _RESULTS[opid, device]


def _cast_tree(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.detach().to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_tree(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast_tree(v, dtype) for k, v in x.items()}
    return x


def _oracle(j):
    """What accel's outcome must match: eager's, unless the job has a float64 ``reference``
    and eager's own result is outside the default tolerance of it -- an ill-conditioned
    sample whose float32 rounding eager amplifies (layer norm of one element: 1/sqrt(eps)
    times an FMA's rounding), or a 16-bit float kernel of eager's that rounds an
    intermediate to float16 (CPU ``add`` with ``alpha`` rounds ``alpha * other`` first,
    two ulps off the correctly rounded sum) -- in which case the float64 result rounded to
    the sample's dtype, with the same default tolerance."""
    if j.reference is None or j.expected[0] != "ok":
        return j.expected
    ref = ("ok", _cast_tree(j.reference(), j.dtype))
    try:
        _check(j.expected, ref, "eager vs float64")
        return j.expected
    except AssertionError:
        return ref


def _check_case(kind, opid, dtype, device="cpu", get_jobs=op_jobs):
    jobs = [j for j in get_jobs(opid, device) if j.kind == kind and j.dtype == dtype]
    if not jobs:
        pytest.skip(f"no {kind} samples")
    errors = []
    for j in jobs:
        for label, out in j.runs:
            try:
                try:
                    _check(out, j.expected, f"{j.label()} ({label})")
                except AssertionError:
                    oracle = _oracle(j)
                    if oracle is j.expected:
                        raise
                    _check(out, oracle, f"{j.label()} ({label}, float64 oracle: eager is off)")
            except AssertionError as e:
                errors.append(str(e))
        if j.snapshot is not None:
            try:
                assert_same((j.sample.input, j.sample.args, j.sample.kwargs), j.snapshot,
                            f"{j.label()}: inputs after the call")
            except AssertionError as e:
                errors.append(str(e))
    assert not errors, f"{len(errors)} mismatches; first:\n" + "\n".join(errors[:3])


# -- tests ------------------------------------------------------------------------------
def _repro_lerp_after_pending_call():
    torch.manual_seed(0)
    x, y, w = torch.randn(5, 5), torch.randn(5, 5), torch.rand(5, 5)
    expected = x.clone().lerp_(y, w)
    with accel.eager():
        z = x * 2  # noqa: F841 - anything pending
        x.lerp_(y, w)
    assert_same(x, expected)


def _repro_eager_rejects_meta_accepts():
    b = torch.tensor([True, False])
    for fn in (torch.abs, lambda t: t.clone().sub_(t), lambda t: torch.addcmul(t, t, t),
               lambda t: t.add(t, alpha=0.5), lambda t: torch.bitwise_and(t.double(), t.double())):
        e = _outcome(lambda: fn(b))
        assert e[0] == "err"
        with accel.eager():  # must raise at the call, like eager (not at flush)
            a = _outcome(lambda: fn(b))
        _check(a, e, "bool")


def _repro_inplace_on_expanded():
    for dt in (torch.float32, torch.int64):
        e = _outcome(lambda: torch.ones(1, 5, dtype=dt).expand(4, 5).add_(1))
        assert e[0] == "err"
        x = torch.ones(1, 5, dtype=dt)
        with accel.eager():
            a = _outcome(lambda: x.expand(4, 5).add_(1))
        _check(a, e, str(dt))
        assert_same(x, torch.ones(1, 5, dtype=dt), "x left alone")


def _runs_as_one_kernel(fn):
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    expected = fn(x)
    accel.reset_stats()
    with accel.eager():
        actual = fn(x)
    st = accel.stats()
    assert_same(actual, expected)
    assert (st["flushes"], st["kernel_runs"], st["compile_failures"]) == (1, 1, 0), st


REPROS = {
    "lerp_-after-pending-call": _repro_lerp_after_pending_call,
    "eager-rejects-meta-accepts": _repro_eager_rejects_meta_accepts,
    "inplace-on-expanded": _repro_inplace_on_expanded,
    "0-dim-operand-no-kernel": lambda: _runs_as_one_kernel(lambda x: x + torch.tensor(2.0)),
    "scalar_tensor-splits-region": lambda: _runs_as_one_kernel(lambda x: torch.where(x > 0, x, 0.0)),
    "softshrink-sentinel": lambda: _runs_as_one_kernel(lambda x: torch.nn.functional.softshrink(x, 0.25)),
}


@pytest.mark.parametrize("name", list(REPROS))
def test_repro(name):
    """Minimal repros of bugs this file found, kept as regression tests."""
    REPROS[name]()


def test_selection_is_broad():
    assert len(OPS) >= 150
    for n in ("sin", "add", "mul", "where", "clamp", "lerp", "addcmul", "nn.functional.gelu",
              "nn.functional.silu", "logit", "nn.functional.softplus"):
        assert n in _BY_ID


@pytest.mark.parametrize("opid,dtype,device", _cases("functional"))
def test_functional(opid, dtype, device):
    _check_case("functional", opid, dtype, device)


@pytest.mark.parametrize("opid,dtype,device", _cases("inplace", [o for o in OPS if o.inplace_variant]))
def test_inplace(opid, dtype, device):
    _check_case("inplace", opid, dtype, device)


@pytest.mark.parametrize("opid,dtype,device", _cases("out", [o for o in OPS if _opid(o) in OUT_OPS]))
def test_out(opid, dtype, device):
    assert _BY_ID[opid].supports_out
    _check_case("out", opid, dtype, device)


def _plain_sample(op, device="cpu"):
    return next(s for s in _samples(op, torch.float32, cap=100, device=device)
                if isinstance(s.input, torch.Tensor) and s.input.numel() > 1
                and all(t.dim() > 0 for t in _tensors((s.args, s.kwargs))))


@pytest.mark.parametrize("device", [pytest.param(d, marks=m) for d, m in DEVICES])
@pytest.mark.parametrize("name", ["sin", "add", "mul", "where", "nn.functional.gelu", "clamp",
                                  "lerp", "addcmul"])
def test_kernel_really_runs(name, device):
    """On an ordinary float32 sample a kernel runs (no replay) and matches eager."""
    op = _BY_ID[name]
    s = _plain_sample(op, device)
    expected = op.op(s.input, *s.args, **s.kwargs)
    accel.reset_stats()
    with accel.eager():
        actual = op.op(s.input, *s.args, **s.kwargs)
    st = accel.stats()
    assert st["kernel_runs"] >= 1, st
    assert st["eager_replays"] == 0, st
    assert_same(actual, expected)


@pytest.mark.parametrize("name", ["sin", "add", "mul"])
def test_out_resized(name):
    """An empty out= tensor is resized by eager (no warning for numel 0); accel must too."""
    op = _BY_ID[name]
    s = _plain_sample(op)
    expected = op.op(s.input, *s.args, **s.kwargs)
    o = torch.empty(0)
    with accel.eager():
        r = op.op(s.input, *s.args, **s.kwargs, out=o)
    assert r is o
    assert_same(o, expected)
