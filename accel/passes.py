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


#: The pass pipeline, in order.
PASSES: List[Tuple[str, Callable[[fx.GraphModule], int]]] = [
    ("remove_noops", remove_noops),
    ("specialize_pow", specialize_pow),
    ("cse", cse),
    ("dce", dce),
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
