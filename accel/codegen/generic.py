"""Shape-generic kernels (CPU and GPU): one kernel for every length of a region's outer
loops.

Each nest of a region's loop IR runs its loops around its stores; the outermost one is,
in most regions, the rows of its tensors, or all their elements: an optimizer's update of
each parameter, a weight's initialization or conversion, a bias + activation or a
LayerNorm over a varying number of rows. A column nest (one loop of results, each a
reduction down the rows: a bias's gradient) takes its reductions' outermost loop, the
rows, instead (:func:`_column_rows`); so does a nest without loops (a whole reduction: a
loss's sum or mean; on a GPU from 65536 elements, where it runs over the whole grid). A
mean's or a variance's count (n, n - 1), divided by, becomes a :class:`RunTimeCount`. Two
regions whose IR is the same up to the
lengths of those outer loops compute the same thing, iteration by iteration, so one kernel
serves both, taking the lengths at run time (after the region's scalars) instead of as
constants: :func:`generic_layout` finds the outer loops and the IR's text with their
lengths left out (the store key of the shared kernel); :class:`GenericCppRenderer`
renders it.

Why the shared kernel computes what each region's own kernel would: the text holds
everything the renderer reads but those lengths (every address with its coefficients, the
inner loops' and the other reductions' lengths, the buffers' dtypes, the scalars' types),
and the renderer sees each outer length as a :class:`RunTimeLength`: an int that prints as the C
variable holding it and refuses every other use (arithmetic, comparison, truth,
conversion, hashing) with :class:`NotGeneric`. A decision that depends on a length (a row
cache or a vertical loop over it, a tile) therefore raises and the region is built for
its own sizes; otherwise the source differs from the static kernel's only in the loops'
bounds. The parallel threshold, the one decision about an outer length the static kernel
always takes, becomes an OpenMP ``if()`` on the run-time iteration count; a column nest's
choice between column blocks and rows split among the threads becomes an ``if`` around
both (:meth:`GenericCppRenderer._emit_vertical`), and its steps of 4 rows start from 8
rows, as the static kernel's.

The static kernel remains the rule where a nest's stores are large enough for streaming
stores (:func:`accel.codegen.cpp.stream_min_bytes`): such a region is built for its own
sizes, as it is where it has an empty loop. Scratch buffers (a reduction's results kept
for a later nest: a LayerNorm backward's row statistics) are arguments like the others,
allocated for each region's own sizes (its entry's ``scratch``).
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from typing import Dict, List, Optional

from ..loop_ir import Addr, Expr, LoopIR, reductions, walk
from . import machine_threads
from .columns import SPLIT_ROWS
from .cpp import CHUNK, CppRenderer, stream_min_bytes
from .cpp_groups import PARALLEL_MIN
from .cuda import CudaRenderer, index_type
from .cuda_columns import col_rows, col_split
from .cuda_shapes import BLOCK_UNROLL, COL_BLOCKS, GRID_MIN, MAX_GRID, VEC16


class NotGeneric(Exception):
    """A renderer's decision depends on a run-time length (:class:`RunTimeLength`): the
    region is built for its own sizes."""


class RunTimeLength(int):
    """Loop ``var``'s length, known at run time, times ``coeff`` (the CUDA renderer's
    iterations of a nest's loops flattened: the outer one's and the inner ones' lengths):
    formats as ``n<var>`` (``(n<var> * coeff)``), the kernel's variable holding it; any
    other use from Python raises :class:`NotGeneric`. (C code that takes an int's value
    directly, ``range()`` or ``%d`` formatting, would read 0: the renderers use neither on
    a loop's length, and only an outer loop's is one.)"""

    def __new__(cls, var: int, coeff: int = 1):
        self = super().__new__(cls, 0)
        self.var, self.coeff = var, coeff
        return self

    def __str__(self) -> str:
        return f"n{self.var}" if self.coeff == 1 else f"(n{self.var} * {self.coeff})"

    def __format__(self, spec: str) -> str:
        return str(self)

    __repr__ = __str__

    def _refuse(self, *args):
        raise NotGeneric(f"the code depends on loop {self.var}'s length")


for _op in ("add radd sub rsub mul rmul floordiv rfloordiv truediv rtruediv mod rmod divmod "
            "rdivmod pow rpow neg pos abs invert lshift rlshift rshift rrshift and rand or ror "
            "xor rxor lt le gt ge eq ne bool index int float hash round trunc floor ceil").split():
    setattr(RunTimeLength, f"__{_op}__", RunTimeLength._refuse)


@dataclasses.dataclass
class GenericLayout:
    """A region's shape-generic description. ``loops``: the outer loops' variables, in
    nest order (the k-th takes run-time scalar ``len(ir.scalar_types) + k``); ``sizes``:
    their lengths in this region; ``text``: the IR with those lengths left out (what the
    shared kernel's store key hashes); ``index_types``: on a GPU, each nest's kernel's
    index type for this region's lengths (:func:`accel.codegen.cuda.index_type`), in
    ``text`` too."""

    loops: List[int]
    sizes: List[int]
    text: str
    index_types: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RunTimeCount:
    """A floating constant that equals run-time loop ``var``'s length times ``mult``, plus
    ``offset`` (0 or -1): a mean's count of elements, or a variance's count less its
    correction of 1, which the decompositions divide by. Rendered as that expression of the
    kernel's variable, converted to the constant's dtype (the same value, rounded once)."""

    var: int
    mult: int
    offset: int = 0

    def __str__(self) -> str:
        n = f"n{self.var}" if self.mult == 1 else f"(n{self.var} * {self.mult})"
        return n if not self.offset else f"({n} - {-self.offset})"

    __repr__ = __str__


def _counts(ir: LoopIR, loops: List[int]) -> Dict[Expr, RunTimeCount]:
    """The floating constants of ``ir`` that something is divided by (whole, at least 2)
    and that are a whole multiple of a run-time length a reduction runs over (the first
    such of ``loops``), or one less than one: a mean's count (``x.mean()`` over n values
    divides their sum by n), a variance's (``x.var()``: by n - 1). In a region of other
    lengths the same IR has that expression there, or another text (a constant that is
    not such a count there stays a number), so the kernel computing it at run time
    computes each region's constant."""
    reduced = [v for v in loops if any(v in r.args[2] for nest in ir.nests for r in reductions(nest))]
    out: Dict[Expr, RunTimeCount] = {}
    seen: set = set()
    for nest in ir.nests if reduced else ():
        for st in nest.stores:
            for d in walk(st.value, seen):
                e = d.args[1] if d.op == "div" else None
                while e is not None and e.op == "cast":
                    e = e.args[0]
                v = e.args[0] if e is not None and e.op == "const" and e.dtype.is_floating_point else None
                if type(v) not in (int, float) or not math.isfinite(v) or v < 2 or v != int(v):
                    continue
                match = next(((r, o) for o in (0, -1) for r in reduced if (int(v) - o) % ir.sizes[r] == 0), None)
                if match is not None:
                    r, offset = match
                    out[e] = RunTimeCount(r, (int(v) - offset) // ir.sizes[r], offset)
    return out


def _with_counts(ir: LoopIR, counts: Dict[Expr, RunTimeCount]) -> LoopIR:
    """``ir`` with each constant of ``counts`` holding its :class:`RunTimeCount`."""
    if not counts:
        return ir
    memo: Dict[Expr, Expr] = {}

    def sub(a):
        if isinstance(a, tuple):
            return tuple(sub(b) for b in a)
        if not isinstance(a, Expr):
            return a
        if a not in memo:
            memo[a] = (Expr("const", a.dtype, (counts[a], counts[a])) if a in counts
                       else Expr(a.op, a.dtype, sub(a.args)))
        return memo[a]

    nests = [dataclasses.replace(n, stores=[dataclasses.replace(st, value=sub(st.value)) for st in n.stores])
             for n in ir.nests]
    return dataclasses.replace(ir, nests=nests)


def generic_layout(ir: LoopIR, device: str = "cpu") -> Optional[GenericLayout]:
    """The :class:`GenericLayout` of ``ir``: each nest's outermost loop of run-time
    length; a column nest's rows instead (:func:`_column_rows`), and a nest without loops
    (a whole reduction: a loss's mean) its reductions' outermost loops; on a GPU only
    where each of its reductions has ``GRID_MIN`` elements or more (the static kernel's
    grid-wide reduction; a shorter one runs in one block planned on its length and keeps
    its lengths in the text, so the two never share a kernel). None where it has no such
    loop or an empty one, or (on "cpu") a nest's stores reach the streaming-store size
    (its static kernel streams them). On a GPU each nest's index type for this region's
    lengths is part of the text: 32-bit where every index fits, as in the static kernel,
    and so the kernel of regions whose indices do is not the one of those whose do not."""
    loops: List[int] = []
    rows: List[int] = []  # reduction loops of run-time length
    for nest in ir.nests:
        if not nest.vars and device != "cpu" and any(
                math.prod(ir.sizes[v] for v in r.args[2]) < GRID_MIN for r in reductions(nest)):
            continue  # (a GPU's whole reduction under GRID_MIN: one block, planned on its length)
        if any(ir.sizes[v] <= 0 for v in nest.vars):
            return None
        out_bytes = sum(ir.buffers[st.buf].dtype.itemsize for st in nest.stores if st.addr.terms)
        if device == "cpu" and math.prod(ir.sizes[v] for v in nest.vars) * out_bytes >= stream_min_bytes():
            return None
        down = _column_rows(nest) if nest.vars else [r.args[2][0] for r in reductions(nest) if r.args[2]]
        if down and any(ir.sizes[v] <= 0 for v in down):
            return None
        for v in down or nest.vars[:1]:
            if v not in loops:
                loops.append(v)
        rows += down or []
    if not loops or any(v in loops for nest in ir.nests for v in nest.vars[1:]) or any(
            v in loops and (v not in rows or k) for nest in ir.nests for r in reductions(nest)
            for k, v in enumerate(r.args[2])):
        return None  # (a run-time length only as an outer loop's: see RunTimeLength)
    counts = _counts(ir, loops)
    text = _text(ir, ["n" if v in loops else s for v, s in enumerate(ir.sizes)], counts)
    index_types = [] if device == "cpu" else [index_type(nest, ir) for nest in ir.nests]
    if index_types:  # (regions whose every index fits in 32 bits share a kernel indexing in them)
        text += "\nindex types: " + " ".join(index_types)
    return GenericLayout(loops, [ir.sizes[v] for v in loops], text, index_types)


def _column_rows(nest) -> Optional[List[int]]:
    """The rows of a column nest: a nest of one loop whose every reduction reads down rows
    (a load contiguous along the loop, strided along the reduction's outermost loop, every
    load contiguous along the loop or the same for all of it: a bias's gradient, a column
    mean; the CPU renderer's column blocks, :meth:`accel.codegen.columns.ColumnLoops.
    _vertical`) takes its reductions' outermost loops at run time, not its own. None for
    any other nest."""
    reds = reductions(nest)
    if len(nest.vars) != 1 or not reds:
        return None
    c, rows = nest.vars[0], []
    for r in reds:
        rvars = r.args[2]
        loads = [x.args[1] for b in r.args[1] for x in walk(b, set(), into_reduce=False) if x.op == "load"]
        if not rvars or not all(a.coeff(c) in (0, 1) for a in loads) or not any(
                a.coeff(c) == 1 and abs(a.coeff(rvars[0])) > 1 for a in loads):
            return None
        rows += [rvars[0]] if rvars[0] not in rows else []
    return rows


def _text(ir: LoopIR, sizes: list, counts: Dict[Expr, RunTimeCount]) -> str:
    """``ir`` as text, each Expr once (``eK = ...``), its loop variables renumbered in order
    of first use (the lowering's numbering depends on dims it dropped), with ``sizes`` for
    their lengths and ``counts``' constants as run-time counts."""
    names: Dict[Expr, str] = {}
    order: Dict[int, int] = {}
    lines = [f"scalars {ir.scalar_types}"] + [f"buf {b.dtype} out={b.output} scratch={b.scratch}"
                                              for b in ir.buffers]

    def var(v: int) -> int:
        return order.setdefault(v, len(order))

    def addr(a: Addr) -> str:
        return "[" + ",".join(f"{var(v)}*{c}" for v, c in a.terms) + (f"+{a.offset}]" if a.offset else "]")

    def arg(a) -> str:
        if isinstance(a, Expr):
            return names[a]
        if isinstance(a, Addr):
            return addr(a)
        if isinstance(a, (tuple, list)):
            return "(" + ", ".join(map(arg, a)) + ")"
        return repr(a)

    def args(e: Expr) -> str:
        if e.op == "reduce":  # (kind, bodies, rvars, which)
            kind, bodies, rvars, which = e.args
            return f"{kind!r}, {arg(bodies)}, {[var(r) for r in rvars]}, {which!r}"
        return ", ".join(map(arg, e.args))

    for nest in ir.nests:
        lines.append(f"nest {[var(v) for v in nest.vars]}")
        for st in nest.stores:
            for e in walk(st.value, set()):  # (operands before users: each named before use)
                if e not in names:
                    count = counts.get(e)
                    text = f"{e.op} {e.dtype} ({args(e)})" if count is None else \
                        f"count {e.dtype} (n{var(count.var)} * {count.mult} + {count.offset})"
                    names[e] = f"e{len(names)}"
                    lines.append(f"{names[e]} = {text}")
            lines.append(f"store b{st.buf}{addr(st.addr)} = {names[st.value]}")
    lines.append(f"sizes {[sizes[v] for v in order]}")
    return "\n".join(lines)


class _RunTimeLengths:
    """What both devices' shape-generic renderers share: the lengths of loops ``loops``
    (see :func:`generic_layout`) rendered as :class:`RunTimeLength` values, no nest left
    out as empty (:func:`generic_layout` takes no IR with an empty loop; an outer one may
    run 0 times)."""

    def __init__(self, loops: List[int]):
        super().__init__()
        self.loops = loops

    def render(self, ir: LoopIR, name: str) -> str:
        ir = _with_counts(ir, _counts(ir, self.loops))
        sizes = list(ir.sizes)
        for v in self.loops:
            sizes[v] = RunTimeLength(v)
        return super().render(dataclasses.replace(ir, sizes=sizes), name)

    def const(self, v, dtype) -> str:
        if isinstance(v, RunTimeCount):  # (a mean's count: see _counts)
            return f"{self.ctype(dtype)}({v})"
        return super().const(v, dtype)

    def _empty(self, nest, ir: LoopIR) -> bool:
        return False

    def _static(self, n) -> bool:
        return not isinstance(n, RunTimeLength)

    def _size(self, vs):
        """The product of loops ``vs``' lengths: a :class:`RunTimeLength` (its ``coeff`` the
        others' product) where one of them is; two raise :class:`NotGeneric`."""
        n, run = 1, None
        for v in vs:
            s = self.ir.sizes[v]
            if not isinstance(s, RunTimeLength):
                n *= s
            elif run is None:
                run = s
            else:
                raise NotGeneric("a product of run-time lengths")
        return n if run is None else RunTimeLength(run.var, run.coeff * n)


class GenericCppRenderer(_RunTimeLengths, CppRenderer):
    """Renders a :class:`LoopIR` with the lengths of loops ``loops`` (see
    :func:`generic_layout`) read from the run-time scalars after the region's own: loop
    ``loops[k]``'s from ``s[len(ir.scalar_types) + k].i``. No streaming stores (decided
    by a nest's whole size; :func:`generic_layout` leaves the nests that would stream to
    the static kernel). The static kernel's other plans that depend on an outer loop's
    length (a transposing tile over it, column blocks along it, a cache of a one-loop
    nest's values between whole reductions and it) raise :class:`NotGeneric`: such a region
    is built for its own sizes. A one-loop nest's float16 values are widened element by
    element (the static kernel's whole-row passes are over a row of static length).

    Raises:
        NotGeneric: a decision of the renderer depends on a run-time length.
    """

    stream_stores = False

    def preamble(self, ir: LoopIR) -> List[str]:
        first = len(ir.scalar_types)
        return [f"  const int64_t n{v} = s[{first + k}].i;" for k, v in enumerate(self.loops)]

    def _plan_row_cache(self, v: int, outer, inner, index: str = "") -> None:
        if not isinstance(self.ir.sizes[v], RunTimeLength):
            super()._plan_row_cache(v, outer, inner, index)
        elif any(k == "group" for k, _ in outer.items):  # a one-loop nest after whole reductions
            raise NotGeneric("a row cache over a run-time loop")

    def _plan_f16_rows(self, v: int, outer, inner) -> None:
        if not isinstance(self.ir.sizes[v], RunTimeLength):  # (else converted element by element)
            super()._plan_f16_rows(v, outer, inner)

    @contextmanager
    def _lengths(self, k: int, var: Optional[int] = None):
        """The run-time lengths taken as ``k`` meanwhile (with ``var``: that loop's, the
        others' as 0), for a plan that must not depend on them (it is computed at several
        lengths, or asked whether it would apply at all)."""
        sizes = self.ir.sizes
        self.ir.sizes = [(k if var in (None, s.var) else 0) if isinstance(s, RunTimeLength) else s
                         for s in sizes]
        try:
            yield
        finally:
            self.ir.sizes = sizes

    def _plan(self, nest, ir: LoopIR) -> None:
        self.nest = nest  # (the nest a column loop's run-time work is counted in)
        super()._plan(nest, ir)

    def _plan_tile(self, order, scopes):
        if not any(isinstance(self.ir.sizes[v], RunTimeLength) for v in order[-2:]):
            return super()._plan_tile(order, scopes)
        with self._lengths(1 << 30):
            if super()._plan_tile(order, scopes) is not None:
                raise NotGeneric("a transposing tile over a run-time loop")
        return None

    def _work_varies(self, nest) -> bool:
        """Whether the nest's iterations (:meth:`CppRenderer._work`) depend on a run-time
        length."""
        try:
            return isinstance(super()._work(nest), RunTimeLength)
        except NotGeneric:
            return True

    def _work(self, nest) -> int:
        if self._work_varies(nest):
            return PARALLEL_MIN  # threads where the machine has them: if() decides at run time
        return super()._work(nest)

    def _run_time_work(self, nest) -> str:
        """The C expression of the nest's iterations (:meth:`CppRenderer._work`), linear in
        the run-time lengths: ``n<v> * a + ... + b`` (a product of two of them raises
        :class:`NotGeneric`)."""
        with self._lengths(0):
            b = super()._work(nest)
        terms, total = [], b
        for v in self.loops:
            with self._lengths(1, v):
                a = super()._work(nest) - b
            if a:
                terms.append(f"{RunTimeLength(v)} * {a}")
                total += a
        with self._lengths(1):
            if super()._work(nest) != total:
                raise NotGeneric("iterations not linear in the run-time lengths")
        return " + ".join(terms + [str(b)])

    def _emit_loop(self, j, out, ind, nest, parallel, innermost, simd, par_pragma) -> None:
        v = nest.vars[j]
        n = self.ir.sizes[v]
        if parallel and j == 0 and self._work_varies(nest):
            par_pragma += f" if({self._run_time_work(nest)} >= {PARALLEL_MIN})"
        if j or not isinstance(n, RunTimeLength):
            super()._emit_loop(j, out, ind, nest, parallel, innermost, simd, par_pragma)
            return
        if innermost and self._vertical(v, self.nest_scopes[j + 1]):
            raise NotGeneric("column blocks along a run-time loop")
        if parallel:
            out.append(f"{ind}#pragma {par_pragma}")
        if simd and self._last_loop(j, nest):  # a flat loop: chunks of CHUNK, each vectorized
            self._chunked_loop(j, out, ind, nest, n, f"({n} + {CHUNK - 1}) / {CHUNK}")
            return
        out.append(f"{ind}for (int64_t i{v} = 0; i{v} < {n}; ++i{v}) {{")  # rows, as the static kernel's
        self._emit_nest(j + 1, out, ind + "  ", nest)
        out.append(f"{ind}}}")

    def _emit_vertical(self, v: int, scope, out: List[str], ind: str, parallel: bool) -> None:
        """A column nest whose rows are of run-time length (a bias's gradient): what the
        static kernel decides on the rows is decided in the kernel, as it would be. Where
        the static kernel may split the rows among the threads (:meth:`ColumnLoops.
        _row_split` at any row count), both forms, the split taken where the work is
        parallel and every run-time row count reaches :data:`SPLIT_ROWS` rows a thread;
        the column blocks parallel where the work is (an OpenMP ``if()``)."""
        rows = [self.ir.sizes[g.rvars[0]] for k, g in scope.items if k == "group"]
        if not parallel or all(self._static(r) for r in rows):
            super()._emit_vertical(v, scope, out, ind, parallel)
            return
        work = f"{self._run_time_work(self.nest)} >= {PARALLEL_MIN}"
        with self._lengths(1 << 30):
            split = self._row_split(self.ir.sizes[v], scope)
        if not split:
            self._column_blocks(v, scope, out, ind, True, f" if({work})")
            return
        need = SPLIT_ROWS * machine_threads()
        cond = " && ".join([f"({work})"] + [f"{r} >= {need}" for r in rows if not self._static(r)])
        out.append(f"{ind}if ({cond}) {{")
        self._emit_rows(v, scope, out, ind + "  ")
        out.append(f"{ind}}} else {{")
        self._column_blocks(v, scope, out, ind + "  ", True, f" if({work})")
        out.append(f"{ind}}}")


class GenericCudaRenderer(_RunTimeLengths, CudaRenderer):
    """Renders a :class:`LoopIR` for CUDA with the lengths of loops ``loops`` (see
    :func:`generic_layout`) read from the run-time scalars after the region's own, as
    :class:`GenericCppRenderer` does for the CPU. The CUDA kernels flatten a nest's loops
    (or those outside its reductions) into one grid-strided index, so their iteration
    count is the outer loop's length times the inner ones' (:meth:`_size`, a
    :class:`RunTimeLength` with that ``coeff``), and a launch's grid is a formula of it
    (:meth:`_grid`, evaluated for a region's lengths by :func:`launches_for`). Column
    tiles take their block's rows of threads and their split among blocks at launch too
    (:meth:`_col_shape`), and a whole reduction of ``GRID_MIN`` elements or more its
    blocks. Transposing tiles, a block's reduction (a row's or a short whole one) over a
    run-time length and long rows' moments decide on the count and raise
    :class:`NotGeneric` (those regions are built for their own sizes); elementwise nests
    (16-byte vectors included: a vector never straddles rows, whose length is static) and
    row kernels do not.

    Each nest's kernel indexes in ``index_types[k]`` (:attr:`GenericLayout.index_types`:
    ``int`` only where every region it serves has every index below 2**30).

    Raises:
        NotGeneric: a decision of the renderer depends on a run-time length.
    """

    def __init__(self, loops: List[int], index_types: List[str]):
        super().__init__(loops)
        self.index_types = index_types

    def _index_types(self, ir: LoopIR) -> List[str]:
        return self.index_types

    def preamble(self, ir: LoopIR) -> List[str]:
        first = len(ir.scalar_types)
        return [f"  const int64_t n{v} = sc.v[{first + k}].i;" for k, v in enumerate(self.loops)]

    def _n_scalars(self, ir: LoopIR) -> int:
        return len(ir.scalar_types) + len(self.loops)

    def _flat_var(self, nest, ir: LoopIR):
        """The loop of run-time length whose every vector a vector variant moves whole (the
        launch's ``multiple``): the innermost loop of elementwise ``nest`` (one loop: a flat
        nest), or the one loop of a whole reduction (a loss's sum, grid mode); else None."""
        reds = reductions(nest)
        if nest.vars and not reds:
            v = nest.vars[-1]
        elif not nest.vars and reds and all(list(e.args[2]) == list(reds[0].args[2]) for e in reds) \
                and len(reds[0].args[2]) == 1:
            v = reds[0].args[2][0]
        else:
            return None
        return v if isinstance(ir.sizes[v], RunTimeLength) else None

    def _vector_width(self, nest, ir: LoopIR) -> frozenset:
        v = self._flat_var(nest, ir)
        if v is None:
            return super()._vector_width(nest, ir)
        sizes = ir.sizes  # vectors where the length is a multiple of 8
        ir.sizes = [VEC16 if u == v else s for u, s in enumerate(sizes)]
        try:
            return super()._vector_width(nest, ir)
        finally:
            ir.sizes = sizes

    def _vector_condition(self, nest, ir: LoopIR) -> dict:
        v = self._flat_var(nest, ir)
        return {} if v is None else {"multiple": [self.loops.index(v), self.vw]}

    def _cdiv(self, n, k: int):
        return f"(({n} + {k - 1}) / {k})" if isinstance(n, RunTimeLength) else super()._cdiv(n, k)

    def _grid(self, n, per: int, cap: int = MAX_GRID):
        if not isinstance(n, RunTimeLength):
            return super()._grid(n, per, cap)
        return {"loop": self.loops.index(n.var), "coeff": n.coeff, "per": per, "cap": cap}

    def _col_loop(self, f: str, n, ind: str) -> List[str]:
        """Column tiles, the block's shape at launch: a thread's rows as a count of steps,
        computed once, so that nvcc still unrolls the loop (by a step known only at run time,
        a loop ``r += step`` ran one load at a time: a float32 column variance over [100000,
        96] took 1837 us against the static kernel's 435 on the H200). The same rows in the
        same order."""
        if isinstance(self.col_step, int):
            return super()._col_loop(f, n, ind)
        return [f"{ind}const int64_t {f}_0 = {self.col_start}, {f}_s = {self.col_step};",
                f"{ind}const int64_t {f}_n = {f}_0 < {n} ? ({n} - {f}_0 + {f}_s - 1) / {f}_s : 0;",
                f"{ind}#pragma unroll {BLOCK_UNROLL}",
                f"{ind}for (int64_t {f}_k = 0; {f}_k < {f}_n; ++{f}_k) {{",
                f"{ind}  const int64_t {f} = {f}_0 + {f}_k * {f}_s;"]

    def _grid_fits(self, order, rsize) -> bool:
        # (a whole reduction of run-time length has GRID_MIN elements or more: generic_layout)
        return super()._grid_fits(order, GRID_MIN if isinstance(rsize, RunTimeLength) else rsize)

    def _col_shape(self, groups, tiles: int, splits: bool):
        """Column tiles down rows of run-time length (a bias's gradient over 1024 columns):
        the block's rows of threads and the blocks a tile's rows are split among as launch
        formulas (``col_rows``, ``col_split``: the static kernel's choice for the region's
        rows), the kernel reading them from ``blockDim.y`` and ``gridDim.y``; the split's
        partials under ``if (gridDim.y > 1)``, in arrays for the most blocks a split
        takes. Reductions over two run-time lengths raise :class:`NotGeneric`."""
        rs = [self._size(g.rvars) for g in groups]
        if all(self._static(r) for r in rs):
            return super()._col_shape(groups, tiles, splits)
        if any(self._static(r) or (r.var, r.coeff) != (rs[0].var, rs[0].coeff) for r in rs):
            raise NotGeneric("column reductions over different lengths")
        rows = {"fn": "col_rows", "loop": self.loops.index(rs[0].var), "coeff": rs[0].coeff}
        split = dict(rows, fn="col_split", tiles=tiles) if splits else 1
        self.col_start = "blockIdx.y * blockDim.y + threadIdx.y" if splits else "threadIdx.y"
        self.col_step = "(int64_t)gridDim.y * blockDim.y" if splits else "(int64_t)blockDim.y"
        self.col_split_max = -(-COL_BLOCKS // tiles) if splits else 1
        self.col_split_if = "if (gridDim.y > 1) " if splits else ""
        return rows, split


def _formula(d: dict, sizes: List[int]) -> int:
    """A launch dimension's formula (see :func:`launches_for`) for outer lengths ``sizes``."""
    n = sizes[d["loop"]] * d["coeff"]
    fn = d.get("fn", "blocks")
    if fn == "blocks":
        return min(-(-n // d["per"]), d["cap"])
    return col_rows(n) if fn == "col_rows" else col_split(n, d["tiles"])


def launches_for(launches: List[dict], sizes: List[int]) -> List[dict]:
    """A shape-generic CUDA module's launch plan (:attr:`GenericCudaRenderer.launches`)
    for a region whose outer loops have lengths ``sizes`` (:attr:`GenericLayout.sizes`),
    each dimension as the static renderer computes it for that region. A formula takes
    ``n = sizes[k] * c`` from ``{"loop": k, "coeff": c, ...}``: ``"per": p, "cap": m``
    (a grid) is ``min(ceil(n / p), m)`` blocks; ``"fn": "col_rows"`` a column tile's rows
    of threads (:func:`accel.codegen.cuda_columns.col_rows`), ``"fn": "col_split", "tiles": t``
    the blocks its rows are split among (:func:`accel.codegen.cuda_columns.col_split`)."""
    def plan(launch: dict) -> dict:
        grid, block = ([_formula(d, sizes) if isinstance(d, dict) else d for d in launch[k]]
                       for k in ("grid", "block"))
        out = dict(launch, grid=grid, block=block)
        vector = launch.get("vector")
        if vector is not None and vector.get("multiple"):  # (a flat nest: its length a multiple of the width)
            k, width = vector["multiple"]
            vector = None if sizes[k] % width else {x: y for x, y in vector.items() if x != "multiple"}
        if vector is not None:
            out["vector"] = plan(vector)
        else:
            out.pop("vector", None)
        return out
    return [plan(l) for l in launches]
