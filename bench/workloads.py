"""The CPU benchmark's workloads (bench_cpu.py; bench_gpu.py runs them at GPU sizes): the
functions and models, and per workload a ``Spec``, its three backends (eager, accel,
torch.compile) as zero-argument callables on inputs built once."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

# _common puts this checkout's accel first on sys.path: import it before accel
from _common import accel_fn
from bench_pointwise import CHAIN_N, chain

import accel  # noqa: E402

ROWS, D, HIDDEN, BATCH = 8192, 1024, 4096, 2048


def bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


def add_layernorm(x, r, w, b):
    return F.layer_norm(x + r, [x.shape[-1]], w, b)


def scaled_softmax(x):
    return torch.softmax(x * 0.125, dim=-1)


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class MLPBlock(nn.Module):
    """LayerNorm(x + fc2(GELU(fc1(x)))): a transformer MLP block with its residual."""

    def __init__(self, d: int = D, hidden: int = HIDDEN):
        super().__init__()
        self.fc1, self.act = nn.Linear(d, hidden), nn.GELU()
        self.fc2, self.norm = nn.Linear(hidden, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class Spec:
    """One workload's three backends (zero-argument callables returning the result) and the
    bytes of its inputs (``None``: no bandwidth floor)."""

    def __init__(self, eager, accelerated, compiled, in_bytes=None, exact=None):
        self.eager, self.accel, self.compile, self.in_bytes = eager, accelerated, compiled, in_bytes
        self.exact = exact  # the result in float64 (the oracle where eager's is off it)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fn_spec(fn, *args) -> Spec:
    """``fn(*args)`` eagerly, under accel and torch.compile'd; the floor reads ``args``."""
    af, cf = accel_fn(fn), torch.compile(fn)
    return Spec(lambda: fn(*args), lambda: af(*args), lambda: cf(*args),
                sum(a.nbytes for a in args))


def _three(model):
    """Three copies of ``model`` (same weights): eager, accel, and the one torch.compile wraps."""
    return copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)


def mlp_model(d: int = D, hidden: int = HIDDEN) -> MLPBlock:
    """The benchmarks' MLP block (seed 0), its LayerNorm's weight and bias random: with
    ones / zeros, ``out.sum()`` would be ~0 and its input gradients ~0 (rounding noise, no
    tolerance can compare them)."""
    torch.manual_seed(0)
    m = MLPBlock(d, hidden)
    with torch.no_grad():
        m.norm.weight.normal_(1.0, 0.5)
        m.norm.bias.normal_(0.0, 0.5)
    return m


def _mlp():
    return mlp_model(), _randn(BATCH, D, seed=1)


def mlp_fwd_spec() -> Spec:
    model, x = _mlp()
    me, ma, mc = _three(model)
    cm = torch.compile(mc)

    def fwd(m):
        with torch.no_grad():
            return m(x)

    def fwd_a():
        with accel.eager():
            return fwd(ma)

    return Spec(lambda: fwd(me), fwd_a, lambda: fwd(cm))


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def mlp_train_spec() -> Spec:
    model, x = _mlp()
    me, ma, mc = _three(model)
    cm = torch.compile(mc)

    def step(m, params_of):
        m.zero_grad(set_to_none=True)
        loss = m(x).sum()
        loss.backward()
        return loss.detach(), _grads(params_of)

    def step_a():
        with accel.eager():
            return step(ma, ma)

    m64 = copy.deepcopy(model).double()

    def exact():
        m64.zero_grad(set_to_none=True)
        loss = m64(x.double()).sum()
        loss.backward()
        return loss.detach(), _grads(m64)

    return Spec(lambda: step(me, me), step_a, lambda: step(cm, mc), exact=exact)


def gpt2_train_spec() -> Spec:
    from accel.demo import build_model, make_batch, train_step

    model = build_model()
    ids, labels = make_batch()
    me, ma, mc = _three(model)
    cm = torch.compile(mc)

    def step(m, params_of):
        return train_step(m, ids, labels), _grads(params_of)

    def step_a():
        with accel.eager():
            return step(ma, ma)

    return Spec(lambda: step(me, me), step_a, lambda: step(cm, mc))


def gpt2_adamw_spec() -> Spec:
    """The demo's training step followed by ``torch.optim.AdamW.step()`` (torch's default
    implementation for CPU parameters: a loop of in-place updates, parameter by parameter),
    each backend with its own model and optimizer; torch.compile compiles the model, the
    optimizer steps eagerly. Result: the loss and every parameter after the step (checked
    after each backend's first step)."""
    from accel.demo import build_model, make_batch, train_step

    model = build_model()
    ids, labels = make_batch()
    three = _three(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in three]
    me, ma, mc = three
    cm = torch.compile(mc)

    def step(m, params_of, opt):
        loss = train_step(m, ids, labels)
        opt.step()
        return loss, dict(params_of.named_parameters())

    def step_a():
        with accel.eager():
            return step(ma, ma, opts[1])

    return Spec(lambda: step(me, me, opts[0]), step_a, lambda: step(cm, mc, opts[2]))


def _gpt2_title() -> str:
    try:
        from accel.demo import DEFAULTS as d
    except ImportError:
        return "GPT-2 train step (accel demo)"
    return f"GPT-2 train step (demo: {d['layers']}L, {d['embd']}d, {d['batch']}x{d['seq']})"


#: name -> (table title, Spec factory)
WORKLOADS = {
    "chain": ("1 sin*exp+tanh chain, 16M f32",
              lambda: fn_spec(chain, _randn(CHAIN_N))),
    "bias_gelu": (f"2 bias + tanh-GELU, [{ROWS}, {D}] f32",
                  lambda: fn_spec(bias_gelu, _randn(ROWS, D), _randn(D, seed=1))),
    "add_ln": (f"3 residual add + LayerNorm, [{ROWS}, {D}] f32",
               lambda: fn_spec(add_layernorm, _randn(ROWS, D), _randn(ROWS, D, seed=1),
                               _randn(D, seed=2), _randn(D, seed=3))),
    "softmax": (f"4 softmax(x * 0.125), [{ROWS}, {D}] f32",
                lambda: fn_spec(scaled_softmax, _randn(ROWS, D))),
    "rmsnorm": (f"5 RMSNorm (hand-written), [{ROWS}, {D}] f32",
                lambda: fn_spec(rmsnorm, _randn(ROWS, D), _randn(D, seed=1))),
    "mlp_fwd": (f"6 MLP block fwd (no_grad), {BATCH}x{D}->{HIDDEN}->{D}", mlp_fwd_spec),
    "mlp_train": (f"7 MLP block fwd+bwd, {BATCH}x{D}->{HIDDEN}->{D}", mlp_train_spec),
    "gpt2_train": (None, gpt2_train_spec),
    # 16-bit floats (not among the eight: outside the geometric mean)
    "bias_gelu_bf16": (f"9 bias + tanh-GELU, [{ROWS}, {D}] bf16",
                       lambda: fn_spec(bias_gelu, _randn(ROWS, D, dtype=torch.bfloat16),
                                       _randn(D, seed=1, dtype=torch.bfloat16))),
    "add_ln_bf16": (f"10 residual add + LayerNorm, [{ROWS}, {D}] bf16",
                    lambda: fn_spec(add_layernorm, *(_randn(*s, seed=k, dtype=torch.bfloat16) for k, s in
                                                     enumerate([(ROWS, D), (ROWS, D), (D,), (D,)])))),
    "softmax_f16": (f"11 softmax(x * 0.125), [{ROWS}, {D}] f16",
                    lambda: fn_spec(scaled_softmax, _randn(ROWS, D, dtype=torch.float16))),
    # a whole training step: the demo's, then the optimizer's
    "gpt2_adamw": ("12 GPT-2 train step + AdamW step (demo)", gpt2_adamw_spec),
}
#: workloads outside the issue's eight, left out of the geometric mean
EXTRA = ("bias_gelu_bf16", "add_ln_bf16", "softmax_f16", "gpt2_adamw")
#: workloads whose every call changes the state its result depends on (an optimizer step):
#: their results compare only at each backend's first call (bench_cpu's ``measure``)
STATEFUL = ("gpt2_adamw",)


def title(name: str) -> str:
    return WORKLOADS[name][0] or "8 " + _gpt2_title()
