"""Lowering: a prims ``torch.fx`` graph -> loop IR, device independent.

The IR is a list of loop nests. A nest iterates over a static shape and stores values into
buffers; a value is an expression DAG (``Expr``) over loads, scalars, constants and prim
ops, built by evaluating each graph node *at an index* (as Inductor's ``Pointwise.inner_fn``
does), so views and broadcasts become index arithmetic and every nest is fused.
Expressions are hash-consed: equal subexpressions are one object (CSE across a nest).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

prims = torch.ops.prims
aten = torch.ops.aten


class LoweringError(Exception):
    """The graph uses an op or pattern the loop IR does not express (region runs eagerly)."""


@dataclass(frozen=True)
class Expr:
    """One value in a loop body. ``op`` is ``load`` (args: buffer, Addr), ``scalar``
    (args: slot), ``const`` (args: value), ``cast`` (args: Expr) or a prim name."""

    op: str
    dtype: torch.dtype
    args: tuple


@dataclass(frozen=True)
class Addr:
    """Element offset ``sum(coeffs[v] * i_v)`` into a buffer, in elements."""

    coeffs: Tuple[int, ...]


@dataclass
class Store:
    buf: int
    addr: Addr
    value: Expr


@dataclass
class Nest:
    """A loop nest over ``shape`` (row-major iteration) with its stores."""

    shape: Tuple[int, ...]
    stores: List[Store] = field(default_factory=list)


@dataclass
class BufferSpec:
    """A kernel argument buffer: ``bufs[index]`` in the kernel ABI."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    output: bool


@dataclass
class LoopIR:
    buffers: List[BufferSpec]
    scalar_types: List[str]
    nests: List[Nest]

    def describe(self) -> str:
        return "\n".join(f"nest{i} {n.shape}: {len(n.stores)} stores"
                         for i, n in enumerate(self.nests))


#: prims lowered one-to-one to a same-named IR op (the codegen tables say how to emit them).
ELEMENTWISE = frozenset("""
abs acos acosh asin asinh atan atanh cos cosh ceil erf erfc erf_inv exp exp2 expm1 floor
lgamma log log1p log2 log10 neg reciprocal round sign signbit sin sinh sqrt rsqrt tan tanh
trunc bitwise_not isfinite cbrt digamma
add sub mul div atan2 fmod remainder pow maximum minimum fmax fmin hypot nextafter copysign
bitwise_and bitwise_or bitwise_xor shift_left shift_right_arithmetic eq ne lt le gt ge
where gcd
""".split())

_CMP = frozenset("eq ne lt le gt ge".split())


class _Lowerer:
    def __init__(self, gm: fx.GraphModule, ext: Sequence[BufferSpec], scalar_types):
        self.gm = gm
        self.ext = ext
        self.scalar_types = list(scalar_types)
        self.memo: Dict[tuple, Expr] = {}
        self.exprs: Dict[Expr, Expr] = {}
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tensor_ph = {n: i for i, n in enumerate(phs[: len(ext)])}
        self.scalar_ph = {n: k for k, n in enumerate(phs[len(ext):])}

    def mk(self, op, dtype, *args) -> Expr:
        e = Expr(op, dtype, tuple(args))
        return self.exprs.setdefault(e, e)

    def cast(self, e: Expr, dtype) -> Expr:
        return e if e.dtype == dtype else self.mk("cast", dtype, e)

    def operand(self, a, idx, dtype) -> Expr:
        """Lower an argument: a node evaluated at idx, or a constant of ``dtype``."""
        if isinstance(a, fx.Node):
            if a in self.scalar_ph:
                return self.mk("scalar", dtype, self.scalar_ph[a])
            if a.meta["val"].dim() == 0:  # prims take 0-dim tensors beside n-dim ones
                idx = ()
            return self.value(a, idx)
        if isinstance(a, (bool, int, float)):
            return self.mk("const", dtype, a)
        raise LoweringError(f"unsupported operand {a!r}")

    def value(self, n: fx.Node, idx: Tuple) -> Expr:
        key = (n, idx, self.nvars)
        e = self.memo.get(key)
        if e is None:
            e = self._value(n, idx)
            self.memo[key] = e
        return e

    def _value(self, n: fx.Node, idx: Tuple) -> Expr:
        if n in self.tensor_ph:
            b = self.ext[self.tensor_ph[n]]
            coeffs = [0] * self.nvars
            for d, atom in enumerate(idx):
                if atom is not None and b.shape[d] != 1:
                    coeffs[atom] += b.stride[d]
            return self.mk("load", b.dtype, self.tensor_ph[n], Addr(tuple(coeffs)))
        if n.op != "call_function":
            raise LoweringError(f"unsupported node {n.format_node()}")
        t = n.target
        val = n.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else None
        name = t._opname if hasattr(t, "_opname") else str(t)
        if t is prims.broadcast_in_dim.default:
            x, shape, bdims = n.args
            xs = x.meta["val"].shape
            return self.value(x, tuple(None if xs[i] == 1 else idx[d] for i, d in enumerate(bdims)))
        if t is prims.convert_element_type.default:
            return self.cast(self.value(n.args[0], idx), n.args[1])
        if t in (prims.view_of.default, aten.alias.default, aten.clone.default,
                 prims.device_put.default, prims.clone.default):
            return self.value(n.args[0], idx)
        if t is prims.squeeze.default:
            x, dims = n.args
            xs = x.meta["val"].shape
            dims = {d % len(xs) for d in dims} if xs else set()
            it = iter(idx)
            return self.value(x, tuple(None if d in dims else next(it) for d in range(len(xs))))
        if t is prims.transpose.default:
            x, perm = n.args
            inner = [None] * len(perm)
            for i, p in enumerate(perm):
                inner[p] = idx[i]
            return self.value(x, tuple(inner))
        if t in (prims.scalar_tensor.default, aten.scalar_tensor.default):
            return self.operand(n.args[0], (), dtype)
        if t in (prims.full.default,):
            return self.operand(n.args[1], (), dtype)
        if t is aten.full_like.default:
            return self.operand(n.args[1], (), dtype)
        if t is prims.fill.default:
            return self.operand(n.args[1], idx, dtype)
        if t in (aten.copy.default,):
            return self.cast(self.value(n.args[1], self._bcast(n.args[1], idx, n)), dtype)
        if name in ELEMENTWISE and t.namespace == "prims":
            tensors = [a for a in n.args if isinstance(a, fx.Node) and a not in self.scalar_ph]
            if name == "where":
                comp = dtype
            elif tensors:
                comp = tensors[0].meta["val"].dtype
            else:
                comp = dtype
            if name == "where":
                args = [self.operand(n.args[0], idx, torch.bool)] + [
                    self.operand(a, idx, comp) for a in n.args[1:]]
            else:
                args = [self.operand(a, idx, comp) for a in n.args]
            return self.mk(name, dtype, *args)
        raise LoweringError(f"no lowering for {t}")

    def _bcast(self, src: fx.Node, idx, dst: fx.Node):
        ss, ds = src.meta["val"].shape, dst.meta["val"].shape
        off = len(ds) - len(ss)
        return tuple(None if ss[i] == 1 else idx[i + off] for i in range(len(ss)))

    def at(self, n: fx.Node, shape) -> Expr:
        self.nvars = len(shape)
        idx = tuple(range(len(shape)))
        val = n.meta["val"]
        if tuple(val.shape) != tuple(shape):
            off = len(shape) - val.dim()
            idx = tuple(None if val.shape[i] == 1 else i + off for i in range(val.dim()))
        return self.value(n, idx)


def lower(gm: fx.GraphModule, ext: Sequence[BufferSpec], outs: Sequence[BufferSpec],
          scalar_types: Sequence[str]) -> LoopIR:
    """Lower a traced region to loop nests.

    Args:
        gm: a graph from :func:`accel.graph.trace_region` (after passes).
        ext: the external input buffers (kernel args ``0..len(ext)-1``).
        outs: the live output buffers, in the graph's output order (kernel args after ext).
        scalar_types: ``"f"``/``"i"`` per runtime scalar.

    Raises:
        LoweringError: an op or aliasing pattern the IR does not express.
    """
    lw = _Lowerer(gm, ext, scalar_types)
    buffers = list(ext) + list(outs)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    rets = out_node.args[0]
    rets = list(rets) if isinstance(rets, (tuple, list)) else [rets]
    if len(rets) != len(outs):
        raise LoweringError("output count mismatch")
    jobs = []  # (shape, buffer, node, is_mutation)
    for i, (r, b) in enumerate(zip(rets, outs)):
        jobs.append((b.shape, len(ext) + i, r, False))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.copy_.default:
            dst, src = n.args
            if dst not in lw.tensor_ph:
                raise LoweringError("copy_ into a non-input")
            j = lw.tensor_ph[dst]
            jobs.append((ext[j].shape, j, src, True))
        elif n.op == "call_function" and n.users == {} and n is not out_node:
            continue
    nests: Dict[Tuple[int, ...], Nest] = {}
    order = sorted(range(len(jobs)), key=lambda k: jobs[k][3])  # mutations last
    for k in order:
        shape, buf, node, _ = jobs[k]
        nest = nests.setdefault(tuple(shape), Nest(tuple(shape)))
        value = lw.cast(lw.at(node, shape), buffers[buf].dtype)
        b = buffers[buf]
        coeffs = tuple(0 if sz == 1 else st for sz, st in zip(b.shape, b.stride))
        nest.stores.append(Store(buf, Addr(coeffs), value))
    ir = LoopIR(buffers, list(scalar_types), list(nests.values()))
    _check_hazards(ir, len(ext))
    return ir


def _loads(e: Expr, acc: set, seen: set):
    if e in seen:
        return
    seen.add(e)
    if e.op == "load":
        acc.add((e.args[0], e.args[1]))
    for a in e.args:
        if isinstance(a, Expr):
            _loads(a, acc, seen)


def _check_hazards(ir: LoopIR, n_ext: int) -> None:
    """Reject in-place writes that a later read (or a read of another element) could see.

    Every read of a written input must happen in the same nest, at the same element, as
    the write; nests that write inputs run after all others, and none reads what another
    writes.
    """
    written: Dict[int, List[int]] = {}
    reads: List[set] = []
    for k, nest in enumerate(ir.nests):
        acc: set = set()
        seen: set = set()
        for s in nest.stores:
            _loads(s.value, acc, seen)
            if s.buf < n_ext:
                written.setdefault(s.buf, []).append(k)
        reads.append(acc)
    for buf, ks in written.items():
        if len(ks) > 1:
            raise LoweringError("an input is written by two nests")
        k = ks[0]
        nest = ir.nests[k]
        addr = next(s.addr for s in nest.stores if s.buf == buf)
        for j, acc in enumerate(reads):
            for b, a in acc:
                if b == buf and (j != k or a != addr):
                    raise LoweringError("in-place write overlaps a read of another element")
        if any(j > k for j in range(len(ir.nests)) if any(b == buf for b, _ in reads[j])):
            raise LoweringError("input read after it is written")
