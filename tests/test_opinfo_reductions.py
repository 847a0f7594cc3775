"""accel against torch's OpInfo database: reductions, softmax, normalizations, losses and
the backward ops of them all.

Reuses ``test_opinfo``'s machinery (jobs, one ``accel.eager()`` block per op, bisection on
fallback, comparison). Two job kinds per op:

* ``forward``: the sample's call, for each of float32/float64/int32/int64/bool the OpInfo
  supports on CPU. Every run gets a fresh replica of the sample's tensors (same sizes,
  strides, storage offset), and the replicas are compared after the call as well: ops like
  training-mode batch norm write their running statistics, and the others must leave their
  inputs alone.
* ``backward`` (float32/float64, ops that support autograd): the call on leaves requiring
  grad (as the OpInfo marks them), then ``torch.autograd.grad`` of ``sum(out * cotangent)``
  over the differentiable outputs, with a fixed random cotangent, inside the same
  ``accel.eager()`` block; forward results and gradients are compared with eager's.

``nn.functional.softmax`` / ``log_softmax`` are aliases of the ``softmax`` / ``log_softmax``
OpInfos (same aten ops). ``torch.max(x)`` / ``torch.min(x)`` (``reduction_no_dim``) are not
deferred at all (``aten.max.default`` has no decomposition): only their backward runs in
regions. ``nll_loss`` (inside ``cross_entropy``) stays eager by design.
"""
import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import accel
from accel.codegen.cpp_groups import BLOCK
from test_opinfo import (DEVICES, DTYPES, HALF, Job, _check_case, _dtname, _opid, _outcome, _samples,
                         _tensors, assert_same, run_jobs)

# eager's own warning for var/std with correction >= the number of elements
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0")

#: OpInfos covered, as ``name`` or ``name.variant_test_name``
NAMES = (
    "sum", "mean", "prod", "amax", "amin", "max.reduction_with_dim", "min.reduction_with_dim",
    "max.reduction_no_dim", "min.reduction_no_dim", "argmax", "argmin", "var", "std",
    "var_mean", "std_mean", "logsumexp", "linalg.vector_norm", "any", "all", "softmax",
    "softmax.with_dtype", "log_softmax", "log_softmax.with_dtype",
    "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.batch_norm",
    "nn.functional.rms_norm", "nn.functional.mse_loss",
    "nn.functional.smooth_l1_loss", "nn.functional.binary_cross_entropy",
    "nn.functional.binary_cross_entropy_with_logits", "nn.functional.cross_entropy",
    "nn.functional.gelu", "nn.functional.silu", "sigmoid", "tanh",
)
#: samples per (op, dtype). The forward jobs of an op share one region; each backward job
#: is a region of its own (``autograd.grad`` flushes), that is one compile (~0.5 s)
FWD_SAMPLES = {torch.float16: 3, torch.bfloat16: 3}  # 6 for the other dtypes
BWD_SAMPLES = {torch.float32: 3, torch.float64: 2, torch.float16: 1, torch.bfloat16: 1}


def _selected():
    by_id = {_opid(o): o for o in op_db}
    return {n: by_id[n] for n in NAMES if n in by_id}


OPS = _selected()


def _dtypes(op, device="cpu"):
    dts = op.supported_dtypes(device)
    return [dt for dt in DTYPES if dt in dts]


def _grad_dtypes(op, device="cpu"):
    return [dt for dt in _dtypes(op, device) if dt.is_floating_point] if op.supports_autograd else []


# -- jobs -------------------------------------------------------------------------------
def _fresh(t):
    """A replica of ``t`` with its own storage: same sizes, strides (overlapping ones too)
    and storage offset; a leaf that requires grad if ``t`` does."""
    r = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage().clone(), t.storage_offset(),
                                           t.size(), t.stride())
    return r.requires_grad_(t.requires_grad)


def _replicate(x):
    if isinstance(x, torch.Tensor):
        return _fresh(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_replicate(v) for v in x)
    if isinstance(x, dict):
        return {k: _replicate(v) for k, v in x.items()}
    return x


def _forward_job(op, dtype, i, s):
    def prepare():
        inp, args, kw = _replicate((s.input, s.args, s.kwargs))

        def call():
            return (op.op(inp, *args, **kw), list(_tensors((inp, args, kw))))
        return call

    def reference():  # 16-bit floats: the same call in float64 (test_opinfo._oracle)
        inp, args, kw = _replicate(_to_double((s.input, s.args, s.kwargs)))
        return (op.op(inp, *args, **kw), list(_tensors((inp, args, kw))))

    j = Job("forward", dtype, i, s, prepare)
    if dtype in HALF:
        j.reference = reference
    return j


def _diff_outputs(out):
    return [o for o in _tensors(out) if o.requires_grad]


def _backward_job(op, dtype, i, s):
    """None if the sample has nothing to differentiate (or eager's forward raises)."""
    inp, args, kw = _replicate((s.input, s.args, s.kwargs))
    leaves = [t for t in _tensors((inp, args, kw)) if t.requires_grad]
    r = _outcome(lambda: op.op(inp, *args, **kw))
    if not leaves or r[0] == "err" or not _diff_outputs(r[1]):
        return None
    g = torch.Generator().manual_seed(1000 + i)
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in _diff_outputs(r[1])]

    def prepare():
        inp, args, kw = _replicate((s.input, s.args, s.kwargs))
        xs = [t for t in _tensors((inp, args, kw)) if t.requires_grad]

        def call():
            out = op.op(inp, *args, **kw)
            loss = sum((o * c).sum() for o, c in zip(_diff_outputs(out), cots))
            return (out, torch.autograd.grad(loss, xs, allow_unused=True))
        return call

    def reference():  # the same call in float64, eagerly (test_opinfo._oracle)
        inp, args, kw = _replicate(_to_double((s.input, s.args, s.kwargs)))
        xs = [t for t in _tensors((inp, args, kw)) if t.requires_grad]
        out = op.op(inp, *args, **kw)
        loss = sum((o * c.double()).sum() for o, c in zip(_diff_outputs(out), cots))
        return (out, torch.autograd.grad(loss, xs, allow_unused=True))

    j = Job("backward", dtype, i, s, prepare)
    if dtype == torch.float32 or dtype in HALF:
        j.reference = reference
    return j


def _to_double(x):
    if isinstance(x, torch.Tensor):
        return x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_to_double(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_double(v) for k, v in x.items()}
    return x


def _make_jobs(op, device="cpu"):
    jobs = []
    for dt in _dtypes(op, device):
        jobs += [_forward_job(op, dt, i, s)
                 for i, s in enumerate(_samples(op, dt, FWD_SAMPLES.get(dt, 6), device=device))]
    for dt in _grad_dtypes(op, device):
        for i, s in enumerate(_samples(op, dt, BWD_SAMPLES[dt], requires_grad=True, device=device)):
            j = _backward_job(op, dt, i, s)
            if j is not None:
                jobs.append(j)
    return jobs


_RESULTS = {}


def op_jobs(opid, device="cpu"):
    """All jobs of one op on one device, run eagerly and under accel (once per session)."""
    if (opid, device) not in _RESULTS:
        _RESULTS[opid, device] = run_jobs(_make_jobs(OPS[opid], device))
    return _RESULTS[opid, device]


def _cases(dtypes_of):
    return [pytest.param(n, dt, device, marks=marks, id=f"{n}-{_dtname(dt)}-{device}")
            for device, marks in DEVICES for n, op in OPS.items()
            for dt in dtypes_of(op, device if marks == () else "cpu")]


# -- tests ------------------------------------------------------------------------------
def test_selection():
    missing = set(NAMES) - set(OPS) - {"nn.functional.rms_norm"}  # rms_norm: newer torch only
    assert not missing, missing


@pytest.mark.parametrize("opid,dtype,device", _cases(_dtypes))
def test_forward(opid, dtype, device):
    _check_case("forward", opid, dtype, device, op_jobs)


@pytest.mark.parametrize("opid,dtype,device", _cases(_grad_dtypes))
def test_backward(opid, dtype, device):
    _check_case("backward", opid, dtype, device, op_jobs)


# -- the kernels really run -------------------------------------------------------------
def _x(*shape, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).requires_grad_(requires_grad)


def _call(fn, *inputs):
    return lambda: fn(*inputs)


_LONG = 2 * BLOCK + 37  # three blocks of a blockwise reduction, the last partial


def _long_rows():
    """Rows of ``_LONG`` values: one with -inf entries, one of -inf only, one whose exp
    overflows float32, one far from 0."""
    x = _x(6, _LONG) * 4
    x[0, ::5] = float("-inf")
    x[1] = float("-inf")
    x[2, BLOCK + 3] = 90.0
    x[3] += 1e3
    return x


def _layer_norm_backward():
    x, w, b = _x(8, 32, requires_grad=True), _x(32, requires_grad=True), _x(32, requires_grad=True)
    y = torch.nn.functional.layer_norm(x, (32,), w, b)  # eagerly: the region is the backward
    return _call(lambda: torch.autograd.grad(y, (x, w, b), _x(8, 32), retain_graph=True))


#: name -> () -> a zero-argument call, run eagerly and then under accel
KERNEL_CASES = {
    "softmax": lambda: _call(lambda x: torch.softmax(x, -1), _x(8, 32)),
    "log_softmax-dim0": lambda: _call(lambda x: torch.log_softmax(x, 0), _x(8, 32)),
    "layer_norm": lambda: _call(lambda x, w, b: torch.nn.functional.layer_norm(x, (32,), w, b),
                                _x(8, 32), _x(32), _x(32)),
    "sum-dim": lambda: _call(lambda x: x.sum(1), _x(8, 32)),
    "sum-dim0-keepdim-then-pointwise": lambda: _call(lambda x: x - x.sum(0, keepdim=True), _x(8, 32)),
    "var_mean": lambda: _call(lambda x: torch.var_mean(x, 1), _x(8, 32)),
    "layer_norm-backward": _layer_norm_backward,
    # rows of three blocks of the CPU's blockwise reductions (the last one partial): the
    # blocks' Welford and online-softmax states merge, around -inf, overflowing exp and a
    # mean far from 0
    "softmax-rows-of-blocks": lambda: _call(lambda x: torch.softmax(x, -1), _long_rows()),
    "log_softmax-rows-of-blocks": lambda: _call(lambda x: torch.log_softmax(x, -1), _long_rows()),
    "layer_norm-rows-of-blocks": lambda: _call(
        lambda x, w, b: torch.nn.functional.layer_norm(x, (_LONG,), w, b),
        # a mean of 3, not 1e3: there eager's float32 statistics are 3e-4 off float64's
        _x(6, _LONG) + 3.0, _x(_LONG), _x(_LONG)),
    "var_mean-rows-of-blocks": lambda: _call(lambda x: torch.var_mean(x, 1), _x(6, _LONG) + 1e3),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_really_runs(name):
    """On an ordinary float32 input the region runs as a kernel (no replay, no failed
    compile) and matches eager."""
    fn = KERNEL_CASES[name]()
    expected = fn()
    accel.reset_stats()
    with accel.eager():
        actual = fn()
    st = accel.stats()
    assert_same(actual, expected, name)
    assert st["kernel_runs"] >= 1, st
    assert st["eager_replays"] == 0 and st["compile_failures"] == 0, st


# -- minimal repros of bugs this file and tests/test_chains.py found --------------------
def _same_under_accel(fn, *inputs):
    expected = fn(*inputs)
    with accel.eager():
        actual = fn(*inputs)
    assert_same(actual, expected)


REPROS = {
    # two reductions over different dims, combined by broadcasting: the output is never
    # written (uninitialized memory comes back)
    "sum1-plus-sum0": lambda: _same_under_accel(
        lambda x, y: x.sum(1, keepdim=True) + y.sum(0, keepdim=True),
        torch.arange(20.).reshape(4, 5), torch.arange(20.).reshape(4, 5)),
    # softmax over a dim of a value that depends on a reduction over another dim: wrong
    # values (other reductions there fall back: "a reduction nested in another reduction's
    # loop"; softmax/log_softmax run a wrong kernel)
    "softmax1-after-amax0": lambda: _same_under_accel(
        lambda x: torch.softmax(x - x.amax(0, keepdim=True), 1), _x(4, 5)),
    "log_softmax0-after-sum1": lambda: _same_under_accel(
        lambda x: torch.log_softmax(x - x.sum(1, keepdim=True), 0), _x(4, 5)),
    # var_mean/std_mean over an empty dim: the mean must be nan (0/0), as mean() gives
    "var_mean-empty": lambda: _same_under_accel(lambda x: torch.var_mean(x, 0), torch.empty(0, 5)),
    "std_mean-empty": lambda: _same_under_accel(lambda x: torch.std_mean(x, 0), torch.empty(0, 5)),
    # a max over dim 0 (moved to memory: evaluated inside the next reduction's loop), then
    # its max with keepdim: the [1] result joined the [5] nest that writes the first max,
    # and its reduction, hoisted before that nest's loop, read the buffer unwritten
    "max-values-then-amax-keepdim": lambda: _kernel_same(
        lambda x: torch.max(x, -2).values.amax(0, keepdim=True), _x(4, 5)),
    "max-values-then-amax-keepdim-int32": lambda: _kernel_same(
        lambda x: torch.max(x, 0).values.amax(0, keepdim=True),
        torch.randint(-5, 6, (4, 5), generator=torch.Generator().manual_seed(2)).to(torch.int32)),
    # a variance (summed in float64) and a max in one loop, of a value converted to 16 bits
    # in the region: GCC 12 miscompiled the loop's omp simd reductions (the variance was
    # inf, or a fifth of eager's); the CPU kernel now sums and takes the max in two loops
    "var-and-amax-of-bfloat16": lambda: _kernel_same(
        lambda x: _var_and_amax(x.to(torch.bfloat16)), _x(64, 64)),
    "var-and-amax-of-float16": lambda: _kernel_same(
        lambda x: _var_and_amax(x.to(torch.float16)), _x(64, 300)),
    "var-and-amax": lambda: _kernel_same(lambda x: _var_and_amax(x * 1), _x(64, 300)),
}


def _var_and_amax(h):
    return h.var(1), (h * h).amax(1), torch.var_mean(h, 0)[0], h.amin(0)


def _kernel_same(fn, *inputs):
    accel.reset_stats()
    _same_under_accel(fn, *inputs)
    assert accel.stats()["kernel_runs"] >= 1, accel.stats()


@pytest.mark.parametrize("name", list(REPROS))
def test_repro(name):
    REPROS[name]()
