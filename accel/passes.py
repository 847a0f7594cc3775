"""Graph passes: named ``GraphModule -> int`` functions (the int counts what changed), run
in order by one driver that logs each (Inductor's ``GraphTransformObserver``, tinygrad's
named ``graph_rewrite``). The registry is data: :data:`PASSES`.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from . import graph, library  # noqa: F401 - library registers torch.ops.accel.* (mul_rn, div_rn)
from .ops import float_key

log = logging.getLogger("accel.passes")
prims = torch.ops.prims
aten = torch.ops.aten


def writes_argument(n: fx.Node) -> bool:
    """Whether graph node ``n`` writes one of its arguments (an op overload with a mutable
    schema: ``aten.copy_`` into an input, ``prims.copy_to`` into a fresh tensor's slice):
    never dropped or merged as a pure node would be."""
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target._schema.is_mutable)


def _same_value(n: fx.Node, src) -> bool:
    """``src`` is a node whose tensor value has ``n``'s shape and dtype."""
    if not isinstance(src, fx.Node) or "val" not in src.meta or "val" not in n.meta:
        return False
    a, b = src.meta["val"], n.meta["val"]
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.shape == b.shape and a.dtype == b.dtype)


def _replace(gm: fx.GraphModule, n: fx.Node, src: fx.Node) -> int:
    n.replace_all_uses_with(src)
    gm.graph.erase_node(n)
    return 1


def remove_noops(gm: fx.GraphModule) -> int:
    """Drop nodes that return their input unchanged: a cast to the same dtype, ``view_of``,
    ``alias``, a ``broadcast_in_dim`` to the same shape with identity dims, a functional
    ``copy(dst, src[, non_blocking])`` of a ``src`` of ``dst``'s shape and dtype (its value
    is ``src``)."""
    n_removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        t = n.target
        if t is aten.copy.default and not n.kwargs:  # functionalized copy_: src's values
            if _same_value(n.args[0], n.args[1]):  # non_blocking changes nothing within a device
                n_removed += _replace(gm, n, n.args[1])
            continue
        src = n.args[0] if n.args else None
        if not _same_value(n, src):
            continue
        if (t in (prims.view_of.default, aten.alias.default, prims.convert_element_type.default)
                or (t is prims.broadcast_in_dim.default
                    and list(n.args[2]) == list(range(src.meta["val"].dim())))):
            n_removed += _replace(gm, n, src)
    return n_removed


def _is_one(a) -> bool:
    """``a`` is the number 1 (not ``True``) or a ``full`` of it, converted or broadcast
    (constant folding leaves a large constant a 0-dim ``full`` broadcast)."""
    while (isinstance(a, fx.Node) and a.op == "call_function"
           and a.target in (prims.broadcast_in_dim.default, prims.convert_element_type.default)):
        a = a.args[0]
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is prims.full.default:
        a = a.args[1]
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == 1


def remove_identities(gm: fx.GraphModule) -> int:
    """Drop products with 1 and quotients by 1 whose result has the other operand's shape
    and dtype: the result is that operand, in every dtype (for a 16-bit one the product's
    rounding to it is the identity too). Runs after :func:`constant_folding`, which makes a
    ``prims.full`` of a decomposition's constant tensor (``smooth_l1_loss``'s ``/ beta``
    with the default ``beta=1.0``)."""
    products = (prims.mul.default, torch.ops.accel.mul_rn.default)
    quotients = (prims.div.default, torch.ops.accel.div_rn.default)
    n_removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in products + quotients or len(n.args) != 2:
            continue
        a, b = n.args
        src = a if _is_one(b) else b if n.target in products and _is_one(a) else None
        if _same_value(n, src):
            n_removed += _replace(gm, n, src)
    return n_removed


def cse(gm: fx.GraphModule) -> int:
    """Common subexpression elimination: pure nodes with equal (target, args, kwargs) are
    merged into the first."""
    seen = {}
    n_merged = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or writes_argument(n):
            continue
        try:
            key = (n.target, _freeze(n.args), _freeze(n.kwargs))
            hash(key)
        except TypeError:
            continue
        prev = seen.get(key)
        if prev is None:
            seen[key] = n
        else:
            n.replace_all_uses_with(prev)
            gm.graph.erase_node(n)
            n_merged += 1
    return n_merged


def _freeze(a):
    if isinstance(a, (list, tuple)):
        return tuple(_freeze(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in a.items()))
    if isinstance(a, float):  # NaN != NaN; -0.0 == 0.0, yet x + -0.0 and x + 0.0 differ
        return ("float", float_key(a))
    return (type(a).__name__, a) if not isinstance(a, fx.Node) else a


def dce(gm: fx.GraphModule) -> int:
    """Dead code elimination: remove pure nodes whose values nobody uses. A node writing an
    argument (a mutable schema: ``aten.copy_`` into an input, or ``prims.copy_to`` into a
    slice of a fresh tensor, as torch's ``constant_pad_nd`` decomposition writes, which the
    lowering does not express) stays: dropped, its write was silently lost."""
    before = len(gm.graph.nodes)
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and not n.users and not writes_argument(n):
            gm.graph.erase_node(n)
    return before - len(gm.graph.nodes)


def _sq(g, x):
    return g.call_function(prims.mul.default, (x, x))


#: ``pow(x, c)`` for a floating ``x`` and these constant exponents, built as ATen's CPU
#: kernel computes it (``aten/src/ATen/native/cpu/PowKernel.cpp``,
#: ``pow_tensor_scalar_optimized_kernel``): same rounding as eager, and no call to powf.
POW_SPECIALIZATIONS: Dict[float, Callable] = {
    0.5: lambda g, x: g.call_function(prims.sqrt.default, (x,)),
    2.0: _sq,
    3.0: lambda g, x: g.call_function(prims.mul.default, (_sq(g, x), x)),
    -0.5: lambda g, x: g.call_function(prims.rsqrt.default, (x,)),
    -1.0: lambda g, x: g.call_function(prims.reciprocal.default, (x,)),
    -2.0: lambda g, x: g.call_function(prims.reciprocal.default, (_sq(g, x),)),
}


def _constant_number(c):
    """``c`` as a Python number where it is one, or a number made a tensor while traced
    (``scalar_tensor(c)``, converted: a number beside a 16-bit tensor, ``ROUNDED_NUMBERS``);
    else None."""
    while isinstance(c, fx.Node) and c.target is prims.convert_element_type.default:
        c = c.args[0]
    if isinstance(c, fx.Node) and c.target in (aten.scalar_tensor.default, prims.scalar_tensor.default):
        c = c.args[0]
    return c if isinstance(c, (int, float)) and not isinstance(c, bool) else None


def _widened(x: fx.Node):
    """The value ``x`` converts to float32, where ``x`` is such a conversion; else None."""
    if x.target is not prims.convert_element_type.default or not isinstance(x.args[0], fx.Node):
        return None
    src = x.args[0].meta.get("val")
    return src if isinstance(src, torch.Tensor) else None


def _widened_cpu(x: fx.Node, dtype: torch.dtype) -> bool:
    """``x`` is a CPU ``dtype`` value converted to float32. Eager's float16 ``pow`` calls
    ``pow`` for every exponent (its sqrt/rsqrt fast path is float32, float64 and bfloat16
    only), whose ``pow(-inf, 0.5)`` is inf and ``pow(-0.0, -0.5)`` inf where ``sqrt`` and
    ``rsqrt`` give NaN and -inf."""
    src = _widened(x)
    return src is not None and src.dtype == dtype and src.device.type == "cpu"


def _square_dtype(x: fx.Node):
    """The 16-bit dtype eager rounds ``base * base`` to in ``pow`` to the power 3 or -2 of
    the value ``x`` widens, or None: the CPU's bfloat16 kernel, and a GPU's 16-bit ones
    (``pow_tensor_scalar_kernel_impl``, in ``scalar_t`` arithmetic). With the float32 square
    22-27 % of results were an ulp off."""
    src = _widened(x)
    if src is None or src.dtype not in (torch.bfloat16, torch.float16):
        return None
    return src.dtype if src.device.type == "cuda" or src.dtype == torch.bfloat16 else None


def _rounded_square(g, x, dtype):
    """``x * x`` rounded to ``dtype`` and widened to float32 again (:func:`_square_dtype`)."""
    sq = _sq(g, x)
    sq.meta["val"] = prims.mul.default(x.meta["val"], x.meta["val"])
    narrow = g.call_function(prims.convert_element_type.default, (sq, dtype))
    narrow.meta["val"] = prims.convert_element_type.default(sq.meta["val"], dtype)
    return g.call_function(prims.convert_element_type.default, (narrow, torch.float32))


def specialize_pow(gm: fx.GraphModule) -> int:
    """Replace ``prims.pow(x, c)`` (floating ``x``, constant ``c`` in
    :data:`POW_SPECIALIZATIONS`) by the products, roots and reciprocals eager uses."""
    n_replaced = 0
    for n in list(gm.graph.nodes):
        if n.target is not prims.pow.default:
            continue
        x, c = n.args[0], _constant_number(n.args[1])
        if c is None:
            continue
        val = n.meta.get("val")
        build = POW_SPECIALIZATIONS.get(float(c))
        if build is None or not isinstance(x, fx.Node) or val is None or not val.is_floating_point():
            continue
        if x.meta["val"].dtype != val.dtype or (abs(c) == 0.5 and _widened_cpu(x, torch.float16)):
            continue
        before = set(gm.graph.nodes)
        with gm.graph.inserting_before(n):
            if float(c) in (3.0, -2.0) and _square_dtype(x) is not None:
                sq = _rounded_square(gm.graph, x, _square_dtype(x))
                new = gm.graph.call_function(*((prims.mul.default, (sq, x)) if c == 3 else
                                               (prims.reciprocal.default, (sq,))))
            else:
                new = build(gm.graph, x)
        for m in gm.graph.nodes:  # the nodes just built: the result's metadata, pow's kernel
            if m not in before:
                m.meta.setdefault("val", val)
                if "custom" in n.meta:
                    m.meta["custom"] = n.meta["custom"]
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        n_replaced += 1
    return n_replaced

#: the largest constant (in elements) :func:`constant_folding` evaluates at compile time.
FOLD_MAX_NUMEL = 1 << 20
_CONST_SOURCES = {prims.full.default, prims.scalar_tensor.default, aten.scalar_tensor.default}


def _foldable(n: fx.Node) -> bool:
    t = n.target
    if n.op != "call_function" or writes_argument(n):
        return False
    if torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()):
        return False
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return all(not isinstance(v, torch.Tensor) or v.numel() <= FOLD_MAX_NUMEL for v in vals)


def _uniform(t: torch.Tensor):
    """``(True, value)`` if every element of ``t`` equals the first (NaN equals NaN)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return True, False if t.dtype == torch.bool else 0
    first = flat[:1].expand_as(flat)
    same = (flat == first) | (torch.isnan(flat) & torch.isnan(first))
    return bool(same.all()), flat[0].item()


def constant_folding(gm: fx.GraphModule) -> int:
    """Fold pure ``call_function`` nodes whose inputs are all constants: evaluate them at
    compile time and, when the result is uniform (every element equal), replace the node
    by ``prims.full(shape, value, dtype=, device=, requires_grad=False)`` (Inductor's
    ``constant_fold_uniform_value``). A constant is a node without node inputs
    (``prims.full``, ``prims.iota``, ...) or a foldable node of constants; placeholders,
    the runtime scalars ``s0, s1, ...`` included, are never constants. Non-uniform results
    stay as they are (the graph has no tensor attributes to hold them); so do random ops,
    ``copy_`` and results over :data:`FOLD_MAX_NUMEL` elements. Only the last constant
    node of each chain is replaced; the chain is left to :func:`dce`.

    Returns the number of nodes replaced.
    """
    g = gm.graph
    const = set()
    for n in g.nodes:
        if _foldable(n) and all(i in const for i in n.all_input_nodes):
            const.add(n)
    env: Dict[fx.Node, object] = {}

    def value(n: fx.Node):
        if n not in env:
            env[n] = n.target(*fx.map_arg(n.args, value), **fx.map_arg(n.kwargs, value))
        return env[n]

    todo = [n for n in g.nodes if n in const and n.all_input_nodes
            and any(u not in const for u in n.users)]
    seen, n_folded = set(), 0
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        try:
            v = value(n)
            ok, fill = (_uniform(v) if isinstance(v, torch.Tensor) and v.device.type != "meta"
                        else (False, None))
        except Exception as e:  # noqa: BLE001 - an op that cannot run here stays as it is
            log.debug("constant_folding: cannot evaluate %s: %s", n.format_node(), e)
            continue
        if not ok or n.target in _CONST_SOURCES:
            todo.extend(i for i in n.all_input_nodes if i.all_input_nodes)
            continue
        with g.inserting_before(n):
            new = g.call_function(prims.full.default, (list(v.shape), fill),
                                  {"dtype": v.dtype, "device": v.device, "requires_grad": False})
        new.meta = dict(n.meta)
        env[new] = v
        n.replace_all_uses_with(new)
        log.debug("constant_folding: %s -> full(%s, %r)", n.name, list(v.shape), fill)
        n_folded += 1
    return n_folded


def _elementwise(n: fx.Node) -> bool:
    """A prims elementwise op, a dtype conversion or one of accel's own (positional
    arguments only)."""
    from .loop_ir import ACCEL_ELEMENTWISE, ELEMENTWISE

    t = n.target
    if n.op != "call_function" or n.kwargs or not isinstance(t, torch._ops.OpOverload):
        return False
    if t is prims.convert_element_type.default:
        return True
    name = t._opname
    return ((t.namespace == "prims" and name in ELEMENTWISE)
            or (t.namespace == "accel" and name in ACCEL_ELEMENTWISE))


def _split_back(g: fx.Graph, a: fx.Node, start: int, sizes: tuple) -> fx.Node:
    """``a`` (a merged dim at ``start``) seen with that dim split into ``sizes`` again:
    the source of a ``collapse_view`` doing the same merge, or ``split_dim`` calls."""
    if (a.target is prims.collapse_view.default and a.args[1] == start
            and a.args[2] == start + len(sizes) - 1
            and tuple(a.args[0].meta["val"].shape[start:start + len(sizes)]) == sizes):
        return a.args[0]
    for k, outer in enumerate(sizes[:-1]):
        a_val = a.meta["val"]
        a = g.call_function(prims.split_dim.default, (a, start + k, outer))
        a.meta["val"] = prims.split_dim.default(a_val, start + k, outer)
    return a


_SINK_REDUCTIONS = {prims.sum.default, prims.prod.default, prims.amax.default, prims.amin.default}


def _reduce_split(u: fx.Node) -> int:
    """A reduction of a ``collapse_view`` over every merged dim (and maybe others) reads
    the view's source instead, over the split dims (its result has no merged dim)."""
    c, dims = u.args[0], u.args[1]
    if not (isinstance(c, fx.Node) and c.target is prims.collapse_view.default):
        return 0
    x, start, end = c.args
    nd = c.meta["val"].dim()
    dims = sorted({d % nd for d in dims})
    if start not in dims:
        return 0
    shift = end - start
    split = ([d for d in dims if d < start] + list(range(start, end + 1))
             + [d + shift for d in dims if d > start])
    u.args = (x, split) + tuple(u.args[2:])
    return 1


_RESHAPES = (prims.collapse_view.default, prims.split_dim.default, prims.squeeze.default)


def _merge_groups(xs: tuple, ys: tuple) -> Optional[List[Tuple[int, int]]]:
    """The runs ``[start, end]`` of ``xs``'s dims whose products are ``ys``'s dims, in
    order, or None where ``ys`` is not such a merge of ``xs`` (size-1 dims join the run
    before them)."""
    groups, i = [], 0
    for y in ys:
        if i >= len(xs):
            return None
        start, p = i, xs[i]
        i += 1
        while p != y and i < len(xs) and p * xs[i] <= y:
            p *= xs[i]
            i += 1
        if p != y:
            return None
        groups.append((start, i - 1))
    if i < len(xs):
        if any(v != 1 for v in xs[i:]) or not groups:
            return None
        groups[-1] = (groups[-1][0], len(xs) - 1)
    return groups


def _fold_reshapes(g: fx.Graph, n: fx.Node) -> Optional[fx.Node]:
    """A chain of ``collapse_view`` / ``split_dim`` / ``squeeze`` ending at ``n`` (each a row-major
    reshape, so the chain is the reshape from its source's shape to ``n``'s) as the fewest
    of them: the source itself, merges only (``collapse_view``) or splits only
    (``split_dim``); None where the chain is already one op or needs both."""
    x, steps = n, 0
    while isinstance(x, fx.Node) and x.target in _RESHAPES:
        x, steps = x.args[0], steps + 1
    if steps < 2 or not isinstance(x, fx.Node):
        return None
    xs, ys = tuple(x.meta["val"].shape), tuple(n.meta["val"].shape)
    if xs == ys:
        return x
    merges = _merge_groups(xs, ys)
    if merges is not None:
        for start, end in reversed(merges):  # right to left: the starts stay valid
            if end > start:
                v = x.meta["val"]
                x = g.call_function(prims.collapse_view.default, (x, start, end))
                x.meta["val"] = prims.collapse_view.default(v, start, end)
        return x
    splits = _merge_groups(ys, xs)
    if splits is None:
        return None
    for start, end in splits:  # left to right: each split's dims are final
        for d in range(start, end):
            v = x.meta["val"]
            x = g.call_function(prims.split_dim.default, (x, d, ys[d]))
            x.meta["val"] = prims.split_dim.default(v, d, ys[d])
    return x


def _as_collapse(g: fx.Graph, n: fx.Node) -> Optional[fx.Node]:
    """``as_strided(x, size, stride)`` that only merges consecutive dims of a contiguous
    ``x`` (size-1 dims dropped; the decompositions reshape so: group norm's per-channel
    scale, its weight gradient) as ``collapse_view`` (after ``squeeze``); None otherwise."""
    x, size, stride = n.args[0], list(n.args[1]), list(n.args[2])
    off = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset", 0)
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(xv, torch.Tensor) or off not in (0, None) or not xv.is_contiguous():
        return None
    if list(torch.empty(size, device="meta").stride()) != stride or xv.numel() != n.meta["val"].numel():
        return None
    ones = [d for d, v in enumerate(xv.shape) if v == 1]
    xs = [v for v in xv.shape if v != 1]
    for start in range(len(xs)):
        for end in range(start, len(xs)):
            merged = xs[:start] + [math.prod(xs[start:end + 1])] + xs[end + 1:]
            if merged == size:
                if ones:
                    sq = g.call_function(prims.squeeze.default, (x, ones))
                    sq.meta["val"] = prims.squeeze.default(xv, ones)
                    x, xv = sq, sq.meta["val"]
                if end == start:
                    return x
                c = g.call_function(prims.collapse_view.default, (x, start, end))
                c.meta["val"] = prims.collapse_view.default(xv, start, end)
                return c
    return None


def compose_strided_views(gm: fx.GraphModule) -> int:
    """``as_strided(as_strided(x, ...), size, stride, offset)`` as ``as_strided(x, size,
    stride, offset)``: an ``as_strided``'s geometry is its storage's (``offset`` from the
    storage's start; none given, its input's own), and a view shares its input's storage.
    A crop in two dims (``F.pad`` with negative pads: a ``narrow`` of a ``narrow``) reads
    its base directly then, which the lowering indexes (it maps a view of a dense tensor
    only: :func:`accel.ops.dense_view_map`). Returns the views rewritten."""
    n_done = 0
    for n in gm.graph.nodes:  # (in order: an inner view already reads its base)
        inner = n.args[0] if n.op == "call_function" and n.target is aten.as_strided.default else None
        if not (isinstance(inner, fx.Node) and inner.op == "call_function"
                and inner.target is aten.as_strided.default and _tensor_val(inner) is not None):
            continue
        off = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
        n.args = (inner.args[0], n.args[1], n.args[2],
                  inner.meta["val"].storage_offset() if off is None else off)
        n.kwargs = {}
        n_done += 1
    return n_done


def _tensor_val(a):
    """The tensor a node's metadata holds, or None (a runtime scalar's placeholder, a number)."""
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _meta_arg(a):
    """``a`` as a meta computation takes it: a node's value, a runtime scalar's placeholder
    as a number of its type (``meta["scalar_type"]``, accel.graph.trace), else ``a``."""
    if not isinstance(a, fx.Node):
        return a
    if _tensor_val(a) is not None:
        return a.meta["val"]
    return 1.0 if a.meta.get("scalar_type", "f") == "f" else 1


def sink_collapse_views(gm: fx.GraphModule) -> int:
    """Move each ``collapse_view`` (a merge of dims) below the elementwise ops that read
    it, their other operands (of the same shape) seen split back with ``split_dim``:
    ``silu(collapse_view(x))`` becomes ``collapse_view(silu(x))``. The lowering indexes a
    split (an affine index) but not a merge (a division and a modulo); a merge that
    reaches a region's output is stored as the split dims (``lowering._peel_views``), so
    a group norm followed by its activation (a normalization's output reshaped back from
    ``[N, groups, C / groups, ...]``) becomes one kernel. One pass in graph order, so that
    an op's operands have moved their merges below them before it is looked at. Returns
    the ops moved."""
    g = gm.graph
    moved = 0
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is aten.as_strided.default:
            with g.inserting_before(n):
                c = _as_collapse(g, n)
            if c is not None:
                n.replace_all_uses_with(c)
                g.erase_node(n)
                moved += 1
    for u in list(g.nodes):
        if u.op == "call_function" and u.target in _RESHAPES and u.users:
            # merges and splits that undo each other (a 4-d group norm's backward)
            with g.inserting_before(u):
                f = _fold_reshapes(g, u)
            if f is not None:
                u.replace_all_uses_with(f)
                moved += 1
            continue
        if u.op == "call_function" and u.target in _SINK_REDUCTIONS and not u.kwargs:
            moved += _reduce_split(u)
            continue
        if not _elementwise(u):
            continue
        c = next((a for a in u.args if isinstance(a, fx.Node)
                  and a.target is prims.collapse_view.default), None)
        if c is None:
            continue
        x, start, end = c.args
        sizes = tuple(x.meta["val"].shape[start:end + 1])
        shape = tuple(c.meta["val"].shape)
        # other operands: of the same shape (seen split back), or 0-dim or runtime scalars
        # (read as they are)
        if any(_tensor_val(a) is not None and a.meta["val"].dim() and tuple(a.meta["val"].shape) != shape
               for a in u.args):
            continue
        with g.inserting_before(u):
            args = tuple(_split_back(g, a, start, sizes) if _tensor_val(a) is not None and a.meta["val"].dim()
                         else a for a in u.args)
            v = g.call_function(u.target, args)
            v.meta["val"] = u.target(*(_meta_arg(a) for a in args))
            nc = g.call_function(prims.collapse_view.default, (v, start, end))
            nc.meta["val"] = prims.collapse_view.default(v.meta["val"], start, end)
            if "custom" in u.meta:  # (u's eager kernel: accel.graph.kernel_of)
                v.meta["custom"] = nc.meta["custom"] = u.meta["custom"]
        u.replace_all_uses_with(nc)
        g.erase_node(u)
        moved += 1
    if moved:
        dce(gm)
    return moved


_SUMS = (prims.add.default, prims.sub.default)
#: nodes that pass a value on unchanged (views, functionalization's clones)
_SAME_VALUES = {getattr(prims, name).default for name in (
    "transpose", "collapse_view", "split_dim", "broadcast_in_dim", "squeeze", "reshape", "view_of", "clone")} | {
    aten.as_strided.default, aten.clone.default,  # a view of a pending output (ops.pending_view)
    torch.ops.accel.cat.default}  # a concatenation's elements: its inputs' (eager's cat is a kernel)


def _sums_reading(n: fx.Node) -> List[fx.Node]:
    """The sums and differences that read ``n``'s value, directly or through views."""
    found = []
    for u in n.users:
        if u.target in _SUMS:
            found.append(u)
        elif u.target in _SAME_VALUES:
            found += _sums_reading(u)
    return found


def round_products_across_kernels(gm: fx.GraphModule, device: Optional[str] = None) -> int:
    """Make ``accel.mul_rn`` of each float32 or float64 GPU product that one of eager's
    kernels computes and only other kernels' sums and differences read, directly or through
    views (:func:`accel.graph.kernel_of`): eager stores the product, rounded, before another
    kernel adds it, where nvcc would contract the product and the sum of a fused kernel into
    one fused multiply-add (``a * b + c`` was an ulp from eager's in 23 % of float32
    results on an H200, ``binary_cross_entropy_with_logits`` in 39 %). A product that a sum
    of its own kernel reads stays as it is (eager's kernel was contracted alike), as do
    16-bit values (rounded to the dtype between kernels) and CPU kernels (built with
    ``-ffp-contract=off``). ``device``: the device type the kernel is for (None: each
    product's own)."""
    n_changed = 0
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if (n.target is not prims.mul.default or not isinstance(val, torch.Tensor)
                or val.dtype not in (torch.float32, torch.float64)
                or (device or val.device.type) != "cuda"):
            continue
        mine, sums = graph.kernel_of(n), _sums_reading(n)
        if mine is None or not sums or any(graph.kernel_of(u) in (None, mine) for u in sums):
            continue
        n.target = torch.ops.accel.mul_rn.default
        n_changed += 1
    return n_changed


#: The pass pipeline, in order.
def patterns(gm: fx.GraphModule) -> int:
    """The registered replacements of :mod:`accel.patterns` (online softmax, Welford
    mean/variance, silu, tanh-GELU, ...)."""
    from .patterns import apply_patterns

    return apply_patterns(gm)


PASSES: List[Tuple[str, Callable[[fx.GraphModule], int]]] = [
    ("remove_noops", remove_noops),
    ("specialize_pow", specialize_pow),
    ("constant_folding", constant_folding),
    ("remove_identities", remove_identities),
    ("cse", cse),
    ("compose_strided_views", compose_strided_views),
    ("dce", dce),
    ("sink_collapse_views", sink_collapse_views),
    ("patterns", patterns),
    ("round_products_across_kernels", round_products_across_kernels),
]


def run_passes(gm: fx.GraphModule) -> List[str]:
    """Run :data:`PASSES` over ``gm`` in place; return the pass log (one line per pass)."""
    report = []
    for name, fn in PASSES:
        changed = fn(gm)
        line = f"{name}: {changed} changed, {len(gm.graph.nodes)} nodes"
        log.debug(line)
        report.append(line)
    gm.graph.lint()
    return report
