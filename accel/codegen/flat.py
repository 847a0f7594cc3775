"""Shape-generic flat kernels (CPU): one kernel for every size of a region whose loops are flat.

A region's loop IR is *flat* where each nest runs at most one loop, every address is that
loop's variable itself (``b[i]``: a contiguous buffer of the loop's length) or the constant 0
(a one-element buffer), and nothing reduces: pointwise work over contiguous tensors of any
shape, as in an optimizer's update of each parameter, a weight's initialization or
conversion, a bias + activation over a varying number of rows. Two such regions whose IR is
the same up to the loops' lengths compute the same thing element by element, so one kernel
serves both, taking the lengths at run time (after the region's scalars) instead of as
constants: :func:`flat_layout` finds a flat IR and its text with the lengths left out (the
store key of the shared kernel), :class:`FlatCppRenderer` renders it.

The static kernel remains the rule: a region that is not flat, or whose stores are large
enough for streaming stores (:func:`accel.codegen.cpp.stream_min_bytes`), is built for its
own sizes. Scheduling follows :class:`accel.codegen.cpp.CppRenderer`'s one-loop nests:
chunks of :data:`accel.codegen.cpp.CHUNK` elements across OpenMP threads once a nest runs
:data:`accel.codegen.cpp_groups.PARALLEL_MIN` iterations, each chunk a ``#pragma omp simd``
loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..loop_ir import Addr, Expr, LoopIR, walk
from .cpp import CHUNK, CppRenderer, stream_min_bytes
from .cpp_groups import PARALLEL_MIN


@dataclass
class FlatLayout:
    """A flat IR's shape-free description. ``loops``: its loop variables in order of first
    use (the k-th takes run-time scalar ``len(ir.scalar_types) + k``); ``sizes``: their
    lengths in this region; ``text``: the IR with the lengths left out and the variables
    renumbered in that order (what the shared kernel's store key hashes)."""

    loops: List[int]
    sizes: List[int]
    text: str


def flat_layout(ir: LoopIR) -> Optional[FlatLayout]:
    """The :class:`FlatLayout` of ``ir``, or None where it is not flat (see the module's
    docstring), has scratch buffers or an empty loop, or where a nest's stores reach the
    streaming-store size (its static kernel streams them)."""
    if any(b.scratch for b in ir.buffers):
        return None
    loops: List[int] = []
    bound: Dict[int, int] = {}  # buffer -> the loop variable it is indexed by (-1: element 0)
    for nest in ir.nests:
        if len(nest.vars) > 1:
            return None
        v = nest.vars[0] if nest.vars else None
        if v is not None:
            if ir.sizes[v] <= 0:
                return None
            loops.append(v)
            out_bytes = sum(ir.buffers[st.buf].dtype.itemsize for st in nest.stores
                            if st.addr.terms)
            if ir.sizes[v] * out_bytes >= stream_min_bytes():
                return None
        accesses = [(st.buf, st.addr) for st in nest.stores]
        for st in nest.stores:
            for e in walk(st.value, set()):
                if e.op in ("reduce", "index"):
                    return None
                if e.op == "load":
                    accesses.append((e.args[0], e.args[1]))
        for buf, addr in accesses:
            var = _flat_var(addr, v)
            if var is None or bound.setdefault(buf, var) != var:
                return None
    for buf, var in bound.items():
        spec = ir.buffers[buf]
        n = 1 if var == -1 else ir.sizes[var]
        if math.prod(spec.shape) != n or not _contiguous(spec):
            return None
    order = {v: k for k, v in enumerate(loops)}
    return FlatLayout(loops, [ir.sizes[v] for v in loops], _text(ir, order))


def _flat_var(addr: Addr, v: Optional[int]) -> Optional[int]:
    """The loop variable ``addr`` indexes by (-1: the constant 0), None if neither."""
    if not addr.terms:
        return -1
    if v is not None and addr.terms == ((v, 1),):
        return v
    return None


def _contiguous(spec) -> bool:
    """Whether a buffer's elements are contiguous in row-major order (PyTorch's test: a
    size-1 dim's stride does not matter)."""
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta").is_contiguous()


def _text(ir: LoopIR, order: Dict[int, int]) -> str:
    """``ir`` as text, each Expr once (``eK = ...``), loop variables by ``order``, lengths
    left out."""
    names: Dict[Expr, str] = {}
    lines = [f"scalars {ir.scalar_types}"]
    lines += [f"buf {b.dtype} out={b.output}" for b in ir.buffers]

    def addr(a: Addr) -> str:
        return "[" + ",".join(f"{order[v]}*{c}" for v, c in a.terms) + "]"

    def arg(a) -> str:
        if isinstance(a, Expr):
            return names[a]
        if isinstance(a, Addr):
            return addr(a)
        return repr(a)

    for nest in ir.nests:
        lines.append(f"nest {[order[v] for v in nest.vars]}")
        for st in nest.stores:
            for e in walk(st.value, set()):
                if e not in names:
                    names[e] = f"e{len(names)}"
                    lines.append(f"{names[e]} = {e.op} {e.dtype} ({', '.join(map(arg, e.args))})")
            lines.append(f"store b{st.buf}{addr(st.addr)} = {names[st.value]}")
    return "\n".join(lines)


class FlatCppRenderer(CppRenderer):
    """Renders a flat :class:`LoopIR` (see :func:`flat_layout`) with its loops' lengths read
    from the run-time scalars after the region's own: loop ``loops[k]``'s from
    ``s[len(ir.scalar_types) + k].i``. No streaming stores (a flat layout has none), no row
    caches or tiles (a flat nest has one loop and no reduction)."""

    stream_stores = False
    row_caching = False
    f16_row_passes = False
    tile_transposes = False
    expand_invariants = False

    def __init__(self, loops: List[int]):
        super().__init__()
        self.loops = loops

    def preamble(self, ir: LoopIR) -> List[str]:
        first = len(ir.scalar_types)
        return [f"  const int64_t n{v} = s[{first + k}].i;" for k, v in enumerate(self.loops)]

    def _emit_loop(self, j, out, ind, nest, parallel, innermost, simd, par_pragma) -> None:
        # every flat loop: run-time chunks, threads from PARALLEL_MIN on (``parallel`` and
        # the nest's sizes in the IR are the first region's, not this call's)
        n = f"n{nest.vars[j]}"
        out.append(f"{ind}#pragma omp parallel for schedule(static) if({n} >= {PARALLEL_MIN})")
        out.append(f"{ind}for (int64_t c = 0; c < ({n} + {CHUNK - 1}) / {CHUNK}; ++c) {{")
        out.append(f"{ind}  const int64_t lo = c * {CHUNK}, hi = lo + {CHUNK} < {n} ? lo + {CHUNK} : {n};")
        self._simd_loop(j, "lo", "hi", out, ind + "  ", nest)
        out.append(f"{ind}}}")
