"""Where a nest's values are computed, shared by the C++ and CUDA renderers: a :class:`Scope`
is a loop body (the values, reduction groups and stores computed in it, in order), a
:class:`Group` the reductions one loop computes together; and the expression rewrites and
tests their plans use (:meth:`accel.codegen.cpp.CppRenderer._plan`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..loop_ir import Addr, Expr, LoopIR, free_vars, walk
from ..ops import HALF
from . import FLOATS


def subst(e: Expr, r: int, v: int, memo=None) -> Expr:
    """``e`` with loop variable ``r`` replaced by ``v``."""
    memo = {} if memo is None else memo
    out = memo.get(e)
    if out is None:
        if e.op in ("load", "index"):
            k = 1 if e.op == "load" else 0
            terms = tuple(sorted((v if x == r else x, c) for x, c in e.args[k].terms))
            args = list(e.args)
            args[k] = Addr(terms, e.args[k].offset)
            out = Expr(e.op, e.dtype, tuple(args))
        elif e.op == "reduce":
            out = e
        else:
            out = Expr(e.op, e.dtype, tuple(subst(a, r, v, memo) if isinstance(a, Expr) else a
                                            for a in e.args))
        memo[e] = out
    return out


def reciprocal_divisor(b: Expr, numbers: bool) -> bool:
    """Whether eager's kernel multiplies by the reciprocal of loop-invariant divisor ``b``
    rather than divide by it: a softmax's sum of exponentials (ATen's CPU softmax
    kernels), and with ``numbers`` (a GPU) a number, a constant or a scalar argument and
    what is computed from them alone (``div_true_kernel_cuda``'s CPU scalar divisor,
    ``MeanOps``' factor). Eager divides by anything else (the CPU's ``mean``, ``x / 0.3``,
    a row's value broadcast): its bits."""
    b = _uncast(b)
    if b.op == "reduce":
        return b.args[0] == "online_softmax" and b.args[3] == 1
    if b.op == "add" and _exp_sum(b):  # a softmax's over a concatenation's pieces
        return True
    return numbers and _number(b)


def _exp_sum(e: Expr) -> bool:
    """``e`` is a sum of ``exp(x - max)`` over a concatenation's pieces or one of them (a
    softmax's: :meth:`accel.lower_expr._Lowerer.reduce`)."""
    e = _uncast(e)
    if e.op == "add":
        return all(_exp_sum(a) for a in e.args)
    return (e.op == "reduce" and e.args[0] == "sum" and _uncast(e.args[1][0]).op == "exp"
            and _uncast(e.args[1][0]).args[0].op == "sub")


def _uncast(e: Expr) -> Expr:
    while e.op == "cast":
        e = e.args[0]
    return e


def _number(e: Expr) -> bool:
    return e.op in ("const", "scalar") or (
        e.op not in ("load", "index", "reduce") and all(_number(a) for a in e.args if isinstance(a, Expr)))


def _reciprocal(b: Expr, dtype) -> Expr:
    """``1 / b`` in ``dtype``; a float32 number's (a constant or a scalar argument) taken in
    float64 from the number as given, then rounded, as ``div_true_kernel_cuda`` takes it
    (``i / 0.001`` is -2000.0 there: 1000.0 a reciprocal, where float32's of 0.001 is
    999.99994)."""
    leaf = _uncast(b)
    if dtype == torch.float32 and leaf.op in ("const", "scalar"):
        wide = Expr(leaf.op, torch.float64, leaf.args)
        return Expr("cast", dtype, (Expr("reciprocal", torch.float64, (wide,)),))
    return Expr("reciprocal", dtype, (b,))


def two_pass_softmax(e: Expr, memo=None, online: bool = False, numbers: bool = False) -> Expr:
    """CPU forms: an online softmax reduction as the max, then the sum of exp(x - max) (a
    row is in cache, so a second pass is cheap, and the row's exp values can be kept for
    the output: one exp per element instead of two); a division by a loop-invariant value
    that eager's kernel takes the reciprocal of (:func:`reciprocal_divisor`, ``numbers``
    passed on) as a product with that reciprocal. With ``online``, the online softmax
    reductions stay (a GPU's column reductions: one pass over memory, not two)."""
    memo = {} if memo is None else memo
    out = memo.get(e)
    if out is None:
        if e.op == "reduce" and e.args[0] == "online_softmax":
            _, (b,), rv, which = e.args
            b = two_pass_softmax(b, memo, online, numbers)  # (its divisions as the output's: one exp, kept)
            if online:
                memo[e] = Expr("reduce", e.dtype, ("online_softmax", (b,), rv, which))
                return memo[e]
            m = Expr("reduce", e.dtype, ("amax", (b,), rv, 0))
            ex = Expr("exp", e.dtype, (Expr("sub", e.dtype, (b, m)),))
            out = m if which == 0 else Expr("reduce", e.dtype, ("sum", (ex,), rv, 0))
        elif e.op == "reduce":
            kind, bodies, rv, which = e.args
            out = Expr("reduce", e.dtype, (kind, tuple(two_pass_softmax(b, memo, online, numbers) for b in bodies),
                                           rv, which))
        elif (e.op == "div" and e.dtype.is_floating_point and free_vars(e.args[1]) < free_vars(e.args[0])
              and reciprocal_divisor(e.args[1], numbers)):
            # a loop-invariant divisor: one reciprocal, a product per element (as eager's)
            a, b = (two_pass_softmax(x, memo, online, numbers) for x in e.args)
            out = Expr("mul", e.dtype, (a, _reciprocal(b, e.dtype)))
        else:
            out = Expr(e.op, e.dtype, tuple(two_pass_softmax(a, memo, online, numbers) if isinstance(a, Expr) else a
                                            for a in e.args))
        memo[e] = out
    return out


#: the reduction kinds of both renderers. Plain ones, accumulated by an operator (a C++ ``omp
#: simd reduction`` clause): init, update, clause.
SIMPLE = {"sum": ("0", "{a} += {x};", "+"), "prod": ("1", "{a} *= {x};", "*"),
          "amax": ("$lowest", "{a} = accel::maximum({a}, {x});", "accel_max"),
          "amin": ("$highest", "{a} = accel::minimum({a}, {x});", "accel_min")}
#: kinds accumulated a block of values at a time (C++: an accumulator class)
BLOCKED = {"welford": "accel::ShiftedMoments", "online_softmax": "accel::OnlineSoftmax"}
#: value-and-index kinds: init, comparison
ARG = {"argmax": ("$lowest", "accel::argmax_better"), "argmin": ("$highest", "accel::argmin_better")}


@dataclass
class Group:
    """Reductions computed by one loop over ``rvars``."""

    rvars: tuple
    category: str
    members: List[Expr] = field(default_factory=list)


@dataclass
class Scope:
    """A loop body: the items computed in it (Exprs, groups, stores), in order."""

    bound: frozenset
    parent: Optional["Scope"]
    items: list = field(default_factory=list)
    names: Dict[Expr, str] = field(default_factory=dict)

    def lookup(self, e: Expr) -> Optional[str]:
        s = self
        while s is not None:
            if e in s.names:
                return s.names[e]
            s = s.parent
        return None


def trivial(x: Expr, widened_f16: bool) -> bool:
    """A load, constant or scalar, or casts of one: cheaper to compute again than to keep
    (a cast of computed values, a 16-bit rounding of a sum, is worth keeping; with
    ``widened_f16``, so is a float16 value widened, a call on the CPU: log_softmax f16
    [8192, 1024] 7.0 -> 5.8 ms)."""
    while x.op == "cast":
        if widened_f16 and x.args[0].dtype == torch.float16:
            return False
        x = x.args[0]
    return x.op in ("load", "const", "scalar")


def f16_round(x: Expr) -> bool:
    """``x`` is a float32 value rounded to float16 and read back as float32."""
    return (x.op == "cast" and x.dtype == torch.float32 and x.args[0].op == "cast"
            and x.args[0].dtype == torch.float16 and x.args[0].args[0].dtype == torch.float32)


def int_round_trip(ir: LoopIR) -> bool:
    """``ir`` converts a floating value to an integer type and an integer value to a
    floating type (not necessarily the same value: a conservative test)."""
    to_int = to_float = False
    seen: set = set()
    for nest in ir.nests:
        for st in nest.stores:
            for e in walk(st.value, seen):
                if e.op == "cast" and isinstance(e.args[0], Expr):
                    src_float = e.args[0].dtype in FLOATS or e.args[0].dtype in HALF
                    dst_float = e.dtype in FLOATS or e.dtype in HALF
                    to_int |= src_float and not dst_float and e.dtype != torch.bool
                    to_float |= dst_float and not src_float
    return to_int and to_float
