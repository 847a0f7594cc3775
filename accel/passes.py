"""Graph passes: named ``GraphModule -> int`` functions (the int counts what changed), run
in order by one driver that logs each (Inductor's ``GraphTransformObserver``, tinygrad's
named ``graph_rewrite``). The registry is data: :data:`PASSES`.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Tuple

import torch
import torch.fx as fx

log = logging.getLogger("accel.passes")
prims = torch.ops.prims
aten = torch.ops.aten

_IMPURE = {aten.copy_.default}


def remove_noops(gm: fx.GraphModule) -> int:
    """Drop nodes that return their input unchanged: a cast to the same dtype, ``view_of``,
    ``alias``, a ``broadcast_in_dim`` to the same shape with identity dims."""
    n_removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        src = n.args[0] if n.args else None
        if not isinstance(src, fx.Node) or "val" not in src.meta or "val" not in n.meta:
            continue
        a, b = src.meta["val"], n.meta["val"]
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype)
        if not same:
            continue
        t = n.target
        if (t in (prims.view_of.default, aten.alias.default)
                or (t is prims.convert_element_type.default)
                or (t is prims.broadcast_in_dim.default and list(n.args[2]) == list(range(a.dim())))):
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            n_removed += 1
    return n_removed


def cse(gm: fx.GraphModule) -> int:
    """Common subexpression elimination: pure nodes with equal (target, args, kwargs) are
    merged into the first."""
    seen = {}
    n_merged = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target in _IMPURE:
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
    if isinstance(a, float) and a != a:
        return ("nan",)
    return (type(a).__name__, a) if not isinstance(a, fx.Node) else a


def dce(gm: fx.GraphModule) -> int:
    """Dead code elimination: remove pure nodes whose values nobody uses."""
    before = len(gm.graph.nodes)
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and not n.users and n.target not in _IMPURE:
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


def specialize_pow(gm: fx.GraphModule) -> int:
    """Replace ``prims.pow(x, c)`` (floating ``x``, constant ``c`` in
    :data:`POW_SPECIALIZATIONS`) by the products, roots and reciprocals eager uses."""
    n_replaced = 0
    for n in list(gm.graph.nodes):
        if n.target is not prims.pow.default or not isinstance(n.args[1], (int, float)):
            continue
        x, c = n.args
        val = n.meta.get("val")
        build = POW_SPECIALIZATIONS.get(float(c))
        if build is None or not isinstance(x, fx.Node) or val is None or not val.is_floating_point():
            continue
        if x.meta["val"].dtype != val.dtype:
            continue
        with gm.graph.inserting_before(n):
            new = build(gm.graph, x)
        for m in gm.graph.nodes:  # the nodes just built carry the result's metadata
            if m.op == "call_function" and "val" not in m.meta:
                m.meta["val"] = val
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        n_replaced += 1
    return n_replaced

#: the largest constant (in elements) :func:`constant_folding` evaluates at compile time.
FOLD_MAX_NUMEL = 1 << 20
_CONST_SOURCES = {prims.full.default, prims.scalar_tensor.default, aten.scalar_tensor.default}


def _foldable(n: fx.Node) -> bool:
    t = n.target
    if n.op != "call_function" or t in _IMPURE:
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
    ("cse", cse),
    ("dce", dce),
    ("patterns", patterns),
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
