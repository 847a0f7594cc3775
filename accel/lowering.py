"""Lowering: a prims ``torch.fx`` graph -> loop IR (:mod:`accel.loop_ir`), device independent.

The IR is a list of loop nests. A nest iterates over loop variables (static sizes) and
stores values into buffers; a value is an expression DAG (``Expr``) over loads, scalars,
constants, prim ops and reductions, built by :mod:`accel.lower_expr` (each graph node
evaluated at an index). This module places the stores into nests: which stores share a
nest (their loops and reductions fit), in what loop order, which reductions and
intermediates go to memory first, and where in-place writes of inputs may run.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Sequence, Set, Tuple

import torch
import torch.fx as fx

from . import library  # noqa: F401 - registers torch.ops.accel.cat
from .loop_ir import Addr, BufferSpec, Expr, LoopIR, Nest, Store, forget_free_vars, free_vars, reductions, walk
from .lower_expr import (CONTIGUOUS_RUN, ONE, ConcatRead, ConcatSpans, LoweringError, SplitLoop, _addr, _affine,
                         _Lowerer, even_cuts)
from .passes import writes_argument

prims = torch.ops.prims
aten = torch.ops.aten
_CAT = torch.ops.accel.cat.default

__all__ = ["LoweringError", "lower"]

log = logging.getLogger("accel")


class _WriteHazard(LoweringError):
    """A read of an input written in place would see the wrong values (:func:`lower`
    tries the write in a nest of its own, first or last)."""


# -- nests ------------------------------------------------------------------------------------
def _chain_order(nest_vars: List[int], exprs: List[Expr]):
    """A loop order for ``nest_vars`` in which every reduction's free variables come first
    (so it is hoisted out of the loops it does not depend on), or None if the reductions
    depend on incomparable sets of variables."""
    sets = sorted({free_vars(e) & set(nest_vars) for e in exprs if e.op == "reduce"}, key=len)
    for a, b in zip(sets, sets[1:]):
        if not a <= b:
            return None
    order: List[int] = []
    for s in sets + [frozenset(nest_vars)]:
        order += [v for v in nest_vars if v in s and v not in order]
    return order


def _coalesce(ir: LoopIR, nest: Nest) -> None:
    """Merge adjacent loops that every access walks contiguously and that every reduction
    depends on alike (Inductor's and TVM's loop fusion), in place; size-1 loops vanish.""" 
    exprs: List[Expr] = []
    seen: set = set()
    for st in nest.stores:
        exprs += list(walk(st.value, seen))
    addrs = [st.addr for st in nest.stores] + [e.args[1] if e.op == "load" else e.args[0]
                                               for e in exprs if e.op in ("load", "index")]
    reds = [e for e in exprs if e.op == "reduce"]
    merge: Dict[int, int] = {}  # var -> the var it folds into

    def chains():
        yield nest.vars
        for r in reds:
            yield list(r.args[2])

    for loop in chains():
        for a, b in zip(loop, loop[1:]):
            if a in merge or b in merge:
                continue
            sa, sb = ir.sizes[a], ir.sizes[b]
            if sa == 1 or sb == 1:
                continue
            if all(ad.coeff(a) == ad.coeff(b) * sb for ad in addrs) and all(
                    (a in free_vars(r)) == (b in free_vars(r)) for r in reds):
                merge[a] = b
    for a, b in merge.items():  # a is outer: b's range grows by a's
        ir.sizes[b] *= ir.sizes[a]
    # loops of one iteration vanish (their variable is 0)
    merge.update({v: None for v in list(nest.vars) + [v for r in reds for v in r.args[2]]
                  if ir.sizes[v] == 1 and v not in merge})
    if not merge:
        return
    memo: Dict[Expr, Expr] = {}

    def fix_addr(ad: Addr) -> Addr:
        return ad.without(merge)

    def fix(e: Expr) -> Expr:
        r = memo.get(e)
        if r is None:
            if e.op == "load":
                r = Expr("load", e.dtype, (e.args[0], fix_addr(e.args[1])))
            elif e.op == "index":
                r = Expr("index", e.dtype, (fix_addr(e.args[0]),))
            elif e.op == "reduce":
                kind, bodies, rv, which = e.args
                r = Expr("reduce", e.dtype, (kind, tuple(map(fix, bodies)),
                                             tuple(v for v in rv if v not in merge), which))
            else:
                r = Expr(e.op, e.dtype, tuple(fix(a) if isinstance(a, Expr) else a for a in e.args))
            memo[e] = r
        return r

    nest.vars = [v for v in nest.vars if v not in merge]
    nest.stores = [Store(st.buf, fix_addr(st.addr), fix(st.value)) for st in nest.stores]


def lower(gm: fx.GraphModule, ext: Sequence[BufferSpec], outs: Sequence[BufferSpec],
          scalar_types: Sequence[str], device: str = "cpu") -> LoopIR:
    """Lower a traced region to loop nests.

    Args:
        gm: a graph from :func:`accel.graph.trace_region` (after passes).
        ext: the external input buffers (kernel args ``0..len(ext)-1``).
        outs: the live output buffers, in the graph's output order (kernel args after ext).
        scalar_types: ``"f"``/``"i"`` per runtime scalar.
        device: ``"cpu"`` or ``"cuda"``, the device type the kernel is for: a total
            reduction is split into rows stored by an output's nest on the CPU only
            (:func:`_split_totals`; unmeasured on a GPU).

    Each store joins the first nest whose loops it fits (same rank, its sizes equal to the
    nest's or 1) and whose reductions it does not conflict with; otherwise it opens a new
    nest, recomputing what it needs from the inputs. A reduction that would run a store's
    contiguous dim in a loop outside another of its dims (column statistics under a [N, C]
    output: ``x / x.sum(0)``, batch norm of [N, C]) goes to memory first, in a nest of its
    own, so that the store's nest runs along the rows.

    An input written in place (a graph ``copy_`` into a placeholder) is written where it
    fits, like an output, in the nest of reductions that read only the elements its own
    iteration writes (``x.div_(x.sum(-1, keepdim=True))``: a row's sum, then the row's
    writes; :func:`_row_local`). A region that writes one input whose outputs read its new values
    only (``h.add_(r)`` then ``relu(h).mean(0)``) is also lowered with the write first, in
    a nest of its own, and later nests reading the new values back from the input; the one
    of the two that moves fewer bytes is kept. Where a read of its old values would see new
    ones (a nest reading it at other elements while or after it is written: ``x.div_(
    x.sum(0).unsqueeze(1))``, row i over column i's sum), it is lowered with the write
    first, or else with each write in a nest of its own after every other (as AOT autograd
    applies input mutations after the compiled graph); either way, the reductions its new
    values take over written inputs are moved to memory before. Nests run one after another
    on both backends (CPU: each its own OpenMP loop; CUDA: one launch each, on one stream).

    Raises:
        LoweringError: an op or aliasing pattern the IR does not express (two inputs
            written in place, each from the other's old values at other elements).
    """
    for n in gm.graph.nodes:  # (a decomposition's write into a fresh tensor: prims.copy_to)
        if writes_argument(n) and n.target is not aten.copy_.default:
            raise LoweringError(f"a write the loop IR does not express: {n.format_node()}")
    split = _split_totals(gm, outs) if device == "cpu" else []
    try:
        ir = _lower_writes(gm, ext, outs, scalar_types)
    except LoweringError as e:  # (_WriteHazard too)
        if not split:
            raise
        log.debug("accel: lowered with its totals whole (%s)", e)
        _join_totals(gm, split)
        return _lower_writes(gm, ext, outs, scalar_types)
    for n, _, _ in split:
        gm.graph.erase_node(n)
    return ir


def _lower_writes(gm, ext, outs, scalar_types) -> LoopIR:
    """:func:`lower`'s choice among the places for in-place writes: where they fit, else
    first or last (the one of fit and first that moves fewer bytes)."""
    try:
        ir = _lower(gm, ext, outs, scalar_types, "fit")
    except _WriteHazard:
        ir = None
    if any(n.target is aten.copy_.default for n in gm.graph.nodes):
        try:
            first = _lower(gm, ext, outs, scalar_types, "first")
            if ir is None or _traffic(first) < _traffic(ir):
                ir = first
        except _WriteHazard:
            pass
    return ir if ir is not None else _lower(gm, ext, outs, scalar_types, "last")


#: :func:`_split_totals`: a total reduction is split into rows of at least ``PARTIAL_ROW``
#: elements (its value's last dims), at least ``PARTIAL_ROWS`` of them
PARTIAL_ROW = 512
PARTIAL_ROWS = 256
_TOTALS = (prims.sum.default, prims.prod.default, prims.amax.default, prims.amin.default)
_PARTIAL = "accel_partial"  # node.meta key: a total reduction's rows, stored to scratch


def _split_totals(gm: fx.GraphModule, outs: Sequence[BufferSpec]) -> list:
    """Rewrite each total reduction (a sum, product, max or min over every dim: a loss's
    ``(y * y).sum()``) of a value with as many elements as the region's biggest output, in
    ``gm``, into two: the value's rows reduced first (its last dims, of at least
    :data:`PARTIAL_ROW` elements, at least :data:`PARTIAL_ROWS` rows), kept in the value's
    outer dims (``[N, C, 1, 1]`` of ``[N, C, H, W]``), then those results reduced. The
    rows' results (marked ``meta["accel_partial"]``) are stored to scratch by the nest of
    the output their dims fit (:func:`_lower_with`), which computes the rows' values
    anyway (the C++ renderer keeps them in a row cache between the rows' reduction and the
    store's loop), instead of a nest of the total's own reading the inputs again and
    computing the values again. The rows accumulate as the total did (float64 or int64
    for sums and products), then the total accumulates their results likewise (Inductor
    splits big reductions alike: ``ir.Reduction.create``'s ``num_splits``). Totals reading
    an input the region writes in place, and regions concatenating, are left as they are.
    Returns ``[(total, its replacement, the nodes added)]`` for :func:`_join_totals`; the
    totals themselves stay in the graph, unused."""
    g = gm.graph
    if not outs or any(n.target is _CAT for n in g.nodes):
        return []
    size = max(_prod(b.shape) for b in outs)
    written = {n for w in g.nodes if w.target is aten.copy_.default for n in (w, w.args[0])}
    done = []
    for n in [n for n in g.nodes if n.target in _TOTALS]:
        v = n.args[0]
        val = v.meta["val"]
        vs = tuple(val.shape)
        if sorted(d % max(1, len(vs)) for d in n.args[1]) != list(range(len(vs))) or _prod(vs) != size \
                or written & _reach([v]):  # (an input written in place: its writes run where they fit)
            continue
        k = max((k for k in range(1, len(vs)) if _prod(vs[k:]) >= PARTIAL_ROW), default=0)
        if not k or _prod(vs[:k]) < PARTIAL_ROWS:
            continue
        dtype = n.meta["val"].dtype
        acc = dtype if n.target in (prims.amax.default, prims.amin.default) else \
            torch.float64 if dtype.is_floating_point else torch.int64
        added = []

        def add(target, args, shape, dt=acc):
            node = g.call_function(target, args)
            node.meta["val"] = val.new_empty(shape, dtype=dt)
            added.append(node)
            return node

        ones = (1,) * (len(vs) - k)
        with g.inserting_before(n):
            x = v if val.dtype == acc else add(prims.convert_element_type.default, (v, acc), vs)
            rows = add(prims.broadcast_in_dim.default,
                       (add(n.target, (x, list(range(k, len(vs)))), vs[:k]), vs[:k] + ones, list(range(k))),
                       vs[:k] + ones)
            rows.meta[_PARTIAL] = True
            total = add(n.target, (rows, list(range(len(vs)))), ())
            if acc != dtype:
                total = add(prims.convert_element_type.default, (total, dtype), (), dtype)
        n.replace_all_uses_with(total)
        done.append((n, total, added))
    return done


def _join_totals(gm: fx.GraphModule, split: list) -> None:
    """Undo :func:`_split_totals`: each total back in its replacement's place."""
    for n, total, added in reversed(split):
        total.replace_all_uses_with(n)
        for node in reversed(added):
            gm.graph.erase_node(node)


def _traffic(ir: LoopIR) -> int:
    """Bytes the nests of ``ir`` move: each buffer a nest reads, whole, once, and each
    one it writes."""
    total = 0
    for nest in ir.nests:
        seen: set = set()
        loads = {e.args[0] for st in nest.stores for e in walk(st.value, seen) if e.op == "load"}
        for b in [*loads, *{st.buf for st in nest.stores}]:
            total += _prod(ir.buffers[b].shape) * ir.buffers[b].dtype.itemsize
    return total


def _lower(gm, ext, outs, scalar_types, writes: str) -> LoopIR:
    """:func:`lower`, with the in-place writes placed where they fit (``writes="fit"``),
    first, with the new values read back from the input ("first"), or in nests of their
    own after every other ("last"). A concatenation that a store cannot read piece by
    piece where it is placed (:class:`accel.lower_expr.ConcatRead` after
    :func:`_split_concats`) is stored first, and the region lowered again.

    Raises:
        _WriteHazard: a read that would see the wrong values, or ("first") a region that
            writes more than one input or reads an old value other than in the write.
    """
    first: Tuple[fx.Node, ...] = ()
    while True:
        try:
            return _lower_with(gm, ext, outs, scalar_types, writes, first)
        except ConcatRead as e:
            if e.node in first:
                raise LoweringError(str(e)) from e
            first += (e.node,)


def _lower_with(gm, ext, outs, scalar_types, writes: str, stored_first) -> LoopIR:
    """:func:`_lower`, with the concatenations ``stored_first`` stored first."""
    forget_free_vars()
    lw = _Lowerer(gm, ext, scalar_types)
    buffers = lw.buffers
    buffers += list(outs)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    rets = out_node.args[0]
    rets = list(rets) if isinstance(rets, (tuple, list)) else [rets]
    if len(rets) != len(outs):
        raise LoweringError("output count mismatch")
    jobs = [(len(ext) + i, *_peel_views(r, outs[i]), False) for i, r in enumerate(rets)]
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.copy_.default:
            dst, src = n.args
            if dst not in lw.tensor_ph:
                raise LoweringError("copy_ into a non-input")
            jobs.append((lw.tensor_ph[dst], *_peel_views(src, ext[lw.tensor_ph[dst]]), True))
    concats = []  # (concatenation, its pieces): stored first, read from memory
    if any(n.target in (_CAT, prims.collapse_view.default) for n in gm.graph.nodes):
        jobs, concats = _split_concats(lw, jobs, stored_first)
    row_bufs = set()
    for n in gm.graph.nodes:  # a total reduction's rows (_split_totals), in scratch
        if n.meta.get(_PARTIAL) and n.users:
            spec = _scratch(n)
            buffers.append(spec)
            row_bufs.add(len(buffers) - 1)
            jobs.append((len(buffers) - 1, n, spec, False))
    first = writes == "first"
    if first and not _reads_new_values(jobs, lw):
        raise _WriteHazard("the outputs read the old values of an input written in place")
    jobs = _common_loops(jobs)
    apart_jobs, shared, early = _statistics_apart(lw, jobs)
    apart = {id(j) for j in apart_jobs}
    # biggest first, mutations last (first); statistics that cannot share the biggest's
    # nest before it
    jobs.sort(key=lambda j: (j[3] != first, id(j) not in apart, -_prod(j[2].shape)))
    nests: List[Nest] = []
    placed: List[List[tuple]] = []  # per nest: its jobs (buffer, node, spec, is mutation)
    shapes: Dict[int, tuple] = {}  # nest -> (shape, variables in dim order)
    forced = 0  # nests of reductions moved to memory: they run first, in creation order

    home: Dict[fx.Node, Nest] = {}  # the nest of each reduction moved to memory

    def place(job, fresh_only=False, among=(), last=False):
        """Put ``job``'s store into the first nest it fits (``fresh_only``: only those in
        ``among``) after the nests of the reductions it reads from memory, or a new one
        (``last``: a new one, after every other); returns that nest, or None."""
        buf, node, spec, mutation = job
        reads = _reach([node]) if home else ()
        later = nests[max((nests.index(home[d]) + 1 for d in home if d in reads), default=0):]
        for nest in ([] if last else [n for n in among if n in later] if fresh_only else later) + [None]:
            if nest is None:
                dims = [lw.new_var(s) for s in spec.shape]
                nest = Nest(_memory_order(dims, spec))
                shapes[id(nest)] = (tuple(spec.shape), tuple(dims))
            elif mutation and shapes[id(nest)][0] != tuple(spec.shape):
                continue  # an in-place write runs once per element: no extra loops
            store = _store(lw, shapes[id(nest)], buf, spec, node)
            if store is None:
                continue
            # a store reading a buffer the nest writes (not an input written in place, which
            # _check_hazards vets) waits for a later nest: a reduction moved to memory
            written = {s.buf for s in nest.stores if s.buf >= len(ext)}
            if written and any(e.op == "load" and e.args[0] in written
                               for e in walk(store.value, set())):
                continue
            trial = nest.stores + [store]
            exprs = [e for s in trial for e in walk(s.value, set())]
            order = _chain_order(nest.vars, exprs)
            if order is None or any(free_vars(e) - set(nest.vars) for e in exprs if e.op == "reduce"):
                continue  # reductions that cannot all be hoisted, or one inside another's loop
            reds = [e for e in exprs if e.op == "reduce"]
            if any(_transposing(st, reds, lw.sizes, not buffers[st.buf].scratch) for st in trial
                   if st.buf not in row_bufs):  # (a total's rows: one value a row, however laid out)
                continue  # a loop along a store's contiguous dim outside another of its loops
            nest.vars, nest.stores = order, trial
            if not nest.stores[:-1]:
                at = forced if fresh_only else len(nests)
                nests.insert(at, nest)
                placed.insert(at, [])
            placed[nests.index(nest)].append(job)
            return nest
        return None

    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    pieced: List[fx.Node] = []  # reductions to_memory stores piece by piece

    def to_memory(inner: List[fx.Node]) -> None:
        """Store reductions ``inner`` to scratch buffers in nests of their own, which run
        first, in graph order; one may share a nest of this call's with others (a mean and
        a variance of one Welford), after the nests of those it reads (``place``). A
        reduction that conflicts with others in its own nest (a variance of values centered
        by a column mean) sends those to memory before it, and so on."""
        nonlocal forced
        made: List[Nest] = []
        if any(r not in position for r in inner):  # nodes the lowering added (_column_split)
            position.update({n: k for k, n in enumerate(gm.graph.nodes)})
        for r in sorted(inner, key=position.__getitem__):
            spec = _scratch(r)
            buffers.append(spec)
            buf = len(buffers) - 1
            # (piece by piece where it reads a concatenation's pieces: a group norm's
            # statistics of ``torch.cat([h, skip], 1)``, for its backward)
            pieces = _split_spans(lw, (buf, r, spec, False))
            if len(pieces) > 1:
                pieced.append(r)
            homes = []
            for job in pieces:
                while (nest := place(job, fresh_only=True, among=made)) is None:
                    deeper = _conflicting(lw, job)
                    if not deeper:
                        raise LoweringError(f"cannot schedule {r.format_node()}")
                    to_memory(deeper)  # (their nests run after made's: place keeps r after them)
                if nest not in made:
                    made.append(nest)
                    forced += 1
                homes.append(nest)
            home[r] = max(homes, key=nests.index)  # (the last to run: readers are placed after it)
            lw.in_memory[r] = (buf, spec)
        lw.memo.clear()

    for cat, pieces in concats:  # first, in the order they were met (one may read another)
        kept = lw.in_memory.pop(cat)  # (each piece's value read from the concatenated inputs)
        lw.memo.clear()
        made = []
        for job in pieces:
            if (nest := place(job, fresh_only=True, among=made)) is None:
                raise LoweringError(f"cannot schedule {cat.format_node()}")
            if nest not in made:
                made.append(nest)
                forced += 1
        home[cat] = made[-1]  # (the last to run: readers are placed after it)
        lw.in_memory[cat] = kept
        lw.memo.clear()
    if early:  # (a batch norm's statistics, which its running statistics' update reads too)
        to_memory(list(early))
    inputs_written = {job[0] for job in jobs if job[3]}
    for job in jobs:
        write_first, write_last = job[3] and first, job[3] and writes == "last"
        while (write_first or write_last) and (inner := _reading(lw, job, inputs_written)):
            to_memory(inner)  # its reductions over written inputs run before any write
        # (first: the write's nest counts as one of the nests that run first, so that
        # every nest placed after it, reductions moved to memory too, runs after it)
        while (nest := place(job, fresh_only=write_first, last=write_last)) is None:
            # reductions that cannot all be hoisted in one nest (one nested in another's
            # loop, or depending on unrelated loops): the inner ones go to memory first
            inner = _conflicting(lw, job)
            if not inner:
                raise LoweringError(f"cannot schedule the reductions of {job[1].format_node()}")
            to_memory(inner)
        # later nests read it back: an input's new values, a total's rows' results
        if write_first or job[1].meta.get(_PARTIAL):
            forced += write_first
            home[job[1]] = nest
            lw.in_memory[job[1]] = (job[0], _whole(job[2]))
            lw.memo.clear()
    if len(nests) > 1:
        stored: Dict[int, list] = {}
        for cat in [cat for cat, _ in concats] + pieced:  # (read whole after the last piece's nest)
            stored.setdefault(id(home[cat]), []).append((cat, lw.in_memory[cat]))
        for node, (k, buf, spec) in _outputs_in_pieces(placed).items():  # (likewise)
            stored.setdefault(id(nests[k]), []).append((node, (buf, spec)))
        _reuse_memory(lw, gm, buffers, nests, placed, shapes, first, stored, shared)
    ir = LoopIR(buffers, list(scalar_types), lw.sizes, nests)
    for nest in nests:
        _coalesce(ir, nest)
    _check_hazards(ir, len(ext), new_values_after=first)
    _check_bounds(ir)
    return ir


def _statistics_apart(lw: _Lowerer, jobs) -> Tuple[List[tuple], Set[fx.Node], Set[fx.Node]]:
    """What goes before the biggest jobs' nest (the jobs of the most elements, which share
    a nest: :func:`_common_loops`): ``(jobs, shared, early)``.

    ``jobs``: those (not in-place writes) whose values take reductions the biggest jobs'
    values take too, and whose stores cannot join a nest over their shape (another rank:
    a batch norm's gradients of its weight and bias, ``[C]``, beside its input's, ``[N, C,
    H, W]``, all three from the per-channel sums of the incoming gradient and of its
    product with the normalized input); ``shared``: those reductions' graph nodes. The jobs
    go first and store the reductions too, which the nests after them read
    (:func:`_reuse_memory`): placed after, the biggest nest would run each reduction and a
    nest of theirs run it again, reading the reductions' inputs once more (where the
    biggest jobs need no reduction of theirs, as a bias gradient's column sum of the
    biggest output, they stay after it and read that output).

    ``early``: the graph nodes of the reductions the biggest jobs share with in-place
    writes of another shape (a training batch norm's statistics, which its running
    statistics' update reads): an in-place write runs once per element, after the outputs'
    nests, so these go to memory first, in a nest of their own, instead of being run again
    by the write's nest. Jobs reading a total's rows (:func:`_split_totals`) are left out:
    they read the rows' results after the biggest nest, which stores them."""
    if len(jobs) < 2:
        return [], set(), set()
    size = max(_prod(j[2].shape) for j in jobs)
    bigs = [j for j in jobs if _prod(j[2].shape) == size]  # (one nest: _common_loops)
    shape = tuple(bigs[0][2].shape)
    rows = _reach([j[1] for j in jobs if j[1].meta.get(_PARTIAL)], down=True)
    # (an in-place write joins only a nest of its own shape: see place)
    others = [j for j in jobs if not j[2].origin and j[1] not in rows
              and not (tuple(j[2].shape) == shape if j[3] else _fits(j[2].shape, shape))]
    needed = set(_not_in_memory(lw, [r for j in bigs for r in _reductions(lw, j)[1]])) if others else set()
    out, shared, early = [], set(), set()
    for job in others if needed else []:
        common = needed & set(_not_in_memory(lw, _reductions(lw, job)[1]))
        if common and job[3]:
            early |= common
        elif common:
            out.append(job)
            shared |= common
    return out, shared, early


def _outputs_in_pieces(placed) -> Dict[fx.Node, tuple]:
    """The values stored piece by piece into outputs (:func:`_split_spans`; not inputs
    written in place), by node: (the nest that stores its last piece, the buffer, the
    value's spec whole), so that later nests read it whole (a U-Net block's output, stored
    piece by piece, read by the loss's sum) rather than compute it again."""
    last: Dict[fx.Node, tuple] = {}
    for k, jobs in enumerate(placed):
        for buf, node, spec, mutation in jobs:
            if spec.origin and not mutation:
                last[node] = (k, buf, dataclasses.replace(_whole(spec), shape=tuple(node.meta["val"].shape),
                                                          origin=()))
    return {n: v for n, v in last.items() if len(v[2].shape) == len(v[2].stride)}


def _check_bounds(ir: LoopIR) -> None:
    """Every load and store stays inside its buffer (a safety net: a wrong index is a
    lowering bug, and the region then runs eagerly instead of corrupting memory)."""
    def extent(b: BufferSpec) -> int:
        return 1 + sum((sz - 1) * st for sz, st in zip(b.shape, b.stride) if sz > 0)

    for nest in ir.nests:
        accesses = [(st.buf, st.addr) for st in nest.stores]
        seen: set = set()
        for st in nest.stores:
            accesses += [(e.args[0], e.args[1]) for e in walk(st.value, seen) if e.op == "load"]
        for buf, addr in accesses:
            lo, hi = addr.extent(ir.sizes)
            b = ir.buffers[buf]
            if 0 in b.shape:
                continue
            if lo < 0 or hi >= extent(b):
                raise LoweringError(f"internal: access {addr} out of buffer {buf} {b.shape}/{b.stride}")


def _reductions(lw: _Lowerer, job) -> Tuple[Store, List[Expr]]:
    """``job``'s store in a nest of its own (None where it does not fit), and the
    reductions in its value."""
    buf, node, spec, _ = job
    nest = Nest([lw.new_var(s) for s in spec.shape])
    store = _store(lw, (tuple(spec.shape), tuple(nest.vars)), buf, spec, node)
    return store, [] if store is None else [e for e in walk(store.value, set()) if e.op == "reduce"]


def _not_in_memory(lw: _Lowerer, reds) -> List[fx.Node]:
    """The graph nodes that compute reductions ``reds``, less those already in memory."""
    return [n for n in dict.fromkeys(lw.reduce_node.get(r) for r in reds)
            if n is not None and n not in lw.in_memory]


def _conflicting(lw: _Lowerer, job) -> List[fx.Node]:
    """The graph nodes of the reductions that keep ``job`` from one nest (not in memory
    yet): those evaluated inside another reduction's loop at its reduction variables, else
    all but the ones depending on the most loop variables, else those that would put a
    loop along its contiguous dim outside another of its loops (:func:`_transposing`)."""
    store, reds = _reductions(lw, job)
    nested = {x for r in reds for b in r.args[1] for x in walk(b, set())
              if x.op == "reduce" and free_vars(x) & set(r.args[2])}
    if not nested:
        most = max((free_vars(r) for r in reds), key=len, default=frozenset())
        nested = {r for r in reds if not free_vars(r) <= most}
    if not nested and store is not None:
        nested = set(_transposing(store, reds, lw.sizes, not job[2].scratch))
    return _not_in_memory(lw, nested)


def _transposing(store: Store, reds: Sequence[Expr], sizes, across: bool = True) -> List[Expr]:
    """The reductions among ``reds`` whose hoisting (their free variables' loops outermost)
    would leave ``store``'s innermost loops walking fewer than :data:`CONTIGUOUS_RUN`
    contiguous elements, where its memory order walks more: ``x / x.sum(0, keepdim=True)``
    and batch norm of [N, C] (the columns outside the rows: one element a step), a
    channels-last group norm (the groups outside H and W: a group's few channels a step).
    In one nest every access of the store's loops would stride (each OpenMP thread, or each
    CUDA thread, walking a column); with such a reduction stored to memory first (a column
    reduction's own nest, vectorized across the columns), the store's nest runs in its
    memory order. (A contiguous batch norm's channels outside N walk H * W elements a
    step: one nest, each channel's statistics and outputs while it is in cache.) With
    ``across``, also the reductions that read across rows (:func:`_reads_across`); not
    for a reduction's own scratch store, the nest of its own that the rule sends it to
    (it would never fit anywhere: a LayerNorm backward's column sum over a batch, reading
    the rows' sums from memory across the batch, recursed until Python's limit)."""
    terms = sorted(((abs(c), v) for v, c in store.addr.terms if sizes[v] > 1), reverse=True)

    def run(order) -> int:  # contiguous elements the innermost loops of ``order`` walk
        n = 1
        for c, v in reversed(order):
            if c != n:
                break
            n *= sizes[v]
        return n

    best = run(terms)
    inner = terms[-1][1] if terms else None
    if across and reds and inner is not None and _reads_across_rows(store.value, inner):
        return list(reds)
    out = []
    for r in reds:
        free = free_vars(r)
        hoisted = [t for t in terms if t[1] in free] + [t for t in terms if t[1] not in free]
        if run(hoisted) < min(CONTIGUOUS_RUN, best) or (across and _reads_across(r, free - {inner})):
            out.append(r)
    return out


def _reads_across_rows(value: Expr, inner: int) -> bool:
    """Whether ``value``, outside its reductions, loads across the rows of a store whose
    contiguous loop is ``inner``: a load that ``inner`` strides by at least
    :data:`CONTIGUOUS_RUN` elements and another loop walks contiguously (a channels-last
    group norm's output written contiguous, as torch 2.11's CUDA group norm returns it).
    Its reductions then go to memory first, so that the output's nest is elementwise and
    the renderers tile it (:func:`accel.codegen.tiles.transposed_loads`): in one nest with
    them, a CUDA block a group read the group's channels one element a thread, 291 us of
    the H200's time on [64, 128, 64, 64], torch.compile 62."""
    return any(_across(e, inner, None) for e in walk(value, set(), into_reduce=False))


def _across(e: Expr, along: int, walks) -> bool:
    """``e`` is a load that loop ``along`` strides by at least :data:`CONTIGUOUS_RUN`
    elements and one of the loops ``walks`` (None: any loop) walks contiguously."""
    return (e.op == "load" and abs(e.args[1].coeff(along)) >= CONTIGUOUS_RUN
            and any(c == 1 and (walks is None or v in walks) for v, c in e.args[1].terms))


def _reads_across(r: Expr, free) -> bool:
    """Whether reduction ``r`` reads across rows: its innermost reduction loop strides
    by at least :data:`CONTIGUOUS_RUN` elements, where one of its loop variables ``free``
    (not the store's contiguous one) walks the same load contiguously: a softmax over the
    rows of a transposed tensor (``x.t().softmax(-1)``), whose statistics, in a nest of
    their own, then accumulate vectors of neighbouring rows (the column form; the C++
    renderer tiles the output's nest, :meth:`accel.codegen.tiles.TiledLoops._plan_tile`)."""
    last = r.args[2][-1] if r.args[2] else None
    return any(_across(e, last, free) for b in r.args[1] for e in walk(b, set(), into_reduce=False))


def _reads_new_values(jobs, lw: _Lowerer) -> bool:
    """Whether one input is written in place, its new values have its dtype and shape, and
    the outputs read it only through them (not the values it had)."""
    writes = [j for j in jobs if j[3]]
    if len(writes) != 1:
        return False
    buf, node, spec, _ = writes[0]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != spec.dtype or tuple(val.shape) != _whole(spec).shape:
        return False
    old = next(ph for ph, k in lw.tensor_ph.items() if k == buf)
    seen, todo = {node}, [j[1] for j in jobs if not j[3]]
    while todo:
        n = todo.pop()
        if n is old:
            return False
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return True


def _reading(lw: _Lowerer, job, bufs) -> List[fx.Node]:
    """The graph nodes of the reductions in ``job``'s value that read buffers ``bufs``
    and are not in memory yet."""
    return _not_in_memory(lw, [r for r in _reductions(lw, job)[1]
                               if any(x.op == "load" and x.args[0] in bufs for x in walk(r, set()))])


def _fits(shape, loops) -> bool:
    """Whether a store of ``shape`` fits a nest over ``loops`` (a shape): the same rank,
    each size equal to the loop's or 1."""
    return len(shape) == len(loops) and all(s in (1, n) for s, n in zip(shape, loops))


def _store(lw: _Lowerer, domain, buf: int, b: BufferSpec, node: fx.Node):
    """A store of ``node`` into buffer ``b`` in a nest over ``domain`` (its shape and its
    variables, in dim order), or None if ``b`` does not fit the loops (same rank, each
    size equal or 1)."""
    shape, loop_vars = domain
    if not _fits(b.shape, shape):
        return None
    origin = b.origin or (0,) * len(b.shape)
    idx = tuple(_affine((((v, 1),) if s != 1 else (), 1), (((ONE, 1),), o))
                for v, s, o in zip(loop_vars, b.shape, origin))
    at, at_shape = idx, b.shape
    if b.merged:  # the value's index: each group of split dims merged back
        at, at_shape, k = [], [], 0
        for ms in b.merged:
            at.append(_affine(*zip(idx[k:k + len(ms)], ms)))
            at_shape.append(b.shape[k] * ms[0])
            k += len(ms)
    value = lw.cast(lw.at(node, tuple(at), tuple(at_shape)), b.dtype)
    terms = _affine(*((a, st) for a, st in zip(idx, b.stride) if a))
    return Store(buf, _addr(terms), value)


def _split_spans(lw: _Lowerer, job) -> list:
    """``job``, or where its value reads a concatenation across its pieces along a dim of
    its store (:class:`accel.lower_expr.ConcatSpans`: a ``torch.cat`` written out, or
    read by pointwise ops: ``x * cos + cat(-x2, x1) * sin``), the jobs that store it
    piece by piece: each over the dim's range within one piece (:attr:`BufferSpec.origin`),
    their loops reading each input at its own index, with no select between them. Where
    it reads a merge of dims (:class:`accel.lower_expr.SplitLoop`), the store's dim is cut
    where a group of the merged dims' digits begins, and its whole groups split in two
    (:attr:`BufferSpec.merged`): 22 channels from channel 10 in groups of 4 as channels
    10-11, then 5 groups of 4. An
    input's write (a gradient accumulated in place from ``glu``'s backward) is written so
    too: its pieces fit one nest (all of an iteration's reads come before its writes) or
    the write runs eagerly (:func:`_check_hazards`: one nest writes an input).

    Raises:
        ConcatRead: the pieces run along a reduction's loop, or a concatenation is read at
            an index that mixes a loop with others.
    """
    buf, node, spec, mutation = job
    dims = tuple(lw.new_var(s) for s in spec.shape)
    try:
        _store(lw, (tuple(spec.shape), dims), buf, spec, node)
    except SplitLoop as e:
        if e.var not in dims:
            raise LoweringError(str(e)) from e
        d = dims.index(e.var)
        size = spec.shape[d]
        head = -e.offset % e.inner  # where the loop's first whole group of digits starts
        if head == 0 and size % e.inner == 0:
            return _split_spans(lw, (buf, node, _split_dim(spec, d, e.inner), mutation))
        # the part groups at either end apart, then the whole groups between split
        cuts = sorted({c for c in (head, head + (size - head) // e.inner * e.inner) if 0 < c < size})
        if not cuts:
            raise LoweringError(str(e)) from e
        return _pieces(lw, job, d, cuts)
    except ConcatSpans as e:
        if e.var not in dims:
            raise ConcatRead(e.node, f"a concatenation read across its pieces: {node.format_node()}") from e
        d = dims.index(e.var)
        return _pieces(lw, job, d, even_cuts(e.cuts, spec.shape[d]))
    return [job]


def _pieces(lw: _Lowerer, job, d: int, cuts) -> list:
    """``job``'s store cut along its dim ``d`` at ``cuts`` (ascending, within the dim), each
    piece split again where it needs (:func:`_split_spans`)."""
    buf, node, spec, mutation = job
    origin = spec.origin or (0,) * len(spec.shape)
    bounds = [0, *cuts, spec.shape[d]]
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        piece = dataclasses.replace(spec, shape=spec.shape[:d] + (hi - lo,) + spec.shape[d + 1:],
                                    origin=origin[:d] + (origin[d] + lo,) + origin[d + 1:])
        pieces += _split_spans(lw, (buf, node, piece, mutation))
    return pieces


def _split_dim(spec: BufferSpec, d: int, inner: int) -> BufferSpec:
    """``spec`` with its dim ``d`` (a multiple of ``inner``) split in two, the inner of size
    ``inner``, its stride and origin split to match (:attr:`BufferSpec.merged`)."""
    origin = spec.origin or (0,) * len(spec.shape)
    merged = list(spec.merged or ((1,),) * len(spec.shape))
    g, j = 0, d  # (d's group, and its place in it)
    while j >= len(merged[g]):
        j -= len(merged[g])
        g += 1
    m = merged[g][j]
    merged[g] = merged[g][:j] + (m * inner, m) + merged[g][j + 1:]
    return dataclasses.replace(
        spec, shape=spec.shape[:d] + (spec.shape[d] // inner, inner) + spec.shape[d + 1:],
        stride=spec.stride[:d] + (spec.stride[d] * inner, spec.stride[d]) + spec.stride[d + 1:],
        origin=origin[:d] + divmod(origin[d], inner) + origin[d + 1:] if spec.origin else (),
        merged=tuple(merged))


def _common_loops(jobs) -> list:
    """``jobs`` whose stores would need nests of different shapes over the same number of
    elements (a group norm's input ``[N, C, H, W]`` and its output, peeled to
    ``[N, G, C/G, H * W]``: :func:`_peel_views`), their dims split (:func:`_split_dim`) to
    the coarsest shape that refines both (``[N, G, C/G, H, W]``), so that one nest can
    store them all and read their common inputs once; a store over fewer elements that
    fits one such shape (each dim equal or 1: the group norm's mean, ``[N, G, 1, 1]``) is
    split alike. Shapes are refined by their dims' suffix products (row-major logical
    index); where those do not divide one another (``[6, 4]`` and ``[4, 6]``), or in a
    concatenation's pieces, the jobs are left as they are."""
    if len(jobs) < 2 or any(j[2].origin for j in jobs):
        return jobs
    big = max(_prod(j[2].shape) for j in jobs)
    shapes = {tuple(j[2].shape) for j in jobs if _prod(j[2].shape) == big}
    if big == 0 or len(shapes) < 2:
        return jobs
    cuts = sorted({1} | {_prod(s[k:]) for s in shapes for k in range(len(s))})
    if any(b % a for a, b in zip(cuts, cuts[1:])):
        return jobs

    def parts(shape) -> list:  # per dim, the sizes it splits into (innermost last)
        out, inner = [], 1
        for n in reversed(shape):
            sizes = [c // p for p, c in zip(cuts, cuts[1:]) if inner <= p and c <= inner * n] if n > 1 else [1]
            out.append(sizes[::-1])  # (outermost first)
            inner *= n
        return out[::-1]

    splits = {s: parts(s) for s in shapes}
    out = []
    for buf, node, spec, mutation in jobs:
        plan = splits.get(tuple(spec.shape)) or next(
            ([[1] * len(p) if n == 1 else p for n, p in zip(spec.shape, ps)] for s, ps in splits.items()
             if _fits(spec.shape, s)), None)
        if plan is not None and not spec.merged:
            for d in reversed(range(len(plan))):
                for inner in reversed(plan[d][1:]):  # (the innermost piece first)
                    spec = _split_dim(spec, d, inner)
        out.append((buf, node, spec, mutation))
    return out


def _whole(spec: BufferSpec) -> BufferSpec:
    """``spec`` as its stored value sees it: the dims :func:`_split_dim` split merged back."""
    if not spec.merged:
        return spec
    shape, stride, k = [], [], 0
    for ms in spec.merged:
        shape.append(spec.shape[k] * ms[0])
        stride.append(spec.stride[k + len(ms) - 1])
        k += len(ms)
    return dataclasses.replace(spec, shape=tuple(shape), stride=tuple(stride), merged=())


def _split_concats(lw: _Lowerer, jobs, first=()) -> Tuple[list, list]:
    """``jobs`` split piece by piece where they store a concatenation (:func:`_split_spans`),
    and the concatenations ``first`` and those read across their pieces other than along a
    store's or a reduction's loop (a channel at ``2 * g + c`` where a piece starts inside a
    group) stored first: each into the output that holds it (its job taken from ``jobs``)
    or a scratch buffer, piece by piece, and read from memory (``lw.in_memory``), as eager
    reads ``torch.cat``'s result. Returns (the jobs, the concatenations stored first and
    their pieces' jobs, in the order they were met).

    Raises:
        LoweringError: a concatenation's own pieces cannot be stored.
    """
    concats, first = [], list(first)
    while True:
        if first:
            cat = first.pop(0)
        else:
            try:
                return [piece for job in jobs for piece in _split_spans(lw, job)], concats
            except ConcatRead as e:
                cat = e.node
                if cat in lw.in_memory:
                    raise LoweringError(f"a concatenation read across its pieces: {cat.format_node()}") from e
        own = next((j for j in jobs if j[1] is cat and not j[3]), None)
        if own is not None:  # an output
            jobs = [j for j in jobs if j is not own]
        else:
            spec = _scratch(cat)
            lw.buffers.append(spec)
            own = (len(lw.buffers) - 1, cat, spec, False)
        concats.append((cat, _split_spans(lw, own)))
        lw.in_memory[cat] = (own[0], own[2])
        lw.memo.clear()


def _reuse_memory(lw: _Lowerer, gm, buffers, nests, placed, shapes, new_values: bool = False,
                  concats=None, reductions=frozenset()) -> None:
    """Let later nests read what earlier ones write (their outputs, and the intermediates
    :func:`accel.partition.choose_materialized` picks, stored to scratch buffers) instead of
    recomputing it, when that moves fewer bytes; re-evaluates every nest's stores.
    ``new_values``: the inputs written in place are read back too. ``concats``: by ``id``
    of the nest that stores a concatenation's last piece (:func:`_split_concats`), each
    such concatenation and where later nests read it ((buffer, spec)). ``reductions``:
    graph nodes stored as the chosen ones are, by the first nest that computes them and
    can (:func:`_statistics_apart`)."""
    from .partition import choose_materialized

    groups = [[node for _, node, _, _ in jobs] for jobs in placed]
    materialized = choose_materialized(gm, groups) | set(reductions)  # once: not in the comprehension's test
    chosen = [m for m in gm.graph.nodes if m in materialized]
    lw.in_memory = {}  # refilled nest by nest: what earlier nests wrote
    for k, nest in enumerate(nests):
        lw.memo.clear()
        lw.rvars.clear()
        stores = [_store(lw, shapes[id(nest)], buf, spec, node) for buf, node, spec, _ in placed[k]]
        reach = _reach(groups[k])
        # a chosen value this nest stores as an output already is read from there (the
        # update below): no scratch copy (a residual sum saved for a layer norm's backward
        # and read again by the loss's sum was written twice)
        outputs = {node for _, node, spec, mutation in placed[k]
                   if (new_values or not mutation) and not spec.origin}  # (not a piece of one)
        # (and none that no later nest reads: chosen for an earlier nest that could not
        # store it, its readers recompute it)
        later = _reach([n for g in groups[k + 1:] for n in g])
        for m in [m for m in chosen if m in reach and m in later and m not in lw.in_memory and m not in outputs]:
            spec = _scratch(m)
            st = _store(lw, shapes[id(nest)], len(buffers), spec, m)
            if st is not None:  # else it is recomputed where needed
                buffers.append(spec)
                stores.insert(0, st)
                lw.in_memory[m] = (st.buf, spec)
        # (the store's memory order again: reductions now read from memory may have held
        # loops outside the ones the store walks contiguously)
        base = _memory_order(list(shapes[id(nest)][1]), placed[k][0][2])
        order = _chain_order(base, [e for s in stores for e in walk(s.value, set())])
        nest.vars, nest.stores = order or nest.vars, stores
        lw.in_memory.update({node: (buf, _whole(spec)) for buf, node, spec, mutation in placed[k]
                             if (new_values or not mutation) and not spec.origin})
        lw.in_memory.update(concats.get(id(nest), ()) if concats else ())


def _peel_views(node: fx.Node, b: BufferSpec) -> Tuple[fx.Node, BufferSpec]:
    """Store ``collapse_view(x)`` (or a ``clone`` of it) as ``x`` into the output seen with ``x``'s dims (the
    merged dims split back), when the output's strides allow it: the lowering does not
    express the div/mod that reading a collapsed index would need (group norm ends so)."""
    while node.op == "call_function" and node.target in (prims.collapse_view.default,
                                                         prims.clone.default):
        if node.target is prims.clone.default:  # the same values
            node = node.args[0]
            continue
        x, start, end = node.args  # merges dims start..end, inclusive
        end += 1
        xs = tuple(x.meta["val"].shape)
        if not b.shape or any(s == 0 for s in xs):
            break
        inner = b.stride[start]
        split = []
        for size in reversed(xs[start:end]):
            split.append(inner)
            inner *= size
        shape = tuple(b.shape[:start]) + xs[start:end] + tuple(b.shape[start + 1:])
        stride = tuple(b.stride[:start]) + tuple(reversed(split)) + tuple(b.stride[start + 1:])
        b = BufferSpec(b.dtype, shape, stride, b.output, b.scratch)
        node = x
    return node, b


def _memory_order(dims: List[int], spec: BufferSpec) -> List[int]:
    """Loop variables ``dims`` (one per dim of ``spec``) in the order the buffer lays its
    dims out in memory, the largest stride outermost (a channels-last [N, C, H, W] output:
    N, H, W, then C innermost), so that its nest's innermost loop walks it contiguously;
    dims of equal strides keep their order (Inductor's loop order, from the output's
    strides)."""
    return [v for _, v in sorted(zip(spec.stride, dims), key=lambda t: -abs(t[0]))]


def _reach(outs, down: bool = False) -> set:
    """The graph nodes ``outs`` read, directly or through others, and ``outs`` (``down``:
    the nodes that read ``outs``)."""
    seen, todo = set(), list(outs)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users if down else n.all_input_nodes)
    return seen


def _scratch(node: fx.Node) -> BufferSpec:
    """A contiguous scratch buffer for ``node``'s value."""
    val = node.meta["val"]
    return BufferSpec(val.dtype, tuple(val.shape), _contiguous(val.shape), True, scratch=True)


def _contiguous(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_hazards(ir: LoopIR, n_ext: int, new_values_after: bool = False) -> None:
    """Reject in-place writes that a read of the old values could miss.

    One nest writes each written input (with one store, or one a piece of a concatenation:
    each element by one store of one iteration). Nests before it read the input as it was
    (nests run one after another); the nest itself reads it at an element its iteration
    writes (all of an iteration's reads come before its writes), or inside a
    reduction that reads only the elements its own iteration writes (:func:`_row_local`:
    ``x.div_(x.sum(-1, keepdim=True))``, a row's sum before the row's writes); no later
    nest reads it, unless ``new_values_after``: the lowering placed every read of the new
    values after the write, and no read of the old ones (``_lower``'s "first").

    Raises:
        _WriteHazard: a read that would see new values.
        LoweringError: an input written by two nests.
    """
    written: Dict[int, List[int]] = {}
    reads: List[set] = []  # per nest: (buffer, Addr, the reduce Expr reading it or None)
    for k, nest in enumerate(ir.nests):
        acc: set = set()
        seen: set = set()
        for s in nest.stores:
            acc |= {(e.args[0], e.args[1], None) for e in walk(s.value, seen, into_reduce=False)
                    if e.op == "load"}
            if s.buf < n_ext:
                written.setdefault(s.buf, []).append(k)
        for r in reductions(nest):
            seen = set()
            acc |= {(x.args[0], x.args[1], r) for b in r.args[1]
                    for x in walk(b, seen, into_reduce=False) if x.op == "load"}
        reads.append(acc)
    for buf, ks in written.items():
        if len(set(ks)) > 1:
            raise LoweringError("an input is written by two nests")
        k = ks[0]
        addrs = [s.addr for s in ir.nests[k].stores if s.buf == buf]  # (a concatenation's pieces)
        for j, acc in enumerate(reads[k:k + 1] if new_values_after else reads[k:], k):
            for b, a, r in acc:
                if b == buf and (j != k or (a not in addrs if r is None else
                                            not any(_row_local(ir, k, r, a, w) for w in addrs))):
                    raise _WriteHazard("in-place write overlaps a read of another element")


def _row_local(ir: LoopIR, k: int, red: Expr, load: Addr, write: Addr) -> bool:
    """Whether reduction ``red`` of nest ``k``, reading a written input at ``load``, reads
    only the elements its own iteration of the nest writes at ``write``, before writing
    them. It must be a reduction of the nest's deepest level (bound by the most loop
    variables): a CUDA kernel hands each point of that level to one block or thread, which
    computes every reduction of the point (a shallower one again at each point) and then
    writes the point's elements; a C++ loop computes a reduction before the loops inside
    it. Its load must address the point's elements as the write does: the same terms in the
    reduction's free variables, and the reduction variables standing for the write's other
    loop variables (as many, of the same sizes and strides). The write reaches each element
    once (an in-place write), so no other point writes what the point reads."""
    fv = free_vars(red)
    if load.offset != write.offset:
        return False
    if any(not free_vars(r) <= fv for r in reductions(ir.nests[k])):
        return False  # a shallower reduction, computed again at each point of a deeper one
    outer = {v: c for v, c in write.terms if v in fv}
    if {v: c for v, c in load.terms if v in fv} != outer:
        return False
    rvars = set(red.args[2])
    if any(v not in fv and v not in rvars for v, _ in load.terms):
        return False
    row = sorted((c, ir.sizes[v]) for v, c in write.terms if v not in fv)
    return row == sorted((c, ir.sizes[v]) for v, c in load.terms if v in rvars)
