"""Partition: which intermediates a multi-nest kernel writes to temporary buffers.

Lowering evaluates each output *at an index* and inlines everything it depends on, so an
intermediate is normally recomputed in each consumer and never stored. When a region's
outputs need different iteration structures (a row and a column reduction, a reduction
whose result feeds a second nest), it runs as several loop nests, *groups*, one after
another. A later group needs some values; each one is either recomputed from what is in
memory, or *materialized*: an earlier group, which evaluates it anyway, writes it to a
temporary buffer and the later group reads it back.

The choice is a minimum vertex cut, the idea of AOT autograd's
``min_cut_rematerialization_partition`` / ``choose_saved_values_set``
(``torch/_functorch/partitioners.py``), with memory traffic instead of saved activations
as the cost. For group ``k`` (groups after the first, in order), over the nodes its outputs
depend on:

* every node ``v`` is split into ``v_in -> v_out`` (capacity: the cost of cutting at ``v``);
  each data edge ``u -> v`` becomes ``u_out -> v_in`` with infinite capacity;
* *in memory* (tensor placeholders, outputs of earlier groups, nodes materialized for
  earlier groups): ``source -> v_in`` infinite, capacity ``bytes(v)``, read once; its
  inputs get no edges, so a value in memory is read back, never recomputed;
* *materializable* (an ancestor of an earlier group's output, so that group evaluates it):
  capacity ``2 * bytes(v)``, written once and read once;
* anything else can only be recomputed here: infinite capacity;
* ``o_out -> sink`` infinite for each output ``o`` of group ``k``.

The cut's nodes are what group ``k`` reads; the materializable ones are new temporaries.
``bytes(v)`` is ``numel * itemsize`` of ``v.meta["val"]``, so a broadcast or a cast to a
wider dtype costs more than its input and a reduction's small result costs little; scalar
placeholders cost nothing. Of equal-cost cuts the one nearest the source is taken: on a tie,
recompute rather than add a buffer. Groups are planned greedily in order, which is exact for
two groups.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Sequence, Set

import networkx as nx
import torch
import torch.fx as fx

log = logging.getLogger("accel.partition")
prims = torch.ops.prims
aten = torch.ops.aten

#: reductions, for ``recompute_reductions=False`` (``accel::*`` ops count as reductions too).
REDUCTIONS = frozenset({
    prims.sum.default, prims.amax.default, prims.amin.default, prims.prod.default,
    prims.var.default, prims.xor_sum.default, aten.argmax.default, aten.argmin.default,
    aten.max.dim, aten.min.dim,
})

_SOURCE, _SINK = "source", "sink"
Groups = Sequence[Sequence[fx.Node]]


class PartitionError(ValueError):
    """The groups or graph are not something this module can plan (see the message)."""


def node_bytes(n: fx.Node) -> Optional[int]:
    """Bytes of ``n``'s value: ``numel * itemsize`` of its ``meta["val"]`` tensor; 0 for a
    placeholder without one (runtime scalars ``s0``...); None for any other node that is not
    one tensor (a tuple result such as ``aten.max.dim``'s, no metadata): never cut there."""
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0 if n.op == "placeholder" else None


def is_reduction(n: fx.Node) -> bool:
    """Whether ``n`` calls one of :data:`REDUCTIONS` or an ``accel::*`` op."""
    t = n.target
    return n.op == "call_function" and (t in REDUCTIONS or getattr(t, "namespace", "") == "accel")


def _ancestors(roots: Iterable[fx.Node], stop: Set[fx.Node]) -> Set[fx.Node]:
    """``roots`` and everything they depend on, not looking past nodes in ``stop``."""
    seen: Set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


def _check(gm: fx.GraphModule, groups: Groups, materialized: Iterable[fx.Node] = ()) -> None:
    for k, outs in enumerate(groups):
        for n in outs:
            if not isinstance(n, fx.Node) or n.graph is not gm.graph or n.op == "output":
                raise PartitionError(f"group {k}: {n!r} is not a value node of this graph")
    for n in materialized:
        if n.op == "placeholder" or node_bytes(n) is None:
            raise PartitionError(f"{n.name} cannot be materialized (placeholder or not a tensor)")


def _min_cut(outs: Sequence[fx.Node], in_memory: Set[fx.Node], avail: Set[fx.Node],
             recompute_reductions: bool) -> Set[fx.Node]:
    """The nodes on a minimum-traffic vertex cut between memory and ``outs`` (module doc)."""
    g = nx.DiGraph()
    needed = _ancestors(outs, in_memory)
    for v in needed:
        b = node_bytes(v)
        if v in in_memory:
            if b is None:
                raise PartitionError(f"{v.name} is in memory but is not one tensor buffer")
            g.add_edge(_SOURCE, (v, "in"))
            g.add_edge((v, "in"), (v, "out"), capacity=b)
            continue  # read, not computed: its inputs do not matter here
        if v in avail and b is not None:
            g.add_edge((v, "in"), (v, "out"), capacity=2 * b)
            if not recompute_reductions and is_reduction(v):
                g.add_edge(_SOURCE, (v, "in"))  # its result must come from memory
        else:
            g.add_edge((v, "in"), (v, "out"))  # no capacity: infinite
        for u in v.all_input_nodes:
            g.add_edge((u, "out"), (v, "in"))
    for o in outs:
        g.add_edge((o, "out"), _SINK)
    if _SOURCE not in g:
        return set()  # outputs computed from constants alone
    try:
        r = nx.flow.edmonds_karp(g, _SOURCE, _SINK)
    except nx.NetworkXUnbounded as e:
        raise PartitionError("an output depends on a value with no finite-cost cut") from e
    # networkx.minimum_cut gives the cut nearest the sink; take the one nearest the source
    # (fewest new buffers on a tie): what the source reaches in the residual network.
    reach, todo = {_SOURCE}, [_SOURCE]
    while todo:
        for w, e in r[todo.pop()].items():
            if w not in reach and e["flow"] < e["capacity"]:
                reach.add(w)
                todo.append(w)
    return {v for v in needed if (v, "in") in reach and (v, "out") not in reach}


def choose_materialized(gm: fx.GraphModule, groups: List[List[fx.Node]], *,
                        recompute_reductions: bool = True) -> Set[fx.Node]:
    """Choose the intermediates earlier groups write to temporary buffers.

    Args:
        gm: a prims graph (:func:`accel.graph.trace_region`, after passes) whose nodes carry
            ``meta["val"]`` (FakeTensors).
        groups: the nodes each kernel group computes and writes, in execution order (group 0
            first). Group outputs are written by their group anyway and are never returned.
        recompute_reductions: False forbids recomputing a reduction that an earlier group
            evaluates: it (or something past it) is materialized. Bytes alone make recomputing
            cheap whenever the reduction's input is read anyway, though it costs a pass over
            that input, or one per element where the lowering does not hoist it.

    Returns:
        Non-placeholder nodes, each computed by an earlier group than one that reads it,
        minimizing :func:`memory_traffic` group by group (module doc: the cut).

    Raises:
        PartitionError: a group lists a node of another graph or the output node, or an
            in-memory node has no single tensor value.
    """
    _check(gm, groups)
    phs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    in_memory, computable, chosen = set(phs), set(), set()
    for k, outs in enumerate(groups):
        if k:
            cut = _min_cut(outs, in_memory, computable - in_memory, recompute_reductions)
            new = cut - in_memory
            log.debug("group %d reads %s; materializes %s", k,
                      sorted(n.name for n in cut), sorted(n.name for n in new))
            chosen |= new
            in_memory |= new
        computable |= _ancestors(outs, phs) - phs
        in_memory |= set(outs)
    return chosen


def memory_traffic(gm: fx.GraphModule, groups: Groups, materialized: Iterable[fx.Node]) -> int:
    """Bytes a plan moves: each group reads its frontier (the in-memory nodes its outputs
    reach without passing another in-memory node: placeholders, earlier groups' outputs,
    materialized nodes an earlier group computes), each placeholder or buffer once per group;
    group outputs and materialized nodes are written once each.

    Raises:
        PartitionError: as :func:`choose_materialized`, or a placeholder is in ``materialized``.
    """
    materialized = set(materialized)
    _check(gm, groups, materialized)
    phs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    in_memory, computable, total = set(phs), set(), 0
    for outs in groups:
        mem = in_memory | (materialized & computable)
        total += sum(node_bytes(n) or 0 for n in _ancestors(outs, mem) & mem)
        computable |= _ancestors(outs, phs) - phs
        in_memory |= set(outs)
    written = {n for outs in groups for n in outs if n.op != "placeholder"} | materialized
    return total + sum(node_bytes(n) or 0 for n in written)


def describe(gm: fx.GraphModule, groups: Groups, materialized: Iterable[fx.Node] = ()) -> str:
    """The graph one node a line, with shape, bytes and role: ``in`` (placeholder),
    ``out<k>`` (written by group k), ``MAT`` (materialized). For logs and test messages."""
    role: Dict[fx.Node, str] = {n: f"out{k}" for k, outs in enumerate(groups) for n in outs}
    role.update({n: "MAT" for n in materialized})
    lines = []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        val = n.meta.get("val")
        shape = list(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        tag = role.get(n, "in" if n.op == "placeholder" else "")
        target = getattr(n.target, "__name__", n.target)
        lines.append(f"{tag:>5} {n.name:<22} {str(target):<28} {shape} {node_bytes(n)}B")
    return "\n".join(lines)
