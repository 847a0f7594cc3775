"""A reduction along a concatenation's pieces merged before its block reduction: a part of
:class:`accel.codegen.cuda.CudaRenderer` (the mixin :class:`PartialMerges`).

The lowering reduces each piece of a concatenation where it is and merges the pieces'
results (:meth:`accel.lower_expr._Lowerer.reduce`): ``maximum(amax(a), amax(b))`` for a
softmax's maximum over ``cat([a, b], -1)``, ``add(sum(...), sum(...))`` for its sum of
exponentials. A block computes each reduction a thread at a time, then across the block
(``accel::block_reduce``: shuffles, shared memory, barriers); merging the pieces' block
results costs a block reduction a piece. Merged a thread at a time first (the same
combination: sums added, maxima taken), the pieces take one block reduction, as the whole
row's reduction would: a softmax over two pieces runs two block reductions a row, not four
(Inductor's masked loads of a ``ConcatKernel``'s inputs feed one reduction the same way).
"""
from __future__ import annotations

from typing import Dict, List

from ..loop_ir import Expr, walk
from ..lower_expr import MERGE_OPS

#: a plain reduction's combiner across threads (``accel::block_reduce`` and the grid's and
#: columns' reductions), by kind
COMBINE = {"sum": "accel::Sum()", "prod": "accel::Prod()", "amax": "accel::Max()",
           "amin": "accel::Min()"}
#: a merging op (:data:`accel.lower_expr.MERGE_OPS`) -> the reduction kind it merges
KIND = {op: kind for kind, op in MERGE_OPS.items()}
#: a merging op -> the C++ of a pair of thread values
PAIR = {"add": "({a} + {b})", "mul": "({a} * {b})", "maximum": "accel::maximum({a}, {b})",
        "minimum": "accel::minimum({a}, {b})"}


class PartialMerges:
    """Plans (:meth:`_plan_merges`) and renders the merges of a block mode nest's
    reductions a thread at a time: :attr:`merge_leaves` (the merged reductions), whose
    groups skip their block reduction (:meth:`_merge_partial`), and
    :attr:`merge_roots` (a merge -> its reductions), one block reduction of their threads'
    values combined (:meth:`_merged`)."""

    merge_leaves: frozenset = frozenset()
    merge_roots: Dict[Expr, List[Expr]] = {}
    partials: Dict[Expr, str] = {}  # a merged reduction -> its thread's value

    def _plan_merges(self) -> None:
        """The merges of the nest just planned: a value ``op(x, y, ...)`` (nested in one op,
        ``add(add(x, y), z)``) of :data:`KIND` whose leaves are each a reduction of that
        op's kind and dtype, reduced by a group of the block (the outermost scope's loops
        are the block's rows), read by nothing else; the nested ops are no longer computed
        (:attr:`dead`). Called once the nest is planned, in block mode only."""
        self.merge_roots, self.partials = {}, {}
        parents: Dict[Expr, set] = {}
        stored, items = set(), []
        rows = self.nest_scopes[:self.block_lvl + 1]  # run by the whole block (a merge's barriers)
        for sc in self.nest_scopes:
            for k, x in sc.items:
                if k == "store":
                    stored.add(x.value)
                    for e in walk(x.value, set()):
                        for a in (e.args[1] if e.op == "reduce" else e.args):
                            if isinstance(a, Expr):
                                parents.setdefault(a, set()).add(e)
                elif k == "expr" and x.op in KIND and sc in rows:
                    items.append(x)
        blocked = {e for sc in rows for k, g in sc.items if k == "group" for e in g.members}

        def leaves(x: Expr, inner: list):
            kind = KIND[x.op]
            out = []
            for a in x.args:
                if a in stored or parents.get(a) != {x} or a.dtype != x.dtype:
                    return None
                if a.op == x.op:
                    inner.append(a)
                    sub = leaves(a, inner)
                    if sub is None:
                        return None
                    out += sub
                elif a.op == "reduce" and a.args[0] == kind and a in blocked:
                    out.append(a)
                else:
                    return None
            return out

        found, nested = {}, set()  # (a merge nested in another is in its root's nested ops)
        for x in items:
            inner: list = []
            got = leaves(x, inner)
            if got:
                found[x] = got
                nested.update(inner)
        self.merge_roots = {x: got for x, got in found.items() if x not in nested}
        self.merge_leaves = frozenset(e for got in self.merge_roots.values() for e in got)
        self.dead |= {(id(sc), x) for sc in self.nest_scopes for k, x in sc.items if k == "expr" and x in nested}

    def _merge_partial(self, members: List[Expr], acc: str) -> bool:
        """Whether the accumulator ``acc`` of ``members`` keeps its thread's value for a
        merge (every member a merged reduction), its block reduction left to the merge."""
        if not self.merge_leaves or not all(e in self.merge_leaves for e in members):
            return False
        self.partials.update((e, acc) for e in members)
        return True

    def _merged(self, x: Expr, scope) -> str:
        """The C++ of merge ``x``: its reductions' thread values combined, then reduced
        across the block once (a reduction whose group reduced it across the block, one
        sharing its accumulator with a value read elsewhere: merged after)."""
        combine, pair = COMBINE[KIND[x.op]], PAIR[x.op]
        parts = [self.partials[e] for e in self.merge_roots[x] if e in self.partials]
        whole = [self._name(e, scope) for e in self.merge_roots[x] if e not in self.partials]
        vals = ([f"accel::block_reduce({self._fold(pair, parts)}, {combine}, smem)"] if parts else []) + whole
        return self._fold(pair, vals)

    @staticmethod
    def _fold(pair: str, vals: List[str]) -> str:
        acc = vals[0]
        for v in vals[1:]:
            acc = pair.format(a=acc, b=v)
        return acc
