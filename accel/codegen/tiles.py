"""Loop nests that keep an outer loop's values in stack arrays, on the CPU: a transposing
nest in tiles (it writes along its innermost loop and reads an input across it), and a
short inner loop's values that do not depend on the loop around it, computed once. A part
of :class:`accel.codegen.cpp.CppRenderer` (the mixin :class:`TiledLoops`: its ``_plan``
calls the planners, ``_emit_nest`` and ``_emit_items`` the emitters).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..loop_ir import Nest, free_vars
from ..lower_expr import CONTIGUOUS_RUN
from .scopes import trivial

#: values of a transposing nest's outer loop a tile (:meth:`TiledLoops._plan_tile`): a
#: vector of float32 reads, 8 rows' lines of writes. [8192, 1024] float32 on the 2-core dev
#: VM, ms with tiles of 4 / 8 / 16 / 32 (eager): ``x.t() + y`` 13.8 / 13.4 / 16.6 / 20.3
#: (29-31), ``x.t().contiguous()`` 11.4 / 8.7-9.0 / 14.0 / 16.0 (11), ``x.t().softmax(-1)``
#: 21.1 / 16.6-18.0 / 19.0 / 24.6 (16-17)
TILE = 8
#: values of each loop a tile whose transposed loads hold 4-byte values
#: (:meth:`TiledLoops._emit_transposed_tile`), and the tile's element types. A C++
#: microbenchmark of ``x.t() + y`` [8192, 1024] float32 on the dev VM, ms: the tiles of 8 above
#: 12.2-12.3, 8 x 8 register transposes straight into the output 6.6-6.9, tiles of 32 filled by
#: them 6.9-7.1, of 64 5.4; tiles of 16 and 32 filled element by element 15.6 and 17.2
#: (torch.compile's kernel, from Python: 9.3-10.3). On the 2-core AVX-512 VM (AMD EPYC, 48 KiB
#: L1), the same kernel: 8 x 8 blocks, plain stores 2.64-2.75; streamed whole tile rows
#: 2.00-2.32; 16 x 16 AVX-512 blocks and streamed 1.66-1.94; tiles of 16 so 1.45-1.53 in C++
#: alone, but slower from Python (``x.t() + y`` 2.92-3.06 ms against 2.65-2.72, a channels-last
#: GroupNorm's contiguous output 5.7 against 2.3; torch.compile's tiles of 16, 1.6-2.4)
TRANSPOSED_TILE = 64
TRANSPOSED_TYPES = (torch.float32, torch.int32)
#: longest loop whose values invariant in the loop around it are kept in stack arrays
#: (:meth:`TiledLoops._plan_expansion`)
EXPAND_MAX = 256


def transposed_loads(scope, u: int, v: int, stride: int) -> list:
    """The loads of a nest's innermost scope that a transposing tile reads through its
    stack array (CPU) or shared memory (CUDA): contiguous along ``u``, at least ``stride``
    apart along ``v``; none where a store of the scope does not walk ``v`` contiguously."""
    if any(k == "store" and x.addr.coeff(v) != 1 for k, x in scope.items):
        return []
    if not any(k == "store" for k, _ in scope.items):
        return []
    return [x for k, x in scope.items if k == "expr" and x.op == "load"
            and x.args[1].coeff(u) == 1 and abs(x.args[1].coeff(v)) >= stride]


def one_run(addrs, g: int, v: int, n: int) -> bool:
    """Whether every address in ``addrs`` reads loops ``g`` and ``v`` (``v`` inside, ``n``
    values of it, or of the loops it stands for) as one loop over ``g * n + v``: its stride
    along ``g`` is ``n`` times its stride along ``v``. A channels-last group norm's group
    and channel loops (:meth:`TiledLoops._fusable`; the GPU's tile runs,
    :meth:`accel.codegen.cuda_tiles.TransposeTiles._run`)."""
    return all(a.coeff(g) == n * a.coeff(v) for a in addrs)


class TiledLoops:
    """:class:`accel.codegen.cpp.CppRenderer`'s nests with an outer loop's values in stack
    arrays."""

    def _plan_tile(self, order, scopes) -> Optional[tuple]:
        """A pointwise nest whose innermost loop ``v`` writes its stores contiguously but
        reads an input across rows (a stride of at least :data:`TILE`), contiguous along the
        loop around it, ``u`` (``x.t() + y``, ``x.t().contiguous()``, a softmax's output
        over a transposed input): ``(u, v, loads)``, the loads :func:`transposed_loads`,
        for :meth:`_emit_tile`'s tiles of :data:`TILE` values of ``u`` at each ``v`` (each
        read a run of ``u``'s contiguous values, each write one of :data:`TILE` rows'
        lines, all in the cache while the tile's ``v`` loop runs). None for any other nest."""
        if len(order) < 2 or self.row_cache or self.narrowed:
            return None
        if any(k not in ("expr", "store") for sc in scopes for k, _ in sc.items):
            return None
        u, v = order[-2:]
        if self.ir.sizes[u] < TILE or self.ir.sizes[v] < TILE:
            return None
        loads = transposed_loads(scopes[-1], u, v, TILE)
        return (u, v, loads) if loads else None

    def _emit_tile(self, j: int, out: List[str], ind: str, nest: Nest, parallel: bool) -> None:
        """The loops ``u, v`` of :meth:`_plan_tile` (``nest.vars[j:]``) as tiles of
        :data:`TILE` values of ``u``: the values and stores of ``u``'s loop in a loop over
        the tile (values into stack arrays), then ``v``'s loop around a vectorized loop
        over the tile. Where every transposed load holds 4-byte values,
        :meth:`_emit_transposed_tile` instead."""
        u, v, loads = self.tile
        us, inner = self.nest_scopes[j + 1], self.nest_scopes[j + 2]
        if self._transposing_tile():
            self._emit_transposed_tile(j, out, ind, parallel)
            return
        U, V = self.ir.sizes[u], self.ir.sizes[v]
        b = f"i{u}_b"
        if parallel:
            out.append(f"{ind}#pragma omp parallel for schedule(static)")
        out.append(f"{ind}for (int64_t {b} = 0; {b} < {U}; {b} += {TILE}) {{")
        ind2 = ind + "  "
        out.append(f"{ind2}const int64_t {b}_n = {U} - {b} < {TILE} ? {U} - {b} : {TILE};")
        kept = [x for k, x in us.items if k == "expr"]
        out += [f"{ind2}{self.ctype(x.dtype)} {us.names[x]}_t[{TILE}];" for x in kept]
        out.append(f"{ind2}for (int64_t {b}_k = 0; {b}_k < {b}_n; ++{b}_k) {{")
        out.append(f"{ind2}  const int64_t i{u} = {b} + {b}_k;")
        self._emit_items(us, out, ind2 + "  ")
        out += [f"{ind2}  {us.names[x]}_t[{b}_k] = {us.names[x]};" for x in kept]
        out.append(f"{ind2}}}")
        out.append(f"{ind2}for (int64_t i{v} = 0; i{v} < {V}; ++i{v}) {{")
        out.append(f"{ind2}  #pragma omp simd")
        out.append(f"{ind2}  for (int64_t {b}_k = 0; {b}_k < {b}_n; ++{b}_k) {{")
        out.append(f"{ind2}    const int64_t i{u} = {b} + {b}_k;")
        out += [f"{ind2}    const {self.ctype(x.dtype)} {us.names[x]} = {us.names[x]}_t[{b}_k];" for x in kept]
        self._emit_items(inner, out, ind2 + "    ")
        out += [f"{ind2}  }}", f"{ind2}}}", f"{ind}}}"]

    def _transposing_tile(self) -> bool:
        """Whether :meth:`_plan_tile`'s tile is :meth:`_emit_transposed_tile`'s: every
        transposed load holds 4-byte values (:data:`TRANSPOSED_TYPES`)."""
        return self.tile is not None and all(
            self.ir.buffers[x.args[0]].dtype in TRANSPOSED_TYPES for x in self.tile[2])

    def _emit_transposed_tile(self, j: int, out: List[str], ind: str, parallel: bool) -> None:
        """The loops ``u, v`` of :meth:`_plan_tile` in tiles of :data:`TRANSPOSED_TILE`
        values of each: each transposed load's tile into a stack array, transposed
        (``accel::transpose_tile``: 16 x 16 blocks through AVX-512 registers, else 8 x 8
        through AVX), then for each ``u`` of the tile its values and a vectorized loop along
        ``v`` that reads the loads' tiles contiguously and writes the output's row: where the
        stores are streamed (:meth:`_plan_streams`), a whole row of the tile into stack
        arrays, then to memory (``accel::stream_store``), each thread fencing its stores at
        its end (:meth:`_fenced_team`)."""
        if parallel and self.streamed:
            self._fenced_team(out, ind, lambda ind2: self._emit_tiles(
                j, out, ind2, "omp for collapse(2) schedule(static) nowait"))
        else:
            self._emit_tiles(j, out, ind, "omp parallel for collapse(2) schedule(static)" if parallel else None)

    def _emit_tiles(self, j: int, out: List[str], ind: str, par_pragma: Optional[str]) -> None:
        """:meth:`_emit_transposed_tile`'s loops over the tiles (``par_pragma``: their
        OpenMP pragma, None for none)."""
        u, v, loads = self.tile
        U, V, T = self.ir.sizes[u], self.ir.sizes[v], TRANSPOSED_TILE
        us, inner = self.nest_scopes[j + 1], self.nest_scopes[j + 2]
        b, c = f"i{u}_b", f"i{v}_b"
        if par_pragma:
            out.append(f"{ind}#pragma {par_pragma}")
        out.append(f"{ind}for (int64_t {b} = 0; {b} < {U}; {b} += {T}) {{")
        out.append(f"{ind}  for (int64_t {c} = 0; {c} < {V}; {c} += {T}) {{")
        ind2 = ind + "    "
        out.append(f"{ind2}const int64_t {b}_n = {U} - {b} < {T} ? {U} - {b} : {T}, "
                   f"{c}_n = {V} - {c} < {T} ? {V} - {c} : {T};")
        for k, x in enumerate(loads):
            t = self.ctype(x.dtype)
            out.append(f"{ind2}alignas(32) {t} {b}_{k}[{T * T}];")
            out.append(f"{ind2}{{ const int64_t i{u} = {b}, i{v} = {c}; "
                       f"accel::transpose_tile<{T}>(&b{x.args[0]}[{self._addr(x.args[1])}], "
                       f"{x.args[1].coeff(v)}, {b}_{k}, {b}_n, {c}_n); }}")
        self.tiled = {x: f"{b}_{k}[{b}_k * {T} + {c}_k]" for k, x in enumerate(loads)}
        out.append(f"{ind2}for (int64_t {b}_k = 0; {b}_k < {b}_n; ++{b}_k) {{")
        out.append(f"{ind2}  const int64_t i{u} = {b} + {b}_k;")
        self._emit_items(us, out, ind2 + "  ")
        ind3 = ind2 + "  "
        if self.streamed:  # a whole row of the tile streamed, the edge tiles' plainly
            stores = [st for k, st in inner.items if k == "store" and id(st) in self.streamed]
            out.append(f"{ind3}if ({c}_n == {T}) {{")
            out += [f"{ind3}  alignas(64) {self.buffer_ctype(self.ir.buffers[st.buf].dtype)} "
                    f"{self.streamed[id(st)]}[{T}];" for st in stores]
            self._tile_row(c, str(T), inner, out, ind3 + "  ", v, stream=True)
            out.append(f"{ind3}  const int64_t i{v} = {c};")
            out += [f"{ind3}  accel::stream_store<{T}>(&b{st.buf}[{self._addr(st.addr)}], "
                    f"{self.streamed[id(st)]});" for st in stores]
            out.append(f"{ind3}}} else {{")
            self._tile_row(c, f"{c}_n", inner, out, ind3 + "  ", v)
            out.append(f"{ind3}}}")
        else:
            self._tile_row(c, f"{c}_n", inner, out, ind3, v)
        self.tiled = {}
        out += [f"{ind2}}}", f"{ind}  }}", f"{ind}}}"]

    def _tile_row(self, c: str, n: str, inner, out: List[str], ind: str, v: int, stream: bool = False) -> None:
        """A row of a transposed tile: ``n`` values of ``v`` from ``c``, vectorized (into the
        streamed stores' stack arrays where ``stream``)."""
        out.append(f"{ind}#pragma omp simd")
        out.append(f"{ind}for (int64_t {c}_k = 0; {c}_k < {n}; ++{c}_k) {{")
        out.append(f"{ind}  const int64_t i{v} = {c} + {c}_k;")
        self.streaming = c if stream else None
        self._emit_items(inner, out, ind + "  ")
        self.streaming = None
        out.append(f"{ind}}}")

    def _plan_expansion(self, order, scopes) -> None:
        """Loops ``h, g, v`` innermost, ``v`` shorter than :data:`CONTIGUOUS_RUN` and ``g * v``
        at most :data:`EXPAND_MAX`: the values of ``g``'s and ``v``'s loops that do not depend
        on ``h`` are computed before ``h``'s loop, in loops over ``g`` and ``v``, into stack
        arrays that the loops inside ``h`` read; the stores of ``g``'s loop that do not
        depend on ``h`` are written there, once. A channels-last group norm's output loops
        N, H * W, G, then a group's 8 channels: each channel's scale and shift (the group's
        rsqrt times the weight, ...), and the group's mean and rstd outputs, once per image
        instead of once per position (its output nest on the dev VM, [32, 64, 56, 56]
        float32: 1.39 -> 0.7-1.0 ms)."""
        h, g, v = order[-3:]
        sizes = self.ir.sizes
        gs, inner = scopes[-2], scopes[-1]
        if sizes[v] >= CONTIGUOUS_RUN or sizes[g] * sizes[v] > EXPAND_MAX or sizes[h] < 2:
            return
        if any(k not in ("expr", "store") for sc in (gs, inner) for k, _ in sc.items):
            return
        cands = [[x for k, x in sc.items if k == "expr" and h not in free_vars(x)] for sc in (gs, inner)]
        moved = [st for k, st in gs.items if k == "store"
                 and h not in free_vars(st.value) | {u for u, _ in st.addr.terms}]
        if not moved and all(trivial(x, self.keep_widened_f16) for x in cands[0] + cands[1]):
            return
        known = set(cands[0] + cands[1])
        used = {a for sc in (gs, inner) for k, x in sc.items
                if not (k == "expr" and x in known) and not (k == "store" and x in moved)
                for a in ((x.value,) if k == "store" else x.args) if a in known}
        gs.items = [it for it in gs.items if not (it[0] == "store" and it[1] in moved)]
        at = (f"i{g}", f"i{g} * {sizes[v]} + i{v}")
        arrays = []
        for level, (sc, xs) in enumerate(zip((gs, inner), cands)):
            for x in xs:
                if x in used:
                    arrays.append((level, x, f"{sc.names[x]}_x"))
                    self.cached[(id(sc), x)] = f"{arrays[-1][2]}[{at[level]}]"
                else:
                    self.dead.add((id(sc), x))
        scopes[-4].items.append(("expand", (g, v, at, cands, arrays, moved, gs, inner)))
        if self._fusable(g, v, gs, inner):
            self.fused[g] = v

    def _fusable(self, g: int, v: int, gs, inner) -> bool:
        """After :meth:`_plan_expansion`: whether the loops over ``g`` and ``v`` can run as one
        loop over ``g * size(v) + v``, ``i{g}`` held at 0 (nothing left in ``g``'s scope, and
        every address of ``v``'s a function of that combination): a channels-last group
        norm's output then loops over the 64 channels of a position, not 8 groups of 8
        (whole vectors and streaming-store blocks: the region's C++ on the dev VM, [32, 64,
        56, 56] float32, 2.03-2.15 -> 1.87-1.92 ms)."""
        if any(k != "expr" or (id(gs), x) not in self.dead for k, x in gs.items):
            return False
        addrs = [st.addr for k, st in inner.items if k == "store"]
        addrs += [x.args[1] if x.op == "load" else x.args[0] for k, x in inner.items
                  if k == "expr" and x.op in ("load", "index") and (id(inner), x) not in self.dead
                  and (id(inner), x) not in self.cached]
        return one_run(addrs, g, v, self.ir.sizes[v])

    def _emit_expansion(self, g, v, at, cands, arrays, moved, gs, inner, out, ind) -> None:
        """The loops over ``g`` and ``v`` of :meth:`_plan_expansion`, filling its arrays
        (``at``: their indices in ``g``'s loop and in ``v``'s)."""
        sizes = self.ir.sizes
        out += [f"{ind}{self.ctype(x.dtype)} {a}[{sizes[g] * sizes[v] if lv else sizes[g]}];"
                for lv, x, a in arrays]
        body = {0: [], 1: []}
        for lv, (sc, xs) in enumerate(zip((gs, inner), cands)):
            body[lv] += [f"const {self.ctype(x.dtype)} {sc.names[x]} = {self._rhs(x, sc)};" for x in xs]
            body[lv] += [f"{a}[{at[lv]}] = {sc.names[x]};" for k, x, a in arrays if k == lv]
        out.append(f"{ind}for (int64_t i{g} = 0; i{g} < {sizes[g]}; ++i{g}) {{")
        out += [f"{ind}  {line}" for line in body[0]]
        out += [f"{ind}  {self._store(st, gs)}" for st in moved]
        if body[1]:
            out.append(f"{ind}  #pragma omp simd")
            out.append(f"{ind}  for (int64_t i{v} = 0; i{v} < {sizes[v]}; ++i{v}) {{")
            out += [f"{ind}    {line}" for line in body[1]]
            out.append(f"{ind}  }}")
        out.append(f"{ind}}}")
