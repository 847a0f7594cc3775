"""Random chains of pointwise ops (hypothesis), eagerly and under ``accel.eager()``.

A program is plain data: input specs (dtype, shape or view of a base tensor, special
values) and steps (unary math, binary ops with broadcasting, Python scalars, ``alpha=``,
in-place ops, views of intermediates, where, and reductions: sum/mean/amax/amin/var/
logsumexp/argmax/max/softmax/log_softmax over a random dim, keepdim or not, whose
results broadcast back into later steps, or centre their input as
``x - red(x, keepdim=True)``). It runs twice on fresh copies of the inputs; the kept
values, the inputs (in-place ops may write them through views) and the first exception
type must match. Dropped intermediates exercise liveness (outputs kept in
registers). Floats: ``assert_close`` defaults with ``equal_nan``; ints/bools: exact.

``--hypothesis-profile=accel-explore`` runs many more, non-derandomized examples.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import accel
from devices import DEVICES  # tests/devices.py (pytest puts tests/ on sys.path)

# profiles "accel-ci" (default: 60 examples, derandomized) and "accel-explore" are
# registered in conftest.py

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "i32": torch.int32,
          "i16": torch.int16, "i8": torch.int8, "bool": torch.bool}

#: how an input is made; every shape broadcasts against [4, 5]
INPUT_KINDS = {
    "4x5": lambda b: b((4, 5)),
    "5": lambda b: b((5,)),
    "4x1": lambda b: b((4, 1)),
    "1x5": lambda b: b((1, 5)),
    "0d": lambda b: b(()),
    "t(5x4)": lambda b: b((5, 4)).t(),                 # transposed view
    "(4x10)[:, ::2]": lambda b: b((4, 10))[:, ::2],    # strided slice
    "(6x5)[1:5]": lambda b: b((6, 5))[1:5],            # offset slice
    "unsqueeze(5)": lambda b: b((5,)).unsqueeze(0),    # [1, 5] view
    "expand(1x5)": lambda b: b((1, 5)).expand(4, 5),   # stride-0 view
}
#: views taken of intermediates (all keep broadcasting against [4, 5])
VIEWS = {
    "[0:1]": lambda x: x[0:1] if x.dim() == 2 else x,
    "[:, 1:2]": lambda x: x[:, 1:2] if x.dim() == 2 else x,
    "unsqueeze(0)": lambda x: x.unsqueeze(0) if x.dim() < 2 else x,
    "t().t()": lambda x: x.t().t() if x.dim() == 2 else x,
    "expand(4x5)": lambda x: x.expand(4, 5),          # stride-0 view of an intermediate
}

UNARY = {
    "sin": torch.sin, "cos": torch.cos, "exp": torch.exp, "tanh": torch.tanh,
    "abs": torch.abs, "neg": torch.neg, "sqrt": torch.sqrt, "log1p": torch.log1p,
    "sigmoid": torch.sigmoid, "relu": torch.relu, "floor": torch.floor, "ceil": torch.ceil,
    "reciprocal": torch.reciprocal, "square": torch.square, "sign": torch.sign,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
    "isnan": torch.isnan, "erf": torch.erf, "round": torch.round, "trunc": torch.trunc,
    "to_f32": lambda x: x.to(torch.float32), "to_i64": lambda x: x.to(torch.int64),
    "to_bool": lambda x: x.to(torch.bool), "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu, "nan_to_num": torch.nan_to_num,
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "eq": torch.eq, "lt": torch.lt,
    "ge": torch.ge, "ne": torch.ne, "atan2": torch.atan2, "pow": torch.pow,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "logical_xor": torch.logical_xor, "remainder": torch.remainder, "fmod": torch.fmod,
    "floor_divide": torch.floor_divide, "hypot": torch.hypot, "copysign": torch.copysign,
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


def _float(x, dt=torch.float32):
    return x if x.is_floating_point() else x.to(dt)


#: reductions ``(x, dim, keepdim)``; float-only ones take integer/bool inputs through
#: ``dtype=`` or a cast (eager's errors for those are not what these programs are after)
REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k) if x.is_floating_point() else x.mean(d, k, dtype=torch.float32),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "var": lambda x, d, k: torch.var(_float(x, torch.float64), d, keepdim=k),
    "var_c0": lambda x, d, k: torch.var(_float(x), d, keepdim=k, correction=0),
    "logsumexp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
    "argmax": lambda x, d, k: torch.argmax(x if x.dtype != torch.bool else x.to(torch.int64), d, keepdim=k),
    "max.values": lambda x, d, k: torch.max(x, d, keepdim=k).values,
    # shape-preserving: keepdim is meaningless
    "softmax": lambda x, d, k: torch.softmax(x, d) if x.is_floating_point() else torch.softmax(x, d, dtype=torch.float32),
    "log_softmax": lambda x, d, k: torch.log_softmax(x, d) if x.is_floating_point() else torch.log_softmax(x, d, dtype=torch.float64),
}


def _reduce(name, x, dim, keepdim):
    """``REDUCTIONS[name]`` over ``dim`` (taken modulo ``x.dim()``, negative if ``dim`` is);
    a result that lost a trailing dim gets it back (``[4]`` -> ``[4, 1]``), so that every
    value still broadcasts against ``[4, 5]``."""
    n = x.dim()
    d = (dim % n) - (n if dim < 0 else 0) if n else (-1 if dim < 0 else 0)
    r = REDUCTIONS[name](x, d, keepdim)
    if r.dim() < n and n == 2 and d % n == 1:
        r = r.unsqueeze(-1)
    return r


# -- program generation -----------------------------------------------------------------
@st.composite
def programs(draw):
    n_in = draw(st.integers(1, 3))
    inputs = [(draw(st.sampled_from(sorted(INPUT_KINDS))), draw(st.sampled_from(sorted(DTYPES))),
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
    return {"inputs": inputs, "steps": steps, "keep": keep}


def make_inputs(specs, device="cpu"):
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

        out.append(INPUT_KINDS[kind](lambda shape, base=base: base(shape).to(device)))
    return out


def apply(step, env):
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
        return VIEWS[step[1]](env[step[2]])
    if k == "reduce":
        return _reduce(step[1], env[step[2]], step[3], step[4])
    if k == "center":
        x = env[step[2]]
        return x - _reduce(step[1], x, step[3], True)
    return torch.where(env[step[1]].to(torch.bool), env[step[2]], env[step[3]])


def execute(prog, use_accel, device="cpu"):
    """Run ``prog`` on fresh inputs; return (kept values, inputs' bases, exception)."""
    inputs = make_inputs(prog["inputs"], device)
    bases = [t._base if t._base is not None else t for t in inputs]
    env = list(inputs)
    err = None
    keep = prog["keep"]
    ctx = accel.eager() if use_accel else _nullctx()
    with ctx:
        for step in prog["steps"]:
            try:
                env.append(apply(step, env))
            except Exception as e:  # noqa: BLE001 - compared by type
                err = e
                break
        kept = [env[i] if i < len(env) else None for i in keep]
        del env, inputs  # the rest is dead: accel may keep it in registers
    return kept, bases, err


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def assert_same(actual, expected, what):
    if expected is None:
        assert actual is None, what
        return
    assert isinstance(actual, torch.Tensor), what
    if expected.is_floating_point():
        torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}")
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
    for i, (a, e) in zip(prog["keep"], zip(a_kept, e_kept)):
        assert_same(a, e, f"value {i}")
    for i, (a, e) in enumerate(zip(a_in, e_in)):
        assert_same(a, e, f"input {i} after the program")


# -- tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@given(prog=programs())
def test_random_chains(prog, device):
    check_program(prog, device)


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
    # sign(nan) is 0 in eager
    {"inputs": [("4x5", "f64", 13, True)], "steps": [("unary", "sign", 0)], "keep": [1]},
], ids=["f32-chain", "f64-int-inplace", "softmax-center-var", "manual-softmax-argmax",
        "inplace-broadcast-row-repeated", "add_-then-fill_-of-operand", "size-1-sum-of-negative-zero", "sign-of-nan"])
@pytest.mark.parametrize("device", DEVICES)
def test_fixed_chains(prog, device):
    accel.reset_stats()
    check_program(prog, device)
    assert accel.stats()["kernel_runs"] >= 1, accel.stats()


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
