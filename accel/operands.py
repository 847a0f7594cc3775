"""The conversions eager's kernels apply to a call's operands before they compute, for
tracing (:mod:`accel.graph`): a number beside a 16-bit tensor rounded to its dtype, an
integer tensor or a 0-dim tensor of another dtype converted to the 16-bit one
(:func:`eager_operands`); and whether eager's CPU loop over operands runs vectorized
(:func:`_cpu_vector_loop`), which decides where some kernels round an intermediate.
Each names the ATen code it follows and what differed without it, measured.
"""
from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes, make_contiguous_strides_for

from .ops import HALF, ROUNDED_NUMBERS

NO_OPMATH = ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH


def _number_rounded(func, name: str):
    """``func`` (op ``name`` of ``ops.ROUNDED_NUMBERS``, ``mul``, ``div``, its integer
    operands converted: :func:`_operands_converted`) as eager's kernel computes it where
    its two operands' common dtype is float16 or bfloat16: TensorIterator converts a
    number operand (a Python number, a CPU 0-dim tensor) to that dtype first, except where a
    kernel reads a CPU scalar in float32 (``ops.ROUNDED_NUMBERS`` lists, per device type, the
    ops that round a Python number; a GPU's 0-dim tensors: :func:`_operands_converted`).
    On the CPU ``add``'s, ``sub``'s and ``rsub``'s kernels round ``alpha`` too and compute
    ``self + other * alpha`` in float32, rounded once, in their vectorized loop
    (``vec::fmadd``), and with ``other * alpha`` rounded to the dtype first in their scalar loop
    (a 16-bit product), which eager runs where :func:`_cpu_vector_loop` says it does (2-8 % of
    results of ``a[::2].add(b[::2], alpha=0.7)`` were outside ``assert_close``'s tolerance in
    float32). torch's decompositions keep numbers in float32. Elsewhere ``func`` itself."""
    inplace, name = name.endswith("_"), name.rstrip("_")

    def call(*args, **kwargs):
        a, b = args[:2]
        tensors = [t for t in (a, b) if isinstance(t, torch.Tensor)]
        dtype = torch.result_type(a, b) if tensors else None
        if dtype not in HALF:
            return func(*args, **kwargs)
        dev = tensors[0].device.type
        numbers = name in ROUNDED_NUMBERS.get(dev, ())  # Python numbers (and CPU 0-dim tensors)
        zero_dim = numbers and dev == "cpu"
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        round_alpha = dev == "cpu" and numbers and alpha != 1
        if not (round_alpha or any(t.dim() == 0 and zero_dim if isinstance(t, torch.Tensor) else numbers
                                   for t in (a, b))):
            return func(*args, **kwargs)
        a, b = (t.to(dtype) if isinstance(t, torch.Tensor) and (t.dim() or zero_dim)
                else torch.scalar_tensor(t, dtype=dtype) if not isinstance(t, torch.Tensor) and numbers
                else t for t in (a, b))
        kwargs = dict(kwargs)
        kwargs.pop("alpha", None)
        into = args[0] if inplace else kwargs.pop("out", None)
        if alpha == 1:
            out = getattr(torch.ops.aten, name)(a, b, **kwargs)
        elif not round_alpha:
            out = getattr(torch.ops.aten, name)(a, b, alpha=alpha, **kwargs)
        else:
            alpha = torch.scalar_tensor(alpha, dtype=dtype).float()
            x, y = (a.float(), b.float()) if name != "rsub" else (b.float(), a.float())
            prod = y * alpha
            if not _cpu_vector_loop(into, a, b):  # (the scalar loop's 16-bit arithmetic)
                prod = prod.to(dtype).float()
            out = (x - prod if name != "add" else x + prod).to(dtype)
        return out if into is None else into.copy_(out)

    return call


def _cpu_vector_loop(out, *operands) -> bool:
    """Whether eager's CPU elementwise loop over ``operands`` (tensors and numbers; ``out``
    the result tensor written in place, ``"contiguous"`` for a new contiguous one (a kernel
    writing into ``zeros_like(input, contiguous_format)``), or None for a new one laid out as
    TensorIterator allocates it) runs its kernel's vectorized
    form, as ATen's ``cpu_kernel_vec`` decides: TensorIterator orders the dimensions by the
    operands' strides (``reorder_dimensions``: ``out`` first, broadcast dimensions skipped,
    ties to the smaller size), merges the ones it can (``coalesce_dimensions``), and then
    runs the vectorized loop where the innermost dimension is contiguous in every operand,
    or broadcast in one input and contiguous in the rest, and at least two vectors long
    (shorter rows run the scalar loop: ``vectorized_loop``'s remainder). Elements past the
    last whole pair of vectors of a row (and of a thread's chunk) run the scalar loop too;
    this answers for the bulk of them."""
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    shape = list(torch.broadcast_shapes(*(t.shape for t in tensors)))
    nd = len(shape)

    def strides(t):  # per dimension of ``shape``, in bytes; 0 where broadcast
        pad = nd - t.dim()
        return [0 if i < pad or (t.shape[i - pad] == 1 and shape[i] != 1)
                else t.stride(i - pad) * t.element_size() for i in range(nd)]

    ops, sizes = [strides(t) for t in tensors], [t.element_size() for t in tensors]
    if isinstance(out, torch.Tensor):
        ops, sizes = [strides(out)] + ops, [out.element_size()] + sizes
    elif out == "contiguous":  # (of the operands' dtype)
        ops = [[s * sizes[0] for s in make_contiguous_strides_for(shape)]] + ops
        sizes = sizes[:1] + sizes

    def should_swap(d0, d1):
        for st in ops:
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(range(nd))[::-1]  # innermost first
    for i in range(1, nd):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    size, inner = 1, None  # the merged innermost dimension's length and strides
    for d in perm:
        if shape[d] == 1:
            continue
        if inner is None:
            inner, size = [st[d] for st in ops], shape[d]
        elif all(st[d] == i * size for st, i in zip(ops, inner)):
            size *= shape[d]
        else:
            break
    vec = (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32) // 2
    if inner is None or size < 2 * vec:
        return False
    given = len(ops) - len(tensors)  # 1 where ``out`` is (a new result is allocated contiguous)
    contiguous = [st == e for st, e in zip(inner, sizes)]
    return all(contiguous) or any(inner[k] == 0 and all(c for j, c in enumerate(contiguous) if j != k)
                                  for k in range(given, len(ops)))


_WRAPPED = frozenset().union(*ROUNDED_NUMBERS.values(), ("mul", "div"))


def _operands_converted(func, name: str = ""):
    """A pointwise ``func`` (op ``name``) as eager computes it where its tensors' common
    dtype is float16 or bfloat16: TensorIterator converts every operand to that dtype first
    (in bfloat16 an integer above 256 rounds, ``xlogy(257, x)`` is ``xlogy(256, x)``), the
    decompositions to float32. Converted: integer tensors, and 0-dim tensors of another
    dtype (a float32 or float16 one beside a bfloat16 tensor: in ``hypot``, ``xlogy``,
    ``addcmul`` and ``addcdiv`` 2-25 % of results were off, up to 15 % of the value for
    ``addcmul``): on the CPU all but a 0-dim second operand of ``mul`` and ``div``, which
    their CPU kernels read unconverted in float32 (``original_scalar_value``); beside GPU
    tensors the 0-dim GPU ones, which the GPU kernels load like any operand and cast to their
    arguments' dtype (``gpu_kernel``'s dynamic casting), where they read a 0-dim CPU tensor
    in float32 (``opmath_gpu_kernel_with_scalars``' ``scalar_value``)."""
    original = 1 if name.rstrip("_") in ("mul", "div") else None  # (that operand's position)

    def call(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        halves = {a.dtype for a in tensors if a.dim() and a.dtype in HALF}
        if len(halves) != 1:
            return func(*args, **kwargs)
        dtype = halves.pop()
        cpu = all(a.device.type == "cpu" for a in tensors)
        if cpu and elementwise_dtypes(*tensors, type_promotion_kind=NO_OPMATH)[1] != dtype:
            return func(*args, **kwargs)
        convert = [isinstance(a, torch.Tensor) and a.dtype not in (dtype, torch.bool)
                   and (_integer(a) if a.dim() else not a.is_complex()
                        and (cpu and i != original or a.device.type == "cuda"))
                   for i, a in enumerate(args)]
        if not any(convert):
            return func(*args, **kwargs)
        return func(*(a.to(dtype) if c else a for a, c in zip(args, convert)), **kwargs)

    return call


def _integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


#: recorded ops that functorch replaces under its transforms, ``torch.func.functionalize``
#: included (``FuncTorchDynamicLayerFrontMode`` kernels, ATen's
#: ``functorch/PyTorchOperatorHacks.cpp``), by computations other than eager's: traced
#: through their decompositions instead. ``binary_cross_entropy_with_logits``' hack is the
#: older formula (``max_val + log(exp(-max_val) + exp(-x - max_val))``), where eager's
#: kernel and torch._decomp's decomposition subtract ``log_sigmoid`` (an ulp off in 41 % of
#: float32 results).
_FUNCTORCH_HACKED = (torch.ops.aten.binary_cross_entropy_with_logits.default,)


def eager_operands(func):
    """``func`` wrapped, during tracing, to convert its operands as eager's kernel does
    (:func:`_number_rounded`, :func:`_operands_converted`), its decomposition where functorch
    would replace it (:data:`_FUNCTORCH_HACKED`), or ``func`` itself."""
    if func in _FUNCTORCH_HACKED:
        from .decompositions import decomposition_table  # (it imports this module)
        return decomposition_table()[func]
    name = getattr(func, "_opname", "")
    if name.rstrip("_") in _WRAPPED:
        return _number_rounded(_operands_converted(func, name), name)
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return _operands_converted(func, name)
    return func
