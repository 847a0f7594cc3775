"""The loop IR: what the lowering (:mod:`accel.lowering`) produces and the backends
(:mod:`accel.codegen`) render, device independent.

A region's kernel is a list of loop nests, run in order. A nest iterates over loop variables
(static sizes) and stores values into buffers; a value is an expression DAG (:class:`Expr`)
over loads, scalars, constants, prim ops and *reductions*, whose addresses are affine in the
loop variables (:class:`Addr`). An ``Expr("reduce")`` depends only on the variables its
body uses outside its own reduction variables, so a backend computes it once per iteration
of the loops it depends on (:func:`free_vars`). Expressions are frozen dataclasses: equal
subexpressions compare and hash equal (CSE across a nest).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Tuple

import torch


@dataclass(frozen=True)
class Addr:
    """Element offset ``offset + sum(c * v for v, c in terms)`` into a buffer (elements),
    terms sorted by variable, no zero coefficients; ``offset`` (a constant, default 0) is
    where a view at an offset reads from (a slice, a narrow, a chunk of a region's value)."""

    terms: Tuple[Tuple[int, int], ...]
    offset: int = 0

    def coeff(self, var: int) -> int:
        return dict(self.terms).get(var, 0)

    def extent(self, sizes) -> Tuple[int, int]:
        """The lowest and highest offsets the address takes over loops of ``sizes`` (a
        length per variable)."""
        lo = hi = self.offset
        for v, c in self.terms:
            if c > 0:
                hi += c * (sizes[v] - 1)
            else:
                lo += c * (sizes[v] - 1)
        return lo, hi

    def without(self, drop) -> "Addr":
        """This address with the terms of the variables in ``drop`` left out (those loops at 0)."""
        return Addr(tuple(t for t in self.terms if t[0] not in drop), self.offset)


@dataclass(frozen=True)
class Expr:
    """One value in a loop body. ``op`` is ``load`` (args: buffer, Addr), ``scalar`` (args:
    slot), ``const`` (args: value), ``index`` (args: Addr: an affine int64 of the loop
    variables), ``cast`` (args: Expr), ``reduce`` (args: kind, bodies, rvars, which) or a
    prim name (args: Exprs).

    ``reduce``: ``kind`` names the accumulation (``REDUCTIONS``), ``bodies`` the Exprs it
    accumulates (one per input of the kind), ``rvars`` its reduction variables, ``which``
    the result it stands for (``welford``: 0 var, 1 mean; ``online_softmax``: 0 max,
    1 sum of exp; ``argmax``/``argmin``: 0 value, 1 index). ``dtype`` is the accumulator's.
    """

    op: str
    dtype: torch.dtype
    args: tuple


#: reduction kinds: name -> number of results.
REDUCTIONS = {"sum": 1, "prod": 1, "amax": 1, "amin": 1, "argmax": 2, "argmin": 2,
              "welford": 2, "online_softmax": 2}


@dataclass
class Store:
    buf: int
    addr: Addr
    value: Expr


@dataclass
class Nest:
    """A loop nest over ``vars`` (outermost first) with its stores."""

    vars: List[int]
    stores: List[Store] = field(default_factory=list)


@dataclass
class BufferSpec:
    """A kernel argument buffer: ``bufs[index]`` in the kernel ABI. ``scratch``: a
    temporary the runtime provides (contiguous, contents undefined), after the outputs.
    ``origin``: for the lowering only, a piece of a buffer a store writes (``shape`` the
    piece's), the index its first element has in the buffer (a concatenation stored piece
    by piece: :func:`accel.lowering._split_spans`); empty for a whole buffer. ``merged``:
    for the lowering only, for each dim of the stored value, the multipliers of the
    store's dims it spans in its index (a dim of 12 split in 3 by 4: ``(4, 1)``, where the
    value reads a ``collapse_view`` of it: :class:`accel.lower_expr.SplitLoop`); the
    pieces of a split dim keep them; empty: one dim each."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    output: bool
    scratch: bool = False
    origin: Tuple[int, ...] = field(default=(), repr=False)
    merged: Tuple[Tuple[int, ...], ...] = field(default=(), repr=False)


@dataclass
class LoopIR:
    """The kernel of a region: its buffers (external inputs, then live outputs), runtime
    scalar types (``"f"``/``"i"``), the size of each loop variable, and the nests, run in
    order."""

    buffers: List[BufferSpec]
    scalar_types: List[str]
    sizes: List[int]
    nests: List[Nest]

    def describe(self) -> str:
        out = []
        for i, n in enumerate(self.nests):
            dims = "x".join(str(self.sizes[v]) for v in n.vars) or "()"
            out.append(f"nest{i} [{dims}]: {len(n.stores)} stores, "
                       f"{len(reductions(n))} reductions")
        return "\n".join(out)


#: prims lowered one-to-one to a same-named IR op (the codegen tables say how to emit them).
ELEMENTWISE = frozenset("""
abs acos acosh asin asinh atan atanh cos cosh ceil erf erfc erf_inv exp exp2 expm1 floor
lgamma log log1p log2 log10 neg reciprocal round sign signbit sin sinh sqrt rsqrt tan tanh
trunc bitwise_not isfinite cbrt digamma
add sub mul div atan2 fmod remainder pow maximum minimum fmax fmin hypot nextafter copysign
bitwise_and bitwise_or bitwise_xor shift_left shift_right_arithmetic eq ne lt le gt ge
where gcd
""".split())

#: accel's own elementwise operators (accel/library.py), rendered by name.
ACCEL_ELEMENTWISE = frozenset({"silu", "gelu_tanh", "vec_erf", "log_libm", "fma", "mul_rn", "div_rn",
                               "div_floor"})

def walk(e: Expr, seen: set, into_reduce: bool = True):
    """Yield every Expr reachable from ``e`` once, operands before users."""
    if e in seen:
        return
    seen.add(e)
    if e.op == "reduce":
        if into_reduce:
            for b in e.args[1]:
                yield from walk(b, seen, into_reduce)
    else:
        for a in e.args:
            if isinstance(a, Expr):
                yield from walk(a, seen, into_reduce)
    yield e


_FREE: Dict[Expr, FrozenSet[int]] = {}


def forget_free_vars() -> None:
    """Drop :func:`free_vars`' memo (each lowering starts afresh: the memo then holds one
    region's Exprs, not every region's)."""
    _FREE.clear()


def free_vars(e: Expr) -> FrozenSet[int]:
    """The loop variables ``e`` depends on (a reduction's own variables excluded)."""
    f = _FREE.get(e)
    if f is None:
        if e.op in ("load", "index"):
            addr = e.args[1] if e.op == "load" else e.args[0]
            f = frozenset(v for v, _ in addr.terms)
        elif e.op == "reduce":
            f = frozenset().union(*map(free_vars, e.args[1])) - frozenset(e.args[2])
        else:
            f = frozenset().union(*(free_vars(a) for a in e.args if isinstance(a, Expr)))
        _FREE[e] = f
    return f


def reductions(nest: Nest) -> List[Expr]:
    """Every reduce Expr of a nest, operands before users."""
    seen: set = set()
    out = []
    for st in nest.stores:
        out += [e for e in walk(st.value, seen) if e.op == "reduce"]
    return out
