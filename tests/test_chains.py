"""Random chains of pointwise ops (hypothesis), eagerly and under ``accel.eager()``.

A program is plain data: input specs (dtype, shape or view of a base tensor, special
values) and steps (unary math, binary ops with broadcasting, Python scalars, ``alpha=``,
in-place ops, views of intermediates, where, and reductions: sum/mean/amax/amin/var/
logsumexp/argmax/max/softmax/log_softmax over a random dim, keepdim or not, whose
results broadcast back into later steps, or centre their input as
``x - red(x, keepdim=True)``). It runs twice on fresh copies of the inputs; the kept
values, the inputs (in-place ops may write them through views) and the first exception
type must match. A program with ``"grad"`` makes its float inputs' bases leaves that
require grad and, still under ``accel.eager()`` for accel's run, takes the gradients of
its kept values (each against a cotangent) with respect to them: the backward formulas'
ops, recorded as the forward's are, compared as the kept values are. Dropped intermediates exercise liveness (outputs kept in
registers). Floats: ``assert_close`` defaults with ``equal_nan``; ints/bools: exact.

``--hypothesis-profile=accel-explore`` runs many more, non-derandomized examples.
"""
import functools
import math
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import accel
from devices import DEVICES, SECOND_GPU  # tests/devices.py (pytest puts tests/ on sys.path)

# profiles "accel-ci" (default: 60 examples, derandomized) and "accel-explore" are
# registered in conftest.py

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "i32": torch.int32,
          "i16": torch.int16, "i8": torch.int8, "bool": torch.bool,
          "f16": torch.float16, "bf16": torch.bfloat16}
#: what a program's inputs draw from unless a test names its dtypes (16-bit floats have
#: tests of their own: :data:`HALF_DTYPES`)
DEFAULT_DTYPES = ("f32", "f64", "i64", "i32", "i16", "i8", "bool")
#: 16-bit floats beside float32 values, integers and booleans (every op's result rounded
#: to its dtype, as eager's kernels round theirs)
HALF_DTYPES = ("f16", "bf16", "f32", "i64", "bool")

#: how an input is made from the program's base shape [R, C] (names give the [4, 5] case);
#: every input broadcasts against [R, C]
INPUT_KINDS = {
    "4x5": lambda b, r, c: b((r, c)),
    "5": lambda b, r, c: b((c,)),
    "4x1": lambda b, r, c: b((r, 1)),
    "1x5": lambda b, r, c: b((1, c)),
    "0d": lambda b, r, c: b(()),
    "t(5x4)": lambda b, r, c: b((c, r)).t(),                   # transposed view
    "(4x10)[:, ::2]": lambda b, r, c: b((r, 2 * c))[:, ::2],   # strided slice
    "(6x5)[1:5]": lambda b, r, c: b((r + 2, c))[1:r + 1],      # offset slice
    "unsqueeze(5)": lambda b, r, c: b((c,)).unsqueeze(0),      # [1, C] view
    "expand(1x5)": lambda b, r, c: b((1, c)).expand(r, c),     # stride-0 view
}
#: views taken of intermediates (all keep broadcasting against [R, C])
VIEWS = {
    "[0:1]": lambda x, r, c: x[0:1] if x.dim() == 2 else x,
    "[:, 1:2]": lambda x, r, c: x[:, 1:2] if x.dim() == 2 else x,
    "unsqueeze(0)": lambda x, r, c: x.unsqueeze(0) if x.dim() < 2 else x,
    "t().t()": lambda x, r, c: x.t().t() if x.dim() == 2 else x,
    "expand(4x5)": lambda x, r, c: x.expand(r, c),          # stride-0 view of an intermediate
}

UNARY = {
    "sin": torch.sin, "cos": torch.cos, "exp": torch.exp, "tanh": torch.tanh,
    "abs": torch.abs, "neg": torch.neg, "sqrt": torch.sqrt, "log1p": torch.log1p,
    "sigmoid": torch.sigmoid, "relu": torch.relu, "floor": torch.floor, "ceil": torch.ceil,
    "reciprocal": torch.reciprocal, "square": torch.square, "sign": torch.sign,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
    "isnan": torch.isnan, "erf": torch.erf, "round": torch.round, "trunc": torch.trunc,
    "to_f32": lambda x: x.to(_f32()), "to_i64": lambda x: x.to(torch.int64),
    "to_bool": lambda x: x.to(torch.bool), "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu, "nan_to_num": torch.nan_to_num,
    "expm1": torch.expm1, "erfc": torch.erfc, "asinh": torch.asinh, "atan": torch.atan,
    "frac": torch.frac, "lgamma": torch.lgamma, "digamma": torch.digamma,
    "erfinv": lambda x: torch.erfinv(x * 0.5),
    "softplus": torch.nn.functional.softplus, "hardswish": torch.nn.functional.hardswish,
    "elu": torch.nn.functional.elu, "mish": torch.nn.functional.mish,
    "logsigmoid": torch.nn.functional.logsigmoid,
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "eq": torch.eq, "lt": torch.lt,
    "ge": torch.ge, "ne": torch.ne, "atan2": torch.atan2, "pow": torch.pow,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "logical_xor": torch.logical_xor, "remainder": torch.remainder, "fmod": torch.fmod,
    "floor_divide": torch.floor_divide, "hypot": torch.hypot, "copysign": torch.copysign,
    "logaddexp": torch.logaddexp, "xlogy": torch.xlogy, "fmax": torch.fmax,
    "bitwise_xor": torch.bitwise_xor, "lerp": lambda a, b: torch.lerp(a, b, 0.25),
}
#: ops with a Python scalar as second operand (``x OP s``, or ``s OP x`` when reversed)
SCALAR_OPS = {
    "add": lambda x, s: x + s, "sub": lambda x, s: x - s, "mul": lambda x, s: x * s,
    "div": lambda x, s: x / s, "pow": lambda x, s: x ** s, "gt": lambda x, s: x > s,
    "clamp_min": lambda x, s: torch.clamp(x, min=s), "clamp": lambda x, s: torch.clamp(x, -abs(s), abs(s)),
    "rsub": lambda x, s: s - x, "rdiv": lambda x, s: s / x,
    "leaky_relu": lambda x, s: torch.nn.functional.leaky_relu(x, s),
    "where": lambda x, s: torch.where(x > 0, x, s),
}
INPLACE = {
    "add_": lambda x, y: x.add_(y), "mul_": lambda x, y: x.mul_(y),
    "sub_": lambda x, y: x.sub_(y), "div_": lambda x, y: x.div_(y),
    "clamp_": lambda x, y: x.clamp_(min=-1.5, max=1.5), "neg_": lambda x, y: x.neg_(),
    "sin_": lambda x, y: x.sin_(), "copy_": lambda x, y: x.copy_(y),
    "fill_": lambda x, y: x.fill_(0.5), "addcmul_": lambda x, y: x.addcmul_(y, y, value=0.5),
}
SCALARS = [0.5, 2, -1.5, 3, 0, 0.0, -2, 1e-3, 2.5, True, float("inf")]


def _f32():
    """float32, or float64 in a program's float64 reference run (torch's default dtype there)."""
    return torch.get_default_dtype()


def _float(x, dt=None):
    return x if x.is_floating_point() else x.to(dt or _f32())


#: reductions ``(x, dim, keepdim)``; float-only ones take integer/bool inputs (eager's
#: errors for those are not what these programs are after) through ``dtype=`` or a cast to
#: the programs' float type, :func:`_f32`: float32, float64 in the reference run, which then
#: is one (a variance cast to float64 was its own reference: accel's exact 10.0 against
#: eager's 10.000000000000002, each through a remainder by 2, failed the check)
REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k) if x.is_floating_point() else x.mean(d, k, dtype=_f32()),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "var": lambda x, d, k: torch.var(_float(x), d, keepdim=k),
    "var_c0": lambda x, d, k: torch.var(_float(x), d, keepdim=k, correction=0),
    "logsumexp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
    "argmax": lambda x, d, k: torch.argmax(x if x.dtype != torch.bool else x.to(torch.int64), d, keepdim=k),
    "max.values": lambda x, d, k: torch.max(x, d, keepdim=k).values,
    # shape-preserving: keepdim is meaningless
    "softmax": lambda x, d, k: torch.softmax(x, d) if x.is_floating_point() else torch.softmax(x, d, dtype=_f32()),
    "log_softmax": lambda x, d, k: torch.log_softmax(x, d) if x.is_floating_point() else torch.log_softmax(x, d, dtype=torch.float64),
}


def _reduce(name, x, dim, keepdim):
    """``REDUCTIONS[name]`` over ``dim`` (taken modulo ``x.dim()``, negative if ``dim`` is);
    a result that lost a trailing dim gets it back (``[4]`` -> ``[4, 1]``), so that every
    value still broadcasts against ``[R, C]``."""
    n = x.dim()
    d = (dim % n) - (n if dim < 0 else 0) if n else (-1 if dim < 0 else 0)
    r = REDUCTIONS[name](x, d, keepdim)
    if r.dim() < n and n == 2 and d % n == 1:
        r = r.unsqueeze(-1)
    return r


# -- program generation -----------------------------------------------------------------
@st.composite
def programs(draw, shapes=None, dtypes=None):
    """A random program over the base shape [4, 5], or one drawn from ``shapes`` (a list
    of ``(R, C)``; the program's ``"shape"``); its inputs' dtypes drawn from ``dtypes``
    (names of :data:`DTYPES`; :data:`DEFAULT_DTYPES` by default)."""
    shape = draw(st.sampled_from(shapes)) if shapes else None
    n_in = draw(st.integers(1, 3))
    inputs = [(draw(st.sampled_from(sorted(INPUT_KINDS))), draw(st.sampled_from(sorted(dtypes or DEFAULT_DTYPES))),
               draw(st.integers(0, 2 ** 16)), draw(st.booleans()))
              for _ in range(n_in)]
    steps = []
    n = n_in
    ref = st.integers(0, 63)
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "scalar", "alpha",
                                     "inplace", "view", "where", "reduce", "reduce", "center"]))
        if kind == "unary":
            steps.append(("unary", draw(st.sampled_from(sorted(UNARY))), draw(ref) % n))
        elif kind == "binary":
            steps.append(("binary", draw(st.sampled_from(sorted(BINARY))), draw(ref) % n, draw(ref) % n))
        elif kind == "scalar":
            steps.append(("scalar", draw(st.sampled_from(sorted(SCALAR_OPS))), draw(ref) % n,
                          draw(st.sampled_from(SCALARS))))
        elif kind == "alpha":
            steps.append(("alpha", draw(ref) % n, draw(ref) % n, draw(st.sampled_from([0.5, -2.0, 3, 1.25]))))
        elif kind == "inplace":
            steps.append(("inplace", draw(st.sampled_from(sorted(INPLACE))), draw(ref) % n, draw(ref) % n))
        elif kind == "view":
            steps.append(("view", draw(st.sampled_from(sorted(VIEWS))), draw(ref) % n))
        elif kind == "reduce":
            steps.append(("reduce", draw(st.sampled_from(sorted(REDUCTIONS))), draw(ref) % n,
                          draw(st.integers(-2, 1)), draw(st.booleans())))
        elif kind == "center":
            steps.append(("center", draw(st.sampled_from(["sum", "mean", "amax", "amin", "logsumexp"])),
                          draw(ref) % n, draw(st.integers(-2, 1))))
        else:
            steps.append(("where", draw(ref) % n, draw(ref) % n, draw(ref) % n))
        n += 1
    keep = sorted(set(draw(st.lists(st.integers(n_in, n - 1), min_size=1, max_size=4))))
    prog = {"inputs": inputs, "steps": steps, "keep": keep}
    if shape is not None:
        prog["shape"] = shape
    return prog


def make_inputs(specs, device="cpu", shape=(4, 5), reference=False, grad=False):
    """The program's inputs over base shape ``shape``; ``reference``: float32 and 16-bit
    bases (their values as rounded to that dtype) widened to float64 before the view is
    taken; ``grad``:
    float bases are leaves that require grad."""
    out = []
    for kind, dt, seed, special in specs:
        dtype = DTYPES[dt]
        g = torch.Generator().manual_seed(seed)

        def base(shape, dtype=dtype, g=g, special=special):
            if dtype.is_floating_point:
                t = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype)
                if special and t.numel() >= 4:
                    flat = t.view(-1)
                    for i, v in enumerate([float("nan"), float("inf"), -float("inf"), -0.0]):
                        flat[(i * 7 + seed) % flat.numel()] = v
            elif dtype == torch.bool:
                t = torch.randint(0, 2, shape, generator=g).bool()
            else:
                t = torch.randint(-5, 6, shape, generator=g).to(dtype)
            return t

        wide = torch.float64 if reference and dtype in (torch.float32, torch.float16, torch.bfloat16) else dtype
        leaf = grad and wide.is_floating_point
        out.append(INPUT_KINDS[kind](
            lambda size, base=base, wide=wide, leaf=leaf: base(size).to(device, wide).requires_grad_(leaf), *shape))
    return out


def apply(step, env, shape=(4, 5)):
    k = step[0]
    if k == "unary":
        return UNARY[step[1]](env[step[2]])
    if k == "binary":
        return BINARY[step[1]](env[step[2]], env[step[3]])
    if k == "scalar":
        return SCALAR_OPS[step[1]](env[step[2]], step[3])
    if k == "alpha":
        return env[step[1]].add(env[step[2]], alpha=step[3])
    if k == "inplace":
        return INPLACE[step[1]](env[step[2]], env[step[3]])
    if k == "view":
        return VIEWS[step[1]](env[step[2]], *shape)
    if k == "reduce":
        return _reduce(step[1], env[step[2]], step[3], step[4])
    if k == "center":
        x = env[step[2]]
        return x - _reduce(step[1], x, step[3], True)
    return torch.where(env[step[1]].to(torch.bool), env[step[2]], env[step[3]])


def execute(prog, use_accel, device="cpu", reference=False):
    """Run ``prog`` on fresh inputs; return (kept values, inputs' bases, exception).
    ``reference``: eagerly, in float64 where the program computes in float32 (its float32
    inputs widened, torch's default dtype float64)."""
    if reference:
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return _execute(prog, False, device, True)
        finally:
            torch.set_default_dtype(old)
    return _execute(prog, use_accel, device, False)


def _execute(prog, use_accel, device, reference):
    shape = prog.get("shape", (4, 5))
    inputs = make_inputs(prog["inputs"], device, shape, reference, prog.get("grad", False))
    bases = [t._base if t._base is not None else t for t in inputs]
    env = list(inputs)
    err = None
    keep = prog["keep"]
    ctx = accel.eager() if use_accel else _nullctx()
    with ctx:
        for step in prog["steps"]:
            try:
                env.append(apply(step, env, shape))
            except Exception as e:  # noqa: BLE001 - compared by type
                err = e
                break
        kept = [env[i] if i < len(env) else None for i in keep]
        del env, inputs  # the rest is dead: accel may keep it in registers
        if prog.get("grad") and err is None:
            try:
                kept += _gradients(kept, bases, prog["grad"] == "engine thread" and use_accel)
            except Exception as e:  # noqa: BLE001 - compared by type
                err = e
    return kept, bases, err


def _gradients(kept, bases, on_engine_thread=False):
    """The gradients of the kept values that require grad (each times a cotangent of
    quarters, exact in every float dtype, and summed) with respect to the bases that do:
    a list, ``None`` for a base they do not depend on; empty where nothing requires grad.
    ``on_engine_thread``: the backward pass runs on :data:`ENGINE_THREAD`."""
    outs = [o for o in kept if isinstance(o, torch.Tensor) and o.requires_grad]
    leaves = [b for b in bases if b.requires_grad]
    if not outs or not leaves:
        return []
    loss = 0
    for k, o in enumerate(outs):
        g = torch.Generator().manual_seed(100 + k)
        loss = loss + (o * (torch.randint(-4, 5, o.shape, generator=g) / 4).to(o.device, o.dtype)).sum()
    if on_engine_thread:
        return ENGINE_THREAD.grad(loss, leaves)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


class _EngineThread:
    """One thread for every backward pass, as autograd's CUDA device thread (one a GPU, for
    the whole process), to test that path on a CPU: ``grad`` does what accel's
    ``torch.autograd.grad`` does on the calling thread (flush its region; if the pass
    raises, flush the engine threads' calls: ``accel.interceptor.flush_workers``) and
    runs the pass itself (torch's own ``grad``) on this thread, under the caller's dispatch
    mode and dispatch filter key, as the engine passes them on. Passes and results are
    handed over through plain locks, not the thread primitives accel's hooks flush on (the
    engine hands gradients back in C++)."""

    def __init__(self):
        self.job = self.out = None
        self.ready, self.done = threading.Lock(), threading.Lock()
        self.ready.acquire()
        self.done.acquire()
        self.thread = None

    def _loop(self):
        while True:
            self.ready.acquire()
            try:
                self.out = (True, self.job())
            except Exception as e:  # noqa: BLE001 - raised on the calling thread
                self.out = (False, e)
            self.done.release()

    def grad(self, loss, leaves):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        from accel import dispatch, interceptor

        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()
        mode, key = _get_current_dispatch_mode(), dispatch.active()
        grad = getattr(torch.autograd.grad, "__wrapped__", torch.autograd.grad)

        def job():
            if key:  # (the filter loaded: ACCEL_DISPATCH_FILTER=0 loads none)
                dispatch.set_included(True)
            try:
                with mode:
                    return list(grad(loss, leaves, allow_unused=True))
            finally:
                if key:
                    dispatch.set_included(False)

        interceptor.flush()
        self.job = job
        self.ready.release()
        self.done.acquire()
        ok, result = self.out
        self.job = self.out = None
        if not ok:
            interceptor.flush_workers()
            raise result
        return result


ENGINE_THREAD = _EngineThread()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


#: ``torch.testing.assert_close``'s default (rtol, atol) by dtype (its documentation's table)
TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
              torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}


def within_reference(actual, expected, reference) -> bool:
    """Whether float tensor ``actual`` (accel's), in every element not close to ``expected``
    (eager's, ``assert_close`` defaults), is at least as near the float64 reference run's
    value (``reference``, rounded to the dtype) as eager's: accel's error there is no larger
    than eager's own; all three finite there, NaN exactly where eager's is.

    A sum of float32 values that nearly cancel rounds differently in eager's order of
    additions than in accel's: by more than ``assert_close``'s tolerance where eager's own
    rounding is off the reference (a sum of thousands of values), or where the exact sum is
    0 and the two roundings fall on either side of it, each within the tolerance of the
    reference but twice that apart (a gradient summed over 64 rows of cancelling terms).
    The benchmarks' check (bench/_common.py ``check``) decides a whole tensor by its
    greatest difference, and only where eager's is off the reference."""
    if not isinstance(reference, torch.Tensor) or reference.shape != expected.shape \
            or actual.shape != expected.shape or not reference.is_floating_point():
        return False
    rtol, atol = TOLERANCES[expected.dtype]
    a, e = (t.detach().cpu().to(torch.float64) for t in (actual, expected))
    r = reference.detach().cpu().to(expected.dtype).to(torch.float64)
    if not torch.equal(a.isnan(), e.isnan()):
        return False
    off = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    a, e, r = a[off], e[off], r[off]
    return bool(torch.isfinite(torch.stack([a, e, r])).all() and ((a - r).abs() <= (e - r).abs()).all())


def assert_same(actual, expected, what, reference=None):
    """``actual`` (accel's) equals ``expected`` (eager's): integers and booleans exactly,
    floats within ``assert_close``'s defaults or, where they are not, as the float64
    reference run's value (``reference()``, called then) decides (:func:`within_reference`)."""
    if expected is None:
        assert actual is None, what
        return
    assert isinstance(actual, torch.Tensor), what
    if expected.is_floating_point():
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}")
        except AssertionError:
            if reference is None or not within_reference(actual, expected, reference()):
                raise
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def check_program(prog, device="cpu"):
    e_kept, e_in, e_err = execute(prog, False, device)
    a_kept, a_in, a_err = execute(prog, True, device)
    if e_err is not None:
        assert a_err is not None, f"eager raised {type(e_err).__name__}: {e_err}; accel did not"
        assert type(a_err) is type(e_err), (
            f"eager raised {type(e_err).__name__}: {e_err}; accel {type(a_err).__name__}: {a_err}")
    else:
        assert a_err is None, f"accel raised {type(a_err).__name__}: {a_err}; eager did not"
    ref = functools.cache(lambda: execute(prog, False, device, reference=True))
    assert len(a_kept) == len(e_kept), (len(a_kept), len(e_kept))  # (as many gradients)
    names = [f"value {i}" for i in prog["keep"]] + [f"gradient {j}" for j in range(len(e_kept) - len(prog["keep"]))]
    for j, (what, a, e) in enumerate(zip(names, a_kept, e_kept)):
        assert_same(a, e, what, lambda j=j: ref()[0][j])
    for i, (a, e) in enumerate(zip(a_in, e_in)):
        assert_same(a, e, f"input {i} after the program", lambda i=i: ref()[1][i])


# -- tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES + [SECOND_GPU])
@given(prog=programs())
def test_random_chains(prog, device):
    check_program(prog, device)


#: base shapes past the kernels' shape-dependent layouts: rows of an odd length, rows a GPU
#: block keeps in registers (32768) and rows past them in block loops (65540), rows as
#: long as short columns, columns long enough to be split among GPU blocks (4099 x 33),
#: transposing tiles (1030 x 257), and the small [4, 5]
LARGE_SHAPES = [(3, 4099), (2, 32768), (1, 65540), (64, 1027), (4099, 33), (1030, 257), (96, 128), (4, 5)]


@pytest.mark.parametrize("device", DEVICES)
@given(prog=programs(LARGE_SHAPES))
def test_random_chains_large(prog, device):
    check_program(prog, device)


@pytest.mark.parametrize("device", DEVICES + [SECOND_GPU])
@given(prog=programs([(4, 5), (64, 1027)], ["f32", "f32", "f64", "i64"]))
def test_random_chains_backward(prog, device):
    """The programs' gradients (``"grad"``): their backward under accel as eager's. Mostly
    float inputs, so that most programs have gradients to take."""
    check_program({**prog, "grad": True}, device)


@given(prog=programs([(4, 5), (64, 1027)], ["f32", "f32", "f64", "i64"]))
def test_random_chains_backward_on_an_engine_thread(prog):
    """The programs' gradients on the CPU, each backward pass on one other thread
    (:class:`_EngineThread`), as CUDA's backward runs on autograd's device thread: the
    calls recorded through the engine thread's worker, flushed by its final callbacks. What
    these programs found on the GPU (a backward pass that raised left every later pass's
    gradients pending) has tests of its own (test_interceptor.py, ``..._raises...``)."""
    check_program({**prog, "grad": "engine thread"}, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@given(prog=programs(None, HALF_DTYPES))
def test_random_chains_16_bit(prog, device):
    """Programs over float16 and bfloat16 inputs beside float32, int64 and bool ones."""
    check_program(prog, device)


@pytest.mark.parametrize("device", DEVICES)
@given(prog=programs([(4, 5), (64, 1027)], ["f16", "bf16", "f32"]))
def test_random_chains_16_bit_backward(prog, device):
    """The gradients of programs over 16-bit inputs (and float32 ones): 16-bit backward
    formulas' ops recorded and rounded as eager's."""
    check_program({**prog, "grad": True}, device)


#: base shapes whose other row counts the shape-generic kernels serve (codegen/generic.py):
#: columns a multiple of 32 (GPU column tiles) and not (a thread a column), and a whole
#: reduction on either side of a GPU's grid-wide one (65536 elements) as the rows change
GENERIC_SHAPES = [(64, 96), (33, 40), (1030, 96)]


@pytest.mark.parametrize("device", DEVICES)
def test_random_chains_at_other_row_counts(device, fresh_store, monkeypatch):
    """Each program at its base shape [R, C], then at 3 R + 1 and R // 2 + 3 rows, half of
    them with gradients: the same regions over other outer lengths, which a kernel built
    for another row count serves where its layout allows (``generic_hits``), and their own
    kernels otherwise; every run matches eager's."""
    monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "1")
    hits = accel.stats()["generic_hits"]

    @given(prog=programs(GENERIC_SHAPES, ["f32", "f32", "f64", "i64", "i32", "bool"]), grad=st.booleans())
    def run(prog, grad):
        r, c = prog["shape"]
        for rows in (r, 3 * r + 1, r // 2 + 3):
            check_program({**prog, "shape": (rows, c), "grad": grad}, device)

    run()
    assert accel.stats()["generic_hits"] > hits


#: found by test_random_chains_large: a float32 sum over 4099 values that nearly cancel
#: (about 7e-5 against values near 2), where eager's order of additions and accel's round apart
CANCELLING_SUM = {"inputs": [("5", "f32", 0, False)], "steps": [("center", "mean", 0, 0), ("reduce", "sum", 1, 0, False)],
                  "keep": [2], "shape": (3, 4099)}


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_against_the_float64_reference(device):
    """Where accel's float result is not close to eager's, the check accepts it only where
    accel's is no farther from the float64 reference run than eager's, in every element
    that differs, all finite, NaN where eager's is."""
    e, _, _ = execute(CANCELLING_SUM, False, device)
    r, _, _ = execute(CANCELLING_SUM, False, device, reference=True)
    assert r[0].dtype == torch.float64 and e[0].dtype == torch.float32
    check_program(CANCELLING_SUM, device)
    e, r = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0], dtype=torch.float64)
    assert within_reference(torch.tensor([1.0, 2.25, 3.0]), e, r)   # nearer
    assert within_reference(torch.tensor([1.0, 2.5, 3.0]), e, r)    # on it
    assert within_reference(torch.tensor([1.0, 3.0, 3.0]), e, r)    # as near
    assert not within_reference(torch.tensor([1.0, 3.25, 3.0]), e, r)   # farther
    assert not within_reference(torch.tensor([1.0, 2.5, 3.5]), e, r)    # off where eager is on it
    # both within the tolerance of an exact 0, on either side of it, twice that apart:
    # accel's nearer is right, eager's nearer is not (the backward of exp over an
    # expanded [1, 1027] input summed 64 cancelling rows so, test_random_chains_backward)
    e0, r0 = torch.tensor([1.0, 7.6e-6]), torch.tensor([1.0, 1e-14], dtype=torch.float64)
    assert within_reference(torch.tensor([1.0, -2.4e-6]), e0, r0)
    assert not within_reference(torch.tensor([1.0, -7.7e-6]), torch.tensor([1.0, 2.4e-6]), r0)
    assert not within_reference(torch.tensor([1.0, 2.5, float("nan")]), e, r)
    assert not within_reference(torch.tensor([1.0, float("inf"), 3.0]), e, r)
    e2 = torch.tensor([1.0, 2.0, float("nan")])
    assert not within_reference(torch.tensor([1.0, 2.5, 3.0]), e2, r)   # eager's NaN kept
    with pytest.raises(AssertionError):
        assert_same(torch.tensor([1.0, 3.25, 3.0]), e, "v", lambda: r)
    assert_same(torch.tensor([1.0, 2.25, 3.0]), e, "v", lambda: r)


#: found by ``--hypothesis-profile=accel-explore``: hypot(x, x / x)'s gradient adds two terms
#: of about 1250 that cancel to 8e-4, so a one-ulp difference in hypot showed as 15 %
HYPOT_THROUGH_A_CANCELLATION = {
    "inputs": [("(4x10)[:, ::2]", "f32", 0, False)],
    "steps": [("unary", "abs", 0), ("binary", "div", 0, 0), ("binary", "hypot", 0, 2)],
    "keep": [3], "shape": (64, 1027), "grad": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hypot_is_correctly_rounded_as_eagers_cpu_kernel(dtype):
    """Eager's CPU hypot is correctly rounded (Sleef's; its float64 results equal Python's
    ``math.hypot``). accel's was libm's (libmvec's in vector loops), 16 % of the elements an
    ulp away; it is now correctly rounded too (include/accel/cpu_math.h): equal bit for bit
    over operands from 1e-300 to 1e300 (float32: outside subnormals, where Sleef's is not),
    with infinities beside NaN, zeros and equal operands."""
    g = torch.Generator().manual_seed(0)
    n = 20000
    mags = torch.tensor([1e-300, 1e-160, 1e-30, 1e-10, 1.0, 1e10, 1e30, 1e160, 1e300], dtype=torch.float64)
    a = torch.randn(n, dtype=torch.float64, generator=g) * mags[torch.randint(0, 9, (n,), generator=g)]
    b = torch.randn(n, dtype=torch.float64, generator=g) * mags[torch.randint(0, 9, (n,), generator=g)]
    b[: n // 3] = a[: n // 3] * torch.rand(n // 3, dtype=torch.float64, generator=g)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, 3.0], dtype=torch.float64)
    a, b = torch.cat([a, special.repeat_interleave(7)]), torch.cat([b, special.repeat(7)])
    a, b = a.to(dtype), b.to(dtype)
    if dtype == torch.float32:  # (operands outside float32's range are infinities or zeros)
        subnormal = (a.abs() < torch.finfo(dtype).tiny) & (a != 0) | (b.abs() < torch.finfo(dtype).tiny) & (b != 0)
        a, b = a[~subnormal], b[~subnormal]
    want = torch.hypot(a, b)
    accel.reset_stats()
    with accel.eager():
        got = torch.hypot(a * 1, b) * 1
    assert accel.stats()["kernel_runs"] == 1, accel.stats()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    check_program(HYPOT_THROUGH_A_CANCELLATION, "cpu")


def _fmod_operands(dtype, device, n=60000):
    """Pairs for fmod-like ops: random finite bits (any exponent ratio), exponents close
    together and far apart, divisors near and under the subnormal range, small integers
    and quarters (exact multiples, zero results of both signs), quotients within 2 ulps of
    integers up to 2^24, then every pair of zeros,
    infinities, NaN, ones and extremes, alone and each among ordinary pairs."""
    g = torch.Generator().manual_seed(0)
    fin = torch.finfo(dtype)
    ib = torch.int32 if dtype == torch.float32 else torch.int64
    lo, hi = torch.iinfo(ib).min, torch.iinfo(ib).max
    a = torch.randint(lo, hi, (n,), dtype=ib, generator=g).view(dtype)
    b = torch.randint(lo, hi, (n,), dtype=ib, generator=g).view(dtype)
    keep = a.isfinite() & b.isfinite()
    a, b = a[keep], b[keep]
    m = a.numel() // 4
    exps = torch.randint(-40, 40, (m,), generator=g).to(dtype)
    a[:m] = torch.randn(m, dtype=dtype, generator=g) * 2.0 ** exps
    b[:m] = torch.randn(m, dtype=dtype, generator=g) * 2.0 ** (exps - torch.randint(0, 60, (m,), generator=g))
    b[m:2 * m] = torch.randn(m, dtype=dtype, generator=g) * fin.tiny * 2.0 ** torch.randint(-20, 4, (m,), generator=g)
    a[2 * m:3 * m] = torch.randint(-1000, 1001, (m,), generator=g).to(dtype) + torch.randint(0, 4, (m,), generator=g) * 0.25
    b[2 * m:3 * m] = torch.randint(-10, 11, (m,), generator=g).to(dtype) + torch.randint(0, 2, (m,), generator=g) * 0.5
    # quotients next to integers up to 2^24 (k b, stepped by up to 2 ulps either way: a
    # rounded quotient on an integer the exact one is just under; around floor division's
    # one-division bound, 2^22 for float32)
    k = torch.randint(-2 ** 24, 2 ** 24, (m,), generator=g).to(dtype)
    k[: m // 2] = torch.randint(-2 ** 12, 2 ** 12, (m // 2,), generator=g).to(dtype)
    a3 = k * b[3 * m:4 * m]
    for _ in range(2):
        step = torch.randint(-1, 2, (m,), generator=g)
        a3 = torch.where(step == 0, a3, torch.nextafter(a3, step.to(dtype) * float("inf")))
    a[3 * m:4 * m] = a3
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -3.0, fin.max, fin.tiny],
                           dtype=dtype)
    sa, sb = special.repeat_interleave(len(special)), special.repeat(len(special))
    # each special pair also among 31 ordinary ones (a vector's other lanes decide its path)
    pa, pb = torch.full((len(sa), 32), 5.0, dtype=dtype), torch.full((len(sa), 32), 3.0, dtype=dtype)
    pos = torch.arange(len(sa)) % 32
    pa[torch.arange(len(sa)), pos], pb[torch.arange(len(sa)), pos] = sa, sb
    a = torch.cat([a, sa, pa.flatten()])
    b = torch.cat([b, sb, pb.flatten()])
    return a.to(device), b.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_fmod_remainder_floor_division_and_nextafter_are_eagers_bits(device, dtype):
    """``fmod`` (and so ``remainder`` and floating floor division, whose formulas take one)
    and ``nextafter`` are exact: accel's CPU kernels compute them in vector loops
    (include/accel/vector_fmod.h: float32 fmod reduced in float64 steps; cpu_math.h's
    nextafter on the bits), where glibc's scalar fmodf and nextafterf had kept the loops
    scalar. Every result is eager's, bit for bit, over pairs of every exponent ratio,
    subnormal divisors and special values -- eager's scalar loop's (strided operands): on
    a contiguous CPU tensor eager's vector loop (SLEEF's fmod) gives NaN where the quotient
    overflows (pytorch/pytorch#193753, open; the fix #193763 falls back to ``std::fmod``
    there), and accel the exact value; everywhere else the two loops agree."""
    a, b = _fmod_operands(dtype, device)
    sa, sb = torch.stack([a, a], 1)[:, 0], torch.stack([b, b], 1)[:, 0]  # eager's scalar loop
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    ops = {
        "fmod": torch.fmod, "remainder": torch.remainder,
        "floor division": lambda x, y: torch.div(x, y, rounding_mode="floor"),
        "nextafter": torch.nextafter,
    }
    for name, op in ops.items():
        want, vector_loop = op(sa, sb), op(a, b)
        accel.reset_stats()
        with accel.eager():
            got = op(a * 1, b)
        assert accel.stats()["kernel_runs"] == 1, (name, accel.stats())
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), name
        assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), name
        agree = ~vector_loop.isnan()  # (eager's two loops, where SLEEF's is not NaN)
        assert torch.equal(vector_loop[agree].view(bits), want[agree].view(bits)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_lgamma_near_its_zeros_poles_and_overflow_is_eagers(device, dtype):
    """``lgamma`` on the CPU is accel's own vectorizable Lanczos approximation
    (include/accel/cpu_math.h, computed in float64; glibc's lgammaf had kept the loops
    scalar): eager's values, within the default tolerances, and its infinities and NaNs
    exactly, over random bits, ordinary values of both signs, a thousand float steps around
    the zeros at 1 and 2 and four negative ones, both sides of the poles, tiny and huge
    arguments up to and past the overflow, and special values -- against both of eager's
    loops (its SLEEF vectors on contiguous tensors, the C library's lgamma on strided ones)."""
    g = torch.Generator().manual_seed(0)
    fin = torch.finfo(dtype)
    ib = torch.int32 if dtype == torch.float32 else torch.int64
    bits = torch.randint(torch.iinfo(ib).min, torch.iinfo(ib).max, (20000,), dtype=ib, generator=g).view(dtype)
    steps = torch.arange(-500, 501, dtype=torch.float64)
    near = [(c + steps * fin.eps * abs(c)).to(dtype)  # about an ulp a step
            for c in (1.0, 2.0, -2.4570247382208006, -2.7476826467274126, -3.1435808883499798, -3.9552942848585)]
    poles = torch.arange(-60, 1, dtype=dtype).repeat_interleave(4) + torch.tensor([-1e-3, -fin.eps * 4, fin.eps * 4, 0.3],
                                                                                   dtype=dtype).repeat(61)
    overflow = 4.08e36 if dtype == torch.float32 else 2.55e305
    special = torch.tensor([0.0, -0.0, 1.0, 2.0, 3.0, 0.5, -0.5, fin.tiny, -fin.tiny, fin.tiny * fin.eps,
                            -fin.tiny * fin.eps, 1e-30, -1e-30, fin.max, -fin.max, float("inf"), -float("inf"),
                            float("nan"), overflow * 0.99, overflow * 1.01, -2.0 ** 23, -2.0 ** 23 - 0.5],
                           dtype=dtype)
    x = torch.cat([bits, (torch.rand(20000, dtype=dtype, generator=g) - 0.5) * 200,
                   torch.rand(2000, dtype=dtype, generator=g) * 2.0 ** torch.randint(-150, 120, (2000,), generator=g),
                   *near, poles, special]).to(device)
    strided = torch.stack([x, x], 1)[:, 0]
    want, scalar_loop = torch.lgamma(x * 1.0), torch.lgamma(strided * 1.0)
    accel.reset_stats()
    with accel.eager():
        got = torch.lgamma(x * 1.0)
    assert accel.stats()["kernel_runs"] == 1, accel.stats()
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(got, scalar_loop, equal_nan=True)
    assert torch.equal(got.isinf(), want.isinf())
    assert (got[(x == 1) | (x == 2)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_digamma_and_lgammas_backward_run_as_kernels(device, dtype):
    """``digamma`` (lgamma's derivative: a Beta or Gamma distribution's log-probability
    backward, its entropy) is rendered by both backends (it ran eagerly before, "no
    rendering for digamma"; on the CPU a vectorizable form in float64, cpu_math.h): poles
    and signed zeros, both sides of the poles up to 1e-10 away (where eager's float64
    reflection rounds pi r: accel's takes the same rounding), its zeros, negative arguments,
    tiny, huge and random bits, the recurrence up to 10 and the asymptotic series, as eager."""
    g = torch.Generator().manual_seed(0)
    fin = torch.finfo(dtype)
    ib = torch.int32 if dtype == torch.float32 else torch.int64
    special = [0.0, -0.0, -1.0, -2.0, -2.5, -7.3, 1e-30, -1e-30, 1.4616321449683622, 9.999999,
               10.0, 10.000001, 1e20, float("inf"), float("-inf"), float("nan"), -0.5040830082644554,
               -1.5734742153901676, fin.tiny, -fin.tiny, fin.tiny * fin.eps, -fin.tiny * fin.eps, fin.max,
               -fin.max, -2.0 ** 23 - 0.5]
    away = torch.logspace(-10 if dtype == torch.float64 else -5, -1, 12, dtype=torch.float64)
    poles = (-torch.arange(0, 100, 7, dtype=torch.float64)[:, None] + torch.cat([away, -away])).flatten()
    bits = torch.randint(torch.iinfo(ib).min, torch.iinfo(ib).max, (4096,), dtype=ib, generator=g).view(dtype)
    x = torch.cat([torch.randn(512, dtype=dtype, generator=g) * 30,
                   torch.rand(256, dtype=dtype, generator=g) * 1e-3, poles.to(dtype), bits,
                   torch.tensor(special, dtype=dtype)]).to(device)
    a = (x.abs() + 0.1).nan_to_num(1.0).requires_grad_()
    want = torch.digamma(x * 2.0) + 1
    (want_grad,) = torch.autograd.grad(torch.lgamma(a * 2).sum(), a)
    accel.reset_stats()
    with accel.eager():
        got = torch.digamma(x * 2.0) + 1
        (got_grad,) = torch.autograd.grad(torch.lgamma(a * 2).sum(), a)
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= 2, st
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_erfinv_and_trunc_normal_init_run_as_kernels(device, dtype):
    """``erfinv`` (``nn.init.trunc_normal_``'s middle step, a probit) no longer fails its
    region's codegen ("no rendering for erf_inv", the whole region replayed eagerly with a
    warning): on the GPU it is rendered by CUDA's erfinv, as eager's kernel; on the CPU it
    runs eagerly (accel/ops.py, RUNS_EAGERLY: eager's kernel is faster), bit for bit, its
    neighbours fused. The tails next to +-1, +-1, beyond, signed zeros, subnormals and NaN;
    its gradient; and the initializer itself."""
    g = torch.Generator().manual_seed(0)
    tail = torch.logspace(-15 if dtype == torch.float64 else -7, -0.3, 200, dtype=torch.float64)
    special = [0.0, -0.0, 1.0, -1.0, 1.5, -1.5, 1e-300 if dtype == torch.float64 else 1e-40,
               0.5, -0.5, float("inf"), float("nan")]
    y = torch.cat([torch.rand(4096, dtype=torch.float64, generator=g) * 2 - 1, 1 - tail, tail - 1,
                   torch.tensor(special, dtype=torch.float64)]).to(device, dtype)
    a = (torch.rand(1024, dtype=dtype, generator=g) * 1.98 - 0.99).to(device).requires_grad_()
    want = torch.erfinv(y * 1.0) * 2
    (want_grad,) = torch.autograd.grad((torch.erfinv(a * 0.5) * a).sum(), a)
    torch.manual_seed(1)
    want_w = torch.nn.init.trunc_normal_(torch.empty(64, 48, dtype=dtype, device=device), std=0.02)
    accel.reset_stats()
    with accel.eager():
        got = torch.erfinv(y * 1.0) * 2
        (got_grad,) = torch.autograd.grad((torch.erfinv(a * 0.5) * a).sum(), a)
        torch.manual_seed(1)
        got_w = torch.nn.init.trunc_normal_(torch.empty(64, 48, dtype=dtype, device=device), std=0.02)
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= 3, st
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(got.signbit()[~want.isnan()], want.signbit()[~want.isnan()])
    torch.testing.assert_close(got_grad, want_grad)
    torch.testing.assert_close(got_w, want_w)
    if device == "cpu":
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("device", DEVICES)
def test_gcd_runs_as_a_kernel_bit_for_bit(device, dtype):
    """``gcd`` of integers is rendered by both backends as eager's Euclid (it ran eagerly
    before, "no rendering for gcd"), bit for bit, the type's minimum included (its absolute
    value wraps to itself in both)."""
    g = torch.Generator().manual_seed(0)
    info = torch.iinfo(dtype)
    a = torch.randint(info.min, info.max, (4096,), dtype=dtype, generator=g)
    b = torch.randint(-1000, 1000, (4096,), dtype=dtype, generator=g)
    edge = [(info.min, 0), (info.min, 3), (info.min, info.min), (0, 0), (0, -7), (-12, 18),
            (info.max, info.min), (1, info.min)]
    a = torch.cat([a, torch.tensor([p for p, _ in edge], dtype=dtype)]).to(device)
    b = torch.cat([b, torch.tensor([q for _, q in edge], dtype=dtype)]).to(device)
    want = torch.gcd(a, b) * 3
    accel.reset_stats()
    with accel.eager():
        got = torch.gcd(a, b) * 3
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["kernel_runs"] == 1, st
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_gelus_special_values_are_eagers_on_each_of_its_paths(dtype):
    """eager's CPU GELU runs oneDNN for a contiguous tensor of more than one element (its
    ``gelu(inf)`` is NaN, and from 2^127 on its product overflows to inf; its backward is 0
    from x = -7 or so down, NaN there for an infinite gradient) and ATen's loops otherwise
    (``gelu(inf)`` inf; ``gelu(x)`` x; a backward of 1e-11 and less, infinite there): accel's
    kernels give each path's special values (found by the ``accel-explore`` profile:
    ``gelu`` of a leaf holding inf was inf under accel, NaN in eager). Contiguous, strided
    along the row, one element, and with oneDNN disabled (at another length: the decision
    is the traced region's, and a kernel traced with oneDNN enabled replays after it is
    disabled); signed zeros, subnormals, the tails, NaN; gradients of 1, -2 and +-inf (a
    finite gradient's result in the tails is a cancellation's, its bits another
    approximation's: within the tolerance only scaled by gradients of about 1)."""
    inf, big = float("inf"), 2.0 ** 127 if dtype != torch.float16 else 6e4
    special = [inf, -inf, float("nan"), big, big * 1.25, -big, 1e10, -1e10, 10.0, -10.0,
               -13.0, -7.0, -6.0, 5.9, 1e-40, -1e-40, 0.0, -0.0, 3.0, -3.0, 0.5]
    grads = [1.0, inf, -inf, -2.0]
    g = torch.Generator().manual_seed(0)
    for mkldnn, n in ((True, 64), (False, 66)):
        x = torch.cat([torch.tensor(special), torch.randn(n - len(special), generator=g) * 3]).to(dtype)
        dy = torch.tensor([grads[i % len(grads)] for i in range(n)]).to(dtype)
        two = torch.stack([x, x], 1)
        with torch.backends.mkldnn.flags(enabled=mkldnn):
            for case in (lambda: x, lambda: two[:, 1], lambda: x[:1]):
                run = lambda: (F.gelu(case() * 1) * 2,  # noqa: E731
                               torch.ops.aten.gelu_backward(dy[:len(case())] * 1, case()))
                want = run()
                accel.reset_stats()
                with accel.eager():
                    got = run()
                st = accel.stats()
                assert st["compile_failures"] == 0 and st["kernel_runs"] >= 1, st
                for a, e in zip(got, want):
                    off = (a.isnan() != e.isnan()) | (a.isinf() != e.isinf())
                    assert not off.any(), (mkldnn, case()[off], a[off], e[off])
                    torch.testing.assert_close(a, e, equal_nan=True)


@pytest.mark.parametrize("prog", [
    # a hand-written chain, so that a plain run certainly compiles and runs kernels
    {"inputs": [("4x5", "f32", 1, False), ("1x5", "f32", 2, False)],
     "steps": [("unary", "sin", 0), ("binary", "mul", 2, 1), ("scalar", "add", 3, 0.5),
               ("alpha", 4, 0, -2.0), ("unary", "tanh", 5)], "keep": [6]},
    {"inputs": [("t(5x4)", "f64", 3, True), ("5", "i64", 4, False)],
     "steps": [("binary", "add", 0, 1), ("inplace", "mul_", 2, 1), ("unary", "exp", 3)],
     "keep": [2, 4]},
    # reductions feeding later pointwise steps (hand-written, so they certainly run kernels)
    {"inputs": [("4x5", "f32", 5, False), ("1x5", "f64", 6, False)],
     "steps": [("reduce", "softmax", 0, -1, False), ("center", "mean", 0, 0),
               ("binary", "mul", 2, 3), ("reduce", "var", 4, 1, False),
               ("binary", "add", 4, 5), ("reduce", "logsumexp", 6, 0, True)],
     "keep": [2, 5, 7]},
    {"inputs": [("(4x10)[:, ::2]", "f32", 7, False), ("5", "i64", 8, False)],
     "steps": [("reduce", "amax", 0, 1, False), ("binary", "sub", 0, 2),
               ("unary", "exp", 3), ("reduce", "sum", 4, -1, True), ("binary", "div", 4, 5),
               ("reduce", "argmax", 6, 0, False), ("binary", "add", 7, 1)],
     "keep": [6, 8]},
    # minimal repros of bugs the random programs found
    # an in-place op on a [1, 5] input next to a live [4, 5] result: applied once per row
    {"inputs": [("4x5", "f32", 9, False), ("1x5", "f32", 10, False)],
     "steps": [("scalar", "mul", 0, 2), ("inplace", "sin_", 1, 0)], "keep": [2]},
    # a.add_(b) then b.fill_(): a must see b's old values (a dead read of b comes first)
    {"inputs": [("4x5", "f32", 11, False), ("4x5", "f32", 12, False)],
     "steps": [("unary", "sin", 1), ("inplace", "add_", 0, 1), ("inplace", "fill_", 1, 1)],
     "keep": [3]},
    # a sum or mean over a dim of size 1 of -0.0 is +0.0 in eager (its sums start at +0.0)
    {"inputs": [("unsqueeze(5)", "f32", 256, True), ("4x5", "f32", 14, False)],
     "steps": [("reduce", "sum", 0, 0, True), ("reduce", "mean", 0, 0, False),
               ("binary", "div", 1, 2), ("binary", "div", 1, 3)], "keep": [4, 5]},
    # a variance and an argmax over the one dim a 0-d tensor wraps (lowering took the dim
    # modulo a rank of 0)
    {"inputs": [("0d", "f32", 15, False), ("4x5", "f32", 16, False)],
     "steps": [("reduce", "var_c0", 0, -1, False), ("reduce", "argmax", 0, 0, False),
               ("reduce", "var", 0, 0, True), ("binary", "add", 1, 2), ("binary", "mul", 5, 3)],
     "keep": [2, 6]},
    # round of integers leaves them as they are (it ran eagerly: no rendering)
    {"inputs": [("4x5", "i32", 17, False), ("t(5x4)", "i64", 18, False)],
     "steps": [("unary", "round", 0), ("binary", "add", 2, 1), ("unary", "round", 3)], "keep": [4]},
    # the sign of a NaN a kernel computes (0 / 0 of bools cast to float: x86 sets it, and
    # eager's kernels read it): gcc folded copysign of a value it proved non-negative
    {"inputs": [("(4x10)[:, ::2]", "bool", 0, False), ("(4x10)[:, ::2]", "bool", 1, False)],
     "steps": [("binary", "div", 0, 0), ("binary", "copysign", 1, 2)], "keep": [3]},
    # sign(nan) is 0 in eager
    {"inputs": [("4x5", "f64", 13, True)], "steps": [("unary", "sign", 0)], "keep": [1]},
    # integer powers, negative exponents (0, or +-1 for bases of +-1) and wrapping products
    # (a power of a power of values up to 5) included (they ran eagerly: no rendering)
    {"inputs": [("4x5", "i64", 19, False), ("t(5x4)", "i32", 20, False)],
     "steps": [("binary", "pow", 0, 1), ("binary", "pow", 1, 0), ("unary", "abs", 0),
               ("binary", "mul", 4, 4), ("binary", "pow", 0, 5), ("binary", "pow", 6, 5)],
     "keep": [2, 3, 7]},
    # addcmul_ of integers with value=0.5: eager truncates the value to 0, torch's reference
    # raised (the region ran eagerly)
    {"inputs": [("1x5", "i64", 21, False), ("4x5", "i32", 22, False)],
     "steps": [("reduce", "sum", 1, 0, True), ("inplace", "addcmul_", 2, 0), ("binary", "mul", 2, 1)],
     "keep": [3, 4]},
    # the gradient of a 16-bit log_softmax over the rows: eager's CPU kernel rounds a row's
    # sum and its log to the dtype, and the backward's cancellation carried the difference
    {"inputs": [("(4x10)[:, ::2]", "bf16", 0, False)], "steps": [("reduce", "log_softmax", 0, 1, False)],
     "keep": [1], "shape": (64, 1027), "grad": True},
    # a 16-bit logsumexp centring its input: eager rounds each of its ops' results
    {"inputs": [("(4x10)[:, ::2]", "bf16", 0, False)],
     "steps": [("unary", "abs", 0), ("center", "logsumexp", 0, 0), ("unary", "to_f32", 2)], "keep": [3]},
    # a 0-dim float16 tensor in a bfloat16 addcmul_: eager converts it to bfloat16 first
    {"inputs": [("0d", "f16", 4, False), ("(4x10)[:, ::2]", "bf16", 0, False)],
     "steps": [("binary", "add", 0, 1), ("inplace", "addcmul_", 2, 0)], "keep": [2]},
    # the gradient of a 16-bit softmax over dim 0: eager's GPU kernel rounds grad * output to
    # the dtype before its sum and the subtraction's cancellation
    {"inputs": [("(4x10)[:, ::2]", "bf16", 0, False)], "steps": [("reduce", "softmax", 0, 0, False)],
     "keep": [1], "shape": (64, 1027), "grad": True},
    # a log_softmax over rows of 32768 strided bools plus 0.5: gcc 12 vectorized no CPU loop
    # loading a bool, and the row's exponentials were summed one at a time in float32
    {"inputs": [("(4x10)[:, ::2]", "bool", 0, False)],
     "steps": [("scalar", "add", 0, 0.5), ("reduce", "log_softmax", 1, 1, False)],
     "keep": [2], "shape": (2, 65536)},
], ids=["f32-chain", "f64-int-inplace", "softmax-center-var", "manual-softmax-argmax",
        "inplace-broadcast-row-repeated", "add_-then-fill_-of-operand", "size-1-sum-of-negative-zero",
    "reductions-of-a-0d-tensor", "round-of-integers", "sign-bit-of-a-computed-nan", "sign-of-nan",
    "integer-powers", "addcmul_-of-integers", "16-bit-log-softmax-gradient", "16-bit-logsumexp-steps",
    "0-dim-float16-in-a-bfloat16-addcmul_", "16-bit-softmax-gradient-over-dim-0",
    "log-softmax-of-long-rows-of-strided-bools"])


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_chains(prog, device):
    accel.reset_stats()
    check_program(prog, device)
    assert accel.stats()["kernel_runs"] >= 1, accel.stats()


@pytest.mark.parametrize("device", DEVICES)
def test_the_sign_of_a_computed_nan_is_eagers(device):
    """``signbit`` and ``copysign`` of a NaN a kernel computes read its sign bit as eager's
    kernels do. 0 / 0 of values the compiler can prove non-negative (bools cast to float,
    absolute values) is a NaN whose sign C leaves unspecified: gcc took it for + and
    folded ``signbit`` and ``copysign`` of it (and ``abs`` of it into the value itself),
    where x86's division sets the sign bit (a random program's ``copysign(b1, b0 / b0)``
    was 1 where eager's is -1)."""
    b = torch.tensor([False, True, False, True, False], device=device)
    x = torch.tensor([0.0, -2.0, 0.0, 3.0, -0.0], device=device)
    y = torch.tensor([1.5, -2.5, 3.5, -4.5, 5.5], device=device)
    programs = {
        "signbit(b / b)": lambda: torch.signbit(b / b),
        "copysign(y, b / b)": lambda: torch.copysign(y, b / b),
        "signbit(|x| / |x|)": lambda: torch.signbit(x.abs() / x.abs()),
        "copysign(y, |x| / |x|)": lambda: torch.copysign(y, x.abs() / x.abs()),
        "copysign(y, -(|x| / |x|))": lambda: torch.copysign(y, -(x.abs() / x.abs())),
        "signbit(|b / b|)": lambda: torch.signbit((b / b).abs()),
    }
    for name, fn in programs.items():
        want = fn()
        accel.reset_stats()
        with accel.eager():
            got = fn()
        assert accel.stats()["kernel_runs"] == 1, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_changing_scalar_compiles_once(fresh_store):
    """A Python scalar that changes every iteration is a runtime kernel argument: one
    compile, then the same kernel for every value of that sign. The sign is part of the
    key (decompositions and eager's checks branch on it): the negative values share a
    second kernel."""
    torch.manual_seed(0)
    x, y = torch.randn(7, 13), torch.randn(13)
    accel.reset_stats()
    for alphas, compiles in (((0.5, 1.25, 3.0, 1e-3, math.pi), 1), ((-0.5, -7.0, -1e-6), 2)):
        for alpha in alphas:
            with accel.eager():
                r = torch.tanh(x * alpha).add(y, alpha=alpha / 2)
            torch.testing.assert_close(r, torch.tanh(x * alpha).add(y, alpha=alpha / 2))
        st = accel.stats()
        assert st["compiles"] == compiles, st
    assert st["kernel_runs"] == 8 and st["eager_replays"] == 0, st
