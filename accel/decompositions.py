"""aten ops as eager's kernels compute them, for tracing (:mod:`accel.graph`): torch._decomp's
decomposition table with accel's corrections where a decomposition rounds or computes
otherwise than eager's kernel on that device and dtype (:func:`decomposition_table`). Each
correction names the ATen kernel it follows and what the decomposition got wrong,
measured. (The conversions eager's kernels apply to a call's operands first:
:mod:`accel.operands`.)
"""
from __future__ import annotations

import functools

import torch

from . import cat_decompositions, library  # (library registers torch.ops.accel.*)
from .operands import _cpu_vector_loop
from .ops import HALF

_FLOATING = (torch.float32, torch.float64) + HALF


@functools.lru_cache(maxsize=1)
def decomposition_table():
    """torch._decomp's decomposition table, with accel's corrections to it where a
    decomposition rounds otherwise than eager's kernel (:func:`_native_layer_norm`,
    :func:`_batch_norm`) or computes otherwise (:func:`_gelu`, :func:`_gelu_backward`), and
    the accel ops that the interceptor records whole, decomposed by their references
    (:func:`accel.library.nll_of_log_softmax`, :func:`accel.library.nll_loss_backward`);
    and the ops :mod:`accel.cat_decompositions` writes as views and concatenations (``cat``
    inside a decomposition, ``constant_pad_nd``, ``slice_backward``, ``linalg_cross``)."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    table = dict(decomposition_table)
    for op, fix in ((aten.native_layer_norm.default, _native_layer_norm),
                    (aten.native_group_norm.default, _native_group_norm),
                    (aten.gelu.default, _gelu), (aten.gelu_backward.default, _gelu_backward),
                    (aten.softshrink.default, _softshrink), (aten.round.decimals, _round_decimals),
                    (aten.mse_loss.default, _mse_loss), (aten.div.Tensor_mode, _div_mode),
                    (aten.div.Scalar_mode, _div_mode), (aten.floor_divide.default, _floor_divide),
                    (aten.floor_divide.Scalar, _floor_divide),
                    (aten.hardshrink.default, _hardshrink), (aten.logit.default, _logit),
                    (aten.sigmoid_backward.default, _sigmoid_backward), (aten.xlogy.Tensor, _xlogy),
                    (aten.tanh_backward.default, _tanh_backward), (aten.threshold.default, _threshold),
                    (aten.threshold_backward.default, _threshold_backward),
                    (aten.smooth_l1_loss.default, _smooth_l1_loss),
                    (aten.smooth_l1_loss_backward.default, _smooth_l1_loss_backward),
                    (aten.softplus.default, _softplus),
                    (aten._log_softmax.default, _log_softmax),
                    (aten._softmax_backward_data.default, _softmax_backward_data),
                    (aten.logsumexp.default, _logsumexp),
                    (aten.relu.default, _relu),
                    (aten.glu.default, _glu), (aten.glu_backward.default, _glu_backward),
                    (aten.fmax.default, _fmax_fmin), (aten.fmin.default, _fmax_fmin),
                    (aten.std.correction, functools.partial(_std, aten.var.correction)),
                    (aten.std_mean.correction, functools.partial(_std, aten.var_mean.correction)),
                    *((getattr(getattr(aten, name), ov), functools.partial(_lerp, name.endswith("_")))
                      for name in ("lerp", "lerp_") for ov in ("Scalar", "Tensor")),
                    *((getattr(aten, name).Tensor, functools.partial(_add_alpha, name))
                      for name in ("add", "add_", "sub", "sub_", "rsub")),
                    *((getattr(aten, f"addc{op}{tail}").default, functools.partial(_pointwise_op, op, bool(tail)))
                      for op in ("mul", "div") for tail in ("", "_")),
                    *((getattr(getattr(aten, name), ov), functools.partial(_clamp, name))
                      for name in ("clamp", "clamp_min", "clamp_max", "clamp_", "clamp_min_", "clamp_max_")
                      for ov in ("default", "Tensor")),
                    *((op, _batch_norm) for op in (
                        aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                        aten._native_batch_norm_legit.no_stats,
                        aten._native_batch_norm_legit_functional.default,
                        aten._native_batch_norm_legit_no_training.default))):
        table[op] = functools.partial(fix, table[op])
    cat_decompositions.install(table)
    table[torch.ops.accel.nll_of_log_softmax.default] = library.nll_of_log_softmax  # (recorded whole)
    table[torch.ops.accel.nll_loss_backward.default] = library.nll_loss_backward
    table[torch.ops.accel.group_norm_apply.default] = library.group_norm_apply  # (accel.remat's)
    table[torch.ops.accel.batch_norm_apply.default] = library.batch_norm_apply
    return table


_SQRT1_2 = 0.70710678118654752440  # M_SQRT1_2, as torch._decomp's GELU
_GELU_BETA = 1.12837916709551257390 * _SQRT1_2 * 0.5  # M_2_SQRTPI * M_SQRT1_2 * 0.5
_ONE_OVER_SQRT_PI = 0.56418958354775628695  # M_2_SQRTPI / 2 (oneDNN's GELU backward)


def _erf_gelu_cpu(*tensors) -> bool:
    """Whether the exact GELU (or its backward) of these tensors takes its erf from
    :func:`accel.library.vec_erf`: float32 and 16-bit floats on the CPU."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
               for t in tensors)


def _onednn_gelu(a) -> bool:
    """Whether eager's exact GELU of ``a`` (a CPU tensor) runs oneDNN's ``eltwise_gelu_erf``,
    as ``use_mkldnn`` in ATen's ``Activation.cpp`` decides: oneDNN built in and enabled
    (``torch.backends.mkldnn``), ``a`` contiguous with more than one element, float32,
    bfloat16 where oneDNN has bfloat16 kernels for this CPU, float16 where it has float16
    ones (AVX512-FP16 or AMX-FP16). Decided when a region is traced: a kernel built with
    oneDNN enabled replays after ``torch.backends.mkldnn.flags(enabled=False)`` too."""
    if not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()):
        return False
    if a.numel() <= 1 or not a.is_contiguous():
        return False
    return (a.dtype == torch.float32
            or (a.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
            or (a.dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()))


@functools.lru_cache(maxsize=None)
def _eager_gelu_ends(dtype: torch.dtype, onednn: bool) -> tuple:
    """eager's CPU GELU of ``dtype`` at +inf and -inf, and whether its product overflows at
    2^127 (or the dtype's largest value), on oneDNN's path (``onednn``: a contiguous tensor)
    or ATen's loops (a strided one), read from eager itself once a process: ``(gelu(inf),
    gelu(-inf), overflows)`` as Python floats and a bool. They are eager's bugs
    (pytorch/pytorch#185770: oneDNN's ``gelu(inf)`` is NaN; ``-inf * 0`` makes
    ``gelu(-inf)`` NaN on every path) that a later torch fixes (#192318), so accel reads
    them rather than assumes them. Called while a region is traced: with its fake-tensor
    and tracing modes off."""
    from torch.utils._python_dispatch import _disable_current_modes

    inf = float("inf")
    with _disable_current_modes(), torch.no_grad():
        x = torch.tensor([inf, -inf, min(2.0 ** 127, torch.finfo(dtype).max), 1.0], dtype=dtype)
        y = torch.nn.functional.gelu(x if onednn else torch.stack([x, x], 1)[:, 0]).tolist()
    return y[0], y[1], y[2] == inf


def _gelu(decomposition, a, approximate="none"):
    """``aten.gelu`` as torch._decomp's ``decomposition`` of it (``x * 0.5 * (1 + erf(x *
    M_SQRT1_2))``), except that on float32 and 16-bit CPU tensors the erf is ATen's
    vectorized one (:func:`accel.library.vec_erf`), computed in float32 and rounded to
    ``a``'s dtype. That erf is what ATen's vectorized GELU loop (``Gelu.h``) and
    torch.compile's CPU code use: eager's for float16, and for float32 inputs that oneDNN does
    not take but TensorIterator reads in its vectorized loop (a transposed one). eager's
    float32 and bfloat16 GELU of a contiguous tensor runs oneDNN's ``eltwise_gelu_erf``, whose
    own approximation neither reproduces bitwise (on [2048, 1024] normal samples of standard
    deviation 2, eager's float32 GELU was 1.2e-6 from float64's at most, this one 4.7e-7,
    with libmvec's ``erff`` 7.2e-7; the backward 8.8e-7, 9.5e-7 and 6.2e-7). An input strided
    along its innermost dimension runs ATen's scalar loop, which calls glibc's ``erff`` (not
    correctly rounded in glibc 2.36, so no vectorized erf reproduces it): accel keeps this
    erf there too, an ulp or two from eager's in most elements, and about 25x faster
    (``gelu(x[:, ::2])`` of a [2048, 4096] float32 ``x``: 1.1 ms against eager's 27 on the dev
    VM; calling glibc's ``erff`` gave eager's bits in eager's time). This erf vectorizes to
    about half the time of libmvec's: [2048, 4096] float32 GELU 1.40 ms against 1.81 on the
    dev VM (torch.compile 1.52, eager 1.76-1.84).

    eager's values at the ends of the range are its path's (:func:`_eager_gelu_ends`,
    :func:`_onednn_gelu`): oneDNN's ``gelu(inf)`` is NaN where ATen's loops give inf, and
    oneDNN computes ``x * (1 + erf) * 0.5``, whose product overflows from 2^127 on (ATen's
    ``x * 0.5 * (1 + erf)`` gives ``x``); the product is taken in eager's order, and the
    infinities selected to eager's values where the formula's (inf, NaN) differ. (oneDNN's
    backward: :func:`_gelu_backward`.)"""
    if approximate != "none" or not _erf_gelu_cpu(a):
        return decomposition(a, approximate)
    x = a.float()
    cdf2 = 1 + torch.ops.accel.vec_erf(x * _SQRT1_2)
    at_inf, at_minus_inf, overflows = _eager_gelu_ends(a.dtype, _onednn_gelu(a))
    y = x * cdf2 * 0.5 if overflows else x * 0.5 * cdf2
    if at_inf != float("inf"):
        y = torch.where(x == float("inf"), at_inf, y)
    if at_minus_inf == at_minus_inf:  # (not NaN, the formula's -inf * 0)
        y = torch.where(x == float("-inf"), at_minus_inf, y)
    return y.to(a.dtype)


def _gelu_backward(decomposition, grad, x, approximate="none"):
    """``aten.gelu_backward`` as torch._decomp's ``decomposition`` of it (``dy * (cdf + x *
    pdf)``, ``cdf = 0.5 * (1 + erf(x * M_SQRT1_2))``, ``pdf = M_2_SQRTPI * M_SQRT1_2 * 0.5 *
    exp(x * x * -0.5)``), with :func:`_gelu`'s erf on float32 and 16-bit CPU tensors,
    computed in float32 and rounded to the promoted dtype of ``grad`` and ``x``.

    Where eager runs oneDNN's backward (:func:`_onednn_gelu` of ``x``), in its order of
    operations (``jit_uni_eltwise_injector``'s ``gelu_erf_compute_vector_bwd``, whose erf is
    this one): ``r = x * M_SQRT1_2``, ``t = r * (1 / sqrt(pi)) * exp(-r * r)``, ``dy * ((t +
    0.5) + 0.5 * erf(r))``. Its ``t + 0.5`` absorbs ``t`` where it is under an ulp of 0.5,
    so that the result is exactly 0 from x = -7 or so down (ATen's is 1e-11 and less), and
    ``dy`` infinite there gives NaN where ATen's gives an infinity."""
    if approximate != "none" or not _erf_gelu_cpu(grad, x):
        return decomposition(grad, x, approximate)
    dtype = torch.result_type(grad, x)
    g, v = grad.float(), x.float()
    if _onednn_gelu(x):
        r = v * _SQRT1_2
        t = r * _ONE_OVER_SQRT_PI * torch.exp(-(r * r))
        return (g * ((t + 0.5) + 0.5 * torch.ops.accel.vec_erf(r))).to(dtype)
    cdf = 0.5 * (1 + torch.ops.accel.vec_erf(v * _SQRT1_2))
    pdf = _GELU_BETA * torch.exp(v * v * -0.5)
    return (g * (cdf + v * pdf)).to(dtype)


def _round_decimals(decomposition, a, *, decimals=0):
    """``aten.round.decimals`` as eager's kernels (``round_decimals_kernel``, CPU and CUDA)
    compute it, in the op's math type (float32 for 16-bit floats) with ``p = 10 **
    |decimals|``: ``nearbyint(a * p) / p``, or ``nearbyint(a / p) * p`` for negative
    ``decimals``, a true division (:func:`accel.library.div_rn`: a GPU kernel would take a
    number divisor's reciprocal). torch's decomposition multiplies by ``10 ** -decimals``
    instead: 13-58 % of float32 and float64 results with 2 or 3 decimals were an ulp from
    eager's. On a GPU a 16-bit kernel computes in the dtype (``scalar_t``): ``p`` and the
    product or quotient before the rounding are rounded to it (1 % of results were outside
    ``assert_close``'s tolerance without). Elsewhere (``decimals`` 0, integers)
    ``decomposition`` itself."""
    if not a.is_floating_point() or decimals == 0:
        return decomposition(a, decimals=decimals)
    dt = a.dtype
    opm = torch.float32 if dt in HALF else dt
    p = a.new_full((), float(10 ** abs(decimals)), dtype=opm)
    step = (lambda v: v.to(dt).to(opm)) if _gpu_16_bit(a) else (lambda v: v)  # (scalar_t steps)
    x, p = torch.broadcast_tensors(a.to(opm), step(p))
    div = torch.ops.accel.div_rn
    return (div(torch.round(step(x * p)), p) if decimals > 0 else torch.round(step(div(x, p))) * p).to(dt)


def _16_bit(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype in HALF


def _cpu_16_bit(a) -> bool:
    return _16_bit(a) and a.device.type == "cpu"


def _gpu_16_bit(a) -> bool:
    return _16_bit(a) and a.device.type == "cuda"


def _glu(decomposition, x, dim=-1):
    """``aten.glu`` of 16-bit tensors as eager's kernels compute it (``glu_kernel``, CPU and
    CUDA): ``a * (1 / (1 + exp(-b)))`` of the halves ``a``, ``b`` of ``x`` along ``dim``, in
    float32, rounded once; torch's decomposition rounds the sigmoid to the dtype first.
    Elsewhere ``decomposition`` itself."""
    if not _16_bit(x):
        return decomposition(x, dim)
    a, b = x.float().chunk(2, dim)
    return (a * (1 / (1 + torch.exp(-b)))).to(x.dtype)


def _glu_backward(decomposition, grad, x, dim):
    """``aten.glu_backward`` of 16-bit tensors as eager's kernels compute it: of the halves
    ``a``, ``b`` of ``x`` along ``dim``, ``s = 1 / (1 + exp(-b))``, then the gradients ``s *
    grad`` and ``(1 - s) * s * a * grad`` (CUDA's ``glu_backward_kernel``: in float32, each
    rounded once; ``(1 - s) * s * grad * a``), on the CPU from ``s`` rounded to the dtype
    (``glu_backward_cpu_out``: ``sigmoid_out``, then its fused kernel in float32). torch's
    decomposition rounds every step (bfloat16: 8 % of [64, 48]'s gradients outside
    ``assert_close``'s tolerance). Elsewhere ``decomposition`` itself."""
    if not (_16_bit(x) and grad.dtype == x.dtype):
        return decomposition(grad, x, dim)
    a, b = x.float().chunk(2, dim)
    g = grad.float()
    s = 1 / (1 + torch.exp(-b))
    if x.device.type == "cuda":
        second = (1 - s) * s * g * a
    else:
        s = s.to(x.dtype).float()
        second = (1 - s) * s * a * g
    return torch.cat([(s * g).to(x.dtype), second.to(x.dtype)], dim)


def _mse_loss(decomposition, a, target, reduction=1):
    """``aten.mse_loss`` of 16-bit tensors as eager's kernels compute each element: the
    difference rounded to the dtype, then squared in float32 and rounded (the CPU's
    ``mse_kernel``; CUDA's ``mse_kernel_cuda`` in the dtype's own arithmetic, the same),
    and then reduced (``apply_loss_reduction``); torch's decomposition squares the float32
    difference (36 % of results were an ulp off, 1.8 % of float16 ones on an H200 outside
    ``assert_close``'s tolerance) and reduces the float32 squares. Elsewhere
    ``decomposition`` itself."""
    if not (_16_bit(a) and isinstance(target, torch.Tensor) and target.dtype == a.dtype):
        return decomposition(a, target, reduction)
    d = a - target
    loss = decomposition(d, torch.zeros_like(d), 0)  # (rounded to the dtype, as eager's)
    return loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss


def _div_floor(a, b):
    """Floating floor division of float32 or float64 CPU operands (``a`` a tensor, ``b`` a
    tensor or a number, rounded to the result's dtype as eager's kernel takes it) as one
    :func:`accel.library.div_floor` (c10's ``div_floor_floating``, in one division where
    the quotient is small); None for other operands. torch's decomposition (``torch._refs``'
    ``_floor_divide_float``, the same formula op by op) takes an fmod and two divisions."""
    if not (isinstance(a, torch.Tensor) and a.device.type == "cpu"
            and (not isinstance(b, torch.Tensor) or b.device.type == "cpu")):
        return None
    dtype = torch.result_type(a, b)
    if dtype not in (torch.float32, torch.float64):
        return None
    x = a.to(dtype)
    y = b.to(dtype) if isinstance(b, torch.Tensor) else x.new_full((), b)
    return torch.ops.accel.div_floor(*torch.broadcast_tensors(x, y))


def _floor_divide(decomposition, a, b):
    """``aten.floor_divide`` (``.default``, ``.Scalar``): :func:`_div_floor` where it applies,
    else ``decomposition``."""
    out = _div_floor(a, b)
    return decomposition(a, b) if out is None else out


def _div_mode(decomposition, a, b, *, rounding_mode=None):
    """``aten.div.Tensor_mode`` and ``.Scalar_mode`` with ``rounding_mode="floor"`` of
    float32 and float64 CPU operands: :func:`_div_floor`.
    ``rounding_mode="trunc"`` of 16-bit tensors as eager's
    kernels compute it: the quotient rounded to the dtype, then truncated (the CPU's
    ``div_trunc_kernel``, CUDA's ``div_trunc_kernel_cuda``); torch's decomposition truncates
    the float32 quotient (1-6 % of results were off, by up to 1, on both devices).
    With ``rounding_mode="floor"`` on 16-bit CPU tensors, c10's ``div_floor_floating`` in
    the dtype's own arithmetic (the CPU's ``div_floor_kernel``), each step rounded: ``mod
    = fmod(a, b)``, ``(a - mod) / b``, less 1 where ``mod`` and ``b`` differ in sign, then
    floored and rounded up past a half; torch's decomposition computes it in float32 (up to
    1 % of float16 results were outside ``assert_close``'s tolerance). Elsewhere
    ``decomposition`` itself."""
    if rounding_mode == "floor" and (out := _div_floor(a, b)) is not None:
        return out
    if not (_16_bit(a) and isinstance(b, torch.Tensor) and b.dtype == a.dtype):
        return decomposition(a, b, rounding_mode=rounding_mode)
    if rounding_mode == "trunc":
        return torch.trunc(torch.div(a, b))
    if rounding_mode != "floor" or a.device.type != "cpu":
        return decomposition(a, b, rounding_mode=rounding_mode)
    mod = torch.fmod(a, b)  # (16-bit ops: each rounded to the dtype)
    q = (a - mod) / b
    q = torch.where((mod != 0) & ((b < 0) != (mod < 0)), q - 1, q)
    fl = torch.floor(q)
    fl = torch.where(q - fl > 0.5, fl + 1, fl)
    fl = torch.where(q == 0, torch.copysign(torch.zeros_like(q), a / b), fl)
    return torch.where(b == 0, a / b, fl)


def _hardshrink(decomposition, a, lambd=0.5):
    """``aten.hardshrink`` of 16-bit tensors as eager's kernels compute it: ``lambd``
    rounded to the dtype before the comparison (``hardshrink_kernel``, CPU and CUDA);
    torch's decomposition compares with the float ``lambd`` (values between the two kept or
    zeroed apart from eager: 12-150 of 100003, on both devices). Elsewhere
    ``decomposition`` itself."""
    if not (_16_bit(a) and type(lambd) in (int, float)):
        return decomposition(a, lambd)
    lam = a.new_full((), lambd)
    return torch.where((a >= -lam) & (a <= lam), torch.zeros_like(a), a)


def _logit(decomposition, a, eps=None):
    """``aten.logit`` of 16-bit CPU tensors as eager's kernel (``logit_kernel``, in the
    dtype's own arithmetic, each step rounded to it) computes it: ``lo = eps`` and ``hi = 1
    - eps`` rounded to the dtype, ``x`` clamped to them where ``eps >= 0``, then ``1 - x``,
    the quotient and its log each rounded. torch's decomposition computes in float32 and
    rounds once: 18 % of float16 and 9 % of bfloat16 results were outside
    ``assert_close``'s tolerance (near ``x = 0.5``, where the log is near 0). Elsewhere
    ``decomposition`` itself."""
    if not _cpu_16_bit(a):
        return decomposition(a, eps)
    dt = a.dtype
    if eps is not None and eps >= 0:
        lo = a.new_full((), eps)
        hi = (1 - lo.float()).to(dt)
        a = torch.where(a < lo, lo, torch.where(a > hi, hi, a))  # (NaN stays NaN)
    x = a.float()
    q = (x / (1 - x).to(dt).float()).to(dt)
    return torch.log(q.float()).to(dt)


def _sigmoid_backward(decomposition, grad, y):
    """``aten.sigmoid_backward`` as eager's kernels compute it, in the dtype's own
    arithmetic, each step rounded to it: ``(grad * (1 - y)) * y`` on a GPU, every floating
    dtype (``sigmoid_backward_kernel_cuda``), and of float16 CPU tensors (ATen's
    ``Vectorized<Half>``; the CPU's bfloat16, float32 and float64 kernels compute as
    torch's decomposition, ``grad * (y * (1 - y))``, does). With the decomposition 32 % of
    results were off on a GPU, 0.2 % of float16 ones outside ``assert_close``'s tolerance
    on both devices. Elsewhere ``decomposition`` itself."""
    if not (isinstance(y, torch.Tensor) and y.dtype == grad.dtype and grad.dtype.is_floating_point
            and (grad.device.type == "cuda" or (_cpu_16_bit(grad) and grad.dtype == torch.float16))):
        return decomposition(grad, y)
    return grad * (1 - y) * y  # (16-bit ops: each rounded, as eager's scalar_t arithmetic)


def _tanh_backward(decomposition, grad, y):
    """``aten.tanh_backward`` of 16-bit GPU tensors as eager's kernel
    (``tanh_backward_kernel_cuda``) computes it, in the dtype's own arithmetic: ``grad * (1
    - y * y)``, each step rounded to it; torch's decomposition computes in float32 and
    rounds once (2-7 % of results were outside ``assert_close``'s tolerance on an H200).
    Elsewhere (the CPU computes in float32) ``decomposition`` itself."""
    if not (_gpu_16_bit(grad) and isinstance(y, torch.Tensor) and y.dtype == grad.dtype):
        return decomposition(grad, y)
    return grad * (1 - y * y)


def _threshold(decomposition, a, threshold, value):
    """``aten.threshold`` (``threshold_backward`` alike, ``value`` 0) of 16-bit GPU tensors
    as eager's kernel (``threshold_kernel_cuda``) computes it: ``threshold`` rounded to the
    dtype before the comparison; torch's decomposition compares with the float one (19-36
    bfloat16 results of 100003 kept or replaced apart from eager's). Elsewhere (the CPU
    compares in float32) ``decomposition`` itself."""
    if not (_gpu_16_bit(a) and type(threshold) in (int, float)):
        return decomposition(a, threshold, value)
    return torch.where(a <= a.new_full((), threshold), value, a)


def _threshold_backward(decomposition, grad, a, threshold):
    """``aten.threshold_backward``: :func:`_threshold`'s rounded ``threshold``, 0 where
    ``a`` is at most it, else ``grad``."""
    if not (_gpu_16_bit(a) and type(threshold) in (int, float)):
        return decomposition(grad, a, threshold)
    return torch.where(a <= a.new_full((), threshold), 0, grad)


def _xlogy(decomposition, a, b):
    """``aten.xlogy.Tensor`` of two 16-bit CPU tensors of one dtype as eager's kernel
    (``xlogy_kernel``) computes it: ``log(b)`` rounded to the dtype first (c10's 16-bit
    ``std::log``), then ``a * log(b)`` in float32, rounded; 0 where ``a`` is 0, NaN where
    ``b`` is. torch's decomposition rounds once: 26 % of results were an ulp off. The log is
    the C library's scalar one, as eager's (:func:`accel.library.log_libm`): libmvec's, an
    ulp away at times, moved float16 results up to 1.6e-3 off eager's through the rounding
    to 16 bits. Elsewhere ``decomposition`` itself."""
    if not (_cpu_16_bit(a) and isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.device == a.device):
        return decomposition(a, b)
    prod = a.float() * torch.ops.accel.log_libm(b.float()).to(a.dtype).float()
    return torch.where(torch.isnan(b), float("nan"), torch.where(a == 0, 0.0, prod)).to(a.dtype)


def _softshrink(decomposition, a, lambd=0.5):
    """``aten.softshrink`` as torch._decomp's ``decomposition`` of it, except on float16 and
    bfloat16 CPU tensors, where eager's kernel (``softshrink_kernel``) computes ``x - lambd``
    / ``x + lambd`` / 0 in float32 from a float32 ``lambd`` and rounds once, and the
    decomposition (``a - sign(a) * lambd``) rounds the product ``sign(a) * lambd`` to the
    16-bit dtype first (887 of 4096 bfloat16 elements differed)."""
    if not (a.device.type == "cpu" and a.dtype in HALF):
        return decomposition(a, lambd)
    x = a.float()
    # -x > lambd, not x < -lambd: a runtime lambd's sentinel appears as itself (accel.graph)
    rest = torch.where(torch.isnan(x), x, 0.0)  # NaN stays NaN, as in eager's kernel
    return torch.where(x > lambd, x - lambd, torch.where(-x > lambd, x + lambd, rest)).to(a.dtype)


def _relu(decomposition, a):
    """``aten.relu`` as eager computes it on the CPU: ``-0.0`` stays ``-0.0`` (eager's
    kernel is ``clamp_min(x, 0)``, which keeps ``x`` where it equals the bound; torch's
    decomposition, ``where(x <= 0, 0, x)``, gives 0.0). On a GPU eager's is 0.0, as the
    decomposition's."""
    if a.device.type != "cpu":
        return decomposition(a)
    return torch.where(torch.lt(a, 0), 0, a)


def _lerp(inplace, decomposition, start, end, weight):
    """``aten.lerp`` (``inplace``: ``lerp_``) as eager's CPU kernel computes it (ATen's
    ``lerp_vec``, and its scalar loop alike): ``fma(coeff, end - start, base)`` rounded once,
    ``coeff, base = (weight - 1, end)`` where ``|weight| >= 0.5``, else ``(weight,
    start)``; 16-bit floats in float32. torch's decomposition is the same formula with two
    roundings (11-25 % of float32 results were an ulp from eager's). Elsewhere (a GPU, where
    nvcc contracts the same formula; non-float dtypes) ``decomposition`` itself."""
    dtype = start.dtype  # eager's lerp takes end and a weight tensor of start's dtype only
    if start.device.type != "cpu" or not dtype.is_floating_point:
        return decomposition(start, end, weight)
    opm = torch.float32 if dtype in HALF else dtype
    s, e = start.to(opm), end.to(opm)
    w = weight.to(opm) if isinstance(weight, torch.Tensor) else s.new_full((), weight)
    mask = w.abs() >= 0.5
    coeff, diff, base = torch.broadcast_tensors(torch.where(mask, w - 1, w), e - s, torch.where(mask, e, s))
    out = torch.ops.accel.fma(coeff, diff, base).to(dtype)
    return start.copy_(out) if inplace else out


def _add_alpha(name, decomposition, a, b, **kwargs):
    """``aten.add``, ``aten.sub`` and ``aten.rsub`` (``name``; ``.Tensor``, also ``add_`` and
    ``sub_``) with an ``alpha`` other than 1 and a float32 or float64 result, as eager's
    kernels compute them: ``fma(other, alpha, self)`` rounded once (ATen's CPU
    ``add_kernel``: ``vec::fmadd``, its scalar loop alike; CUDA's ``AddFunctor``, ``a +
    alpha * b``, which nvcc contracts), with ``-alpha`` for ``sub``, and ``self`` and
    ``other`` swapped for ``rsub``. torch's decomposition rounds ``other * alpha`` first:
    27 % of float32 sums with ``alpha=1.25`` were an ulp from eager's, and where the sum
    nearly cancels, that ulp is most of the result. Elsewhere ``decomposition`` itself
    (16-bit floats: :func:`_number_rounded`)."""
    inplace, base = name.endswith("_"), name.rstrip("_")
    alpha = kwargs.get("alpha", 1)
    dtype = torch.result_type(a, b)
    if (set(kwargs) - {"alpha"} or isinstance(alpha, bool) or alpha == 1 or dtype not in (torch.float32, torch.float64)
            or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))):
        return decomposition(a, b, **kwargs)
    x, y = (b, a) if base == "rsub" else (a, b)
    w = y.new_full((), alpha, dtype=dtype)
    w, y, x = torch.broadcast_tensors(torch.neg(w) if base != "add" else w, y.to(dtype), x.to(dtype))
    out = torch.ops.accel.fma(y, w, x)
    return a.copy_(out) if inplace else out


def _pointwise_op(op, inplace, decomposition, a, t1, t2, value=1):
    """``aten.addcmul`` (``op`` ``"mul"``) and ``aten.addcdiv`` (``"div"``), in place where
    ``inplace``, of floating tensors of one dtype and device as eager's kernels compute
    them, in the op's math type (float32 for 16-bit floats), rounded once at the end:

    * on a GPU ``addcmul_cuda_kernel``'s and ``addcdiv_cuda_kernel``'s
      ``pointwise_op_impl``: where ``value`` is 1, ``fma(tensor1, tensor2, self)`` and
      ``self + tensor1 / tensor2``; else ``fma(value, p, self)`` with ``p``, ``tensor1 *
      tensor2`` or ``tensor1 / tensor2``, rounded first (:func:`accel.library.mul_rn`: nvcc
      would fold ``fma(p, -1, self)`` to ``self - p`` and contract that with a plain
      product ``p``; :func:`accel.library.div_rn`: a true division). A run-time ``value``
      is tested in the kernel.
    * on the CPU ``addcmul`` as ``fma(value * tensor1, tensor2, self)``, ``value *
      tensor1`` rounded first (ATen's ``addcmul_cpu_kernel``); ``addcdiv`` as torch's
      decomposition, ``self + value * tensor1 / tensor2``, which is ``addcdiv_cpu_kernel``'s
      order.

    ``addcmul`` was equal to eager's in every one of 100003 float32, bfloat16 and float16
    results (and float64 on the CPU) for values 0.5, 1, 1.3 and -0.7 (torch 2.13 CPU, 2.11
    H200); torch's decomposition, ``self + value * tensor1 * tensor2``, rounds twice on the
    CPU, and nvcc contracts it the CPU's way: 18-25 % of float32 and float64 results were an
    ulp from eager's, which a later ``erfinv`` near 1 made 3.7e-5. A GPU's ``addcdiv`` by
    the decomposition had 29 % of float32 results an ulp from eager's on an H200.
    Integer tensors with a float ``value`` (``addcmul``): truncated to the integer type
    (``Scalar::to<int64_t>``), where torch's reference implementation raises (``value
    argument ... cannot be safely cast``). Elsewhere (mixed dtypes or devices)
    ``decomposition`` itself."""
    tensors = all(isinstance(t, torch.Tensor) for t in (a, t1, t2))
    if op == "mul" and isinstance(value, float) and not any(
            t.is_floating_point() or t.is_complex() for t in (a, t1, t2) if isinstance(t, torch.Tensor)):
        value = int(value)
    elif (tensors and a.dtype.is_floating_point and a.dtype == t1.dtype == t2.dtype
          and a.device == t1.device == t2.device and not isinstance(value, bool)
          and (op == "mul" or a.device.type != "cpu")):
        opm = torch.float32 if a.dtype in HALF else a.dtype
        x, y, base, v = torch.broadcast_tensors(t1.to(opm), t2.to(opm), a.to(opm),
                                                a.new_full((), value, dtype=opm))
        if a.device.type == "cpu":  # (addcmul)
            out = torch.ops.accel.fma(x * v, y, base)
        else:  # (a run-time value: its test in the kernel)
            p = (torch.ops.accel.mul_rn if op == "mul" else torch.ops.accel.div_rn)(x, y)
            one = torch.ops.accel.fma(x, y, base) if op == "mul" else base + p
            out = torch.where(v == 1, one, torch.ops.accel.fma(v, p, base))
        out = out.to(a.dtype)
        return a.copy_(out) if inplace else out
    return decomposition(a, t1, t2, value=value)


def _std(variance, decomposition, a, *args, **kwargs):
    """``aten.std`` (``variance``: ``aten.var``) and ``aten.std_mean`` (``aten.var_mean``)
    as eager's CPU kernel computes them for float32 and 16-bit inputs: the variance in
    float64 (``std_var_kernel_impl``'s double accumulators), its square root taken there,
    then rounded. torch's decomposition rounds the variance first, so the std of float32
    values above about 1.8e19 was inf (the variance overflowed float32) where eager's is
    finite. Elsewhere (a GPU, whose kernel accumulates float32 as the decomposition does;
    float64) ``decomposition`` itself."""
    if a.device.type != "cpu" or not a.is_floating_point() or a.dtype == torch.float64:
        return decomposition(a, *args, **kwargs)
    out = variance(a.double(), *args, **kwargs)
    if isinstance(out, tuple):
        return torch.sqrt(out[0]).to(a.dtype), out[1].to(a.dtype)
    return torch.sqrt(out).to(a.dtype)


def _fmax_fmin(decomposition, a, b):
    """``aten.fmax`` / ``aten.fmin`` (``decomposition``) with eager's choice between two
    zeros of different signs on the CPU: the first operand (accel's CPU ``fmax``,
    include/accel/cpu_math.h), but the second for bfloat16 (eager's bfloat16 kernels, both
    loops), computed here as the operation of ``(b, a)``. Elsewhere ``decomposition`` itself."""
    if a.device.type == "cpu" and torch.result_type(a, b) == torch.bfloat16:
        return decomposition(b, a)
    return decomposition(a, b)


def _clamp(name, decomposition, a, *bounds, **kwargs):
    """``aten.clamp`` (``name``: also ``clamp_min``, ``clamp_max`` and their in-place forms),
    as eager computes it on a GPU: ``fminf(fmaxf(x, lo), hi)`` (``clamp_kernel_cuda``;
    ``lo``/``hi`` numbers or tensors), where -0.0 is below 0.0 (``clamp(0.0, min=-0.0,
    max=-0.0)`` is -0.0, ``clamp_min(-0.0, 0.0)`` is 0.0). torch's decomposition keeps ``x``
    where it equals a bound (as eager's CPU kernels for numbers). NaN in ``x`` or a bound
    gives NaN. Elsewhere, and for integer results, ``decomposition`` itself."""
    inplace, base = name.endswith("_"), name.rstrip("_")
    if a.device.type != "cuda":
        return decomposition(a, *bounds, **kwargs)
    dtype = a.dtype if inplace else decomposition(a, *bounds, **kwargs).dtype  # (traced, then dead)
    if not dtype.is_floating_point:
        return decomposition(a, *bounds, **kwargs)
    given = dict(zip(("min", "max") if base == "clamp" else (base[6:],), bounds), **kwargs)
    lo, hi = given.get("min"), given.get("max")
    x = a.to(dtype)
    if lo is not None:  # eq and a sign bit: x is -0.0 (or a negative number equal to lo)
        x = torch.where(torch.eq(x, lo) & torch.signbit(x), lo,
                        torch.where(torch.ge(x, lo) | torch.isnan(x), x, lo))
    if hi is not None:  # eq and no sign bit: x is 0.0 (or a positive number equal to hi)
        x = torch.where(torch.eq(x, hi) & ~torch.signbit(x), hi,
                        torch.where(torch.le(x, hi) | torch.isnan(x), x, hi))
    return a.copy_(x) if inplace else x.to(dtype)


def _smooth_l1_loss(decomposition, input, target, reduction=1, beta=1.0):
    """``aten.smooth_l1_loss`` as torch._decomp's ``decomposition`` of it, except on float16
    CPU tensors and floating CUDA tensors, where eager's kernels (``smooth_l1_kernel``,
    ``Vectorized<Half>``; CUDA's ``smooth_l1_kernel_cuda``) compute in the tensor's dtype,
    ``beta`` rounded to it: ``z = |input - target|``, then ``((0.5 * z) * z) / beta`` where
    ``z < beta``, else ``z - 0.5 * beta``, every step rounded at 16 bits on the CPU, and on
    a GPU in float32 from the 16-bit difference (CUDA's ``::abs`` of a ``Half`` is a
    float). The decomposition
    computes 16-bit values from float32 ``beta`` (2 % of the elements of a
    ``reduction="none"`` loss were further from eager's than ``assert_close`` allows), and
    a GPU kernel would take its division by the number ``beta`` as a product with the
    reciprocal; here it is a true division (:func:`accel.library.div_rn`; 4 % of float32
    results were an ulp from eager's on an H200). ``reduction``: 0 none, 1 mean, 2 sum."""
    floats = (torch.float16,) if input.device.type == "cpu" else _FLOATING if input.device.type == "cuda" else ()
    if not (input.dtype in floats and target.dtype == input.dtype and beta > 0):
        return decomposition(input, target, reduction, beta)
    z = (input - target).abs()
    b = z.new_full((), beta)
    if input.device.type == "cuda" and z.dtype in HALF:  # (CUDA's ::abs returns a float)
        z, b = z.float(), b.float()
    b, z = torch.broadcast_tensors(b, z)
    loss = torch.where(z < b, torch.ops.accel.div_rn(0.5 * z * z, b), z - 0.5 * b).to(input.dtype)
    return loss if reduction == 0 else loss.mean() if reduction == 1 else loss.sum()


def _smooth_l1_loss_backward(decomposition, grad, input, target, reduction, beta):
    """``aten.smooth_l1_loss_backward`` of floating tensors of one dtype and device as
    eager's kernels (``smooth_l1_backward_cpu_kernel``, ``smooth_l1_backward_cuda_kernel``)
    compute it, in the dtype (a GPU's 16-bit kernel: each step rounded to it, ``scalar_t``
    arithmetic; the CPU's: in float32, rounded once), with ``n`` its ``1 / numel`` for the
    mean, else 1, ``b`` its ``beta`` and ``x = input - target``:

    * a GPU's: ``-n * grad`` where ``x < -b``, ``n * grad`` where ``x > b``, else ``((n *
      x) * grad) / b``, a true division (:func:`accel.library.div_rn`; a GPU kernel
      would multiply by the number's reciprocal);
    * the CPU's vectorized loop (:func:`_cpu_vector_loop`): ``(n * s) * grad``, ``s`` the
      sign of ``x`` (-1 at 0) where ``|x| >= b``, else ``x / b``;
    * the CPU's scalar loop: the GPU's form, compared with and divided by the float64
      ``beta`` (``x <= -beta``, ``x >= beta``; the quotient rounded from float64).

    torch's decomposition computes ``((n * grad) * x) / beta``: 7 % of float32 results were
    an ulp from eager's on the CPU, 8 % of float16 ones outside ``assert_close``'s
    tolerance on an H200. Elsewhere (``beta`` 0, mixed dtypes or devices) ``decomposition``
    itself."""
    tensors = (grad, input, target)
    cpu = input.device.type == "cpu"
    if not (all(isinstance(t, torch.Tensor) for t in tensors) and input.dtype in _FLOATING
            and beta > 0 and grad.dtype == input.dtype == target.dtype
            and grad.device == input.device == target.device):
        return decomposition(grad, input, target, reduction, beta)
    dt, div = input.dtype, torch.ops.accel.div_rn
    opm = torch.float32 if dt in HALF and cpu else dt
    g, i, t = torch.broadcast_tensors(grad.to(opm), input.to(opm), target.to(opm))
    x = i - t
    n = x.new_full(x.shape, 1.0 / input.numel() if reduction == 1 else 1.0)
    b = x.new_full(x.shape, beta)
    if not cpu:
        return torch.where(x < -b, -n * g, torch.where(x > b, n * g, div(n * x * g, b)))
    if _cpu_vector_loop("contiguous", input, target, grad):  # (eager's grad_input)
        s = torch.where(x.abs() >= b, torch.where(x > 0, 1.0, -1.0).to(opm), x / b)
        return (n * s * g).to(dt)
    xw, bw = x.to(torch.float64), x.new_full(x.shape, beta, dtype=torch.float64)
    inside = div((n * x * g).to(torch.float64), bw).to(dt)
    return torch.where(xw <= -bw, (-n * g).to(dt), torch.where(xw >= bw, (n * g).to(dt), inside))


def _softplus(decomposition, a, beta=1, threshold=20):
    """``aten.softplus`` of a floating GPU tensor as eager's kernel (``softplus_kernel``,
    ``ActivationSoftplusKernel.cu``) computes it, in the op's math type (float32 for 16-bit
    floats): ``x * beta > threshold ? x : log1p(exp(x * beta)) / beta``, a true division
    (:func:`accel.library.div_rn`), where a GPU kernel of torch's decomposition takes the
    division by the number ``beta`` as a product with its reciprocal (32 % of float32
    results were an ulp from eager's on an H200). Elsewhere ``decomposition`` itself (the
    CPU's kernel divides as it does)."""
    if not (isinstance(a, torch.Tensor) and a.device.type == "cuda" and a.dtype in _FLOATING
            and not isinstance(beta, bool)):
        return decomposition(a, beta, threshold)
    opm = torch.float32 if a.dtype in HALF else a.dtype
    x = a.to(opm)
    xb = x * beta
    b, xb = torch.broadcast_tensors(x.new_full((), beta), xb)
    return torch.where(xb > threshold, x, torch.ops.accel.div_rn(torch.log1p(torch.exp(xb)), b)).to(a.dtype)


def _log_softmax(decomposition, x, dim, half_to_float):
    """``aten._log_softmax`` of a 16-bit CPU tensor over its last dim as eager's kernel
    computes it (``_vec_log_softmax_lastdim``, ATen's ``SoftMaxKernel.cpp``, which keeps a
    row's sum of exponentials and that sum's log in ``scalar_t``): in float32 ``x - max -
    log(sum)``, with the sum rounded to the dtype and its log rounded again, then the result
    rounded. torch._decomp's ``decomposition`` keeps both in float32 and rounds once, nearer
    float64 but 1-2 ulps from eager's in 10 % of bfloat16 and float16 results (a [64, 1027]
    input of standard deviation 2), which a backward's cancellation (``grad - exp(y) *
    sum(grad)``) carried outside ``assert_close``'s tolerance. Elsewhere (another dim, whose
    kernel rounds once; a GPU; float32 and float64; a 0-d or empty tensor) ``decomposition``
    itself. Returns a tensor of ``x``'s shape and dtype."""
    if not (_cpu_16_bit(x) and not half_to_float and x.dim() and x.numel()
            and dim % x.dim() == x.dim() - 1):
        return decomposition(x, dim, half_to_float)
    f = x.float()
    shifted = f - torch.amax(f, dim, keepdim=True)
    total = torch.sum(torch.exp(shifted), dim, keepdim=True).to(x.dtype).float()
    return (shifted - torch.log(total).to(x.dtype).float()).to(x.dtype)


def _softmax_backward_data(decomposition, grad_output, output, dim, input_dtype):
    """``aten._softmax_backward_data`` of 16-bit GPU tensors as eager's kernel computes it
    (``softmax_backward_cuda_out``, ATen's ``SoftMax.cu``): ``grad_output * output`` as an op
    of its own, rounded to the dtype, then in float32 ``product - output * sum(product)``,
    rounded once. torch._decomp's ``decomposition`` keeps the product in float32: 28 of
    131,456 bfloat16 gradients of a softmax over dim 0 of a [64, 1027] input were outside
    ``assert_close``'s tolerance (the subtraction's cancellation). Elsewhere (the CPU, whose
    kernel keeps the product in float32; float32, float64; a float32 ``grad_output`` of a
    float16 input) ``decomposition`` itself. Returns ``grad_input`` of ``output``'s shape,
    dtype ``input_dtype``."""
    if not (_gpu_16_bit(grad_output) and grad_output.dtype == input_dtype):
        return decomposition(grad_output, output, dim, input_dtype)
    product = (grad_output * output).float()
    out = output.float()
    return (product - out * torch.sum(product, dim, keepdim=True)).to(input_dtype).contiguous()


def _logsumexp(decomposition, a, dim, keepdim=False):
    """``aten.logsumexp`` of a 16-bit tensor as eager computes it: ATen's
    ``logsumexp_out_impl`` (``ReduceOps.cpp``, both devices) runs ``amax``, ``a - max``,
    ``exp``, ``sum``, ``log`` and the max's addition as ops of their own, each result
    rounded to the dtype (a max of +-inf added as 0). torch._decomp's ``decomposition``
    computes all of it in float32 and rounds once: 5-15 % of bfloat16 and float16 results
    were an ulp off eager's. Elsewhere (float32, float64, integers, an empty tensor)
    ``decomposition`` itself. ``dim``: an int or ints; returns ``a``'s dtype,
    reduced over ``dim``."""
    if not _16_bit(a) or not a.numel():
        return decomposition(a, dim, keepdim)
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    maxes = torch.amax(a, dims, keepdim=True)
    maxes = torch.masked_fill(maxes, maxes.abs() == float("inf"), 0)
    out = torch.sum(torch.exp(a - maxes), dims, keepdim)
    return out.log().add(maxes if keepdim else maxes.squeeze(dims))


def _native_layer_norm(decomposition, input, normalized_shape, weight, bias, eps):
    """``aten.native_layer_norm`` as torch._decomp's ``decomposition`` of it, except where a
    16-bit ``input`` (float16, bfloat16) on the CPU comes with float32 ``weight`` and
    ``bias`` (autocast's layer norm of a 16-bit activation, say): eager's mixed-dtype
    kernel (``layer_norm_cpu``, ``is_mixed_type``) returns the mean and rstd in float32 as
    computed, where the decomposition rounds them to the input's dtype on the CPU (and a
    backward from rounded statistics drifts from eager's). Returns ``(out, mean, rstd)``:
    ``out`` in the input's dtype, ``mean`` and ``rstd`` float32 of shape
    ``input.shape[:-len(normalized_shape)] + (1,) * len(normalized_shape)``."""
    params = [p for p in (weight, bias) if p is not None]
    if not (input.device.type == "cpu" and input.dtype in (torch.float16, torch.bfloat16) and params
            and all(p.dtype == torch.float32 for p in params)):
        return decomposition(input, normalized_shape, weight, bias, eps)
    x = input.float()
    dims = list(range(input.ndim - len(normalized_shape), input.ndim))
    var, mean = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(input.dtype), mean, rstd


def _native_group_norm(decomposition, input, weight, bias, N, C, HxW, group, eps):
    """``aten.native_group_norm`` as eager's CPU and CUDA kernels compute it (``x * (rstd *
    w) + (b - mean * rstd * w)``, weight and bias optional; ATen's ``group_norm_kernel.cpp``,
    ``group_norm_kernel.cu``), on ``input`` seen as ``[N, group, C / group, *spatial]``
    (dim 1 split), where torch._decomp's ``decomposition`` reshapes through
    ``as_strided`` (the per-channel scale) or merges the spatial dims into the group's (a
    4-d input): views that read a merged index, which the lowering cannot express (a
    division and a modulo of a loop index), so the region ran eagerly. Here the only
    merge left is the output's own (``[N, group, C / group, ...]`` back to ``input``'s
    shape), which the lowering stores as the split dims
    (:func:`accel.lowering._peel_views`). (A GPU's 16-bit group norm runs eagerly:
    ``accel.ops.RUNS_EAGERLY``.) Returns ``(out, mean, rstd)``, ``mean`` and ``rstd`` of
    shape ``[N, group]``, all three in ``input``'s dtype."""
    shape = tuple(input.shape)
    if (input.ndim < 2 or 0 in shape or C % group
            or shape[:2] != (N, C) or any(not isinstance(v, int) for v in shape)):
        return decomposition(input, weight, bias, N, C, HxW, group, eps)
    acc = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    split = (N, group, C // group) + shape[2:]
    x = input.to(acc).reshape(split)
    dims = list(range(2, x.ndim))
    var, mean = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = library.group_norm_affine(x, mean, rstd, weight, bias, group)
    return (out.to(input.dtype).reshape(shape), mean.to(input.dtype).squeeze(dims),
            rstd.to(input.dtype).squeeze(dims))


def _batch_norm(decomposition, input, *args):
    """A batch norm op (``native_batch_norm``, the ``_native_batch_norm_legit`` family) as
    torch._decomp's ``decomposition`` of it, except where a 16-bit ``input`` (float16,
    bfloat16) on the CPU comes with a float32 weight, bias or running statistic (a
    bfloat16 activation under autocast into a float32 ``BatchNorm2d``): eager's mixed-dtype
    kernel (``batch_norm_cpu``, ``is_mixed_type``) computes in float32 and returns the saved
    mean and inverse standard deviation in float32 as computed, where the decomposition
    rounds them to the input's dtype on the CPU (3e-3 relative in bfloat16, and the
    backward from them drifts from eager's). Then the decomposition runs on the input
    converted to float32 (exact) and only the normalized output is rounded to the input's
    dtype, once, as eager's kernel rounds it. Returns the decomposition's tuple."""
    if not (input.device.type == "cpu" and input.dtype in (torch.float16, torch.bfloat16)
            and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args)):
        return decomposition(input, *args)
    out = decomposition(input.float(), *args)
    return (out[0].to(input.dtype),) + tuple(out[1:])
