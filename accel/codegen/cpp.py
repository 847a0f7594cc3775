"""C++/OpenMP backend: one ``extern "C"`` entry point per region, a loop nest per IR nest.

Scheduling: every value is computed in the outermost loop that binds all the variables it
depends on (loop-invariant code motion), so a row reduction runs once per row, before the
loop that uses it, and stays in a register. Reductions of one domain that do not depend on
each other share one loop (a group); ``welford`` and ``online_softmax`` run blockwise through
helpers in ``include/accel/cpu_math.h``. The outermost loop runs across OpenMP threads
(a full reduction runs as an OpenMP reduction); innermost loops are ``#pragma omp simd`` so
gcc vectorizes them, calling libmvec's vector math. A memory-bound innermost loop whose
stores exceed the last-level cache writes them with streaming stores (:data:`STREAM_MIN_BYTES`).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..loop_ir import Addr, Expr, LoopIR, Nest, Store, free_vars, walk
from ..ops import HALF
from . import FLOATS, CodegenError, CStyle, llc_bytes, machine_threads
from .columns import ColumnLoops
from .cpp_groups import PARALLEL_MIN, GroupLoops
from .tiles import TiledLoops
from .scopes import ARG, SIMPLE, Group, Scope, f16_round, int_round_trip, subst, trivial, two_pass_softmax

#: elements per OpenMP work item in a one-loop nest.
CHUNK = 4096
#: a plain reduction over at most this many values a result (a static count: the sum of
#: squares of [N, 3] points, a logsumexp over 5 classes, mvlgamma's sum of p lgammas) is
#: computed by a loop gcc unrolls whole inside the vectorized loop over the results
#: (:meth:`CppRenderer._small_rows`): vectors run across the results, where a vectorized
#: loop over 3 values a result had kept every lane but 3 idle, and every call of a function
#: without vector variants of its own scalar. C++ kernels on the dev VM, [4M, 3] float32,
#: two threads, ms: sum of squares 4.7 -> 3.0, mvlgamma (p = 3) 130 -> 27.
SMALL_ROWS = 16
#: strides along the vectorized loop whose loads gcc 12 vectorizes as interleaved groups (2,
#: 3, 4, 8 or 16 values a result); of 5, 6, 7 or 9-15 it vectorizes no loop (a logsumexp
#: over 5 values stayed scalar, 70 ms on [4M, 5] float32 against eager's 55), but it builds
#: vectors of single loads where the stride is a run-time value: such a stride is hidden
#: from it (``accel::opaque``; that logsumexp 8-12 ms).
SMALL_ROW_STRIDES = (0, 1, 2, 3, 4, 8, 16)
#: longest row kept in a stack array between a reduction loop and the row's loop.
ROW_CACHE_MAX = 16384
#: a nest whose innermost loop stores at least this many bytes contiguously (None: three
#: quarters of the last-level cache, glibc memcpy's non-temporal threshold, the cache taken
#: at most STREAM_LLC_MAX: :func:`stream_min_bytes`) writes them
#: with streaming stores, in blocks of STREAM_BLOCK values computed into a stack array
#: (accel::stream_store): such outputs cannot stay in the cache, and a plain store first
#: reads the line it writes. RMSNorm on [8192, 1024] float32, one kernel on the 2-core VM:
#: 1.90 -> 1.54 ms.
STREAM_MIN_BYTES: Optional[int] = None
STREAM_BLOCK = 64
#: the cache size the streaming threshold takes at most. A VM may list its host's whole
#: last-level cache (480 MiB on a 2-core Intel Xeon VM, whose triad over 3 x 64 MiB runs at
#: DRAM speed, 27.6 GB/s): there a 32 MiB output cannot stay in the cache either, and
#: streaming its stores made [8192, 1024] float32 rows faster with tuned malloc (ms, plain
#: -> streamed; torch.compile): RMSNorm 3.07-3.37 -> 2.75-3.04 (2.44-3.14), softmax
#: 5.27-5.86 -> 5.05-5.11 (5.54-6.20), residual add + LayerNorm 5.76-5.82 -> 4.51-4.93
#: (6.44-6.97).
STREAM_LLC_MAX = 32 << 20


def stream_min_bytes() -> int:
    """Bytes an innermost loop stores at least to be written with streaming stores:
    :data:`STREAM_MIN_BYTES` where set, else three quarters of the last-level cache
    (:func:`accel.codegen.llc_bytes`, at most :data:`STREAM_LLC_MAX`)."""
    if STREAM_MIN_BYTES is not None:
        return STREAM_MIN_BYTES
    return min(llc_bytes(), STREAM_LLC_MAX) * 3 // 4


#: ops cheap enough per element that a loop of them is memory-bound: only such loops
#: stream. A loop calling exp, tanh, sin... is compute-bound, and the block's round trip
#: through the stack costs more there than streaming saves (bias + tanh-GELU on [8192,
#: 1024]: 2.41 -> 2.52 ms streamed).
CHEAP_OPS = frozenset(
    "load index const scalar cast add sub mul div neg eq ne lt le gt ge where bitwise_and "
    "bitwise_or bitwise_xor bitwise_not maximum minimum abs sign signbit isfinite shift_left "
    "shift_right_arithmetic round reciprocal rsqrt sqrt floor ceil trunc fmax fmin "
    "copysign".split())


def _category(e: Expr) -> str:
    kind = e.args[0]
    if kind in SIMPLE:
        return "simple"
    return kind + repr(e.args[1])  # blocked and arg kinds: one group per body


class CppRenderer(GroupLoops, ColumnLoops, TiledLoops, CStyle):
    """Renders a :class:`LoopIR` as a C++ translation unit for gcc/clang with OpenMP."""

    prefix = '#include "accel/cpu_math.h"\n'
    row_caching = True  # keep a row's values in a stack array between its loops
    online_softmax = False  # online softmax reductions kept whole (else two passes, scopes.two_pass_softmax)
    reciprocal_numbers = False  # divisions by numbers as products with their reciprocals (eager's GPU kernels)
    cache_across_reductions = True  # ... also between two reductions' loops
    keep_widened_f16 = True  # ... and float16 values widened (see trivial)
    f16_row_passes = True  # a row's float16 conversions as whole-row passes (_plan_f16_rows)
    stream_stores = True  # write outputs larger than the cache with streaming stores
    expand_invariants = True  # a short loop's values invariant around it in arrays (_plan_expansion)
    tile_transposes = True  # a nest reading across rows, writing along them, in tiles (_plan_tile)
    row_cache_max = ROW_CACHE_MAX  # longest row _plan_row_cache keeps (a stack array of it)
    launches = None  # how to launch what render() returned (CUDA); a CPU region is a call
    tiled: Dict[Expr, str] = {}  # a transposing tile's loads -> where the tile holds them
    x86_conversions = True  # float to int32/int64 as x86 converts (see cast)
    # code shaped for gcc 12's vectorizer: bool buffers as uint8_t, bools to floats by way of
    # int32_t (buffer_ctype, cast), a cos beside a sin of its value apart (op)
    gcc_shapes = True
    unrolled_groups = False  # the reduction groups being emitted: loops unrolled whole (_small_rows)
    unrolled_loop: Optional[int] = None  # a row's loop unrolled whole (_small_row_nest)
    opaque_strides: Dict[tuple, str] = {}  # (loop, stride) -> its run-time name (_opaque_strides)

    def buffer_ctype(self, dtype) -> str:
        """As :meth:`CStyle.buffer_ctype`; with :attr:`gcc_shapes`, a bool buffer's elements
        read and written as ``uint8_t`` (a loaded value still taken into a ``bool``): gcc 12
        vectorizes no loop that loads a ``bool`` from memory (a row of 32768 strided bools'
        exponentials summed one at a time in float32: 8.3e-5 from float64 where eager's 16
        lanes are 3.6e-6; ``torch.where(m, x, 0.0)`` on [8192, 1024]: 9.1 -> 1.3 ms)."""
        return "uint8_t" if dtype == torch.bool and self.gcc_shapes else self.ctype(dtype)

    def cast(self, x: str, src, dst) -> str:
        """As :meth:`CStyle.cast`; with :attr:`x86_conversions`, a floating value converted
        to int32 or int64 takes ``trunc_to`` (include/accel/cpu_math.h): x86's result for
        NaN and values out of range, which a C++ cast leaves undefined. With
        :attr:`gcc_shapes`, a ``bool`` converted to a floating type goes by way of
        ``int32_t``, which gcc 12 vectorizes (not the direct conversion; a select of 1 or 0
        it vectorizes too, but folds ``t / t`` into a select of 1 and a NaN with the sign bit
        clear, where x86's 0 / 0 sets it)."""
        if self.gcc_shapes and src == torch.bool and (dst in FLOATS or dst in HALF):
            x, src = f"static_cast<int32_t>({x})", torch.int32
        if self.x86_conversions and dst in (torch.int32, torch.int64) and (src in FLOATS or src in HALF):
            x = super().cast(x, src, torch.float32) if src in HALF else x
            return f"{self.fn}trunc_to<{self.ctype(dst)}>({x})"
        return super().cast(x, src, dst)

    def op(self, e: Expr, args: List[str]) -> str:
        """As :meth:`CStyle.op`; with :attr:`gcc_shapes`, a cos of a value the kernel also
        takes the sin of is ``accel::cos_apart`` (include/accel/cpu_math.h: gcc joins the two
        builtins into a scalar sincos)."""
        if self.gcc_shapes and e.op == "cos" and e.args[0] in self.sin_args:
            return f"{self.fn}cos_apart({args[0]})"
        return super().op(e, args)

    def render(self, ir: LoopIR, name: str) -> str:
        seen: set = set()
        exprs = [x for nest in ir.nests for st in nest.stores for x in walk(st.value, seen)]
        self.sin_args = {x.args[0] for x in exprs if x.op == "sin"}
        prefix = self.prefix
        if any(x.op in ("fmod", "remainder", "div_floor") for x in exprs):
            # a float fmod's and floor division's vector variants (not in every kernel: 0.03 s
            # of a build)
            prefix += '#include "accel/vector_fmod_variants.h"\n'
        if int_round_trip(ir):
            # gcc 12 folds (float)(int)x into trunc(x) under -fno-trapping-math, which is
            # -0.0 for x in (-1, 0) where eager's (and the unfolded code's) is 0.0; the
            # fold survives trunc_to's select and an added + 0.0f. Such a kernel alone
            # (both conversions in one kernel: rare) is compiled with trapping math.
            prefix = '#pragma GCC optimize ("trapping-math")\n' + prefix
        lines = [prefix, f'extern "C" int {name}(void* const* bufs, const accel_scalar_t* s) {{']
        lines += self.preamble(ir)
        written = {st.buf for nest in ir.nests for st in nest.stores}
        for i, b in enumerate(ir.buffers):
            q = "" if i in written else "const "
            r = " __restrict__" if b.output else ""
            t = self.buffer_ctype(b.dtype)
            lines.append(f"  {q}{t}*{r} b{i} = ({q}{t}*)bufs[{i}];")
        self.scalar_decls: Dict[tuple, str] = {}
        self.ntemp = 0
        body: List[str] = []
        for nest in ir.nests:
            body += self.render_nest(nest, ir)
        for (k, dtype), var in self.scalar_decls.items():
            field_ = "f" if ir.scalar_types[k] == "f" else "i"
            src = torch.float64 if field_ == "f" else torch.int64
            lines.append(f"  const {self.ctype(dtype)} {var} = {self.cast(f's[{k}].{field_}', src, dtype)};")
        lines += body
        lines += ["  return ACCEL_OK;", "}", ""]
        return "\n".join(lines)

    def preamble(self, ir: LoopIR) -> List[str]:
        """Declarations at the top of the entry point, before the buffers' (none here)."""
        return []

    # -- planning ---------------------------------------------------------------------------
    def render_nest(self, nest: Nest, ir: LoopIR) -> List[str]:
        if self._empty(nest, ir):
            return []
        self._plan(nest, ir)
        out = ["  {"]
        self._emit_nest(0, out, "    ", nest)
        if self.streamed:
            out.append("    accel::stream_fence();")
        out.append("  }")
        return out

    def _static(self, n) -> bool:
        """Whether length ``n`` is known when the kernel is rendered (a shape-generic
        kernel's run-time lengths are not: :class:`accel.codegen.generic.RunTimeLength`;
        the column and reduction-group mixins ask before deciding on a reduced length)."""
        return True

    def _empty(self, nest: Nest, ir: LoopIR) -> bool:
        """Whether one of the nest's loops runs no iteration (the nest is then left out)."""
        return any(ir.sizes[v] == 0 for v in nest.vars)

    def _plan(self, nest: Nest, ir: LoopIR) -> None:
        """Place every value, reduction group and store of ``nest`` in the scope of the
        outermost loop that binds what it depends on (``self.nest_scopes``)."""
        self.ir = ir
        order = nest.vars
        scopes = [Scope(frozenset(), None)]
        for v in order:
            scopes.append(Scope(scopes[-1].bound | {v}, scopes[-1]))
        self.pos = {v: i for i, v in enumerate(order)}
        self.nest_scopes = scopes
        self.group_of: Dict[Expr, Group] = {}
        self.group_scope: Dict[int, Scope] = {}
        stores = [Store(st.buf, st.addr, two_pass_softmax(st.value, online=self.online_softmax,
                                                        numbers=self.reciprocal_numbers))
                  for st in nest.stores]
        for st in stores:
            for e in walk(st.value, set()):
                if e.op == "reduce":
                    self._plan_reduce(e)
        for st in stores:
            target = scopes[self._level(free_vars(st.value) | {v for v, _ in st.addr.terms})]
            self._need(st.value, target)
            target.items.append(("store", st))
        self.row_cache: Dict[int, list] = {}  # group id -> [(Expr, array name)]
        self.cached: Dict[tuple, str] = {}  # (id(scope), Expr) -> where to read it there instead
        self.dead: set = set()  # (id(scope), Expr) no longer computed there (read from a cache)
        self.narrowed: Dict[int, tuple] = {}  # id(store) -> (float array, row start Addr, loop var)
        self.read_bufs = {e.args[0] for n in ir.nests for st in n.stores  # buffers the kernel reads
                          for e in walk(st.value, set()) if e.op == "load"}
        if order and self.row_caching:
            if self.f16_row_passes:  # first: a widened row is then not kept again
                self._plan_f16_rows(order[-1], scopes[-2], scopes[-1])
            self._plan_row_cache(order[-1], scopes[-2], scopes[-1])
            for k, st in scopes[-1].items:  # a store whose 16-bit value a row cache keeps
                # (a reduction loop rounds it too: cross entropy's x * w) writes the cached
                # value, not a float row narrowed after the loop (its float is not computed)
                if k == "store" and (id(scopes[-1]), st.value) in self.cached:
                    self.narrowed.pop(id(st), None)
        self.tile = self._plan_tile(order, scopes) if self.tile_transposes else None
        self.fused: Dict[int, int] = {}  # a loop held at 0 -> the loop inside it that runs for both
        if len(order) >= 3 and self.expand_invariants and self.tile is None:
            self._plan_expansion(order, scopes)
        self.streamed = (self._plan_streams(nest) if self.stream_stores
                         and (self.tile is None or self._transposing_tile()) else {})
        self.streaming: Optional[str] = None  # the block variable while emitting a streamed block

    def _plan_streams(self, nest: Nest) -> Dict[int, str]:
        """The stores of ``nest`` written with streaming stores (id -> block array name):
        those of the innermost loop, contiguous along it, to buffers the kernel never
        reads, where they write at least :data:`STREAM_MIN_BYTES` in all and the innermost
        loop is a plain ``omp simd`` loop (no reduction inside it) of :data:`CHEAP_OPS`;
        none where that loop is a row of a few values unrolled (:meth:`_small_row_nest`: its
        stores are not contiguous along the vectorized loop)."""
        if not nest.vars or (len(nest.vars) >= 2 and self._small_row_nest(len(nest.vars) - 2, nest)):
            return {}
        inner, v = self.nest_scopes[-1], nest.vars[-1]
        if any(k == "group" or (k == "expr" and x.op not in CHEAP_OPS
                                and (id(inner), x) not in self.cached) for k, x in inner.items):
            return {}
        stores = [st for k, st in inner.items if k == "store" and st.addr.coeff(v) == 1
                  and st.buf not in self.read_bufs and id(st) not in self.narrowed]
        n = self._size(nest.vars)
        if not stores or n * sum(self.ir.buffers[st.buf].dtype.itemsize for st in stores) < stream_min_bytes():
            return {}
        return {id(st): f"nt{k}" for k, st in enumerate(stores)}

    def _plan_row_cache(self, v: int, outer: Scope, inner: Scope, index: str = "") -> None:
        """Row kernels: a value a reduction loop computes for each element of the row and
        a later loop over the row computes again (softmax's exp(x - max), layer norm's
        x + r; with :attr:`cache_across_reductions`, also a later reduction's loop:
        softmax's rounded 16-bit ``x * scale`` in its max and its sum) is kept in an array
        by the first and read by the other."""
        n = self.ir.sizes[v]
        if n > self.row_cache_max:
            return
        offer: Dict[Expr, tuple] = {}  # innermost Expr -> (group, the same value there)
        names: Dict[tuple, str] = {}  # (group id, Expr) -> its array

        def consume(scope: Scope, r: int, roots) -> None:  # what it computes again
            seen, todo = set(), list(roots)
            while todo and offer:
                y = todo.pop()
                if y in seen or y.op == "reduce":
                    continue
                seen.add(y)
                g, x = offer.get(subst(y, r, v), (None, None))
                if g is None:
                    todo += [a for a in y.args if isinstance(a, Expr)]
                    continue
                name = names.get((id(g), x))
                if name is None:
                    name = names[(id(g), x)] = f"c{self.ntemp}"
                    self.ntemp += 1
                    self.row_cache.setdefault(id(g), []).append((x, name))
                self.cached[(id(scope), y)] = f"{name}[{index or f'i{r}'}]"

        for kind, g in outer.items:
            if kind != "group" or len(g.rvars) != 1 or self.ir.sizes[g.rvars[0]] != n:
                continue
            scope, r = self.group_scope[id(g)], g.rvars[0]
            if self.cache_across_reductions:
                consume(scope, r, [b for e in g.members for b in e.args[1]])
            for k, x in scope.items:
                if k == "expr" and not trivial(x, self.keep_widened_f16) and (id(scope), x) not in self.cached:
                    offer.setdefault(subst(x, r, v), (g, x))
        consume(inner, v, [st.value for k, st in inner.items if k == "store"])
        self._mark_dead(inner)

    def _mark_dead(self, scope: Scope) -> None:
        """The values of ``scope`` (a row's last loop) that its stores no longer need,
        read from a row cache instead of computed (layer norm's loads of ``x`` and ``r``
        where ``x + r`` is kept): not emitted, and not kept for it (a CUDA row kernel's
        registers: a thread's share of the row, once, not once per load)."""
        if not any(s == id(scope) for s, _ in self.cached):
            return
        live, todo = set(), [st.value for k, st in scope.items if k == "store"]
        while todo:
            y = todo.pop()
            if y in live:
                continue
            live.add(y)
            if (id(scope), y) not in self.cached:  # a reduction's bodies read this scope's values
                todo += [a for a in (y.args[1] if y.op == "reduce" else y.args) if isinstance(a, Expr)]
        self.dead |= {(id(scope), x) for k, x in scope.items if k == "expr" and x not in live}

    def _plan_f16_rows(self, v: int, outer: Scope, inner: Scope) -> None:
        """Row kernels: the float16 conversions of a row as whole-row passes (``accel::
        f16_widen_row`` / ``f16_round_row`` / ``f16_narrow_row``, explicit F16C vectors)
        rather than element by element inside vectorized loops, where each is a call of a
        vector variant and gcc spills the loop's live vectors around it. A float16 row
        read contiguously is widened into a stack array before the row's first loop (so
        the row cache, planned after this, does not keep a copy of it); a
        rounded value a reduction loop keeps for later loops (softmax's ``x * 0.125``) is
        computed by a loop of its own, rounded in place, then read (see
        :meth:`_emit_group`); the row's float16 output, contiguous and not read by the
        kernel, is computed into an array and narrowed after the row's loop."""
        n = self.ir.sizes[v]
        if n > ROW_CACHE_MAX or n < 8 or any(k == "group" for k, _ in inner.items):
            return
        loops = [(inner, v)] + [(self.group_scope[id(g)], g.rvars[0]) for k, g in outer.items
                                if k == "group" and len(g.rvars) == 1 and self.ir.sizes[g.rvars[0]] == n]

        def row_start(addr: Addr, r: int) -> Optional[Addr]:
            if addr.coeff(r) != 1 or any(var != r and var not in outer.bound for var, _ in addr.terms):
                return None
            return addr.without((r,))

        widened: Dict[tuple, str] = {}
        passes: List[tuple] = []
        for scope, r in loops:
            for k, x in scope.items:
                if not (k == "expr" and x.op == "cast" and x.dtype == torch.float32
                        and x.args[0].op == "load" and x.args[0].dtype == torch.float16
                        and (id(scope), x) not in self.cached):
                    continue
                buf, addr = x.args[0].args
                start = row_start(addr, r)
                if start is None:
                    continue
                name = widened.get((buf, start))
                if name is None:
                    name = widened[(buf, start)] = f"w{self.ntemp}"
                    self.ntemp += 1
                    passes.append(("raw", f"float {name}[{n}];"))
                    passes.append(("raw", f"accel::f16_widen_row(&b{buf}[{self._addr(start)}], {name}, {n});"))
                self.cached[(id(scope), x)] = f"{name}[i{r}]"
        outer.items[:0] = passes
        if len(self.nest_scopes) < 3:  # a one-loop nest: its loop is chunked across threads
            return
        for k, st in inner.items:
            x = st.value if k == "store" else None
            if (x is not None and x.op == "cast" and x.dtype == torch.float16
                    and x.args[0].dtype == torch.float32 and st.buf not in self.read_bufs
                    and self.ir.buffers[st.buf].dtype == torch.float16):
                start = row_start(st.addr, v)
                if start is not None:
                    self.narrowed[id(st)] = (f"o{self.ntemp}", start, v)
                    self.ntemp += 1

    def _level(self, fv) -> int:
        try:
            return 1 + max(self.pos[v] for v in fv) if fv else 0
        except KeyError:
            raise CodegenError("a reduction nested in another reduction's loop") from None

    def _plan_reduce(self, e: Expr) -> None:
        """Give reduction ``e`` a group: the latest group of its scope with the same domain
        and category, if everything ``e`` hoists out of the loop is computed before that
        group's loop; otherwise a new group, planned after its operands."""
        if e in self.group_of:
            return
        scope = self.nest_scopes[self._level(free_vars(e))]
        rvars, cat = e.args[2], _category(e)
        hoisted = [x for b in e.args[1] for x in walk(b, set(), into_reduce=False)
                   if not (free_vars(x) & set(rvars)) and x.op not in ("const", "scalar")]
        for x in hoisted:
            if x.op == "reduce":
                self._plan_reduce(x)
        group, at = None, 0
        for k, (kind, item) in enumerate(scope.items):
            if kind == "group" and item.rvars == rvars and item.category == cat:
                group, at = item, k
        if group is not None:
            before = scope.items[:at]
            for x in hoisted:  # must be computed outside this scope or before the group
                item = ("group", self.group_of[x]) if x.op == "reduce" else ("expr", x)
                in_scope = any(it[1] is item[1] for it in scope.items)
                if self.group_of.get(x) is group or (in_scope and not any(
                        it[1] is item[1] for it in before)):
                    group = None
                    break
        if group is None:
            group = Group(rvars, cat)
            self.group_scope[id(group)] = Scope(scope.bound | set(rvars), scope)
            for b in e.args[1]:
                self._need(b, self.group_scope[id(group)])
            scope.items.append(("group", group))
        else:  # operands hoisted only now go before the group's loop
            n0 = len(scope.items)
            for b in e.args[1]:
                self._need(b, self.group_scope[id(group)])
            new = scope.items[n0:]
            del scope.items[n0:]
            scope.items[at:at] = new
        group.members.append(e)
        self.group_of[e] = group

    def _need(self, e: Expr, scope: Scope) -> None:
        """Plan ``e`` (and its operands) in the outermost ancestor of ``scope`` that binds
        every variable it depends on."""
        if scope.lookup(e) is not None or e.op in ("const", "scalar"):
            return
        if e.op == "reduce":
            self._plan_reduce(e)
            return
        fv = free_vars(e)
        target = scope
        while target.parent is not None and fv <= target.parent.bound:
            target = target.parent
        for a in e.args:
            if isinstance(a, Expr):
                self._need(a, target)
        if target.lookup(e) is None:
            self.ntemp += 1
            target.names[e] = f"t{self.ntemp}"
            target.items.append(("expr", e))

    # -- emission ---------------------------------------------------------------------------
    def _name(self, e: Expr, scope: Scope) -> str:
        if e.op == "const":
            return self.const(e.args[0], e.dtype)
        if e.op == "scalar":
            return self.scalar_decls.setdefault((e.args[0], e.dtype), f"s{e.args[0]}_{len(self.scalar_decls)}")
        n = scope.lookup(e)
        if n is None:
            raise CodegenError(f"internal: {e.op} used before it is computed")
        return n

    def _accumulators(self, g: Group, prefix: str) -> Dict[tuple, tuple]:
        """One accumulator per distinct (kind, bodies) among the plain (``SIMPLE``)
        reductions of ``g``: key -> (name, initial value, first member)."""
        accs: Dict[tuple, tuple] = {}
        for e in g.members:
            key = (e.args[0], e.args[1])
            if key not in accs:
                init = SIMPLE[e.args[0]][0]
                init = self._lim(init, e.dtype) if init.startswith("$") else init
                accs[key] = (f"{prefix}_{len(accs)}", init, e)
        return accs

    def _addr(self, a: Addr) -> str:
        terms = [f"{self.opaque_strides[(v, c)]} * i{v}" if (v, c) in self.opaque_strides
                 else f"i{v}" if c == 1 else f"{c} * i{v}" for v, c in a.terms]
        if a.offset:
            terms.append(str(a.offset))
        return " + ".join(terms) if terms else "0"

    def _rhs(self, e: Expr, scope: Scope) -> str:
        if e in self.tiled:  # a transposing tile's load: read from the tile
            return self.tiled[e]
        if e.op == "load":
            return f"b{e.args[0]}[{self._addr(e.args[1])}]"
        if e.op == "index":
            return f"(int64_t)({self._addr(e.args[0])})"
        if e.op == "cast":
            a = e.args[0]
            if f16_round(e):  # float32 rounded to float16 and back
                return f"{self.fn}f16_round({self._name(a.args[0], scope)})"
            return self.cast(self._name(a, scope), a.dtype, e.dtype)
        return self.op(e, [self._name(a, scope) if isinstance(a, Expr) else repr(a) for a in e.args])

    def _emit_items(self, scope: Scope, out: List[str], ind: str) -> None:
        """A scope's values, then its stores: every read at an element happens before an
        in-place write of that element, whatever order the stores came in."""
        for kind, x in scope.items:
            if kind == "expr":
                if (id(scope), x) in self.dead:
                    continue
                rhs = self.cached.get((id(scope), x)) or self._rhs(x, scope)
                out.append(f"{ind}const {self.ctype(x.dtype)} {scope.names[x]} = {rhs};")
            elif kind == "raw":
                out.append(ind + x)
            elif kind == "expand":  # (_plan_expansion)
                self._emit_expansion(*x, out, ind)
            elif kind == "group":
                self._emit_group(x, scope, out, ind)
        for kind, x in scope.items:
            if kind == "store":
                out.append(ind + self._store(x, scope))

    def _store(self, st, scope: Scope) -> str:
        """The statement writing store ``st`` (into its block array where it is streamed)."""
        if self.streaming and id(st) in self.streamed:
            return f"{self.streamed[id(st)]}[{self.streaming}_k] = {self._name(st.value, scope)};"
        if id(st) in self.narrowed:  # the float32 value; narrowed after the loop
            name, _, v = self.narrowed[id(st)]
            return f"{name}[i{v}] = {self._name(st.value.args[0], scope)};"
        return f"b{st.buf}[{self._addr(st.addr)}] = {self._name(st.value, scope)};"

    def _simd_loop(self, j: int, lo: str, hi: str, out: List[str], ind: str, nest: Nest) -> None:
        """The innermost loop, ``i{v}`` from ``lo`` to ``hi``, vectorized: plain, or the
        values up to the first streamed store's next cache line plainly, then whole blocks
        of :data:`STREAM_BLOCK` values whose streamed stores go to stack arrays, then to
        memory (``accel::stream_store``), and the rest plainly."""
        v = nest.vars[j]
        if self.streamed:  # whole blocks (a constant trip count gcc vectorizes fully) first
            b, B = f"i{v}_b", STREAM_BLOCK
            stores = [st for k, st in self.nest_scopes[j + 1].items if k == "store" and id(st) in self.streamed]
            # the values before the first streamed store's next cache line plainly: its
            # blocks then write whole lines (a row starting mid-line otherwise streams part
            # of each block's lines and stores the rest plainly)
            out.append(f"{ind}int64_t {b} = {lo};")
            out.append(f"{ind}{{")
            out.append(f"{ind}  const int64_t i{v} = {lo};")
            first = f"&b{stores[0].buf}[{self._addr(stores[0].addr)}]"
            out.append(f"{ind}  const int64_t head = {lo} + accel::line_head({first});")
            out.append(f"{ind}  {b} = head < {hi} ? head : {hi};")
            out.append(f"{ind}}}")
            out.append(f"{ind}#pragma omp simd")
            out.append(f"{ind}for (int64_t i{v} = {lo}; i{v} < {b}; ++i{v}) {{")
            self._emit_nest(j + 1, out, ind + "  ", nest)
            out.append(f"{ind}}}")
            out.append(f"{ind}for (; {b} + {B} <= {hi}; {b} += {B}) {{")
            for st in stores:
                t = self.buffer_ctype(self.ir.buffers[st.buf].dtype)
                out.append(f"{ind}  alignas(64) {t} {self.streamed[id(st)]}[{B}];")
            out.append(f"{ind}  #pragma omp simd")
            out.append(f"{ind}  for (int64_t {b}_k = 0; {b}_k < {B}; ++{b}_k) {{")
            out.append(f"{ind}    const int64_t i{v} = {b} + {b}_k;")
            self.streaming = b
            self._emit_nest(j + 1, out, ind + "    ", nest)
            self.streaming = None
            out.append(f"{ind}  }}")
            out.append(f"{ind}  {{")
            out.append(f"{ind}    const int64_t i{v} = {b};")
            for st in stores:
                out.append(f"{ind}    accel::stream_store<{B}>(&b{st.buf}[{self._addr(st.addr)}], "
                           f"{self.streamed[id(st)]});")
            out.append(f"{ind}  }}")
            out.append(f"{ind}}}")
            lo = b  # the rest plainly
        out.append(f"{ind}#pragma omp simd")
        out.append(f"{ind}for (int64_t i{v} = {lo}; i{v} < {hi}; ++i{v}) {{")
        self._emit_nest(j + 1, out, ind + "  ", nest)
        out.append(f"{ind}}}")

    def _chunked_loop(self, j: int, out: List[str], ind: str, nest: Nest, n, chunks) -> None:
        """Loop ``j`` of ``n`` iterations as ``chunks`` chunks of :data:`CHUNK` (the loop a
        parallel pragma above it splits), each a vectorized loop."""
        out.append(f"{ind}for (int64_t c = 0; c < {chunks}; ++c) {{")
        out.append(f"{ind}  const int64_t lo = c * {CHUNK}, hi = lo + {CHUNK} < {n} ? lo + {CHUNK} : {n};")
        self._simd_loop(j, "lo", "hi", out, ind + "  ", nest)
        out.append(f"{ind}}}")

    def _work(self, nest: Nest) -> int:
        """Iterations the nest runs: its loops', plus each reduction group's, computed once
        per iteration of the loops that bind it (a row kernel's statistics once per row)."""
        n = self._size(nest.vars)
        for d, scope in enumerate(self.nest_scopes):
            for k, g in scope.items:
                if k == "group":
                    n += self._size(nest.vars[:d]) * self._size(g.rvars)
        return n

    def _size(self, vs) -> int:
        n = 1
        for v in vs:
            n *= self.ir.sizes[v]
        return n

    def _emit_nest(self, j: int, out: List[str], ind: str, nest: Nest) -> None:
        scope = self.nest_scopes[j]
        self._emit_items(scope, out, ind)
        if not any(s.items for s in self.nest_scopes[j + 1:]):
            return  # nothing left inside the remaining loops
        v = nest.vars[j]
        n = self._extent(v)
        innermost = j == len(nest.vars) - 1
        parallel = j == 0 and self._work(nest) >= PARALLEL_MIN and machine_threads() > 1
        if v in self.fused:  # (TiledLoops._fusable) the loop inside runs for both
            out.append(f"{ind}{{")
            out.append(f"{ind}  const int64_t i{v} = 0;")
            self._emit_nest(j + 1, out, ind + "  ", nest)
            out.append(f"{ind}}}")
            return
        if self.tile is not None and j == len(nest.vars) - 2:
            self._emit_tile(j, out, ind, nest, parallel)
            return
        if v == self.unrolled_loop:  # (_small_row_nest) the row's loop, unrolled as its groups'
            lines: List[str] = []
            self._emit_items(self.nest_scopes[j + 1], lines, "")
            self._loops((v,), lines, out, ind, None, None)
            return
        rows = j == len(nest.vars) - 2 and self._small_row_nest(j, nest)
        small = rows or (innermost and self._small_rows(v, self.nest_scopes[j + 1]))
        simd = small or (innermost and not any(k == "group" for k, _ in self.nest_scopes[j + 1].items))
        if parallel and self.streamed:
            self._fenced_team(out, ind, lambda ind2: self._emit_loop(
                j, out, ind2, nest, parallel, innermost, simd, "omp for schedule(static) nowait"))
            return
        narrowed = [(self.narrowed[id(st)], st) for k, st in self.nest_scopes[j + 1].items
                    if k == "store" and id(st) in self.narrowed] if innermost else []
        out += [f"{ind}float {name}[{n}];" for (name, _, _), _ in narrowed]
        if small:
            # (a row nest's unrolled loops' strides hidden too; the plain small rows' not:
            # gcc then vectorized a sum over 16 values a row half as fast, 1.8 -> 3.7 ms)
            unrolled = (*(r for k, g in self.nest_scopes[j + 1].items if k == "group" for r in g.rvars),
                        nest.vars[j + 1]) if rows else ()
            self._opaque_strides(v, self.nest_scopes[j + 1:j + 2 + rows], out, ind, unrolled)
        self.unrolled_groups, self.unrolled_loop = small, nest.vars[j + 1] if rows else None
        try:
            self._emit_loop(j, out, ind, nest, parallel, innermost, simd, "omp parallel for schedule(static)")
        finally:
            self.unrolled_groups, self.unrolled_loop, self.opaque_strides = False, None, {}
        out += [f"{ind}accel::f16_narrow_row({name}, &b{st.buf}[{self._addr(start)}], {n});"
                for (name, start, _), st in narrowed]

    def _small_row_nest(self, j: int, nest: Nest) -> bool:
        """Whether loop ``j`` and the innermost loop inside it, of at most :data:`SMALL_ROWS`
        values (static), are a row kernel over rows of a few values (a softmax or log-softmax
        over 10 classes, a LayerNorm over 8 channels): reductions as :meth:`_small_rows` takes
        them (their values may be kept for the row's loop), no reduction and no narrowed
        float16 store inside the row's loop. Then loop ``j`` is the vectorized one, each row's
        reductions and its loop unrolled whole (:attr:`unrolled_loop`), the strides along
        them hidden from gcc (:meth:`_opaque_strides`): a vectorized loop over 10 values a
        row had computed 10 lanes of 16 and stored them one at a time (a softmax over rows
        of 3 to 16 float32 values on [4M, 3] .. [1M, 16], dev VM: 14-90 -> 7-14 ms)."""
        u = nest.vars[j + 1]
        n, inner = self.ir.sizes[u], self.nest_scopes[j + 2]
        if (self.fused or not self._static(n) or not 0 < n <= SMALL_ROWS
                or any(k == "group" or (k == "store" and id(x) in self.narrowed) for k, x in inner.items)):
            return False
        return self._small_rows(nest.vars[j], self.nest_scopes[j + 1], kept=True)

    def _small_rows(self, v: int, scope: Scope, kept: bool = False) -> bool:
        """Whether the innermost loop ``v``'s reductions are each over at most
        :data:`SMALL_ROWS` values (static): plain ones (sums, products, maxima, minima),
        argmax and argmin, Welford moments (:meth:`_emit_group`'s unrolled forms), no row
        kept for a later loop, no reduction inside theirs, no tile or column blocks. Then
        ``v`` is the vectorized loop and each group's loops are unrolled whole
        (:attr:`unrolled_groups`, :meth:`accel.codegen.cpp_groups.GroupLoops._loops`), the
        loads' strides along ``v`` that gcc would not vectorize hidden from it
        (:meth:`_opaque_strides`)."""
        groups = [g for k, g in scope.items if k == "group"]
        if not groups or self.tile is not None or self._vertical(v, scope):
            return False
        for g in groups:
            sizes = [self.ir.sizes[r] for r in g.rvars]
            if (not (g.category == "simple" or g.members[0].args[0] in ("welford", *ARG))
                    or not sizes or not all(self._static(n) and n > 0 for n in sizes)
                    or self._size(g.rvars) > SMALL_ROWS
                    or (self.row_cache.get(id(g)) and not kept)
                    or any(f16_round(x) for x, _ in self.row_cache.get(id(g), []))
                    or any(k == "group" for k, _ in self.group_scope[id(g)].items)):
                return False
        return True

    def _opaque_strides(self, v: int, scopes: List[Scope], out: List[str], ind: str,
                        unrolled: tuple = ()) -> None:
        """Declare as run-time values (:attr:`opaque_strides`, read by :meth:`_addr`) the
        strides along ``v`` of the loads of ``scopes`` and their groups that gcc vectorizes
        no interleaved group of (:data:`SMALL_ROW_STRIDES`), and every stride of a load or
        store along the ``unrolled`` loops: a row's values at addresses gcc sees as
        adjacent, it vectorizes the row (two rows of 8 a vector, their reductions across
        lanes) instead of the loop over rows (a softmax over rows of 8 float32 values, C++
        on the dev VM: 29 -> 10 ms for [2M, 8]; of 16: 54 -> 11 for [1M, 16])."""
        self.opaque_strides = {}

        def declare(w: int, c: int) -> None:
            if (w, c) not in self.opaque_strides:
                name = self.opaque_strides[(w, c)] = f"st{w}_{'m' if c < 0 else ''}{abs(c)}"
                out.append(f"{ind}const int64_t {name} = accel::opaque({c});")

        for sc in scopes + [self.group_scope[id(g)] for s in scopes for k, g in s.items if k == "group"]:
            for k, x in sc.items:
                a = x.args[1] if k == "expr" and x.op == "load" else x.addr if k == "store" else None
                if a is None:
                    continue
                if abs(a.coeff(v)) not in SMALL_ROW_STRIDES:
                    declare(v, a.coeff(v))
                for w in unrolled:
                    if a.coeff(w):
                        declare(w, a.coeff(w))

    def _extent(self, v: int) -> int:
        """Loop ``v``'s trip count, times that of a loop held at 0 around it where the two
        run as one (:meth:`accel.codegen.tiles.TiledLoops._fusable`)."""
        n = self.ir.sizes[v]
        for g, w in self.fused.items():
            n *= self.ir.sizes[g] if w == v else 1
        return n

    @staticmethod
    def _fenced_team(out: List[str], ind: str, emit) -> None:
        """A parallel loop whose stores stream: one OpenMP team around it, its ``omp for``
        ``nowait`` (``emit(ind)`` writes it), each thread fencing its own streaming stores
        before the team ends."""
        out += [f"{ind}#pragma omp parallel", f"{ind}{{"]
        emit(ind + "  ")
        out += [f"{ind}  accel::stream_fence();", f"{ind}}}"]

    def _last_loop(self, j: int, nest: Nest) -> bool:
        """Whether loop ``j`` is the innermost one the kernel runs as a loop (the loop
        inside it, if any, unrolled: :attr:`unrolled_loop`)."""
        return j == len(nest.vars) - 1 - (self.unrolled_loop is not None)

    def _emit_loop(self, j, out, ind, nest, parallel, innermost, simd, par_pragma) -> None:
        v = nest.vars[j]
        n = self._extent(v)
        if simd and self._last_loop(j, nest) and (parallel and n > CHUNK or self.unrolled_groups):
            if self.unrolled_groups:
                # rows vectorized across: their count hidden from gcc, so that the rows it
                # leaves to a narrower or scalar tail (another libm, other bits) are those of
                # the shape-generic kernel (accel.codegen.generic), which takes it at run time
                out.append(f"{ind}const int64_t h{v} = accel::opaque({n});")
            if parallel:
                out.append(f"{ind}#pragma {par_pragma}")
            self._chunked_loop(j, out, ind, nest, f"h{v}" if self.unrolled_groups else n, -(-n // CHUNK))
            return
        if innermost and self._vertical(v, self.nest_scopes[j + 1]):
            self._emit_vertical(v, self.nest_scopes[j + 1], out, ind, parallel)
            return
        if parallel and not (innermost and n < 2):
            out.append(f"{ind}#pragma {par_pragma}")
        elif simd:
            self._simd_loop(j, "0", str(n), out, ind, nest)
            return
        out.append(f"{ind}for (int64_t i{v} = 0; i{v} < {n}; ++i{v}) {{")
        self._emit_nest(j + 1, out, ind + "  ", nest)
        out.append(f"{ind}}}")
