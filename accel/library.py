"""accel's own operators (``torch.ops.accel.*``): the targets of pattern replacements
(:mod:`accel.patterns`), and three ops the interceptor records in place of eager calls:
``nll_of_log_softmax`` and ``nll_loss_backward`` (:func:`accel.losses.nll_of_log_softmax`,
:func:`accel.losses.nll_loss_backward`), which :func:`accel.decompositions.decomposition_table`
decomposes through their references when a region is traced, and ``cat`` (eager's ``cat``
and ``stack``), which the lowering reads whole; and ``group_norm_apply`` and
``batch_norm_apply``, a normalization's output from its statistics, which
:mod:`accel.remat`'s recipes call in the backward (deferred like aten's ops, decomposed
through their references).

Each op has a reference implementation written with torch ops (``CompositeExplicitAutograd``:
any device; it defines the semantics the generated kernels must reproduce, and tests compare
against it) and a fake implementation (``torch.library.register_fake``), so that ``make_fx``
with ``tracing_mode="fake"`` records the op as one node instead of tracing into it. The
decomposition table has no entry for the pattern targets: they stay whole through
:func:`accel.graph.trace_region`. Ops with two results appear in a graph as the op node
(``meta["val"]`` a tuple of two tensors) followed by ``operator.getitem(node, 0)`` and
``operator.getitem(node, 1)``.

Output layout (fake and reference agree): reductions return new contiguous tensors of
shape ``[x.shape[d] for d not in dims]`` and ``x``'s dtype; pointwise ops return
``torch.empty_like(x)`` (``x``'s strides when ``x`` is dense, as eager's TensorIterator).
The pattern targets take floating tensors only.

The rewrites that produce these ops (search and replacement functions, examples) are
declared at the end, as data: :data:`REWRITES`, registered by :mod:`accel.patterns`.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

_LIB = torch.library.Library("accel", "FRAGMENT")  # kept alive: it owns the registrations


def _norm_dims(x: torch.Tensor, dims: Sequence[int]) -> List[int]:
    """``dims`` made non-negative and sorted.

    Raises:
        RuntimeError: ``dims`` is empty, repeats a dim or is out of range; ``x`` is not
            a real floating tensor.
    """
    if not x.is_floating_point():
        raise RuntimeError(f"accel reductions take floating tensors, got {x.dtype}")
    nd = max(x.dim(), 1)
    out = []
    for d in dims:
        if not -nd <= d < nd:
            raise RuntimeError(f"dim {d} out of range for a {x.dim()}-d tensor")
        out.append(d % nd)
    if not out or len(set(out)) != len(out):
        raise RuntimeError(f"dims must be non-empty and distinct, got {list(dims)}")
    return sorted(out)


def _reduced_shape(x: torch.Tensor, dims: Sequence[int]) -> List[int]:
    ds = set(_norm_dims(x, dims))
    return [s for d, s in enumerate(x.shape) if d not in ds]


def _keep_shape(x: torch.Tensor, dims: Sequence[int]) -> List[int]:
    ds = set(_norm_dims(x, dims))
    return [1 if d in ds else s for d, s in enumerate(x.shape)]


def _define(schema: str, fake, eager=None):
    """Define ``accel::<schema>`` with the decorated reference and ``fake``; its eager
    kernel is ``eager`` where given (one of eager's own ops computing the same values),
    else the reference."""
    name = schema.split("(")[0]

    def deco(ref):
        _LIB.define(schema)
        _LIB.impl(name, eager or ref, "CompositeExplicitAutograd")
        torch.library.register_fake(f"accel::{name}", fake, lib=_LIB)
        return ref

    return deco


def _fake_stats(x, dims, *rest):
    shape = _reduced_shape(x, dims)
    return x.new_empty(shape), x.new_empty(shape)


def _fake_pointwise(x):
    if not x.is_floating_point():
        raise RuntimeError(f"accel pointwise ops take floating tensors, got {x.dtype}")
    return torch.empty_like(x)


@_define("online_softmax(Tensor x, int[] dims) -> (Tensor amax, Tensor sumexp)", _fake_stats)
def online_softmax(x: torch.Tensor, dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax statistics over ``dims``: ``amax = x.amax(dims)`` and
    ``sumexp = exp(x - amax).sum(dims)`` (``amax`` broadcast back over ``dims``).

    Shapes/dtypes: ``x`` floating, any shape; both results have ``x``'s dtype and shape
    ``[x.shape[d] for d not in dims]`` (keepdim False), contiguous.

    Algorithm: this reference is the two-pass formula. Generated kernels compute both in
    one pass (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
    arXiv:1805.02867): running ``m = -inf``, ``s = 0``; for each ``v``, ``m' = max(m, v)``,
    ``s = s * exp(m - m') + exp(v - m')``; partial results ``(m, s)`` merge the same way.

    Special values: kernels must give this reference's results wherever ``amax > -inf``.
    ``-inf`` elements contribute 0: a kernel must take ``exp(m - m')`` and ``exp(v - m')``
    as 0 when ``m``, resp. ``v``, is ``-inf`` (unguarded, ``exp(-inf - -inf)`` is NaN and
    a row ``[-inf, 1]`` would not give ``amax = 1, sumexp = 1``). NaN propagates to both
    results; ``+inf`` gives ``sumexp = NaN``. For a row of only ``-inf`` the reference
    gives ``sumexp = NaN``, a guarded kernel 0: softmax and log_softmax of that row are
    NaN either way, as in eager.

    Raises:
        RuntimeError: ``x`` not floating; ``dims`` empty, repeated or out of range.
    """
    keep = _keep_shape(x, dims)
    amax = torch.amax(x, _norm_dims(x, dims))
    sumexp = torch.exp(x - amax.reshape(keep)).sum(_norm_dims(x, dims))
    return amax, sumexp


@_define("var_mean(Tensor x, int[] dims, float correction) -> (Tensor var, Tensor mean)",
         _fake_stats)
def var_mean(x: torch.Tensor, dims: List[int],
             correction: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Variance and mean over ``dims``, as ``torch.var_mean(x, dims,
    correction=correction, keepdim=False)``: ``var = sum((x - mean)**2) / (N - correction)``
    with ``N`` the number of reduced elements (``N - correction <= 0`` gives inf/NaN as
    in eager).

    Shapes/dtypes: ``x`` real floating; both results have ``x``'s dtype and shape
    ``[x.shape[d] for d not in dims]``, contiguous.

    Algorithm: generated kernels use one pass of Welford's update (B. P. Welford 1962,
    "Note on a method for calculating corrected sums of squares and products",
    Technometrics 4(3)): ``n += 1; d = v - mean; mean += d / n; m2 += d * (v - mean)``,
    partial results merged as Chan, Golub & LeVeque 1979 ("Updating formulae and a
    pairwise algorithm for computing sample variances"); ``var = m2 / (N - correction)``.

    Raises:
        RuntimeError: ``x`` not floating; ``dims`` empty, repeated or out of range.
    """
    return torch.var_mean(x, _norm_dims(x, dims), correction=correction, keepdim=False)


@_define("silu(Tensor x) -> Tensor", _fake_pointwise)
def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed as eager's silu: ``x / (1 + exp(-x))`` (ATen
    ``aten/src/ATen/native/cpu/Activation.cpp``). Same shape and dtype as ``x``
    (floating)."""
    return torch.nn.functional.silu(x)


@_define("gelu_tanh(Tensor x) -> Tensor", _fake_pointwise)
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Eager's ``gelu(x, approximate="tanh")``:
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` (Hendrycks & Gimpel 2016,
    "Gaussian Error Linear Units", arXiv:1606.08415). Same shape and dtype as ``x``
    (floating)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


@_define("vec_erf(Tensor x) -> Tensor", _fake_pointwise)
def vec_erf(x: torch.Tensor) -> torch.Tensor:
    """``erf`` as ATen's vectorized CPU code computes it for float32: ``Vectorized<float>::erf``
    (``aten/src/ATen/cpu/vec/vec512/vec512_float.h``, the same in ``vec256``), which
    eager's CPU GELU uses in its vectorized loop (``aten/src/ATen/native/cpu/Gelu.h``: float16,
    and float32 where oneDNN does not run and TensorIterator vectorizes, a transposed input;
    its scalar loop, an input strided along its innermost dimension, calls glibc's ``erff``)
    and torch.compile's CPU code uses for every float32 erf. Abramowitz & Stegun 7.1.26: ``t = 1 / (1 + p|x|)``, ``erf(x) = sign(x) (1 - t P(t)
    exp(-x^2))``, P of degree 4, absolute error below 1.5e-7 in exact arithmetic, 3.6e-7 in
    float32 (``torch.erf`` itself is more accurate). Generated CPU kernels repeat ATen's
    operations and roundings (its FMAs included); this reference rounds the FMAs in two
    steps, so it may differ from them in the last bits. Same shape and dtype as ``x`` (floating); float64 is ``torch.erf``.
    Only :func:`accel.decompositions.decomposition_table` emits it (GELU's erf, on the CPU)."""
    if x.dtype == torch.float64:
        return torch.erf(x)
    ax = x.abs()
    t = 1 / (0.3275911 * ax + 1)
    r = (((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592
    y = 1 - t * r * torch.exp(-(x * x))
    return torch.where(torch.signbit(x), -y, y)  # ATen flips y's sign bit by x's


@_define("log_libm(Tensor x) -> Tensor", _fake_pointwise)
def log_libm(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` as the C library computes it one value at a time (glibc's scalar ``logf``
    for float32: ``std::log``, which eager's CPU ``xlogy_kernel`` calls in its scalar loop),
    not as a vector math library does (libmvec's ``logf`` may differ from it in the last
    bit). Generated CPU kernels call the scalar function, so a loop taking it stays scalar.
    Same shape and dtype as ``x`` (floating). Only :func:`accel.decompositions._xlogy` emits
    it (16-bit CPU ``xlogy``, whose log is rounded to 16 bits before its product: a last-bit
    difference there moved 4 of 16384 float16 results outside ``assert_close``)."""
    return torch.log(x)


def _fake_fma(a, b, c):
    if not (a.is_floating_point() and a.shape == b.shape == c.shape and a.dtype == b.dtype == c.dtype):
        raise RuntimeError("accel.fma takes three floating tensors of one shape and dtype")
    return torch.empty_like(a)


@_define("fma(Tensor a, Tensor b, Tensor c) -> Tensor", _fake_fma)
def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once (C's ``fma``), elementwise: three floating tensors of one
    shape and dtype. ATen's vectorized CPU ``lerp`` computes with it (``lerp_vec``:
    ``fmadd(coeff, end - start, base)``; its scalar loop's contracted ``a + w * d`` too), and
    generated CPU kernels call ``fma``; this reference computes in float64 for float32 and
    16-bit inputs (a product of two float32 values is exact there; the sum is rounded twice,
    which may differ from one rounding in the last bit) and in two roundings for float64.
    Only :func:`accel.decompositions.decomposition_table` emits it (``lerp`` on the CPU; ``addcmul``;
    ``add``, ``sub`` and ``rsub`` with an ``alpha``)."""
    if a.dtype == torch.float64:
        return a * b + c
    return (a.double() * b.double() + c.double()).to(a.dtype)


def _fake_binary(name: str):
    """The fake (meta) function of an elementwise accel op of two floating tensors of one
    shape and dtype (:func:`mul_rn`, :func:`div_rn`); RuntimeError for other operands."""
    def fake(a, b):
        if not (a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype):
            raise RuntimeError(f"accel.{name} takes two floating tensors of one shape and dtype")
        return torch.empty_like(a)
    return fake


@_define("mul_rn(Tensor a, Tensor b) -> Tensor", _fake_binary("mul_rn"))
def mul_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` rounded on its own, elementwise: two floating tensors of one shape and
    dtype. A generated GPU kernel never contracts it with a sum that reads it into a fused
    multiply-add (CUDA's ``__fmul_rn``), as nvcc does a plain product; CPU kernels contract
    nothing (``-ffp-contract=off``). :func:`accel.decompositions._pointwise_op` emits it (a
    GPU's ``addcmul``: eager rounds ``tensor1 * tensor2`` first), and
    :func:`accel.passes.round_products_across_kernels` makes it of a product that another
    eager kernel adds."""
    return a * b


@_define("div_rn(Tensor a, Tensor b) -> Tensor", _fake_binary("div_rn"))
def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b``, a true division correctly rounded, elementwise: two floating tensors of
    one shape and dtype. Generated kernels never turn it into a product with ``b``'s
    reciprocal, as a GPU kernel does a division by a number (eager's
    ``div_true_kernel_cuda``; :func:`accel.codegen.scopes.reciprocal_divisor`): CUDA's
    ``__fdiv_rn``, the CPU's ``/``. :mod:`accel.decompositions` emits it where eager's kernel
    divides by a number or a value it computed from one: ``round(x, decimals)`` (by ``10 **
    decimals``, both devices), and on a GPU ``softplus``, ``smooth_l1_loss`` and its
    backward (by ``beta``) and ``addcdiv``."""
    return a / b


@_define("div_floor(Tensor a, Tensor b) -> Tensor", _fake_binary("div_floor"))
def div_floor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` divided by ``b`` rounded toward negative infinity (``torch.div(a, b,
    rounding_mode="floor")``), elementwise: two float32 or float64 tensors of one shape and
    dtype; the bits of c10's ``div_floor_floating`` (eager's kernels), ``a / b`` where ``b``
    is 0. Generated CPU kernels take one division where ``|a / b|`` is small and c10's formula
    (an fmod and two divisions) elsewhere (``include/accel/vector_fmod.h``). Only
    :func:`accel.decompositions._div_floor` emits it (float32 and float64 on the CPU)."""
    return torch.div(a, b, rounding_mode="floor")


def _fake_nll_of_log_softmax(x, rows, target, reduction, ignore_index):
    n = x.shape[0] if x.dim() == 2 else -1
    if not (x.is_floating_point() and tuple(rows.shape) == tuple(target.shape) == (n,)):
        raise RuntimeError("accel.nll_of_log_softmax takes a floating x [N, C] and rows and target [N]")
    return x.new_empty((n,) if reduction == 0 else ()), x.new_empty(())


def _eager_nll_of_log_softmax(x, rows, target, reduction, ignore_index):
    # eager's two kernels (its results, bit for bit), where a region of the op runs eagerly:
    # the reference runs a dozen
    logp = torch.ops.aten._log_softmax.default(x, 1, False)
    loss, total = torch.ops.aten.nll_loss_forward.default(logp, target, None, reduction, ignore_index)
    if reduction == 0:  # (eager's total weight is 0 there; the op's, the count of kept rows)
        total = (target != ignore_index).sum(dtype=x.dtype)
    return loss, total


@_define("nll_of_log_softmax(Tensor x, Tensor rows, Tensor target, int reduction, int ignore_index)"
         " -> (Tensor loss, Tensor total_weight)", _fake_nll_of_log_softmax, _eager_nll_of_log_softmax)
def nll_of_log_softmax(x: torch.Tensor, rows: torch.Tensor, target: torch.Tensor, reduction: int,
                       ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``nll_loss_forward(log_softmax(x, 1), target, None, reduction, ignore_index)`` given
    ``rows = nll_loss_forward(x, target, None, 0, ignore_index)[0]`` (each row's
    ``-x[i, target[i]]``, 0 where ``target[i]`` is ``ignore_index``), without the [N, C]
    log-softmax: a row's loss is ``(max_i - x[i, t]) + log(sum_j exp(x[i, j] - max_i))``,
    its terms added as eager's ``(x - max) - log(sum)`` subtracts them (no cancellation
    beyond eager's own), 0 where the target is ignored. Only the interceptor records it
    (:func:`accel.losses.nll_of_log_softmax`); traced, it decomposes into this
    reference's aten calls (:func:`accel.decompositions.decomposition_table`), whose row max and sum of
    exponentials the ``log_softmax_stats`` pattern makes one online-softmax reduction.

    Shapes/dtypes: ``x`` [N, C] floating, ``rows`` [N] of its dtype, ``target`` [N] int64;
    ``reduction`` 0 (none), 1 (mean) or 2 (sum). Returns ``(loss, total_weight)`` in ``x``'s
    dtype: ``loss`` [N] for reduction 0, else a scalar (mean: the sum over kept rows divided
    by their count, NaN where none is kept, as eager); ``total_weight`` the count of targets
    other than ``ignore_index`` (eager's ``total_weight`` for reductions 1 and 2; eager's is 0
    for reduction 0).

    Raises:
        RuntimeError: the shapes or dtypes above do not hold.
    """
    n = x.shape[0]
    amax = torch.amax(x, [1], True)
    sumexp = torch.sum(torch.exp(x - amax), [1], True)
    kept = target.view(n, 1) != ignore_index
    row = torch.where(kept, (amax + rows.view(n, 1)) + torch.log(sumexp), x.new_zeros(()))
    total = torch.sum(kept, dtype=x.dtype)
    if reduction == 0:
        return torch.sum(row, [1]), total
    out = torch.sum(row)
    return (out / total if reduction == 1 else out), total


def _fake_nll_loss_backward(grad_output, target, total_weight, classes, reduction, ignore_index):
    if not (grad_output.is_floating_point() and target.dim() == 1 and classes > 0):
        raise RuntimeError("accel.nll_loss_backward takes a floating grad_output and a target [N]")
    return grad_output.new_empty((target.shape[0], classes))


def _eager_nll_loss_backward(grad_output, target, total_weight, classes, reduction, ignore_index):
    # eager's own kernel, whose ``self`` gives only the result's shape and dtype: one kernel,
    # already loaded (the reference's half dozen run where a region of it runs eagerly:
    # on a GPU, their first calls in a process loaded 58 ms of kernels on the H200)
    shape = grad_output.new_empty(()).expand(target.shape[0], classes)
    return torch.ops.aten.nll_loss_backward.default(grad_output, shape, target, None, reduction,
                                                    ignore_index, total_weight)


@_define("nll_loss_backward(Tensor grad_output, Tensor target, Tensor total_weight, int classes,"
         " int reduction, int ignore_index) -> Tensor", _fake_nll_loss_backward, _eager_nll_loss_backward)
def nll_loss_backward(grad_output: torch.Tensor, target: torch.Tensor, total_weight: torch.Tensor,
                      classes: int, reduction: int, ignore_index: int) -> torch.Tensor:
    """Eager's ``nll_loss_backward(grad_output, self, target, None, reduction, ignore_index,
    total_weight)`` for a ``self`` of [N, classes] and no class weight, written without
    a scatter: element ``[i, j]`` is ``-(grad_output / total_weight)`` (mean), or
    ``-grad_output`` (sum; ``-grad_output[i]`` for reduction none) where ``j == target[i]``
    and ``target[i] != ignore_index``, else 0 (ATen's ``nll_loss_backward_out_frame``, which
    zeroes its result and writes those elements). Only the interceptor records it, in
    ``NllLossBackward0`` (:func:`accel.losses.nll_loss_backward`), where eager's forward
    has checked every target; traced, it decomposes into this reference's calls (a column
    index compared with each row's target), so a log-softmax backward reading it fuses with
    it and the [N, classes] gradient is not written.

    Shapes/dtypes: ``grad_output`` floating, [N] for reduction 0 (none), else one element;
    ``target`` [N] int64; ``total_weight`` one element of ``grad_output``'s dtype;
    ``reduction`` 0, 1 (mean) or 2 (sum). Returns [N, classes] in ``grad_output``'s dtype,
    contiguous.

    Raises:
        RuntimeError: the shapes or dtypes above do not hold.
    """
    n = target.shape[0]
    g = grad_output.reshape(n, 1) if reduction == 0 else grad_output.reshape(1, 1)
    if reduction == 1:
        g = g / total_weight.reshape(1, 1)
    hit = (torch.arange(classes, device=target.device).reshape(1, classes) == target.reshape(n, 1)) & (
        target.reshape(n, 1) != ignore_index)
    return torch.where(hit, -g, grad_output.new_zeros(()))


def group_norm_affine(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight, bias,
                      group: int) -> torch.Tensor:
    """A group norm's output from its statistics, as eager's CPU and CUDA kernels compute it
    (``x * (rstd * w) + (b - mean * rstd * w)``: ATen's ``group_norm_kernel.cpp``,
    ``group_norm_kernel.cu`` fold the statistics and the affine parameters into a per-channel
    scale and shift), on ``x`` already split as ``[N, group, C / group, *spatial]`` in the
    computing dtype; ``mean`` and ``rstd`` of shape ``[N, group, 1, ...]`` (``x``'s rank),
    ``weight`` and ``bias`` of shape ``[C]`` or None. Returns ``x``'s split shape and dtype.
    (:func:`accel.decompositions._native_group_norm` and :func:`group_norm_apply`.)"""
    param = (1, group, x.shape[2]) + (1,) * (x.ndim - 3)
    w = rstd * weight.reshape(param) if weight is not None else rstd
    b = -mean * w
    if bias is not None:
        b = b + bias.reshape(param)
    return x * w + b


def _fake_like_input(input, *_rest):
    return torch.empty_like(input)


@_define("group_norm_apply(Tensor input, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias,"
         " int group) -> Tensor", _fake_like_input)
def group_norm_apply(input, mean, rstd, weight, bias, group: int) -> torch.Tensor:
    """``native_group_norm(input, weight, bias, N, C, HxW, group, eps)[0]`` given that call's
    other results, ``mean`` and ``rstd``: the normalization without its reductions, which a
    backward's region recomputes from the saved input and statistics in place of the output
    the forward would have written (:mod:`accel.remat`). Elementwise over ``input`` given
    the per-group statistics; traced, it decomposes through this reference.

    Shapes/dtypes: ``input`` ``[N, C, *spatial]`` floating, ``C`` a multiple of ``group``;
    ``mean``, ``rstd`` ``[N, group]``; ``weight``, ``bias`` ``[C]`` or None; the result
    ``input``'s shape and dtype (16-bit inputs computed in float32, as eager's kernels).
    """
    shape = tuple(input.shape)
    n, c = shape[:2]
    acc = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    # the spatial dims as one, as the backward's decomposition reads them (a merge of dims
    # computed in the region, its digits read by a reduction's loop, is not lowered)
    x = input.to(acc).reshape(n, group, c // group, -1)
    stat = (n, group, 1, 1)
    out = group_norm_affine(x, mean.to(acc).reshape(stat), rstd.to(acc).reshape(stat), weight, bias, group)
    return out.to(input.dtype).reshape(shape)


@_define("batch_norm_apply(Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias)"
         " -> Tensor", _fake_like_input)
def batch_norm_apply(input, mean, invstd, weight, bias) -> torch.Tensor:
    """A training batch norm's output (``native_batch_norm(input, weight, bias, running_mean,
    running_var, True, momentum, eps)[0]``) given that call's saved mean and inverse standard
    deviation: ``(input - mean) * invstd * weight + bias`` per channel, as torch._decomp's
    ``native_batch_norm`` (accel's forward) computes it; rebuilt in a backward's region
    by :mod:`accel.remat`, like :func:`group_norm_apply`.

    Shapes/dtypes: ``input`` ``[N, C, *spatial]`` floating; ``mean``, ``invstd``,
    ``weight``, ``bias`` ``[C]`` (the last two may be None); the result ``input``'s shape and
    dtype (16-bit inputs computed in float32).
    """
    param = (1, input.shape[1]) + (1,) * (input.dim() - 2)
    acc = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    out = (input.to(acc) - mean.to(acc).reshape(param)) * invstd.to(acc).reshape(param)
    if weight is not None:
        out = out * weight.reshape(param)
    if bias is not None:
        out = out + bias.reshape(param)
    return out.to(input.dtype)


#: the most tensors ``accel.cat`` takes (a longer ``torch.cat`` runs eagerly)
CAT_MAX = 8


def cat_args(tensors, dim: int) -> tuple:
    """``accel.cat``'s arguments for ``torch.cat(tensors, dim)`` (2 to :data:`CAT_MAX`
    tensors): the tensors, None for the slots left, ``dim``."""
    return (*tensors, *[None] * (CAT_MAX - len(tensors)), dim)


def cat_call(stack: bool, args, kwargs):
    """``accel.cat``'s arguments for a call of eager's ``cat`` (``stack``: of ``stack``)
    with ``args`` / ``kwargs``, or None where the op does not take it: 2 to
    :data:`CAT_MAX` tensors of one rank and of the same sizes but along ``dim``, none
    empty (for ``stack``, the same shape, each unsqueezed at ``dim``: views, which a region
    reads through where they view pending outputs); no ``out=`` tensor."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if (set(kwargs) - {"tensors", "dim"} or not isinstance(tensors, (list, tuple))
            or not 2 <= len(tensors) <= CAT_MAX or type(dim) is not int
            or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors)):
        return None
    shape, nd = tensors[0].shape, tensors[0].dim()
    if stack:
        if not -nd - 1 <= dim <= nd or any(t.shape != shape for t in tensors):
            return None
        dim %= nd + 1
        tensors = [t.unsqueeze(dim) for t in tensors]
        shape, nd = tensors[0].shape, nd + 1
    if nd == 0 or not -nd <= dim < nd:
        return None
    dim %= nd
    if any(t.dim() != nd or t.shape[dim] == 0 or t.shape[:dim] != shape[:dim]
           or t.shape[dim + 1:] != shape[dim + 1:] for t in tensors):
        return None
    return cat_args(tensors, dim)


def _cat_parts(tensors) -> List[torch.Tensor]:
    return [t for t in tensors if t is not None]


def _fake_cat(*args):
    *tensors, dim = args
    return torch.cat(_cat_parts(tensors), dim)


@_define("cat(Tensor t0, Tensor t1, Tensor? t2, Tensor? t3, Tensor? t4, Tensor? t5, Tensor? t6,"
         " Tensor? t7, int dim) -> Tensor", _fake_cat)
def cat(t0, t1, t2, t3, t4, t5, t6, t7, dim: int) -> torch.Tensor:
    """``torch.cat`` of two to :data:`CAT_MAX` tensors (``t0``, ``t1``, then those of
    ``t2``-``t7`` not None), in one op with a tensor per argument: the interceptor records
    eager's ``cat`` and ``stack`` calls as this op (:func:`cat_call`), which a
    region keys like any other (a list of tensors is not an argument it records); traced,
    it stays one node, which the lowering reads piece by piece (each of the result's
    elements is one of an input's: :class:`accel.lower_expr.ConcatSpans`).

    Shapes/dtypes: as ``torch.cat`` (the tensors of one rank, the same sizes but along
    ``dim``; the result in their promoted dtype, laid out as eager's ``cat``).

    Raises:
        RuntimeError: as ``torch.cat``.
    """
    return torch.cat(_cat_parts((t0, t1, t2, t3, t4, t5, t6, t7)), dim)


# -- the rewrites that produce these ops (registered by accel.patterns) ----------------------
aten = torch.ops.aten
_SQRT_2_OVER_PI = 0.7978845608028654  # math.sqrt(2 / math.pi), as HF's NewGELUActivation


def _keepdim(t: torch.Tensor, x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """A reduction result of ``x`` over ``dims`` with the reduced dims back as size 1."""
    for d in _norm_dims(x, dims):
        t = t.unsqueeze(d)
    return t


def softmax_search(x, *, dims):
    return aten._softmax.default(x, dims[0], False)


def softmax_replace(x, *, dims):
    amax, sumexp = torch.ops.accel.online_softmax(x, dims)
    return torch.exp(x - _keepdim(amax, x, dims)) / _keepdim(sumexp, x, dims)


def log_softmax_search(x, *, dims):
    return aten._log_softmax.default(x, dims[0], False)


def log_softmax_replace(x, *, dims):
    amax, sumexp = torch.ops.accel.online_softmax(x, dims)
    return (x - _keepdim(amax, x, dims)) - _keepdim(torch.log(sumexp), x, dims)


def softmax_stats_search(x, *, dims):
    amax = aten.amax.default(x, dims, True)
    return amax, aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(x, amax)), dims, True)


def softmax_stats_replace(x, *, dims):
    amax, sumexp = torch.ops.accel.online_softmax(x, dims)
    return _keepdim(amax, x, dims), _keepdim(sumexp, x, dims)


def log_softmax_stats_search(x, *, dims):
    amax = aten.amax.default(x, dims, True)
    shifted = aten.sub.Tensor(x, amax)
    sumexp = aten.sum.dim_IntList(aten.exp.default(shifted), dims, True)
    log_sumexp = aten.log.default(sumexp)
    return amax, sumexp, log_sumexp, aten.sub.Tensor(shifted, log_sumexp)


def log_softmax_stats_replace(x, *, dims):
    amax, sumexp = softmax_stats_replace(x, dims=dims)
    log_sumexp = torch.log(sumexp)
    return amax, sumexp, log_sumexp, (x - amax) - log_sumexp


def var_mean_keepdim_search(x, *, dims, correction):
    return torch.var_mean(x, dims, correction=correction, keepdim=True)


def var_mean_keepdim_replace(x, *, dims, correction):
    var, mean = torch.ops.accel.var_mean(x, dims, correction)
    return _keepdim(var, x, dims), _keepdim(mean, x, dims)


def var_mean_search(x, *, dims, correction):
    return torch.var_mean(x, dims, correction=correction, keepdim=False)


def var_mean_replace(x, *, dims, correction):
    return torch.ops.accel.var_mean(x, dims, correction)


def rms_norm_search(x, eps, *, dims):
    return x * torch.rsqrt(torch.mean(x * x, dims, keepdim=True) + eps)


def rms_norm_replace(x, eps, *, dims):
    """RMS norm's mean of squares is already one pass (one ``prims.sum`` of ``x * x``) and
    stays. Not ``accel::var_mean``: Welford gives the variance about the mean, RMS needs
    ``E[x^2]``; ``var + mean^2`` would cost a second accumulator and a division per element
    and round differently, for nothing (a sum of squares does not cancel). The rewrite moves
    the row epilogue (``/ N`` as eager's mean, ``+ eps``, ``rsqrt``) onto the reduced tensor
    and broadcasts once; the values are bitwise those of the original graph."""
    return x * _keepdim(torch.rsqrt(torch.mean(x * x, dims) + eps), x, dims)


def silu_search(x):
    return x * torch.sigmoid(x)


def silu_commuted_search(x):
    return torch.sigmoid(x) * x


def silu_replace(x):
    return torch.ops.accel.silu(x)


def gelu_tanh_search(x):
    return 0.5 * x * (1 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_replace(x):
    return torch.ops.accel.gelu_tanh(x)


_R3, _R4 = ((2, 3, 5),), ((3, 4, 6, 7),)  # two example ranks/sizes: shape literals differ
#: (name, search, replace, examples, n_scalars) of each rewrite, in the order tried; see
#: :class:`accel.patterns.Replacement`.
REWRITES = (
    ("softmax", softmax_search, softmax_replace, ((_R3, {"dims": [1]}), (_R4, {"dims": [3]})), 0),
    ("log_softmax", log_softmax_search, log_softmax_replace,
     ((_R3, {"dims": [1]}), (_R4, {"dims": [3]})), 0),
    ("log_softmax_stats", log_softmax_stats_search, log_softmax_stats_replace,
     ((_R3, {"dims": [1]}), (_R4, {"dims": [3]})), 0),
    ("softmax_stats", softmax_stats_search, softmax_stats_replace,
     ((_R3, {"dims": [1]}), (_R4, {"dims": [3]})), 0),
    ("var_mean_keepdim", var_mean_keepdim_search, var_mean_keepdim_replace,
     ((_R3, {"dims": [1], "correction": 0.0}), (_R4, {"dims": [2, 3], "correction": 1.0})), 0),
    ("var_mean", var_mean_search, var_mean_replace,
     ((_R3, {"dims": [1], "correction": 0.0}), (_R4, {"dims": [2, 3], "correction": 1.0})), 0),
    ("rms_norm", rms_norm_search, rms_norm_replace,
     ((_R3, {"dims": [2]}), (_R4, {"dims": [1]})), 1),
    ("silu", silu_search, silu_replace, ((_R3, {}), (_R4, {})), 0),
    ("silu_commuted", silu_commuted_search, silu_replace, ((_R3, {}), (_R4, {})), 0),
    ("gelu_tanh", gelu_tanh_search, gelu_tanh_replace, ((_R3, {}), (_R4, {})), 0),
)
