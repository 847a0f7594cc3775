"""16-bit floats (float16, bfloat16) in regions, on CPU and CUDA.

Kernels keep 16-bit floats in memory only: each op widens its operands to float32,
computes, and rounds its result back, as ATen's kernels do (their opmath type), so most
results are bit-identical to eager's. Conversions must be exact (c10's rounding, bit for
bit, NaN aside); workloads must match eager within ``assert_close``'s defaults for the
dtype. The OpInfo suites (test_opinfo*.py) cover every pointwise op and reduction at these
dtypes too.
"""
import pytest
import torch
import torch.nn.functional as F

import accel
from devices import DEVICES  # tests/devices.py (pytest puts tests/ on sys.path)
from accel.ops import HALF



def _run(fn, *args):
    accel.reset_stats()
    with accel.eager():
        out = fn(*args)
    return out, accel.stats()


def _same_bits(a, b):
    """Equal bit patterns, where every NaN counts as the same NaN (its payload is not
    specified: c10's scalar and vector conversions differ there)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia, ib = a.view(ints), b.view(ints)
    bad = (ia != ib) & ~nan
    assert not bad.any(), f"{int(bad.sum())} differ, first at {a[bad][:4]} vs {b[bad][:4]}"


def _float32_patterns(device):
    """float32 values that exercise rounding to 16 bits: random bit patterns over the
    whole range (normals, subnormals, infinities, NaNs), halfway ties of both 16-bit
    formats, values near their largest finite and smallest subnormal."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 16,), generator=g, dtype=torch.int64)
    rand = bits.to(torch.int32).view(torch.float32)
    base = torch.randn(4096, generator=g)
    ties_bf16 = ((base.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)
    ties_f16 = ((base.view(torch.int32) & ~0x1FFF) | 0x1000).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 6e-8, 3e-8, 2.9e-8,
                          6.1e-5, 6.09e-5, 3.4e38, 3.39e38, float("inf"), -float("inf"),
                          float("nan"), 1e-40, -1e-45, 1.0 + 2 ** -8, 1.0 + 2 ** -11])
    return torch.cat([rand, ties_bf16, ties_f16, edges]).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_conversions_are_exact(dtype, device):
    """float32/float64/int64/bool -> 16 bits and back, bit for bit as eager."""
    x = _float32_patterns(device)
    cases = [
        (lambda x: x.to(dtype), x),
        (lambda x: x.double().mul(1.0).to(dtype), x),  # float64 -> 16 bits (via float32, as c10)
        (lambda h: h.to(torch.float32) * 1.0, x.to(dtype)),
        (lambda h: h.to(torch.float64) + 0.0, x.to(dtype)),
        (lambda h: h.to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16), x.to(dtype)),
        (lambda i: i.to(dtype), torch.arange(-70000, 70000, 7, device=device)),
        (lambda b: b.to(dtype), x > 0),
        (lambda h: (h * 1).to(torch.int32), x.nan_to_num().clamp(-30000, 30000).to(dtype)),
    ]
    all_bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    cases.append((lambda h: h.float() + 0.0, all_bits.to(device)))  # every 16-bit pattern
    for fn, arg in cases:
        expected = fn(arg)
        actual, st = _run(fn, arg)
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        if expected.is_floating_point():
            _same_bits(actual, expected)
        else:
            assert torch.equal(actual, expected)


WORKLOADS = {
    "chain": lambda x, r, w, b: torch.sin(x) * torch.exp(-x * x) + 0.5 * torch.tanh(x),
    "bias_gelu": lambda x, r, w, b: F.gelu(x + b, approximate="tanh"),
    "add_layer_norm": lambda x, r, w, b: F.layer_norm(x + r, [x.shape[-1]], w, b),
    "softmax": lambda x, r, w, b: torch.softmax(x * 0.125, -1),
    "log_softmax": lambda x, r, w, b: torch.log_softmax(x, 0),
    "rms_norm": lambda x, r, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    "reductions": lambda x, r, w, b: (x.sum(0), x.mean(-1), x.amax(0), x.argmin(-1), x.var(0),
                                      torch.logsumexp(x, -1), x.max(0), (x > 0).any(-1)),
    "mixed": lambda x, r, w, b: (x.float() * r.float() + 1).to(x.dtype) - x * b,
    "in_place": lambda x, r, w, b: x.clone().mul_(2).add_(r, alpha=0.5).clamp_(-1, 1),
    "silu_sigmoid": lambda x, r, w, b: F.silu(x) * torch.sigmoid(r),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_match_eager(name, dtype, device):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(64, 512, generator=g).to(device, dtype) for _ in range(2))
    w, b = (torch.randn(512, generator=g).to(device, dtype) for _ in range(2))
    expected = WORKLOADS[name](x, r, w, b)
    actual, st = _run(WORKLOADS[name], x, r, w, b)
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0 and st["compile_failures"] == 0, st
    torch.testing.assert_close(actual, expected, equal_nan=True)


#: ops with a number that float16 and bfloat16 cannot hold (2.37), by name. Eager's kernels
#: round it to the tensor's dtype for some ops and not others, unlike on the CPU and the
#: GPU: accel.ops.ROUNDED_NUMBERS, accel.operands._number_rounded,
#: accel.decompositions._softshrink, _smooth_l1_loss
NUMBERS = {
    "add": lambda x, s: x + s, "radd": lambda x, s: s + x, "sub": lambda x, s: x - s,
    "rsub": lambda x, s: s - x, "rsub_alpha": lambda x, s: torch.rsub(x, s, alpha=2),
    "add_alpha": lambda x, s: torch.add(x, x * 0.5, alpha=s),
    "sub_alpha": lambda x, s: torch.sub(x, x * 0.5, alpha=s),
    "add_tensor_alpha": lambda x, s: torch.add(x, s, alpha=s),
    "mul": lambda x, s: x * s, "div": lambda x, s: x / s, "rdiv": lambda x, s: s / x,
    "pow": lambda x, s: x.abs() ** s, "rpow": lambda x, s: s ** x,
    "remainder": lambda x, s: torch.remainder(x, s), "fmod": lambda x, s: torch.fmod(x, s),
    "eq": lambda x, s: x == s, "ne": lambda x, s: x != s, "lt": lambda x, s: x < s,
    "le": lambda x, s: x <= s, "gt": lambda x, s: x > s, "ge": lambda x, s: x >= s,
    "add_0dim": lambda x, s: x + torch.tensor(s, device=x.device),
    "mul_0dim": lambda x, s: x * torch.tensor(s, device=x.device),
    "eq_0dim": lambda x, s: x == torch.tensor(s, device=x.device),
    "lt_0dim_float64": lambda x, s: x < torch.tensor(s, dtype=torch.float64, device=x.device),
    "logaddexp_0dim": lambda x, s: torch.logaddexp(x, torch.tensor(s, device=x.device)),
    "atan2_0dim": lambda x, s: torch.atan2(x, torch.tensor(s, device=x.device)),
    "add_inplace": lambda x, s: x.add_(s), "sub_inplace_alpha": lambda x, s: x.sub_(x * 0.5, alpha=s),
    "fmod_inplace": lambda x, s: x.fmod_(s),
    "add_out": lambda x, s: torch.add(x, s, out=torch.empty_like(x)),
    "lt_out": lambda x, s: torch.lt(x, s, out=torch.empty_like(x, dtype=torch.bool)),
    "int_tensor": lambda x, s: x + torch.full(x.shape, 257, dtype=torch.int32, device=x.device),
    "chain": lambda x, s: (x - s) * (s - x) + (x == s),
    "softshrink": lambda x, s: F.softshrink(x, s / 3),
    "smooth_l1": lambda x, s: F.smooth_l1_loss(x, x * 0.5, beta=s, reduction="none"),
    "clamp": lambda x, s: x.clamp(-s, s), "where": lambda x, s: torch.where(x > 0, x, s),
    "leaky_relu": lambda x, s: F.leaky_relu(x, s / 10), "lerp": lambda x, s: torch.lerp(x, x * 2, s),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_numbers_with_16_bit_tensors_as_eager(name, dtype, device):
    """A 16-bit tensor with a number it cannot hold exactly, some elements equal to the
    number rounded to the dtype: a kernel's results have eager's bits (``lerp`` within
    ``assert_close``: eager's vectorized lerp is a fused multiply-add; on a GPU
    ``smooth_l1`` too)."""
    s = 2.37
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(4096, generator=g) * 4).to(device, dtype)
    x[:64] = s
    expected = NUMBERS[name](x.clone(), s)
    actual, st = _run(NUMBERS[name], x.clone(), s)
    # on a GPU these run eagerly: softshrink at 16 bits (ops.RUNS_EAGERLY); the
    # decomposition multiplies add's two runtime numbers at trace time (accel.graph's
    # sentinels)
    if device == "cpu" or name not in ("softshrink", "add_tensor_alpha"):
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0 and st["compile_failures"] == 0, st
    if name == "lerp" or (name, device) == ("smooth_l1", "cuda"):
        torch.testing.assert_close(actual, expected)
    elif actual.dtype == torch.bool:
        assert torch.equal(actual, expected)
    else:
        _same_bits(actual, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_integer_tensors_with_16_bit_tensors_as_eager(dtype, device):
    """An int32 tensor (values up to 3000: above 256 bfloat16 rounds them, above 2048
    float16) with a 16-bit one in pointwise ops: eager converts the integers to the 16-bit
    dtype first, and so does the kernel (the decompositions converted them to float32;
    ``accel.operands._operands_converted``, ``_number_rounded``)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(4096, generator=g) * 300).to(device, dtype)
    i = torch.randint(-3000, 3000, (4096,), generator=g, dtype=torch.int32).to(device)

    def fn(x, i):
        return torch.hypot(x, i), torch.addcmul(x, x, i), i + x, torch.maximum(i, x), x * i, x / i

    expected = fn(x, i)
    actual, st = _run(fn, x, i)
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
    for a, e in zip(actual, expected):
        _same_bits(a, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_floats_out_of_an_integers_range_convert_as_eager(dtype, device):
    """NaN, infinities and values out of int32's or int64's range, computed on (rounded to
    ``dtype``) and then converted to an integer type: eager's values (on x86 CPUs the
    type's minimum; a C++ cast leaves them undefined, and gcc turned a bfloat16 NaN into
    0 where it was converted to int64)."""
    vals = [float("nan"), float("inf"), -float("inf"), 1e10, -1e10, 3e9, -3e9, 40000.0, -40000.0,
            300.0, -2.7, 0.5]
    x = torch.tensor(vals * 8, dtype=torch.float64).to(device, dtype)

    def fn(x):
        return [f(x).to(d) for f in (lambda v: v, torch.abs, lambda v: v * 1, torch.neg)
                for d in (torch.int64, torch.int32, torch.int16, torch.uint8)]

    expected = fn(x)
    actual, st = _run(fn, x)
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
    for a, e in zip(actual, expected):
        assert torch.equal(a, e), (a, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_special_values_of_16_bit_pow_fmax_and_softshrink_as_eager(dtype, device):
    """``pow`` at the exponents eager specializes, and ``softshrink``, on -0.0, infinities
    and NaN. On the CPU eager's float16 ``pow(x, 0.5)`` is ``pow`` (inf at -inf, 0.0 at
    -0.0; its sqrt fast path is float32, float64 and bfloat16 only), and gcc folded a
    constant 0.5 exponent into sqrt; elsewhere it is sqrt (and -0.5 rsqrt), also for a
    16-bit exponent made a tensor (it was pow). ``fmax``/``fmin`` of two zeros: on the CPU
    eager's bfloat16 kernels return the second, its float16 ones the first. The 16-bit
    ``softshrink`` of NaN is NaN (it was 0)."""
    x = torch.tensor([-0.0, 0.0, -float("inf"), float("inf"), float("nan"), 4.0, -1.0, 0.3, -0.7, 2.5] * 410,
                     device=device).to(dtype)
    # two ops a case: a region (on a GPU a lone op runs eagerly)
    cases = [lambda v, e=e: (v * 1).pow(e) for e in (0.5, -0.5, 2.0, 3.0, -1.0, -2.0, 0.25)]
    cases += [lambda v: (v * 1).pow_(0.5), lambda v: torch.fmax(v * 1, -v), lambda v: torch.fmin(v * 1, -v)]
    cases += [lambda v: F.softshrink(v * 1, 0.5), lambda v: F.softshrink(v * 1, 0.25)]
    for fn in cases:
        expected = fn(x)
        actual, st = _run(fn, x)
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        # values (eager's own vectorized and scalar loops differ by an ulp in bfloat16 rsqrt,
        # and in the sign of softshrink's zeros), NaNs, infinities, and the sign of a pow's zero
        torch.testing.assert_close(actual, expected, equal_nan=True)
        special = expected.isinf() | ((expected == 0) & (fn not in cases[-2:]))
        assert torch.equal(actual[special], expected[special]), (actual, expected)
        assert torch.equal(actual[special].signbit(), expected[special].signbit()), (actual, expected)


@pytest.mark.parametrize("dtype", (torch.float32,) + HALF, ids=str)
def test_cpu_std_takes_its_root_in_float64_as_eager(dtype):
    """``std`` / ``std_mean`` on the CPU: the variance's square root taken in float64 before
    rounding, as eager's kernel does, bit for bit; the std of float32 values near 1e25 is
    finite (it was inf: the decomposition rounded the variance, 1e50, to float32 first)."""
    g = torch.Generator().manual_seed(7)
    for scale in (1.0, 1e25):
        x = (torch.randn(64, 257, generator=g) * scale).to(dtype)
        cases = [lambda: (x * 1).std(-1), lambda: torch.std(x * 1, 0, correction=0, keepdim=True),
                 lambda: torch.std_mean(x * 1, -1), lambda: (x * 1).std()]
        for fn in cases:
            expected = fn()
            actual, st = _run(fn)
            assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
            for a, e in zip(*((r if isinstance(r, tuple) else (r,)) for r in (actual, expected))):
                _same_bits(a, e)
            if dtype == torch.float32:
                assert torch.isfinite(actual[0] if isinstance(actual, tuple) else actual).all()


def _kernels_have_eagers_bits(cases):
    """Each case (a function of no arguments) runs as a kernel under accel, its result
    bit for bit eager's."""
    for fn in cases:
        expected = fn()
        actual, st = _run(fn)
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        _same_bits(actual, expected)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_cpu_lerp_has_eagers_bits(dtype):
    """``lerp`` on the CPU, bit for bit as eager's: one rounding of ``coeff * (end - start)
    + base`` (ATen's ``lerp_vec`` fmadd; accel.library.fma), with a number or a tensor
    weight (broadcast), in place too (an optimizer's ``exp_avg.lerp_(grad, 1 - beta1)``).
    With two roundings 11-25 % of float32 results were an ulp off."""
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(64, 257, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(257, generator=g).to(dtype) * 1.5 - 0.25
    cases = [lambda: torch.lerp(a * 1, b, 0.1), lambda: torch.lerp(a * 1, b, 0.7),
             lambda: torch.lerp(a * 1, b, w), lambda: torch.lerp(a.t() * 1, b.t(), 0.3),
             lambda: (a * 1).lerp_(b, 0.9), lambda: (a * 1).lerp_(b, w)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_addcmul_has_eagers_bits(dtype, device):
    """``addcmul`` bit for bit as eager's: on the CPU ``fma(value * tensor1, tensor2,
    self)``, on a GPU ``fma(value, tensor1 * tensor2, self)``, the product rounded first
    (accel.decompositions._pointwise_op), with values of several
    kinds, in place (an optimizer's ``exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)``),
    broadcast against a row and a 0-dim tensor, transposed. With three roundings 18-25 %
    of float32 and float64 results were an ulp off."""
    g = torch.Generator().manual_seed(9)  # (float64 values: a product of float32 ones is exact there)
    a, b, c = (torch.randn(64, 257, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(3))
    s = torch.tensor(1.7, dtype=dtype, device=device)
    cases = [lambda: torch.addcmul(a * 1, b, c), lambda: torch.addcmul(a * 1, b, c, value=0.5),
             lambda: torch.addcmul(a * 1, b, c, value=-0.7), lambda: (a * 1).addcmul_(b, b, value=0.001),
             lambda: torch.addcmul(a * 1, b[0], s, value=1.3), lambda: (a.t() * 1).addcmul_(b.t(), c.t(), value=3)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_round_with_decimals_has_eagers_bits(dtype, device):
    """``round(x, decimals=d)`` bit for bit as eager's: ``nearbyint(x * 10**d) / 10**d``, a
    true division on a GPU as well (``nearbyint(x / 10**-d) * 10**-d`` for negative ``d``;
    accel.decompositions._round_decimals, accel.library.div_rn), in place too. Multiplied by
    ``10**-d`` instead, 13-58 % of float32 and float64 CPU results with 2 or 3 decimals were
    an ulp off."""
    g = torch.Generator().manual_seed(10)
    x = (torch.randn(64, 257, generator=g, dtype=torch.float64) * 100).to(device, dtype)
    cases = [lambda: torch.round(x * 1, decimals=2), lambda: torch.round(x * 1, decimals=3),
             lambda: torch.round(x * 1, decimals=-1), lambda: (x * 1).round_(decimals=1)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_16_bit_steps_eager_rounds_have_eagers_bits(dtype):
    """16-bit CPU ops whose eager kernels round an intermediate to the dtype, bit for bit:
    ``mse_loss``'s difference (each reduction), a truncating division's quotient, a
    flooring division's steps (zero divisors too), ``hardshrink``'s ``lambd``, bfloat16
    ``pow``'s square for the exponents 3 and -2 (accel.decompositions._mse_loss, _div_mode,
    _hardshrink; accel.passes._rounded_square). In float32 throughout, 1-36 % of results
    were off."""
    g = torch.Generator().manual_seed(11)
    a, b = (torch.randn(64, 257, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    F = torch.nn.functional
    cases = [lambda: F.mse_loss(a * 1, b, reduction="none"), lambda: F.mse_loss(a * 1, b),
             lambda: F.mse_loss(a * 1, b, reduction="sum"), lambda: torch.div(a * 10, b, rounding_mode="trunc"),
             lambda: F.hardshrink(a * 1, 0.3), lambda: (a * 1).pow(3), lambda: (a * 1).pow(-2),
             lambda: torch.div(a * 100, b, rounding_mode="floor"),
             lambda: (a * 1).div_(torch.where(b > 1, 0, b), rounding_mode="floor")]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_0_dim_tensors_and_numbers_convert_to_the_16_bit_dtype_as_eager(dtype):
    """A 0-dim CPU tensor of another dtype (float32, float64, the other 16-bit float,
    int64) beside a 16-bit tensor, bit for bit as eager's: converted to the 16-bit dtype
    first, as TensorIterator converts its operands (``hypot``, ``addcmul``, ``addcdiv``,
    ``xlogy``, ``mul`` and ``div`` with it first), except ``mul``'s and ``div``'s second
    operand, which their kernels read unconverted (accel.operands._operands_converted);
    and ``xlogy``'s Python number, rounded as its kernel rounds it. Unconverted, 2-25 % of
    these results were off (``addcmul``'s by up to 15 %)."""
    g = torch.Generator().manual_seed(13)
    a = (torch.randn(64, 257, generator=g, dtype=torch.float64) * 2).to(dtype)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    for s in [torch.tensor(-3.2099, dtype=dt) for dt in (torch.float32, torch.float64, other)] + [
            torch.tensor(2049, dtype=torch.int64)]:
        cases = [lambda: torch.hypot(a, s), lambda: torch.hypot(s, a * 1),
                 lambda: torch.addcmul(a, s, s, value=0.5), lambda: (a * 1).addcmul_(a, s, value=0.5),
                 lambda: torch.addcdiv(a, a, s, value=0.5), lambda: torch.addcdiv(a, s, a, value=0.5),
                 lambda: a * s, lambda: s * a, lambda: a / s, lambda: s / a]
        if dtype == torch.bfloat16:  # (float16's log rounds an ulp off eager's near ties)
            cases.append(lambda: torch.xlogy(s, a.abs() + 1))
        _kernels_have_eagers_bits(cases)
    if dtype == torch.bfloat16:  # a Python number, which xlogy's CPU kernel rounds too (ops.ROUNDED_NUMBERS)
        _kernels_have_eagers_bits([lambda: torch.xlogy(a.abs() + 1, 3.21), lambda: torch.xlogy(3.21, a.abs() + 1)])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_16_bit_log_softmax_over_the_last_dim_has_eagers_bits(dtype):
    """16-bit ``log_softmax`` on the CPU, bit for bit: over the last dim eager's kernel keeps
    a row's sum of exponentials and its log in the dtype (accel.decompositions._log_softmax)
    (contiguous rows, a strided view's rows, a 1-d and a 3-d tensor); over dim 0 its other
    kernel rounds once. Rounding once, 10 % of the last dim's results were an ulp or two
    off, and a random program's gradient through it left ``assert_close``'s tolerance."""
    g = torch.Generator().manual_seed(12)
    a = (torch.randn(64, 2054, generator=g, dtype=torch.float64) * 2).to(dtype)
    v = (torch.randn(3, 5, 300, generator=g, dtype=torch.float64) * 4).to(dtype)
    cases = [lambda: torch.log_softmax(a * 1, -1), lambda: torch.log_softmax(a[:, ::2] * 1, 1),
             lambda: torch.log_softmax(a[0] * 1, 0), lambda: torch.log_softmax(v * 1, 2),
             lambda: F.log_softmax(v + 1, dim=-1), lambda: torch.log_softmax(a * 1, 0)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_16_bit_logsumexp_rounds_each_step_as_eager(dtype):
    """16-bit ``logsumexp`` on the CPU as ATen's composite computes it, each op's result
    rounded to the dtype (accel.decompositions._logsumexp): over one dim, two, keeping
    dims, a strided view's rows, with an infinite max. Every result is eager's or its
    16-bit neighbour, and at most 0.5 % are the neighbour: a float32 ``log`` or ``exp``
    an ulp from eager's (accel's libmvec and polynomial functions, eager's Sleef) rounds
    the other way where the value lies next to a 16-bit tie (2 of 2054 float16 results
    over dim 0). Rounding once in float32, 11-17 % of results were off."""
    g = torch.Generator().manual_seed(12)
    a = (torch.randn(64, 2054, generator=g, dtype=torch.float64) * 2).to(dtype)
    v = (torch.randn(3, 5, 300, generator=g, dtype=torch.float64) * 4).to(dtype)
    w = v.clone()
    w[1, 2, 7] = float("inf")
    cases = [lambda: torch.logsumexp(a * 1, 1), lambda: torch.logsumexp(a * 1, 0, keepdim=True),
             lambda: torch.logsumexp(v * 1, (0, 2)), lambda: torch.logsumexp(w * 1, -1),
             lambda: torch.logsumexp(a[:, ::2] * 1, 1)]
    ints = torch.int16
    for fn in cases:
        expected = fn()
        actual, st = _run(fn)
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        torch.testing.assert_close(actual, expected, equal_nan=True)
        steps = (actual.view(ints).int() - expected.view(ints).int()).abs()[~expected.isnan()]
        assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.005, steps.bincount()


@pytest.mark.parametrize("device", DEVICES[1:])  # (a GPU's kernels only)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_gpu_arithmetic_steps_have_eagers_bits(dtype, device):
    """GPU kernels that eager computes in ``scalar_t``, each step rounded to a 16-bit dtype,
    bit for bit: ``sigmoid_backward``'s ``(grad * (1 - y)) * y`` and ``rsqrt`` as CUDA's
    ``rsqrtf`` (every dtype; include/accel/cuda_math.cuh), and for
    16-bit tensors ``tanh_backward``, ``mse_loss``'s difference, a truncating division's
    quotient, ``pow``'s square (exponents 3 and -2), and ``hardshrink``'s ``lambd`` and
    ``threshold``'s threshold rounded to the dtype (accel.decompositions._sigmoid_backward,
    _tanh_backward, _mse_loss, _div_mode, _hardshrink, _threshold, _threshold_backward;
    accel.passes._rounded_square). On an H200, 0.2-7 % of 16-bit results were outside
    ``assert_close``'s tolerance without, and 32-34 % of float32 ones an ulp off."""
    g = torch.Generator().manual_seed(17)
    a, b = (torch.randn(64, 256, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(2))
    cases = [lambda: torch.ops.aten.sigmoid_backward(a * 1, torch.sigmoid(b)), lambda: torch.rsqrt(a.abs() * 3)]
    if dtype in HALF:
        cases += [lambda: torch.ops.aten.tanh_backward(a * 1, torch.tanh(b)),
                  lambda: F.mse_loss(a * 1, b, reduction="none"), lambda: torch.div(a * 10, b, rounding_mode="trunc"),
                  lambda: (a * 1).pow(3), lambda: (a * 1).pow(-2), lambda: F.hardshrink(a * 1, 0.3),
                  lambda: F.threshold(a * 1, 0.2, -1.5), lambda: torch.ops.aten.threshold_backward(b * 1, a, 0.2)]
    _kernels_have_eagers_bits(cases)
    for reduction in ("mean", "sum"):  # (the reduction's order is the kernel's own)
        actual, _ = _run(lambda: F.mse_loss(a * 1, b, reduction=reduction))
        torch.testing.assert_close(actual, F.mse_loss(a, b, reduction=reduction))


@pytest.mark.parametrize("device", DEVICES[1:])  # (a GPU's kernels only)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_gpu_products_and_quotients_have_eagers_bits(dtype, device):
    """GPU kernels whose products and quotients eager rounds where accel's fused kernel
    would not, bit for bit: a product that another kernel adds (``a * b + c``, ``c - a *
    b``, through a view or broadcast, ``pow(a, 3) + c``,
    ``binary_cross_entropy_with_logits``' ``(1 - t) * x - log_sigmoid(x)``;
    accel.passes.round_products_across_kernels), a division by a number inside an op's
    formula as a true division (``softplus``'s ``/ beta``, ``smooth_l1_loss``'s and its
    backward's ``/ beta``), ``addcdiv`` as ``pointwise_op_impl`` (``self + t1 / t2``, else
    ``fma(value, t1 / t2, self)``), and the tanh-GELU's ``kKappa * (x * x * x)``
    (accel.decompositions._softplus, _smooth_l1_loss, _smooth_l1_loss_backward, _pointwise_op;
    include/accel/scalar_ops.h). On an H200 4-39 % of float32 results were an ulp off, and
    8 % of float16 ``smooth_l1_loss_backward`` ones outside ``assert_close``'s tolerance."""
    g = torch.Generator().manual_seed(19)
    a, b, c = (torch.randn(64, 256, generator=g, dtype=torch.float64).mul(2).to(device, dtype) for _ in range(3))
    cases = [lambda: a * b + c, lambda: c - a * b, lambda: (a * b) * 0.3 + c, lambda: (a * 1).pow(3) + c,
             lambda: (a * b).t() + c.t(), lambda: a + b[0] * c[0], lambda: (a * b)[:, 1:] + c[:, :-1],
             lambda: torch.cat([a * b, c], -1) - torch.cat([c, a], -1),
             lambda: torch.addcdiv(a * 1, b, c, value=0.3), lambda: torch.addcdiv(a * 1, b, c),
             lambda: (a * 1).addcdiv_(b, c[:1], value=-0.7), lambda: F.softplus(a * 1, beta=1.5, threshold=3),
             lambda: F.softplus(a * 1), lambda: F.gelu(a * 1, approximate="tanh"),
             lambda: F.smooth_l1_loss(a * 1, b, reduction="none", beta=0.7),
             lambda: torch.ops.aten.smooth_l1_loss_backward(c * 1, a, b, 0, 0.7),
             lambda: torch.ops.aten.smooth_l1_loss_backward(c * 1, a, b, 1, 0.7)]
    if dtype in (torch.float32, torch.float64):
        cases += [lambda: F.binary_cross_entropy_with_logits(a * 1, torch.sigmoid(b), reduction="none"),
                  lambda: F.binary_cross_entropy_with_logits(a * 1, torch.sigmoid(b), pos_weight=c.abs(),
                                                             reduction="none")]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_16_bit_binary_cross_entropy_with_logits_is_a_kernel_with_eagers_bits(dtype, device):
    """16-bit ``binary_cross_entropy_with_logits`` runs as a kernel, bit for bit eager's:
    traced as eager computes it (accel.operands._FUNCTORCH_HACKED), each of its calls
    rounds to the dtype where eager's do, with a weight, a ``pos_weight`` and each
    reduction. It ran eagerly while the trace took functorch's older formula."""
    g = torch.Generator().manual_seed(23)
    x, y, w, pw = (torch.randn(64, 256, generator=g, dtype=torch.float64).mul(2).to(device, dtype)
                   for _ in range(4))
    t = torch.sigmoid(y)
    bce = F.binary_cross_entropy_with_logits
    cases = [lambda: bce(x * 1, t, reduction="none"), lambda: bce(x * 1, t),
             lambda: bce(x * 1, t, weight=w.abs(), reduction="sum"),
             lambda: bce(x * 1, t, pos_weight=pw.abs()[0], reduction="none"),
             lambda: bce(x.t() * 1, t.t(), reduction="none")]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64) + HALF, ids=str)
def test_cpu_smooth_l1_backward_has_eagers_bits(dtype):
    """``smooth_l1_loss_backward`` on the CPU, bit for bit, in both of eager's loops: the
    vectorized one's ``(norm * s) * grad`` (``s`` the sign of ``x`` or ``x / beta``) and the
    scalar one's float64 ``beta`` (transposed operands against eager's contiguous
    ``grad_input``), each reduction's ``norm`` (accel.decompositions._smooth_l1_loss_backward,
    accel.operands._cpu_vector_loop). torch's decomposition, ``((norm * grad) * x) / beta``, had 7 % of
    float32 results an ulp off."""
    g = torch.Generator().manual_seed(14)
    a, b, c = (torch.randn(64, 256, generator=g, dtype=torch.float64).mul(2).to(dtype) for _ in range(3))
    bw = torch.ops.aten.smooth_l1_loss_backward
    cases = [lambda r=reduction: bw(c * 1, a, b, r, 0.7) for reduction in (0, 1, 2)]
    cases += [lambda: bw(c.t() * 1, a.t(), b.t(), 0, 0.7), lambda: bw(c.t().contiguous(), a.t(), b.t(), 1, 1.3),
              lambda: bw(c[:1] * 1, a, b[:, :1], 2, 0.7)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_16_bit_arithmetic_steps_have_eagers_bits(dtype):
    """16-bit CPU kernels that compute in the dtype's own arithmetic, each step rounded,
    bit for bit (``logit``, each ``eps`` branch, within ``assert_close``'s tolerance), float16
    ``sigmoid_backward``, ``xlogy``'s log, and ``add`` / ``sub`` / ``rsub`` with an ``alpha`` where eager runs its scalar loop
    (a strided operand, a transposed one against a contiguous one, rows shorter than two
    vectors) as well as its vectorized one (accel.decompositions._logit, _sigmoid_backward, _xlogy,
    accel.operands._cpu_vector_loop). In float32 throughout, 9-18 % of ``logit`` results and 2-8 % of the
    strided sums were outside ``assert_close``'s tolerance."""
    g = torch.Generator().manual_seed(13)
    a, b = (torch.randn(64, 256, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    p = (torch.rand(64, 256, generator=g, dtype=torch.float64) * 1.4 - 0.2).to(dtype)
    p[0, :4] = torch.tensor([0.0, 1.0, 0.5, float("nan")])
    c = torch.randn(2 * 64 * 256, generator=g, dtype=torch.float64).to(dtype)
    for eps in (None, 0.0, 1e-3, 0.2, -0.5):  # (its log is float32's, which may differ from
        # eager's in the last bit: a 16-bit result then rounds the other way, rarely)
        actual, st = _run(lambda: torch.logit(p * 1, eps=eps))
        assert st["kernel_runs"] == 1 and st["eager_replays"] == 0, st
        torch.testing.assert_close(actual, torch.logit(p, eps=eps), equal_nan=True)
    cases = [lambda: torch.ops.aten.sigmoid_backward(a * 1, torch.sigmoid(b)),
             lambda: torch.xlogy(a * 1, p.abs()), lambda: torch.xlogy(torch.where(a > 1, 0, a), p),
             lambda: (a * 1).add(b, alpha=0.7), lambda: (c[::2] * 1).sub(c[1::2], alpha=1.3),
             lambda: (a.t() * 1).add(b.t().contiguous(), alpha=0.7), lambda: (a.t() * 1).add(b.t(), alpha=0.7),
             lambda: (a[:, :20] * 1).add(b[:, :20], alpha=0.7), lambda: c[::2].add(1.7, alpha=0.3) * 1,
             lambda: torch.rsub(c[::2] * 1, c[1::2], alpha=-2.5), lambda: (a[:, ::2] * 1).sub_(b[:, ::2], alpha=0.3)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_add_with_alpha_has_eagers_bits(dtype, device):
    """``add``, ``sub`` and ``rsub`` with an ``alpha``, bit for bit as eager's: one rounding
    of ``other * alpha + self`` (ATen's CPU ``vec::fmadd``, CUDA's contracted
    ``AddFunctor``; accel.decompositions._add_alpha), in place, broadcast, transposed, with an
    integer ``self`` and a float ``other``. With two roundings 27 % of float32 results
    were an ulp off, and a sum that nearly cancels was off in its leading digits."""
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randn(64, 257, generator=g).to(device, dtype) for _ in range(2))
    near = -b * 1.25 + torch.randn(64, 257, generator=g).to(device, dtype) * 1e-6  # a + 1.25 b cancels
    cases = [lambda: (a * 1).add(b, alpha=1.25), lambda: (a * 1).sub(b, alpha=0.3),
             lambda: torch.rsub(a * 1, b, alpha=-2.5), lambda: (a * 1).add_(b[0], alpha=0.7),
             lambda: (a.t() * 1).sub_(b.t(), alpha=1.1), lambda: (near * 1).add(b, alpha=1.25),
             lambda: (a * 4).long().add(b, alpha=0.3)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_division_has_eagers_bits(dtype, device):
    """Divisions bit for bit as eager's, a loop-invariant divisor's included: on the CPU
    true divisions (``x / 0.3``, a row's value broadcast); on a GPU a number's reciprocal
    times the dividend (``div_true_kernel_cuda``) and true divisions by tensors
    (accel.codegen.scopes.reciprocal_divisor); in place and from integers too. With
    every loop-invariant divisor's reciprocal 21-28 % of float32 CPU quotients were an ulp
    off, and a GPU softmax of ``i / 0.001`` in its leading digits."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(64, 257, generator=g) * 100).to(device, dtype)
    i = torch.randint(-5, 6, (64, 257), generator=g).to(device)
    cases = [lambda: (x * 1) / 0.3, lambda: (x + 1) / 7.1, lambda: (x * 1).div_(3.0),
             lambda: (x * 2) / -0.001, lambda: (x * 1) / (x[:, :1] + 1000), lambda: (i / 0.001).to(dtype) + x,
             lambda: (x * 1).div_(x[0] + 1000)]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_nextafter_of_16_bit_floats_steps_by_their_ulp(dtype, device):
    """``nextafter`` of 16-bit floats moves each element by one ulp of its dtype, as eager's
    kernel does (computed in float32, a float32 ulp rounded back to the input: every
    element came back unchanged): it runs eagerly at 16 bits (``ops.RUNS_EAGERLY``),
    in place too."""
    g = torch.Generator().manual_seed(3)
    x, y = ((torch.randn(4096, generator=g) * 100).to(device, dtype) for _ in range(2))

    def fn(x, y):
        return torch.nextafter(x * 1, y), (x * 1).nextafter_(y + 1)

    expected = fn(x, y)
    actual, _ = _run(fn, x, y)
    for a, e in zip(actual, expected):
        _same_bits(a, e)
    assert not torch.equal(actual[0], x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_16_bit_prod_is_eagers(dtype, device):
    """``prod`` of 16-bit floats: on the CPU it runs eagerly (``ops.RUNS_EAGERLY``: eager's
    kernel rounds each partial product to the dtype; accel's float32 products were outside
    ``assert_close``'s tolerance on most rows), bit for bit eager's; on a GPU, where eager
    multiplies in float32, a kernel within tolerance. Whole, along a dim, and after a
    fused call."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(256, 512, generator=g, dtype=torch.float64) * 0.1 + 1).to(device, dtype)
    cases = [lambda: (x * 1).prod(-1), lambda: (x * 1).prod(0, keepdim=True), lambda: (x[:8] * 1).prod()]
    for fn in cases:
        expected = fn()
        actual, st = _run(fn)
        if device == "cpu":
            _same_bits(actual, expected)
        else:
            torch.testing.assert_close(actual, expected)
            assert st["kernel_runs"] >= 1, st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_native_layer_norm_in_16_bits_returns_eagers_dtypes_from_a_kernel(dtype, device):
    """``native_layer_norm`` of a 16-bit input returns its mean and rstd in the dtype eager's
    kernel gives (bfloat16 and float16 on the CPU, where the meta function says float32;
    float32 on a GPU) from accel's kernel, not eagerly: the statistics rounded from the
    float32 ones as eager rounds them, the output within the default tolerance."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g).to(device, dtype)
    w, b = (torch.randn(512, generator=g).to(device, dtype) for _ in range(2))

    def fn(x, w, b):  # the call alone: a region of its own, or (eagerly) none
        return torch.ops.aten.native_layer_norm(x, [512], w, b, 1e-5)

    expected = fn(x, w, b)
    actual, st = _run(fn, x, w, b)
    assert st["kernel_runs"] == 1 and st["eager_replays"] == 0 and st["compile_failures"] == 0, st
    assert [t.dtype for t in actual] == [t.dtype for t in expected]
    torch.testing.assert_close(actual[0], expected[0])
    for a, e in zip(actual[1:], expected[1:]):
        if a.dtype == dtype:  # rounded from the same float32 statistics
            _same_bits(a, e)
        else:
            torch.testing.assert_close(a, e)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_layer_norm_of_a_16_bit_input_with_float32_weights_keeps_float32_statistics(dtype):
    """CPU autocast's layer norm of a 16-bit activation with float32 weights: eager's
    mixed-dtype CPU kernel returns the mean and rstd in float32 as computed (torch._decomp's
    decomposition rounds them to the input's dtype there; CUDA's kernel refuses mixed
    dtypes, and CUDA autocast runs layer norm in float32). The backward from
    them: the input's gradient as eager's; the weight's and bias's as eager's, or, where
    eager's sum of 16-bit terms is outside the tolerance of the float64 sum, as that."""
    g = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(256, 64, generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(64, generator=g) for _ in range(2))

    def forward(x, w, b):
        return torch.ops.aten.native_layer_norm(x * 1.0, [64], w, b, 1e-5)

    expected = forward(x, w, b)
    actual, st = _run(forward, x, w, b)
    assert st["kernel_runs"] == 1 and st["eager_replays"] == 0, st
    assert [t.dtype for t in actual] == [dtype, torch.float32, torch.float32]
    torch.testing.assert_close(actual, expected)

    _, mean, rstd = expected

    def backward(dy, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward(dy * 1.0, x, [64], mean, rstd, w, b,
                                                         [True, True, True])

    eager = backward(dy, x, mean, rstd, w, b)
    got, _ = _run(backward, dy, x, mean, rstd, w, b)
    reference = backward(*(t.double() for t in (dy, x, mean, rstd, w, b)))
    torch.testing.assert_close(got[0], eager[0])
    _close_or_closer({"weight": got[1], "bias": got[2]}, {"weight": eager[1], "bias": eager[2]},
                     {"weight": reference[1], "bias": reference[2]})



@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_batch_norm_of_a_16_bit_input_with_float32_weights_keeps_float32_statistics(dtype):
    """CPU autocast's batch norm of a 16-bit activation into a float32 ``BatchNorm2d``:
    eager's mixed-dtype CPU kernel returns the saved mean and inverse standard deviation in
    float32 as computed, where torch._decomp's decomposition rounds them to the input's
    dtype (they were 3e-3 off eager's in bfloat16). Each training-mode op, with and
    without running statistics (updated in place as eager's), then the backward from its
    statistics: as eager's."""
    g = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(4, 8, 6, 6, generator=g).to(dtype) for _ in range(2))
    w, b, rm = (torch.randn(8, generator=g) for _ in range(3))
    rv = torch.rand(8, generator=g) + 0.5
    aten = torch.ops.aten
    calls = {
        "native_batch_norm": lambda x, rm, rv: aten.native_batch_norm(x * 1.0, w, b, rm, rv, True, 0.1, 1e-5),
        "legit": lambda x, rm, rv: aten._native_batch_norm_legit(x * 1.0, w, b, rm, rv, True, 0.1, 1e-5),
        "no_stats": lambda x, rm, rv: aten._native_batch_norm_legit(x * 1.0, w, b, True, 0.1, 1e-5)}
    for name, forward in calls.items():
        ers, ars = (rm.clone(), rv.clone()), (rm.clone(), rv.clone())
        expected = forward(x, *ers)
        actual, st = _run(forward, x, *ars)
        assert st["kernel_runs"] == 1 and st["eager_replays"] == 0, (name, st)
        assert [t.dtype for t in actual] == [dtype, torch.float32, torch.float32], name
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(ars, ers, msg=lambda m: f"{name} running statistics: {m}")

    _, mean, invstd = expected

    def backward(dy, x, mean, invstd):
        return aten.native_batch_norm_backward(dy * 1.0, x, w, rm, rv, mean, invstd, True, 1e-5,
                                               [True, True, True])

    got, st = _run(backward, dy, x, mean, invstd)
    assert st["kernel_runs"] == 1, st
    torch.testing.assert_close(got, backward(dy, x, mean, invstd))

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.ln = torch.nn.Linear(128, 512), torch.nn.Linear(512, 128), torch.nn.LayerNorm(128)

    def forward(self, x):
        return self.ln(x + self.fc2(F.gelu(self.fc1(x), approximate="tanh")))


def _close_or_closer(actual, expected, reference):
    """``actual`` within the default tolerance of eager's ``expected``, or, for a tensor
    where eager itself is outside it of the float64 ``reference`` (a bfloat16 sum over
    hundreds of rounded terms), within it of the reference."""
    for n in expected:
        try:
            torch.testing.assert_close(actual[n], expected[n], msg=lambda m: f"{n}: {m}")
        except AssertionError:
            ref = reference[n].to(expected[n].dtype)
            try:
                torch.testing.assert_close(expected[n], ref)
            except AssertionError:
                torch.testing.assert_close(actual[n], ref, msg=lambda m: f"{n} against float64: {m}")
            else:
                raise


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_training_step_matches_eager(device):
    """An MLP block in bfloat16, forward and backward: loss and every gradient as eager's
    (or, where eager's bfloat16 rounding puts it outside the tolerance of the float64
    step, as the float64 step's)."""
    import copy

    torch.manual_seed(0)
    m = _Block().to(device, torch.bfloat16)
    x = torch.randn(256, 128, device=device, dtype=torch.bfloat16)
    target = torch.randn(256, 128, device=device)

    def step(m, x, t=target):
        m.zero_grad(set_to_none=True)
        loss = (m(x).to(t.dtype) * t).mean()
        loss.backward()
        return {"loss": loss.detach(), **{n: p.grad for n, p in m.named_parameters()}}

    ma, md = copy.deepcopy(m), copy.deepcopy(m).double()
    expected = step(m, x)
    actual, st = _run(step, ma, x)
    assert st["kernel_runs"] >= 3 and st["eager_replays"] == 0, st
    reference = step(md, x.double(), target.double())
    _close_or_closer(actual, expected, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cuda_half_off_runs_eagerly(dtype, monkeypatch):
    """With ACCEL_CUDA_HALF=0, calls on CUDA float16/bfloat16 tensors, and calls that would
    make one, run eagerly; float32 still runs as kernels."""
    monkeypatch.setenv("ACCEL_CUDA_HALF", "0")
    x = torch.randn(64, 512, device="cuda")
    # the float32 product still runs as a kernel, flushed before the cast runs eagerly
    for fn, arg, kernels in ((lambda h: h * 2 + 1, x.to(dtype), 0),
                             (lambda f: (f * 2).to(dtype), x, 1)):
        expected = fn(arg)
        actual, st = _run(fn, arg)
        torch.testing.assert_close(actual, expected)
        assert st["kernel_runs"] == kernels, st
    _, st = _run(lambda f: f * 2 + 1, x)
    assert st["kernel_runs"] == 1, st


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(l.split(":", 1)[1].split()) for l in f if l.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif(not {"avx2", "f16c"} <= _cpu_flags(),
                    reason="float16 conversions use F16C on x86 CPUs with AVX2 and F16C")
def test_cpu_float16_conversions_vectorize_with_f16c(tmp_path):
    """On this CPU a float16 kernel's loop converts 8 values at a time with F16C, 16 with
    AVX-512: gcc calls the vector variants include/accel/half.h defines (8 lanes under
    their AVX2 names, or 16 under their AVX-512 ones: two 8-lane calls and their spills for
    every 16 lanes made float16 smooth_l1_loss twice as slow), a rounding read back as
    float32 among them (test_conversions_are_exact checks their bits through kernels)."""
    import os
    import subprocess
    import sys

    from accel.build import CXXFLAGS, INCLUDE_DIR
    from accel.codegen.cpp import CppRenderer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_pipeline import _lowered

    x = torch.empty(64, 1024, dtype=torch.float16)
    meta = [((64, 1024), (1024, 1), torch.float16)]
    calls = [(torch.ops.aten.mul.Tensor, (("x", 0), ("s", 0)), {}, 1),  # rounded, read by the add
             (torch.ops.aten.add.Tensor, (("o", 0), ("x", 0)), {}, 1)]
    ir = _lowered(calls, [x], meta * 2, (1,), ["f"])
    (tmp_path / "k.cpp").write_text(CppRenderer().render(ir, "accel_region_t"))
    flags = [f for f in CXXFLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run(["g++", *flags, "-S", "-I", INCLUDE_DIR, str(tmp_path / "k.cpp"), "-o", str(tmp_path / "k.s")],
                   check=True, capture_output=True, timeout=120)
    asm = (tmp_path / "k.s").read_text()
    if "avx512f" in _cpu_flags():  # 16 float lanes a vector: the 16-lane variants
        assert all(f"call\t_ZGVeN16v_accel_f16c_{f}" in asm for f in ("h2f", "f2h", "round"))
        assert "vcvtph2ps\t%ymm" in asm and "vcvtps2ph\t$8, %zmm" in asm
    else:
        assert all(f"call\t_ZGVdN8v_accel_f16c_{f}" in asm for f in ("h2f", "f2h", "round"))
        assert "vcvtph2ps\t%xmm" in asm and "vcvtps2ph\t$8, %ymm" in asm


def test_float16_values_selected_or_unchanged_are_not_rounded_again():
    """A float16 op whose result is one of its float16 operands or exactly representable
    (``abs``, ``maximum``, ``where``'s arms, ``floor``, a product with 1) is not rounded to
    float16 and back before the next op reads it (accel.lower_expr._Lowerer.f16_exact):
    eager's kernels round it, to the same value. Each rounding costs a CPU loop a call of
    F16C's vector variant. A product with 2 still is; so is a bfloat16 maximum."""
    import os
    import sys

    from accel.codegen.scopes import f16_round
    from accel.loop_ir import walk

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_pipeline import _lowered

    def roundings(dtype, scale):
        x, y = torch.empty(64, 256, dtype=dtype), torch.empty(64, 256, dtype=dtype)
        calls = [(torch.ops.aten.abs.default, (("x", 0),), {}, 1),
                 (torch.ops.aten.maximum.default, (("o", 0), ("x", 1)), {}, 1),
                 (torch.ops.aten.floor.default, (("o", 1),), {}, 1),
                 (torch.ops.aten.mul.Tensor, (("o", 2), ("c", scale)), {}, 1),
                 (torch.ops.aten.gt.Scalar, (("x", 0), ("c", 0)), {}, 1),
                 (torch.ops.aten.where.self, (("o", 4), ("o", 3), ("x", 1)), {}, 1),
                 (torch.ops.aten.add.Tensor, (("o", 5), ("x", 0)), {}, 1)]
        meta = [((64, 256), (256, 1), dtype)] * 4 + [((64, 256), (256, 1), torch.bool)]
        ir = _lowered(calls, [x, y], meta + [((64, 256), (256, 1), dtype)] * 2, (6,))
        seen: set = set()
        return sum(f16_round(e) for nest in ir.nests for st in nest.stores for e in walk(st.value, seen))

    assert roundings(torch.float16, 1.0) == 0
    assert roundings(torch.float16, 2.0) == 1  # x * 2 may overflow or leave the subnormals
    assert roundings(torch.bfloat16, 1.0) == 0  # (bfloat16's roundings are not f16_round's)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_results_not_rounded_again_have_eagers_bits(device):
    """Programs whose float16 results are not rounded again
    (test_float16_values_selected_or_unchanged_are_not_rounded_again), over every float16
    bit pattern (NaNs, infinities, subnormals, -0.0): eager's bits."""
    h = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = h.reshape(256, 256).to(device)
    g = h.flip(0).roll(7, 1)
    cases = [lambda: torch.where(h > 0, h, h * 2), lambda: torch.relu(h * 3) + g,
             lambda: F.smooth_l1_loss(h, g, reduction="none"), lambda: torch.maximum(h.abs(), g).floor() * 1,
             lambda: torch.fmin(h, g * 0.5).trunc().round() / 1, lambda: F.hardtanh(h * 1.5) - g,
             lambda: torch.where(h < g, h.ceil(), 0.25) * h, lambda: torch.minimum(h, g).abs().sqrt()]
    _kernels_have_eagers_bits(cases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_16_bit_product_kept_for_a_row_and_stored_builds(dtype, device):
    """``log_softmax(x * w)`` returning ``x * w`` too (cross entropy's forward with its
    input saved for the backward): the row's max loop keeps the rounded 16-bit product in
    a row cache, and its store reads it from there. The CPU renderer once narrowed that
    store from a float value it never computed (g++: ``t21`` was not declared; the region
    ran eagerly). Builds, runs as kernels, matches eager: the loss, ``w``'s gradient, the
    log-softmax and the product bit for bit. (``x``'s bfloat16 gradient is not compared:
    it takes ``exp`` of the saved bfloat16 log-softmax, where a one-ulp difference within
    tolerance, 0.03 at -5.5, becomes 3 % of the gradient; 3 of 16384 elements.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    w = (torch.randn(256, generator=g, dtype=torch.float64) * 0.5 + 1).to(device, dtype).requires_grad_()
    t = torch.randint(0, 256, (64,), generator=g).to(device)

    def step():
        out = F.cross_entropy(x * w, t)
        out.backward()
        grads = (x.grad, w.grad)
        x.grad = w.grad = None
        return out.detach(), *grads

    expected = step()
    actual, st = _run(step)
    assert st["kernel_runs"] >= 1 and st["compile_failures"] == 0 and st["eager_replays"] == 0, st
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[2], expected[2])
    xw = (x * w).detach()
    actual, st = _run(lambda: (lambda z: (z.log_softmax(-1), z))(x.detach() * w.detach()))
    assert st["compile_failures"] == 0 and st["eager_replays"] == 0, st
    torch.testing.assert_close(actual[0], xw.log_softmax(-1))
    _same_bits(actual[1], xw)
