"""Op tables, as data: which aten op overloads accel defers into regions, and how it reads
their arguments.

The pointwise set comes from torch's own op tags (``torch.Tag.pointwise``), plus the
reductions and composite ops named in :data:`REDUCTIONS` and :data:`COMPOSITES`, restricted
to ops that ``torch._decomp`` can decompose to prims (the semantics accel compiles) and that
are not random. Views run eagerly without reading data. Anything else flushes the region
and runs eagerly.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch

aten = torch.ops.aten

# Argument kinds of an op schema, as the hot path reads them.
TENSOR, SCALAR, CONST = 0, 1, 2

#: marker in a trie node: the call cannot be deferred (its meta evaluation raised).
NOT_DEFERRABLE = type("NotDeferrable", (), {"__repr__": lambda self: "NOT_DEFERRABLE"})()


class Deferred(Exception):
    """Internal: a call cannot join the region; ``args[0]`` says why (``"alias"``: it reads
    a view of a pending output, so flush and retry)."""

#: dtypes whose results accel computes; complex and the other integer widths stay eager.
DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                    torch.int64, torch.bool})
#: the 16-bit floats: kept in memory, computed in float32 (see lower_expr's ``_Lowerer.mk``).
HALF = (torch.float16, torch.bfloat16)

#: ops that run eagerly without flushing: they create views, metadata or new tensors
#: (factories, filled with constants or left empty), and read no tensor's data.
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default,
    aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.slice.Tensor, aten.select.int, aten.as_strided.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.narrow.default,
    aten.view_as_real.default, aten.unfold.default, aten.diagonal.default,
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.lift_fresh.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
    aten.sym_storage_offset.default, aten.is_same_size.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.arange.default, aten.arange.start, aten.arange.start_step,
})

#: pointwise ops not tagged as such in torch, or whose decomposition accel relies on.
_EXTRA = (aten._to_copy.default, aten.copy_.default, aten.fill_.Scalar, aten.zero_.default,
          aten.fill.Scalar, aten.scalar_tensor.default)
#: accel's own ops that a program's calls make (the recipes of :mod:`accel.remat`), deferred
#: as aten's are: names in ``torch.ops.accel`` (:mod:`accel.library`), decomposed by their
#: references when a region is traced (:func:`accel.decompositions.decomposition_table`)
_ACCEL_DEFERRED = ("group_norm_apply", "batch_norm_apply")

#: scalar arguments whose *value* eager specializes on (e.g. pow(x, 2) is x*x, pow(x, 0.5)
#: is sqrt, a vector norm's order picks its formula, a variance's correction its divisor):
#: they are part of the key, never runtime arguments. elu's scalars (selu's fixed
#: constants) and logit's eps are folded into other constants by their decompositions
#: (``alpha * scale``, ``1 - eps``), which a runtime scalar cannot be traced through.
_VALUE_SPECIALIZED = {"elu": {"alpha", "scale", "input_scale"},
                      "elu_backward": {"alpha", "scale", "input_scale"},
                      "logit": {"eps"}, "logit_backward": {"eps"},
                      "pow": {"exponent", "self"}, "float_power": {"exponent", "self"},
                      "round": {"decimals"}, "linalg_vector_norm": {"ord"},
                      **{n: {"correction"} for n in ("var", "std", "var_mean", "std_mean")},
                      "smooth_l1_loss": {"beta"}, "smooth_l1_loss_backward": {"beta"},
                      **{n: {"momentum"} for n in ("native_batch_norm", "_native_batch_norm_legit",
                                                   "_native_batch_norm_legit_functional")}}

#: memory-bound ops between matmuls that are not tagged pointwise: reductions, and composite
#: ops that reach the dispatcher whole (forward and backward); fused through their
#: decompositions (or lowered directly: argmax/argmin, max/min.dim). Every overload counts.
REDUCTIONS = ("sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "var",
              "std", "var_mean", "std_mean", "logsumexp", "linalg_vector_norm", "any", "all")
COMPOSITES = ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
              "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
              "native_group_norm_backward", "native_batch_norm", "native_batch_norm_backward",
              "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
              "_native_batch_norm_legit_no_training", "_fused_rms_norm", "_fused_rms_norm_backward",
              "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
              "threshold_backward", "mse_loss", "mse_loss_backward", "smooth_l1_loss",
              "smooth_l1_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
              "binary_cross_entropy_with_logits", "linalg_cross", "glu", "glu_backward", "constant_pad_nd",
              "slice_backward")
#: ops whose tensor arguments' sizes relate otherwise than by equality (``glu``'s gradient
#: is half its input along ``dim``): their probe (:meth:`accel.region.Region._probe`) runs on
#: stand-ins of the real sizes, not of at most 2 a dim, whose broken relation eager's CPU
#: kernel warns of (resizing its output) before it raises. Inside ``backward`` that warning
#: reached the user: the autograd engine collects C++ warnings and replays them at its end,
#: past the probe's ``catch_warnings``.
REAL_SIZE_PROBES = frozenset({"glu_backward"})
# nll_loss_forward/backward stay eager: they gather/scatter at data-dependent class indices,
# and eager raises at the call on an index out of range, which a kernel cannot do.
#: ops the interceptor does not defer but must see while a region is pending, which the
#: dispatch filter therefore sends to the mode as it sends deferrable ones (it runs other
#: calls past the mode, flushing the region first): ``nll_loss_forward`` of a pending
#: ``log_softmax`` (``accel.losses.nll_of_log_softmax``), ``nll_loss_backward`` in
#: autograd's ``NllLossBackward0`` (``accel.losses.nll_loss_backward``), ``cat`` and
#: ``stack`` (recorded as ``accel.cat``: ``accel.library.cat_call``).
MODE_OPS = (aten.nll_loss_forward.default, aten.nll_loss_backward.default, aten.cat.default,
            aten.stack.default)
#: ops without a decomposition that the lowering handles itself.
_LOWERED = ("argmax", "argmin", "max.dim", "min.dim", "max", "min")
#: pointwise ops that torch tags ``pointwise`` only from 2.13 on (torch 2.11's tags lack it):
#: deferred on every torch accel supports
POINTWISE_UNTAGGED = frozenset({"leaky_relu", "leaky_relu_", "elu_", "celu_", "selu_", "hardtanh_",
                                "hardsigmoid_"})

#: ops that eager refuses to run on integer tensors with a zero divisor, raising at the call;
#: a kernel cannot raise there, so on integer (and bool) results they run eagerly.
INTEGER_DIVISION = frozenset({"div", "floor_divide", "remainder", "fmod"})
_HALF_ROUNDING = "16-bit float rounding unlike eager's"
#: ops that run eagerly where a kernel cannot do what eager's does: op name (in-place
#: variants included) -> (device types, None for all; only where a result is float16 or
#: bfloat16; the reason logged):
#: - ``nextafter``: the kernel steps by a float32 ulp, which rounds back to a 16-bit input;
#: - ``softshrink`` on a GPU: neither its decomposition nor the CPU kernel's float32
#:   arithmetic (:func:`accel.decompositions._softshrink`) gave CUDA's 16-bit results on an H200 (1 %
#:   of the elements outside ``assert_close``);
#: - ``binary_cross_entropy`` on the CPU: eager's kernel raises at the call on an input
#:   outside [0, 1] (NaN included), which a kernel cannot (its backward checks nothing and
#:   stays fusible; eager's CUDA kernel only asserts on the device);
#: - ``native_group_norm`` and its backward on a GPU at 16 bits: accel's decomposition
#:   (:func:`accel.decompositions._native_group_norm`) was an ulp from eager's CUDA results on 2-4 %
#:   of the elements on an H200, and torch._decomp's reads merged dims the lowering cannot;
#: - ``erfinv`` on the CPU: eager's kernel took 5.7 ms on 4M float32 values (30 ms float64)
#:   on 2 cores; accel's rendering, a double-precision Halley iteration on erf and erfc,
#:   took 55-65 ms (bench/README.md, sixty-seventh round), so the CPU backend has none (the
#:   GPU's is CUDA's erfinv, eager's own);
#: - ``prod`` on the CPU at 16 bits: eager's kernel (``prod_kernel_impl``,
#:   ``binary_kernel_reduce_vec`` in ``scalar_t``) rounds every partial product to the
#:   dtype, in its vector lanes' order; accel's float32 products were outside
#:   ``assert_close``'s tolerance on 69-87 % of 256 rows of 512 (a GPU multiplies in
#:   float32, as accel does).
RUNS_EAGERLY = {
    "nextafter": (None, True, _HALF_ROUNDING),
    "softshrink": (("cuda",), True, _HALF_ROUNDING),
    "binary_cross_entropy": (("cpu",), False, "eager's CPU kernel checks its input's values"),
    "native_group_norm": (("cuda",), True, _HALF_ROUNDING),
    "native_group_norm_backward": (("cuda",), True, _HALF_ROUNDING),
    "erfinv": (("cpu",), False, "eager's CPU kernel is faster"),
    "prod": (("cpu",), True, "eager's CPU kernel multiplies in the 16-bit dtype"),
}
#: per device type, the binary ops whose eager kernel rounds a Python number operand to the
#: common dtype when that is float16 or bfloat16 and computes from the rounded value
#: (TensorIterator converts a CPU scalar to the common dtype; CPU ``mul`` and ``div`` and
#: CUDA ``add``, ``sub``, ``mul``, ``div`` read it in float32 instead), measured op by op
#: on torch 2.13 (CPU; ``xlogy`` in the seventy-seventh round, 2-23 % of its results off
#: before) and 2.11 (H200): on the CPU a 0-dim tensor counts as a number, and
#: ``add``'s, ``sub``'s and ``rsub``'s ``alpha`` is rounded too. torch's decompositions
#: keep numbers in float32: accel's trace rounds them first (:func:`accel.operands._number_rounded`).
ROUNDED_NUMBERS = {
    "cpu": frozenset({"add", "sub", "rsub", "pow", "remainder", "fmod", "eq", "ne", "lt", "le",
                      "gt", "ge", "logaddexp", "atan2", "xlogy"}),
    "cuda": frozenset({"pow", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge"}),
}
#: ops whose eager kernel returns a floating result in another dtype than the meta function
#: (CPU layer norm of bfloat16 / float16: its mean and rstd in that dtype, float32 by the
#: meta function) by rounding the value the meta dtype holds: accel rounds it alike (the
#: same bits; tests/test_half.py). Any other dtype disagreement runs the call eagerly (CPU
#: batch norm's 16-bit statistics do not round-trip so: its backward then drifts).
ROUNDED_RESULTS = frozenset({"native_layer_norm"})
#: ops whose eager CPU kernel returns an empty result of shape (0,) where the meta function's
#: has elements (eval-mode batch norm's saved statistics; the meta function gives them the
#: running statistics' shape): the region's result is eager's empty one, as the op's
#: decomposition returns on the CPU
EMPTY_RESULTS = frozenset({"native_batch_norm", "_native_batch_norm_legit_no_training"})

#: pointwise-tagged ops accel does not take: no useful decomposition, or non-numeric results;
#: or a decomposition into prims without a lowering (``i0``'s ``bessel_i0``, ``igamma``,
#: ``igammac``, ``frexp``) or into an integer division (``lcm``), whose region failed its
#: build and ran eagerly at every call, with a warning, its neighbours unfused.
_DENY = {"equal", "polygamma", "polygamma_", "_conj_physical", "angle", "rrelu",
         "logit_backward", "i0", "i0_", "igamma", "igamma_", "igammac", "igammac_", "frexp", "lcm",
         "lcm_"}


class OpSpec(NamedTuple):
    """How the hot path reads one op overload's arguments.

    ``pos`` gives the kind (TENSOR / SCALAR / CONST) of each positional argument and
    ``kw`` of each keyword argument; ``mutates`` lists the arguments written in place as
    (name, position or -1 if keyword-only): ``self`` of ``add_``, ``out`` of ``add.out``,
    ``running_mean`` of batch norm;
    ``returns_input``: the call returns the (first) argument it writes, as in-place and
    ``out=`` variants do; otherwise it returns new tensors (a tuple for several).
    """

    pos: Tuple[int, ...]
    kw: Dict[str, int]
    mutates: Tuple[Tuple[str, int], ...]
    returns_input: bool


def _kind(op_name: str, arg) -> int:
    t = str(arg.type)
    if "Tensor" in t:
        return TENSOR if t in ("Tensor", "Optional[Tensor]") else -1
    if t in ("number", "float", "Optional[number]", "Optional[float]"):
        return CONST if arg.name in _VALUE_SPECIALIZED.get(op_name.rstrip("_"), ()) else SCALAR
    return CONST


def _spec(op) -> Optional[OpSpec]:
    name = op._schema.name.split("::")[1]
    pos, kw, mut = [], {}, []
    for a in op._schema.arguments:
        k = _kind(name, a)
        if k < 0:
            return None  # Tensor[] and friends: not pointwise-fusible here
        if a.alias_info is not None and a.alias_info.is_write:
            mut.append((a.name, -1 if a.kwarg_only else len(pos)))
        if a.kwarg_only:
            kw[a.name] = k
        else:
            pos.append(k)
    rets = op._schema.returns
    if not rets or any(str(r.type) != "Tensor" for r in rets):
        return None
    returns_input = any(r.alias_info is not None and r.alias_info.is_write for r in rets)
    if returns_input and len(rets) != 1:
        return None
    return OpSpec(tuple(pos), kw, tuple(mut), returns_input)


def float_key(v: float):
    """A float constant as a dict key that tells apart what ``==`` does not: NaN is equal to
    itself (``"nan"``), -0.0 differs from 0.0 (``"-0.0"``: equal as values, not as results:
    ``x + 0.0`` of -0.0, clamp's bounds, ``copysign``); any other value is itself."""
    if v != v:
        return "nan"
    return "-0.0" if v == 0.0 and math.copysign(1.0, v) < 0 else v


_data_ptr = torch._C.TensorBase.data_ptr


def splits(src, dst) -> bool:
    """Whether shape ``dst`` splits each dim of ``src`` into consecutive dims, size-1 dims
    aside (``[1024, 1024]`` -> ``[8, 128, 1024]``): the views a region's loop IR reads
    through as index arithmetic (``prims.split_dim``, ``prims.squeeze``, and
    ``as_strided`` where torch's view decomposition splits that way:
    ``accel.lower_expr._strided_index``); a merge of dims (``prims.collapse_view``) it cannot
    express."""
    s = [n for n in src if n != 1]
    d = [n for n in dst if n != 1]
    j = 0
    for n in s:
        p = 1
        while p < n and j < len(d):
            p *= d[j]
            j += 1
        if p != n:
            return False
    return j == len(d)


def dense_view_map(shape, strides, size, stride, offset: int):
    """How a strided view reads a tensor laid out densely: per dim of the view, ``(k, m)``
    (its index times ``m`` adds to dim ``k``'s of the tensor; None for a dim of size 1 or
    stride 0, a broadcast), and per dim of the tensor the index ``o[k]`` its view starts
    at, so that the view's element at ``idx`` is the tensor's at ``j[k] = o[k] +
    sum(m * idx[d] for the view's dims d on k)``: a slice, a narrow, a select, a chunk, a
    transpose or an expand of the tensor, or a split of its dims, alike.

    ``shape`` / ``strides``: the tensor's (elements; dense: its dims of size above 1, in
    some order, contiguous); ``size`` / ``stride`` / ``offset``: the view's, as
    ``torch.as_strided`` takes them, ``offset`` from the tensor's first element. The map
    is exact where every ``j[k]`` stays below ``shape[k]`` (no index carries into the next
    dim): the view's element and the tensor's are then one address.

    Returns:
        ``(maps, o)``, or None where the view reads the tensor otherwise (a merge of its
        dims, a stride across dims, an offset or extent outside a dim) or the tensor is not
        dense or either is empty.
    """
    dims = sorted((k for k in range(len(shape)) if shape[k] != 1), key=lambda k: -strides[k])
    numel = 1
    for k in reversed(dims):
        if strides[k] != numel:
            return None
        numel *= shape[k]
    if not 0 <= offset < numel or 0 in shape or 0 in size:
        return None
    o, rest = [0] * len(shape), offset
    for k in dims:
        o[k], rest = divmod(rest, strides[k])
    top = list(o)
    maps = []
    for n, st in zip(size, stride):
        if n == 1 or st == 0:
            maps.append(None)
            continue
        k = next((k for k in dims if strides[k] <= st), None)
        if k is None or st % strides[k] or st // strides[k] >= shape[k]:
            return None
        maps.append((k, st // strides[k]))
        top[k] += st // strides[k] * (n - 1)
    if any(top[k] >= shape[k] for k in range(len(shape))):
        return None
    return maps, o


def pending_view(t: torch.Tensor, outs, base: int):
    """The argument reference of ``t``, a view of a pending region output (whose storage
    starts at address ``base``, a pending output's), that the region reads through, or
    None (the region is flushed first, and ``t`` is an input of the next).

    - ``("v", i, shape, stride)``: ``t`` reads exactly ``outs[i]``'s elements, reshaped:
      the same dtype, data address and number of elements (not 0), both contiguous, and
      ``t``'s shape a refinement of the output's (:func:`splits`): a Linear's
      ``[B * T, C]`` output viewed as ``[B, T, C]``. The region's graph reads it as
      ``outs[i].view(shape)``.
    - ``("v", i, shape, stride, offset)``: ``t`` reads some of a contiguous ``outs[i]``'s
      elements dim by dim (:func:`dense_view_map`), from ``offset`` elements on: a slice,
      a narrow, a chunk, a select, a transpose, an expand. The region's graph reads it as
      ``torch.as_strided`` of the output (:func:`_strided_view`), which the lowering
      indexes through (:mod:`accel.lower_expr`).

    The dispatch filter keys such an argument by the output, the view's offset, sizes and
    strides (include/accel/call_keys.h: ``make_key``), which decide between the two (or
    None) alike, and replays the call's edge once the interceptor recorded it.
    """
    n = t.numel()
    if n == 0:
        return None
    for i, o in enumerate(outs):
        if _data_ptr(o) == base:  # (not Tensor.data_ptr: accel's hook flushes the region)
            if o.dtype != t.dtype or not o.is_contiguous():
                return None
            p = _data_ptr(t)
            shape, stride = tuple(t.shape), t.stride()
            if p == base and o.numel() == n and t.is_contiguous() and splits(o.shape, t.shape):
                return ("v", i, shape, stride)
            off, r = divmod(p - base, t.element_size())
            if r or dense_view_map(tuple(o.shape), o.stride(), shape, stride, off) is None:
                return None
            return ("v", i, shape, stride, off)
    return None


def written_refs(spec: OpSpec, targs, tkw) -> list:
    """The argument references (``("x", j)``, ``("o", i)``, ...) of the tensors a call writes
    in place or through ``out=`` (``spec.mutates``); ``("c", None)`` for one not passed."""
    return [tkw[n] if n in tkw else targs[k] if 0 <= k < len(targs) else ("c", None)
            for n, k in spec.mutates]


def overlap_args(call) -> tuple:
    """For a recorded call ``(func, targs, tkw, n_new)`` that writes an external input:
    ``(ext, written)``, the external-input indices of its tensor arguments, the written
    ones first, and their positions in it, for ``accel._core.ext_overlap``: a written input
    that shares storage with another argument of the same call runs the call eagerly, as
    eager's ``at::assert_no_partial_overlap`` may refuse it there and then. ``()`` where
    the call has no other argument to share it with."""
    func, targs, tkw = call[0], call[1], call[2]
    written = list(dict.fromkeys(r[1] for r in written_refs(op_spec(func), targs, tkw)
                                 if r[0] == "x"))
    read = dict.fromkeys(r[1] for r in (*targs, *tkw.values())
                         if type(r) is tuple and len(r) == 2 and r[0] == "x" and r[1] not in written)
    if len(written) + len(read) < 2:
        return ()
    return tuple(written) + tuple(read), tuple(range(len(written)))


def op_spec(func) -> OpSpec:
    """The :class:`OpSpec` of a recorded call's op: its :func:`fusible_ops` entry, or, for
    the ops of accel's own that the interceptor records (``accel.library``:
    ``nll_of_log_softmax``, ``nll_loss_backward``), its schema's."""
    spec = fusible_ops().get(func)
    return spec if spec is not None else _schema_spec(func)


@functools.lru_cache(maxsize=None)
def _schema_spec(func) -> OpSpec:
    return _spec(func)


@functools.lru_cache(maxsize=None)
def fusible_ops() -> Dict[object, OpSpec]:
    """Map each deferrable aten ``OpOverload`` to its :class:`OpSpec` (built once, ~10 ms)."""
    from torch._decomp import decomposition_table

    table = {}
    lowered = [getattr(aten, n.split(".")[0]).__getattr__(n.split(".")[1] if "." in n else "default")
               for n in _LOWERED]
    for op in list(decomposition_table) + lowered:
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            continue
        name = op._schema.name[6:]
        if name in _DENY or name.startswith("special_") or name.startswith("_foreach"):
            continue
        tags = op.tags
        if torch.Tag.nondeterministic_seeded in tags:
            continue
        if (torch.Tag.pointwise not in tags and name not in REDUCTIONS and name not in COMPOSITES
                and name not in POINTWISE_UNTAGGED):
            continue
        spec = _spec(op)
        if spec is not None:
            table[op] = spec
    from . import library  # noqa: F401 - registers torch.ops.accel.*

    for op in (*_EXTRA, *(getattr(torch.ops.accel, n).default for n in _ACCEL_DEFERRED)):
        spec = _spec(op)
        if spec is not None:
            table[op] = spec
    return table

def _split_view(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.view(shape)`` for a ``shape`` that :func:`splits` ``t``'s, as a squeeze of
    ``t``'s size-1 dims, a view of the rest and an unsqueeze of ``shape``'s: traced, these
    decompose into ops the loop IR reads through (``t.view(shape)`` itself can decompose
    into a merge and a split: ``[64, 1, 48]`` as ``[1, 64, 48, 1]``)."""
    ones = [d for d, n in enumerate(t.shape) if n == 1]
    if ones:
        t = t.squeeze(ones)
    core = [n for n in shape if n != 1]
    if list(t.shape) != core:
        t = t.view(core)
    for d, n in enumerate(shape):
        if n == 1:
            t = t.unsqueeze(d)
    return t


def _view(t: torch.Tensor, ref) -> torch.Tensor:
    """``t`` (a region output, as computed) viewed as the reference ``("v", ...)`` says
    (:func:`pending_view`): a split of its dims, or a strided view of it, taken of ``t``
    contiguous (the pending output's layout when it was recorded; traced, a no-op)."""
    if len(ref) == 4:
        return _split_view(t, ref[2])
    t = t.contiguous()
    return t.as_strided(ref[2], ref[3], t.storage_offset() + ref[4])


def resolver(ext, outs, scalars, views=None):
    """The function that turns a call's argument template into its value: ``("x", j)``
    ``ext[j]``, ``("o", i)`` ``outs[i]`` (a list, or a dict by output index), ``("v", i,
    shape, stride[, offset])`` a view of ``outs[i]`` (:func:`_view`; kept in ``views``,
    where given, for the next argument that views it alike), ``("s", k)``
    ``scalars[k]``, ``("c", value)`` the constant (a tuple as a list)."""
    def res(r):
        tag = r[0]
        if tag == "x":
            return ext[r[1]]
        if tag == "o":
            return outs[r[1]]
        if tag == "s":
            return scalars[r[1]]
        if tag == "v":  # a view of a region output (pending_view)
            if views is None:
                return _view(outs[r[1]], r)
            v = views.get(r)
            if v is None:
                v = views[r] = _view(outs[r[1]], r)
            return v
        v = r[1]
        return list(v) if isinstance(v, tuple) else v

    return res


def run_calls(calls, ext, outs, scalars, on_new) -> None:
    """Run a region's recorded calls in order (eagerly, or under a tracer).

    ``calls``: (OpOverload, arg templates, kwarg templates, number of new tensors) with
    templates ``("x", j)`` (``ext[j]``), ``("o", i)`` (``outs[i]``), ``("v", i, shape,
    stride[, offset])`` (a view of ``outs[i]``: :func:`pending_view`), ``("s", k)`` (``scalars[k]``), ``("c", value)``.
    ``on_new(i, tensor)`` receives the i-th new tensor of the region (``outs[i]`` must
    resolve to it afterwards).
    """
    res = resolver(ext, outs, scalars)
    k = 0
    for func, targs, tkw, n_new in calls:
        out = func(*[res(r) for r in targs], **{n: res(r) for n, r in tkw.items()})
        if n_new:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if t is not None:
                    on_new(k, t)
                    k += 1
