"""Expression lowering: each node of a prims ``torch.fx`` graph evaluated *at an index*, as a
loop-IR expression (:mod:`accel.loop_ir`), device independent (as Inductor's
``Pointwise.inner_fn`` / ``Reduction.inner_fn`` do), so views and broadcasts become index
arithmetic and every consumer is fused with its producers. :mod:`accel.lowering` places the
stores of these expressions into loop nests.

An index is a tuple of *atoms*, one per tensor dim: an affine combination of loop
variables, ``((var, multiplier), ...)``, the empty tuple meaning "always 0" (a broadcast
or size-1 dim), a term of :data:`ONE` a constant (a view at an offset). A reduction gets reduction variables of its own; an ``Expr("reduce")``
depends only on the variables its body uses outside them, so the backend computes it once
per iteration of the loops it depends on (a row reduction once per row) and keeps it in a
register. Reductions over the same domain share their variables, so one loop can compute
several of them (a sum and a sum of squares in one pass).
Expressions are hash-consed: equal subexpressions are one object (CSE across a nest).
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Dict, List, Sequence, Tuple

import torch
import torch.fx as fx

from .loop_ir import ACCEL_ELEMENTWISE, ELEMENTWISE, Addr, BufferSpec, Expr, free_vars, walk
from .ops import HALF, dense_view_map, float_key

prims = torch.ops.prims
aten = torch.ops.aten

#: 16-bit floats (``ops.HALF``) are storage only in the IR: a value of one is a ``load`` or
#: a ``cast``; every op on them is computed in float32 and its result rounded back, op by
#: op, as ATen's kernels compute Half and BFloat16 (opmath float32; see ``_Lowerer.mk``).
_F32 = torch.float32


#: Ops whose result is one of their operands or exactly representable in their operands'
#: float format (NaNs kept as they are), by the index of their first float operand.
_F16_EXACT = {"abs": 0, "maximum": 0, "minimum": 0, "fmax": 0, "fmin": 0, "where": 1,
              "ceil": 0, "floor": 0, "trunc": 0, "round": 0}


class LoweringError(Exception):
    """The graph uses an op or pattern the loop IR does not express (region runs eagerly)."""


class ConcatRead(LoweringError):
    """A concatenation (``accel.cat`` node ``node``) read at an index that reaches more than
    one of its pieces: :func:`accel.lowering._split_concats` stores it first and has the
    value read it from memory."""

    def __init__(self, node: fx.Node, message: str):
        super().__init__(message)
        self.node = node


class SplitLoop(LoweringError):
    """A ``collapse_view`` read at an index whose merged dim is ``var + offset`` (``var`` a
    loop), whose digits are not affine in it: :func:`accel.lowering._split_spans` splits
    the store's loop into ``(var + offset) // inner`` and ``(var + offset) % inner``
    (``inner`` the size of the digit: a GroupNorm's gradient ``[N, G, C/G, H, W]`` merged
    to ``[N, C, H, W]`` and sliced by channel, a U-Net's skip connection), where ``var``
    is one of the store's loops."""

    def __init__(self, var: int, offset: int, inner: int, message: str):
        super().__init__(message)
        self.var, self.offset, self.inner = var, offset, inner


class ConcatSpans(ConcatRead):
    """A concatenation read at an index that runs across its pieces along loop ``var``
    (the rest of the index within one of ``var``'s steps), a new piece starting where
    ``var`` reaches each of ``cuts``:
    :func:`accel.lowering._split_spans` stores such a value piece by piece, each piece's
    loop within one input (as Inductor's ``ConcatKernel`` has each input write its slice
    of the output), where ``var`` is one of the store's loops (else a reduction's)."""

    def __init__(self, node: fx.Node, var: int, cuts: List[int]):
        super().__init__(node, f"loop {var} runs across a concatenation's pieces at {cuts}")
        self.var, self.cuts = var, cuts


_PRIM_REDUCTIONS = {"sum": "sum", "prod": "prod", "amax": "amax", "amin": "amin"}

#: how the results of a reduction's parts merge (:meth:`_Lowerer.reduce`), by kind (the
#: others: ``welford``, ``online_softmax``, merged there; arg reductions are not split; a
#: CUDA block merges them a thread at a time: accel.codegen.cuda_merges)
MERGE_OPS = {"sum": "add", "prod": "mul", "amax": "maximum", "amin": "minimum"}

#: pieces of a store cut at a concatenation's pieces are cut again into spans of one
#: size, the sizes' greatest common divisor, where it is at least this many elements
#: (:func:`even_cuts`)
EVEN_SPAN = 64


def even_cuts(cuts, size: int) -> list:
    """``cuts`` along a store's dim of ``size`` (a concatenation's pieces' starts), or,
    where the pieces differ in size and their sizes' greatest common divisor ``g`` is at
    least :data:`EVEN_SPAN` and cuts the dim into at most :data:`MAX_SEGMENTS` spans, every
    multiple of ``g``: spans of one shape share a nest (``accel.lowering._lower``'s
    ``place``), so that a row's reductions are computed once for its pieces (768 and 256
    channels: 4 spans of 256), not once per nest; a reduction's parts are cut so too
    (:meth:`_Lowerer._segments`), each a loop of the store's length (a backend keeps a
    row's values, a softmax's exponentials, in registers for the store's loop)."""
    bounds = [0, *cuts, size]
    spans = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    g = math.gcd(*spans)
    if len(set(spans)) == 1 or g < EVEN_SPAN or size // g > MAX_SEGMENTS:
        return list(cuts)
    return list(range(g, size, g))


#: the most parts a reduction over a concatenation's pieces is split into
#: (:meth:`_Lowerer.reduce_domains`); more: the concatenation is stored first
MAX_SEGMENTS = 8


def _wrap_dims(dims, shape) -> list:
    """Reduction ``dims`` (negative ones wrapped) of a tensor of ``shape``, sorted, each once;
    none for a 0-d tensor, whose dims 0 and -1 reduce its one value (as eager's
    ``maybe_wrap_dim`` wraps them against a rank of 1)."""
    return sorted({d % len(shape) for d in dims}) if len(shape) else []


def _affine(*parts) -> tuple:
    """Sum of (atom, multiplier) pairs as a canonical atom."""
    acc: Dict[int, int] = {}
    for atom, k in parts:
        for v, m in atom:
            acc[v] = acc.get(v, 0) + m * k
    return tuple(sorted((v, m) for v, m in acc.items() if m))


def _substitute(a: tuple, var: int, terms: tuple) -> tuple:
    """Atom ``a`` with loop variable ``var`` replaced by the affine ``terms`` ((variable,
    multiplier) pairs)."""
    m = dict(a).get(var, 0)
    if not m:
        return a
    return _affine((tuple(t for t in a if t[0] != var), 1), (terms, m))


def _merges_ones(n: fx.Node) -> bool:
    """Whether ``collapse_view(x, start, end)`` merges at most one dim of size above 1
    (``passes._fold_reshapes`` folds two squeezes so): its index is that dim's."""
    x, start, end = n.args
    return sum(1 for d in range(start, end + 1) if x.meta["val"].shape[d] != 1) <= 1


#: the "variable" of an index atom's constant term (a view at an offset: a slice's start),
#: always 1; a load's or an index's :class:`Addr` takes it as its ``offset``
ONE = -1


def _addr(terms) -> Addr:
    """The :class:`Addr` of an affine combination ``terms`` (an atom's form), its constant
    term (:data:`ONE`'s) as the offset."""
    if terms and terms[0][0] == ONE:
        return Addr(terms[1:], terms[0][1])
    return Addr(terms)


def _strided_index(n: fx.Node, idx: tuple) -> tuple:
    """The index into ``as_strided``'s input ``x`` of its result's element at ``idx``, where
    the result reads ``x`` dim by dim (:func:`accel.ops.dense_view_map`): torch's view
    decomposition emits such an ``as_strided`` for some splits of dims (``[16]`` as
    ``[4, 4]``), and a region reads a slice, a chunk, a select or a transpose of a pending
    output through one (:func:`accel.ops.pending_view`).

    Raises:
        LoweringError: any other ``as_strided``.
    """
    x, size, stride = n.args[0], list(n.args[1]), list(n.args[2])
    offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
    xv = x.meta["val"]
    found = dense_view_map(tuple(xv.shape), xv.stride(), size, stride,
                           (offset or 0) - xv.storage_offset())
    if found is None:
        raise LoweringError(f"no lowering for {n.format_node()}")
    maps, start = found
    parts: List[list] = [[(((ONE, 1),), o)] if o else [] for o in start]
    for d, m in enumerate(maps):
        if m is not None:
            parts[m[0]].append((idx[d], m[1]))
    return tuple(_affine(*p) for p in parts)


#: a nest whose innermost loops walk fewer contiguous elements of its store than this
#: (and fewer than its memory order would) stores the reductions that force it to memory
#: (:func:`accel.lowering._transposing`); a reduction's innermost variable walking fewer
#: is reduced per column first (:meth:`_Lowerer._column_split`)
CONTIGUOUS_RUN = 64


def _load_strides(body: Expr) -> Dict[int, int]:
    """Each loop variable's largest stride (elements, absolute) among ``body``'s loads."""
    stride: Dict[int, int] = {}
    for e in walk(body, set(), into_reduce=False):
        if e.op == "load":
            for v, c in e.args[1].terms:
                stride[v] = max(stride.get(v, 0), abs(c))
    return stride


class _Lowerer:
    def __init__(self, gm: fx.GraphModule, ext: Sequence[BufferSpec], scalar_types):
        self.gm = gm
        self.ext = ext
        self.sizes: List[int] = []
        self.memo: Dict[tuple, Expr] = {}
        self.exact16: Dict[Expr, bool] = {}  # (see f16_exact)
        self.exprs: Dict[Expr, Expr] = {}
        self.rvars: Dict[tuple, Tuple[tuple, tuple]] = {}  # -> (in dim order, in loop order)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tensor_ph = {n: i for i, n in enumerate(phs[: len(ext)])}
        self.scalar_ph = {n: k for k, n in enumerate(phs[len(ext):])}
        self.buffers = list(ext)
        self.in_memory: Dict[fx.Node, tuple] = {}  # node -> (buffer index, its spec as seen)
        self.reduce_node: Dict[Expr, fx.Node] = {}  # reduction -> the graph node it computes
        self.split_nodes: Dict[tuple, tuple] = {}  # (see _column_split)

    def new_var(self, size: int) -> int:
        self.sizes.append(size)
        return len(self.sizes) - 1

    def mk(self, op, dtype, *args) -> Expr:
        if op != "cast":
            if op == "reduce":  # (kind, bodies, vars, which): the bodies are operands
                kind, bodies, rv, which = args
                if any(b.dtype in HALF for b in bodies):
                    args = (kind, tuple(self.cast(b, _F32) if b.dtype in HALF else b for b in bodies),
                            rv, which)
            elif any(isinstance(a, Expr) and a.dtype in HALF for a in args):
                args = tuple(self.cast(a, _F32) if isinstance(a, Expr) and a.dtype in HALF else a
                             for a in args)
            if dtype in HALF and op != "load":  # computed in float32, rounded once per op
                return self.cast(self.mk(op, _F32, *args), dtype)
        e = Expr(op, dtype, tuple(args))
        return self.exprs.setdefault(e, e)

    def cast(self, e: Expr, dtype) -> Expr:
        if e.dtype == dtype:
            return e
        if (dtype == _F32 and e.op == "cast" and e.dtype == torch.float16
                and self.f16_exact(e.args[0])):
            return e.args[0]  # rounding a float16 value to float16 again: the same value
        return self.mk("cast", dtype, e)

    def f16_exact(self, e: Expr) -> bool:
        """``e`` (a float32 value) is a float16 value: widened from one, a constant one, or a
        result of ``_F16_EXACT`` ops of such values (the absolute value, a maximum or a
        selected operand of float16 values is one). Rounding it to float16 changes nothing
        (NaNs included: these ops make no NaN of another sign or payload than their
        operands'; a negation would, on CUDA, whose rounding makes every NaN 0x7FFF), so the
        kernel need not round it (float16 ``where``, ``relu``, ``smooth_l1_loss``'s
        ``abs``): ATen's kernels round every op's result, and these results are eager's bits
        without the rounding. (A product with or quotient by 1 is gone before lowering:
        :func:`accel.passes.remove_identities`.)"""
        if not isinstance(e, Expr) or e.dtype != _F32:
            return False
        known = self.exact16.get(e)
        if known is None:
            if e.op == "cast":
                known = e.args[0].dtype == torch.float16
            elif e.op == "const":
                v = e.args[0]
                known = (isinstance(v, (int, float)) and not isinstance(v, bool)
                         and (v != v or float(torch.tensor(float(v)).half()) == v))
            elif e.op in _F16_EXACT:
                known = all(self.f16_exact(a) for a in e.args[_F16_EXACT[e.op]:])
            else:
                known = False
            self.exact16[e] = known
        return known

    def const(self, v, dtype) -> Expr:
        # the key rides along so that -0.0 and 0.0, equal as values, stay two Exprs
        return self.mk("const", dtype, v, float_key(v) if isinstance(v, float) else v)

    def operand(self, a, idx, dtype) -> Expr:
        """Lower an argument: a node evaluated at idx, or a constant of ``dtype``."""
        if isinstance(a, fx.Node):
            if a in self.scalar_ph:
                return self.mk("scalar", dtype, self.scalar_ph[a])
            if a.meta["val"].dim() == 0:  # prims take 0-dim tensors beside n-dim ones
                idx = ()
            return self.value(a, idx)
        if isinstance(a, (bool, int, float)):
            return self.const(a, dtype)
        raise LoweringError(f"unsupported operand {a!r}")

    def value(self, n: fx.Node, idx: tuple, which: int = 0) -> Expr:
        key = (n, idx, which)
        e = self.memo.get(key)
        if e is None:
            e = self._value(n, idx, which)
            self.memo[key] = e
            if isinstance(n.meta.get("val"), torch.Tensor):  # the node a reduction computes
                for r in walk(e, set(), into_reduce=False):
                    if r.op == "reduce":
                        self.reduce_node.setdefault(r, n)
        return e

    # -- reductions ------------------------------------------------------------------------
    def reduce_domains(self, x: fx.Node, dims, idx, dim_order=False) -> List[Tuple[tuple, tuple]]:
        """The domains of a reduction of ``x`` over ``dims`` at output index ``idx`` (the
        kept dims): ``[(x's index, the reduction variables)]``, the variables shared by
        reductions of one domain and in memory order (:meth:`_memory_order`), or with
        ``dim_order`` in dim order (an argmax's iteration order is its tie-break: the first
        index, row-major). One domain, but where ``x`` reads a concatenation across its
        pieces along a reduction variable (a softmax or a LayerNorm over ``torch.cat``'s
        dim): a domain per piece, its variable over the piece's span (:meth:`_segments`), so
        that the reduction reads each input where it is, as Inductor's masked loads of a
        ``ConcatKernel``'s inputs do, instead of the concatenation stored first; the caller
        merges the pieces' results (:meth:`reduce`).

        Raises:
            ConcatRead: an arg reduction's pieces, or more than :data:`MAX_SEGMENTS`.
        """
        xs = tuple(x.meta["val"].shape)
        dims = _wrap_dims(dims, xs)
        key = (xs, tuple(dims), idx, dim_order)
        known = self.rvars.get(key)
        if known is None:
            rv = tuple(self.new_var(xs[d]) for d in dims)
            it, rit, xi = iter(idx), iter(rv), []
            for d in range(len(xs)):
                if d in dims:
                    v = next(rit)
                    xi.append(((v, 1),) if xs[d] != 1 else ())
                else:
                    xi.append(next(it))
            known = [(tuple(xi), rv, None)]
        # (a domain shared with an earlier reduction may be split for this one's pieces)
        known = [d for xi, rv, order in known for d in self._segments(x, xi, rv, order, dim_order)]
        self.rvars[key] = known
        return [(xi, order) for xi, _, order in known]

    def _segments(self, x: fx.Node, xi: tuple, rv: tuple, order, dim_order) -> list:
        """The domain ``(xi, rv, order)`` (``order``: ``rv`` in loop order, None before it
        is known) of a reduction of ``x``, or where ``x`` at ``xi`` reads a concatenation's
        pieces along a variable of ``rv`` (:class:`ConcatSpans`), its parts, that variable
        cut at the pieces' starts, each part split again where it needs."""
        try:
            body = self.value(x, xi)
        except ConcatSpans as e:
            if e.var not in rv:
                raise
            if dim_order:
                raise ConcatRead(e.node, "an arg reduction across a concatenation's pieces") from e
            bounds = [0, *even_cuts(e.cuts, self.sizes[e.var]), self.sizes[e.var]]
            parts = []
            for lo, hi in zip(bounds, bounds[1:]):
                w = self.new_var(hi - lo)
                at = tuple(_affine(*(((((w if u == e.var else u), m),), 1) for u, m in a),
                                   *((((ONE, m * lo),), 1) for u, m in a if u == e.var)) for a in xi)
                parts += self._segments(x, at, tuple(w if v == e.var else v for v in rv), None, dim_order)
            if len(parts) > MAX_SEGMENTS:
                raise ConcatRead(e.node, f"a reduction across {len(parts)} pieces") from e
            return parts
        except SplitLoop as e:
            size = self.sizes[e.var] if e.var in rv else 0
            if dim_order or not size or e.offset % e.inner or size % e.inner:
                raise
            # a merge of dims read along a reduction variable (a group norm's gradient
            # summed over the spatial positions, of a value computed in the group's
            # [..., H, W] form): the variable as the merge's digits, (outer, inner), row-major
            # (the values in the same order)
            outer, inner = self.new_var(size // e.inner), self.new_var(e.inner)
            digits = ((outer, e.inner), (inner, 1))
            at = tuple(_substitute(a, e.var, digits) for a in xi)
            split = tuple(w for v in rv for w in ((outer, inner) if v == e.var else (v,)))
            return self._segments(x, at, split, None, dim_order)
        return [(xi, rv, order or (rv if dim_order else self._memory_order(rv, body)))]

    def reduce_vars(self, x: fx.Node, dims, idx, dim_order=False) -> Tuple[tuple, Tuple[int, ...]]:
        """The one domain of a reduction (:meth:`reduce_domains`).

        Raises:
            LoweringError: ``x`` reads a concatenation's pieces along the reduction.
        """
        doms = self.reduce_domains(x, dims, idx, dim_order)
        if len(doms) != 1:
            raise LoweringError(f"a reduction across {len(doms)} pieces of {x.format_node()}")
        return doms[0]

    def _memory_order(self, rv: tuple, body: Expr) -> tuple:
        """Reduction variables ``rv`` (in dim order) in the order ``body``'s loads lay them
        out in memory, the largest stride outermost, so that the innermost reduction loop
        walks memory contiguously (a channels-last group norm's statistics: the spatial
        positions outside the group's channels); equal strides keep dim order."""
        stride = _load_strides(body)
        return tuple(sorted(rv, key=lambda v: -stride.get(v, 0)))

    def reduce(self, kind, x, dims, idx, acc_dtype, which=0, index=False) -> Expr:
        """``kind`` (:data:`accel.loop_ir.REDUCTIONS`) of ``x`` over ``dims`` at ``idx``, its
        result ``which``, accumulated in ``acc_dtype``; over a concatenation's pieces
        (:meth:`reduce_domains`), each piece's result merged: sums added, maxima taken,
        Welford moments by Chan et al.'s pairwise formula ("Updating formulae and a pairwise
        algorithm for computing sample variances", 1979); an online softmax's maximum and
        sum of exponentials in two passes, the pieces' maxima, then each piece's sum of
        ``exp(x - max)`` (as a row kernel computes one).
        """
        if acc_dtype in HALF:  # a max, min or arg reduction of 16-bit floats: compared in float32
            acc_dtype = _F32
        doms = self.reduce_domains(x, dims, idx, dim_order=index)
        if len(doms) == 1:
            return self._reduce_over(kind, x, dims, doms[0], acc_dtype, which, index)
        if kind in MERGE_OPS:
            return functools.reduce(lambda a, b: self.mk(MERGE_OPS[kind], acc_dtype, a, b),
                                    (self._reduce_over(kind, x, dims, d, acc_dtype, which, index) for d in doms))
        t = acc_dtype
        if kind == "online_softmax":  # the two passes' form: max of the maxima, then the sums
            top = functools.reduce(lambda a, b: self.mk("maximum", t, a, b),
                                   (self._reduce_over("amax", x, dims, d, t, 0, index) for d in doms))
            if which == 0:
                return top
            return functools.reduce(lambda a, b: self.mk("add", t, a, b), (
                self.mk("reduce", t, "sum", (self.mk("exp", t, self.mk("sub", t, self.cast(self.value(x, xi), t), top)),),
                        rv, 0) for xi, rv in doms))
        assert kind == "welford", kind
        parts = [(self._reduce_over(kind, x, dims, d, t, 0, index),  # (m2, mean) per piece
                  self._reduce_over(kind, x, dims, d, t, 1, index)) for d in doms]
        m2, mean = parts[0]
        n = math.prod(self.sizes[v] for v in doms[0][1])
        for (m2_b, mean_b), (_, rv_b) in zip(parts[1:], doms[1:]):
            n_b = math.prod(self.sizes[v] for v in rv_b)
            delta = self.mk("sub", t, mean_b, mean)
            mean = self.mk("add", t, mean, self.mk("mul", t, delta, self.const(n_b / (n + n_b), t)))
            spread = self.mk("mul", t, self.mk("mul", t, delta, delta), self.const(n * n_b / (n + n_b), t))
            m2 = self.mk("add", t, self.mk("add", t, m2, m2_b), spread)
            n += n_b
        return (m2, mean)[which]

    def _reduce_over(self, kind, x, dims, dom, acc_dtype, which, index) -> Expr:
        """``kind`` of ``x`` over one domain ``dom`` ((x's index, the reduction variables in
        loop order): :meth:`reduce_domains`)."""
        xi, rv = dom
        body = self.cast(self.value(x, xi), acc_dtype)
        n = 1
        for v in rv:
            n *= self.sizes[v]
        if kind == "sum" and not index and n > 0 and not free_vars(body) & set(rv):
            # a sum of one value (the gradient of ``loss.sum()``, expanded): body * n, which
            # the sum's float64 or int64 accumulation gives exactly (n < 2**29 for floats);
            # then + 0.0, as eager's float sums start from +0.0 (a sum of -0.0 values, a
            # dim of size 1 too, is +0.0: ``1 / x.sum(0)`` of [[-0.0]] is +inf)
            r = self.mk("mul", acc_dtype, body, self.const(n, acc_dtype)) if n != 1 else body
            return self.mk("add", acc_dtype, r, self.const(0.0, acc_dtype)) if acc_dtype.is_floating_point else r
        bodies = (body,)
        if index:  # the flat index over the reduced dims, row-major, as eager's argmax
            xs, stride, terms = x.meta["val"].shape, 1, []
            for v, d in zip(reversed(rv), reversed(_wrap_dims(dims, xs))):
                terms.append((v, stride))
                stride *= xs[d]
            bodies += (self.mk("index", torch.int64, Addr(tuple(sorted(terms)))),)
        out_dtype = torch.int64 if index and which == 1 else acc_dtype
        return self.mk("reduce", out_dtype, kind, bodies, rv, which)

    def _acc(self, dtype) -> torch.dtype:
        return torch.float64 if dtype.is_floating_point else torch.int64

    def _value(self, n: fx.Node, idx: tuple, which: int) -> Expr:
        if n in self.tensor_ph or n in self.in_memory:
            k, b = (self.tensor_ph[n], self.ext[self.tensor_ph[n]]) if n in self.tensor_ph \
                else self.in_memory[n]
            terms = _affine(*((atom, b.stride[d]) for d, atom in enumerate(idx) if b.shape[d] != 1))
            return self.cast(self.mk("load", b.dtype, k, _addr(terms)), n.meta["val"].dtype)
        if n.op != "call_function":
            raise LoweringError(f"unsupported node {n.format_node()}")
        t = n.target
        if t is operator.getitem:
            return self.value(n.args[0], idx, n.args[1])
        val = n.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else None
        name = t._opname if hasattr(t, "_opname") else str(t)
        ns = getattr(t, "namespace", "")
        if t is prims.broadcast_in_dim.default:
            x, shape, bdims = n.args
            xs = x.meta["val"].shape
            return self.value(x, tuple(() if xs[i] == 1 else idx[d] for i, d in enumerate(bdims)))
        if t is prims.convert_element_type.default:
            return self.cast(self.value(n.args[0], idx), n.args[1])
        if t in (prims.view_of.default, aten.alias.default, aten.clone.default,
                 prims.device_put.default, prims.clone.default):
            return self.value(n.args[0], idx)
        if t is prims.squeeze.default:
            x, dims = n.args
            xs = x.meta["val"].shape
            dims = set(_wrap_dims(dims, xs))
            it = iter(idx)
            return self.value(x, tuple(() if d in dims else next(it) for d in range(len(xs))))
        if t is prims.transpose.default:
            x, perm = n.args
            inner = [()] * len(perm)
            for i, p in enumerate(perm):
                inner[p] = idx[i]
            return self.value(x, tuple(inner))
        if t is prims.split_dim.default:
            x, dim, outer = n.args
            inner = n.meta["val"].shape[dim + 1]
            merged = _affine((idx[dim], inner), (idx[dim + 1], 1))
            return self.value(x, idx[:dim] + (merged,) + idx[dim + 2:])
        if t is prims.collapse_view.default:
            x, start, end = n.args
            xs = x.meta["val"].shape
            if _merges_ones(n):  # a squeeze, in effect
                inner = tuple(idx[start] if xs[d] != 1 else () for d in range(start, end + 1))
            else:
                inner = self.unmerge(idx[start], xs[start:end + 1], n)
            return self.value(x, idx[:start] + inner + idx[start + 1:])
        if t is aten.as_strided.default:  # a view: a split of dims, a slice, a transpose
            return self.value(n.args[0], _strided_index(n, idx))
        if t in (prims.scalar_tensor.default, aten.scalar_tensor.default):
            return self.operand(n.args[0], (), dtype)
        if t in (prims.full.default, aten.full_like.default):
            return self.operand(n.args[1], (), dtype)
        if t is prims.fill.default:
            return self.operand(n.args[1], idx, dtype)
        if t is prims.iota.default:
            start, step = n.kwargs["start"], n.kwargs["step"]
            i = self.mk("index", torch.int64, _addr(tuple(idx[0])))
            e = self.mk("add", torch.int64, self.mk("mul", torch.int64, i, self.const(step, torch.int64)),
                        self.const(start, torch.int64))
            return self.cast(e, dtype)
        if t is aten.copy.default:
            return self.cast(self.value(n.args[1], self._bcast(n.args[1], idx, n)), dtype)
        if ns == "prims" and name in _PRIM_REDUCTIONS:
            x, dims = n.args[0], n.args[1]
            acc = dtype if name in ("amax", "amin") else self._acc(dtype)
            return self.cast(self.reduce(_PRIM_REDUCTIONS[name], x, dims, idx, acc), dtype)
        if t is prims.var.default:
            return self.cast(self.variance(n.args[0], n.args[1], n.args[2], idx)[0], dtype)
        if t in (aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim):
            return self.arg_reduction(n, idx, which)
        if t in (aten.max.default, aten.min.default):  # all elements
            x = n.args[0]
            kind = "amax" if t is aten.max.default else "amin"
            return self.cast(self.reduce(kind, x, range(x.meta["val"].dim()), idx, dtype), dtype)
        if ns == "accel" and name == "var_mean":
            x, dims, correction = n.args
            xd = x.meta["val"].dtype
            var, mean = self.variance(x, dims, correction, idx, welford=True)
            return self.cast((var, mean)[which], xd)
        if ns == "accel" and name == "online_softmax":
            x, dims = n.args
            xd = x.meta["val"].dtype
            return self.cast(self.reduce("online_softmax", x, dims, idx, xd, which), xd)
        if ns == "accel" and name == "cat":
            return self.cast(self.concat(n, idx), dtype)
        if ns == "accel" and name in ACCEL_ELEMENTWISE:
            return self.mk(name, dtype, *(self.operand(a, idx, dtype) for a in n.args))
        if name in ELEMENTWISE and ns == "prims":
            tensors = [a for a in n.args if isinstance(a, fx.Node) and a not in self.scalar_ph]
            comp = dtype if name == "where" or not tensors else tensors[0].meta["val"].dtype
            if name == "where":
                args = [self.operand(n.args[0], idx, torch.bool)] + [
                    self.operand(a, idx, comp) for a in n.args[1:]]
            else:
                args = [self.operand(a, idx, comp) for a in n.args]
            return self.mk(name, dtype, *args)
        raise LoweringError(f"no lowering for {t}")

    def unmerge(self, a: tuple, sizes, n: fx.Node) -> tuple:
        """The atoms of the dims of ``sizes`` (row-major) that ``collapse_view`` ``n`` merges,
        read at its merged atom ``a``: digit by digit from the innermost, each the terms of
        ``a`` whose multipliers the digit's size does not divide, which must stay within
        it over their loops (``4 * i + j + 8`` over ``j < 4``: ``j`` and ``i + 2``).

        Raises:
            SplitLoop: a digit is not affine in a lone loop variable (multiplier 1).
            LoweringError: any other index.
        """
        digits = []
        for z in reversed(sizes[1:]):
            off = dict(a).get(ONE, 0)
            terms = tuple((v, m) for v, m in a if v != ONE)
            low = _affine((tuple(t for t in terms if t[1] % z), 1), (((ONE, 1),), off % z))
            lo, hi = _addr(low).extent(self.sizes)
            if lo < 0 or hi >= z:
                if len(terms) == 1 and terms[0][1] == 1:
                    raise SplitLoop(terms[0][0], off, z, f"a merge of dims read at {a}: {n.format_node()}")
                raise LoweringError(f"a merge of dims read at {a}: {n.format_node()}")
            digits.append(low)
            a = _affine((tuple((v, m // z) for v, m in terms if m % z == 0), 1), (((ONE, 1),), off // z))
        return (a, *reversed(digits))

    def concat(self, n: fx.Node, idx: tuple) -> Expr:
        """``accel.cat`` at ``idx``: the input whose piece holds every element the index
        reaches, at the index less the piece's start.

        Raises:
            ConcatSpans: the index reaches more than one piece along a loop.
            ConcatRead: along anything else (a group norm's group and channel in it).
        """
        *parts, dim = n.args
        parts = [p for p in parts if p is not None]
        d = dim % len(idx)
        a = idx[d]
        at = _addr(a)
        lo, hi = at.extent(self.sizes)
        start, starts = 0, []
        for p in parts:
            size = p.meta["val"].shape[dim]
            if start <= lo and hi < start + size:
                return self.value(p, idx[:d] + (_affine((a, 1), (((ONE, 1),), -start)),) + idx[d + 1:])
            if start and lo < start <= hi:
                starts.append(start)
            start += size
        # a loop ``v`` whose steps the pieces start between: the rest of the index stays
        # within a step (a group norm's channel ``2 * g + c`` of groups of 2: ``g`` cut at
        # the group each piece starts with)
        for v, m in sorted(at.terms, key=lambda t: -t[1]):
            rlo, rhi = Addr(tuple(t for t in at.terms if t[0] != v), at.offset).extent(self.sizes)
            cuts = [-(-(c - rlo) // m) for c in starts] if m > 0 else []
            if cuts and all(m * (k - 1) + rhi < c and 0 < k < self.sizes[v] for k, c in zip(cuts, starts)):
                raise ConcatSpans(n, v, cuts)
        raise ConcatRead(n, f"a concatenation read at {a}: {n.format_node()}")

    def variance(self, x, dims, correction, idx, welford=False) -> Tuple[Expr, Expr]:
        """(var, mean) of ``x`` over ``dims`` in float64: one Welford pass, or two passes
        (the mean, then the sum of squared deviations from it)."""
        f64 = torch.float64
        xs = x.meta["val"].shape
        n = 1
        for d in _wrap_dims(dims, xs):
            n *= xs[d]
        split = self._column_split(x, dims, idx) if welford else None
        if split is not None:  # each column's moments, then the columns' merged (Chan et al.)
            cvar_n, cmean_n, pos, k = split
            ci, c = self.reduce_vars(cmean_n, [pos], idx)  # (c: the column variables)
            cmean, cvar = self.value(cmean_n, ci), self.value(cvar_n, ci)
            rows = n // k
            mean = self.mk("div", f64, self.mk("reduce", f64, "sum", (cmean,), c, 0), self.const(k, f64))
            dev = self.mk("sub", f64, cmean, mean)
            spread = self.mk("reduce", f64, "sum", (self.mk("mul", f64, dev, dev),), c, 0)
            within = self.mk("reduce", f64, "sum", (cvar,), c, 0)
            m2 = self.mk("mul", f64, self.mk("add", f64, within, spread), self.const(rows, f64))
        elif welford:
            mean = self.reduce("welford", x, dims, idx, f64, which=1)
            m2 = self.reduce("welford", x, dims, idx, f64, which=0)
        else:
            mean = self.mk("div", f64, self.reduce("sum", x, dims, idx, f64), self.const(n, f64))
            m2 = None
            for xi, rv in self.reduce_domains(x, dims, idx):  # (a concatenation's pieces: summed)
                dev = self.mk("sub", f64, self.cast(self.value(x, xi), f64), mean)
                part = self.mk("reduce", f64, "sum", (self.mk("mul", f64, dev, dev),), rv, 0)
                m2 = part if m2 is None else self.mk("add", f64, m2, part)
        if not isinstance(correction, (int, float)):
            raise LoweringError("correction must be a constant")
        var = self.mk("div", f64, m2, self.const(max(0, n - correction), f64))
        return var, mean

    def _column_split(self, x: fx.Node, dims, idx):
        """Where a reduction of ``x`` over ``dims`` at ``idx`` has an innermost reduction
        variable in memory order, ``c``, that walks fewer than :data:`CONTIGUOUS_RUN`
        contiguous elements next to an output variable's (a channels-last group norm's
        channels of a group, beside the groups): its two levels as graph nodes, ``(var,
        mean, c's dim among theirs, c's size)``, ``x``'s float64 variance and mean over the
        other dims, each of ``c``'s columns (a column reduction of their own: each run of
        memory read once, vectorized across the columns); the caller merges the columns.
        None for any other reduction."""
        xv = x.meta["val"]
        xs = tuple(xv.shape)
        dims = _wrap_dims(dims, xs)
        doms = self.reduce_domains(x, dims, idx)
        if len(doms) != 1:  # (a concatenation's pieces)
            return None
        xi, rv = doms[0]
        if len(rv) < 2 or any(self.sizes[v] == 1 for v in rv):
            return None
        stride = _load_strides(self.value(x, xi))
        c = rv[-1]
        if stride.get(c) != 1 or self.sizes[c] >= CONTIGUOUS_RUN:
            return None
        if not any(stride.get(v) == self.sizes[c] for a in idx for v, _ in a):
            return None
        dim = next(d for d in dims if xi[d] == ((c, 1),))
        rest = [d for d in dims if d != dim]
        key = ("columns", x, tuple(rest))
        if key not in self.split_nodes:
            g = self.gm.graph
            shape = [s for d, s in enumerate(xs) if d not in rest]
            with g.inserting_after(x):
                x64 = g.call_function(prims.convert_element_type.default, (x, torch.float64))
            with g.inserting_after(x64):
                vm = g.call_function(torch.ops.accel.var_mean.default, (x64, rest, 0))
            with g.inserting_after(vm):
                parts = [g.call_function(operator.getitem, (vm, i)) for i in (0, 1)]
            x64.meta["val"] = xv.to(torch.float64)
            for p in parts:
                p.meta["val"] = x64.meta["val"].new_empty(shape)
            vm.meta["val"] = tuple(p.meta["val"] for p in parts)
            self.split_nodes[key] = (*parts, dim - sum(1 for d in rest if d < dim), xs[dim])
        return self.split_nodes[key]

    def arg_reduction(self, n: fx.Node, idx, which) -> Expr:
        """argmax/argmin (the index) and max.dim/min.dim (value 0, index 1), first
        occurrence on ties and NaN counting as the extreme, as eager."""
        x = n.args[0]
        xs = x.meta["val"].shape
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keepdim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
        dims = list(range(len(xs))) if dim is None else [dim % max(1, len(xs))]
        if not xs:
            dims = []
        if keepdim and xs:  # drop the kept size-1 dims from the index
            idx = tuple(a for d, a in enumerate(idx) if d not in dims)
        is_value = n.target in (aten.max.dim, aten.min.dim) and which == 0
        kind = "argmax" if n.target in (aten.argmax.default, aten.max.dim) else "argmin"
        xd = x.meta["val"].dtype
        r = self.reduce(kind, x, dims, idx, xd, which=0 if is_value else 1, index=True)
        return self.cast(r, xd) if is_value else r

    def at(self, n: fx.Node, idx, shape) -> Expr:
        """``n`` evaluated at the index ``idx`` of a store of ``shape`` (``n`` broadcasts to it)."""
        val = n.meta["val"]
        if tuple(val.shape) != tuple(shape):
            off = len(shape) - val.dim()
            idx = tuple(() if val.shape[i] == 1 else idx[i + off] for i in range(val.dim()))
        return self.value(n, idx)

    def _bcast(self, src: fx.Node, idx, dst: fx.Node):
        ss, ds = src.meta["val"].shape, dst.meta["val"].shape
        off = len(ds) - len(ss)
        return tuple(() if ss[i] == 1 else idx[i + off] for i in range(len(ss)))


