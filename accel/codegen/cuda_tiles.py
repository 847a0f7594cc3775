"""Transposing elementwise nests on a GPU: a nest that writes along its innermost loop and
reads an input across it (``x.t() + y``) runs in tiles through shared memory, so that both
the reads and the writes are coalesced. A part of :class:`accel.codegen.cuda.CudaRenderer`
(the mixin :class:`TransposeTiles`: its ``render_kernel`` calls :meth:`_plan_transpose`
and :meth:`_transpose_tiles` for an elementwise nest; the CPU's tiles are
:mod:`accel.codegen.tiles`).
"""
from __future__ import annotations

from typing import List

from ..loop_ir import Expr
from .cuda_shapes import (MAX_GRID, TRANSPOSE_LONG_SMEM, TRANSPOSE_MIN_RUN, TRANSPOSE_ROWS, TRANSPOSE_SMEM,
                          TRANSPOSE_TILE)
from .tiles import one_run, transposed_loads


class TransposeTiles:
    """:class:`accel.codegen.cuda.CudaRenderer`'s transposing tiles."""

    transposing = False  # the nest being rendered runs in transposing tiles (no vector variant)

    def _plan_transpose(self, order) -> List[Expr]:
        """An elementwise nest whose innermost loop ``v`` writes every store of the
        innermost scope contiguously and reads an input across rows (a stride of at least
        :data:`TRANSPOSE_TILE` along ``v``), contiguous along the loop around it, ``u``, of at
        least :data:`TRANSPOSE_MIN_RUN` values (``x.t() + y``, ``x.t().contiguous()``, a
        channels-last input's contiguous output; a channels-last group norm's, whose group's
        16 channels are ``u``): those loads (:func:`accel.codegen.tiles.transposed_loads`),
        for :meth:`_transpose_tiles`. Empty for any other nest."""
        if len(order) < 2:
            return []
        u, v = order[-2:]
        if self.ir.sizes[v] < TRANSPOSE_TILE:
            return []
        loads = transposed_loads(self.nest_scopes[-1], u, v, TRANSPOSE_TILE)
        if not loads or self._size(self._run(order, loads)) < TRANSPOSE_MIN_RUN:
            return []
        if _tiles_bytes(loads, TRANSPOSE_TILE, TRANSPOSE_TILE) > TRANSPOSE_SMEM:
            return []  # more shared memory than a block has
        return loads

    def _run(self, order, loads: List[Expr]) -> list:
        """The loops a tile takes as its contiguous run ``u``: the nest's second-to-last
        loop, with the loops around it while it is shorter than :data:`TRANSPOSE_TILE`
        and every transposed load reads them as one contiguous run (a loop's stride the
        product of the sizes inside it). A channels-last group norm's output loops over a
        group and its channels: the run is then a position's 128 channels, not a group's
        16 (H200, [64, 128, 64, 64] float32: tiles of 32 x 32, not 16 x 64)."""
        run = [order[-2]]
        while len(run) < len(order) - 1 and self._size(run) < TRANSPOSE_TILE:
            g = order[-len(run) - 2]
            if not one_run([x.args[1] for x in loads], g, run[-1], self._size(run)):
                break
            run.insert(0, g)
        return run

    def _run_values(self) -> List[Expr]:
        """The values of the tile's outer scopes (those without the tile's ``v``) that its
        innermost scope reads: a softmax's maximum and reciprocal sum, a group norm's scale
        and shift. :meth:`_transpose_tiles` computes them once a tile for each ``u`` into
        shared memory, not at each element (their loads and a division or rsqrt an element
        before)."""
        inner = self.nest_scopes[-1]
        refs = {a for k, x in inner.items for a in ((x.value,) if k == "store" else x.args)
                if isinstance(a, Expr)}
        return [x for sc in self.nest_scopes[:-1] for k, x in sc.items if k == "expr" and x in refs]

    def _transpose_tiles(self, order, loads: List[Expr], out: List[str]):
        """The nest of :meth:`_plan_transpose` in tiles of ``tu`` x ``tv`` values of its last
        two loops ``u, v`` (``tu`` :data:`TRANSPOSE_TILE`, or less where ``u`` is shorter;
        ``tu * tv`` the square of :data:`TRANSPOSE_TILE`, twice that with run values: below),
        a block of 32 x
        :data:`TRANSPOSE_ROWS` threads a tile (the shared-memory transpose of NVIDIA's "An
        Efficient Matrix Transpose in CUDA C/C++"): the threads read each transposed load's
        tile along ``u`` into shared memory (coalesced; where ``tu`` is shorter than 32, a
        warp reads ``32 / tu`` runs of ``tu`` values), then compute the tile's values along
        ``v`` with those loads read from it, and store them (coalesced). A row of the shared
        tile is one element longer than ``tu``, so that a column's elements are in distinct
        banks. ``u`` may be several loops read as one run (:meth:`_run`). The values of the
        outer scopes that the elements read (:meth:`_run_values`) are computed once a tile,
        by its first ``tu`` threads, into shared memory, with the outer scopes' stores (a
        group norm's mean beside its output: by the thread at 0 of the loops it does not
        depend on, in the tile at ``v`` = 0). H200, [64, 128, 64, 64] channels-last
        GroupNorm's output kernel: 119 -> 84 us (8 groups), 238 -> 86 (32 groups); ``x.t()
        .softmax(-1)`` [16384, 4096]: 198 -> 164. The elements' other loads (the ``x`` of
        ``x.softmax(-1) + y.t()``) are read into registers before the transposed ones, so
        that both are in flight before the barrier (that kernel, [16384, 4096] on the H200:
        264 -> 215 us; ``x.t() + y`` 195 and 196). Where the tile has both run values and such
        other loads, its transposed loads go into registers too, the run values after them
        and the shared tile last, so that all are in flight together (the softmax's max and
        sum had waited on the other loads: 215 -> 186 us). Without other loads the run
        values stay first: the same order slowed the channels-last group norm's output
        kernel (83 -> 93 us; ``x.t().softmax(-1)`` 164 -> 162). A tile with run values is
        twice as long along ``v`` (32 x 64 values, 8 a thread) where ``v`` has at least four
        such tiles: its run values and its barrier come once per twice the values (that
        group norm's output kernel 83 -> 77 us; the softmaxes above unchanged; without run
        values longer tiles were slower: ``x.t() + y`` 196 -> 279). Returns the body, the
        grid and the block."""
        run, v = self._run(order, loads), order[-1]
        u = run[-1] if len(run) == 1 else f"{run[-1]}_r"  # a run of several loops: i{u} combines them
        U, V, T, R = self._size(run), self.ir.sizes[v], TRANSPOSE_TILE, TRANSPOSE_ROWS
        tu = T if U >= T else 1 << (U.bit_length() - 1)
        tv, m = T * T // tu, T // tu  # m: the runs of u a warp reads
        kept = self._run_values()
        if kept and V >= 4 * tv and _tiles_bytes(loads, tu, 2 * tv) <= TRANSPOSE_LONG_SMEM:
            tv *= 2  # the run values and the barrier once per twice the values
        nu, nv = -(-U // tu), -(-V // tv)
        outer = order[:-1 - len(run)]
        tiles = self._size(outer) * nu * nv
        self.transposing = True
        f = f"f{self.ntemp}"
        self.ntemp += 1
        out += [f"  __shared__ {self.ctype(x.dtype)} tp{k}[{tv}][{tu + 1}];" for k, x in enumerate(loads)]
        out += [f"  __shared__ {self.ctype(x.dtype)} tq{k}[{tu}];" for k, x in enumerate(kept)]
        out.append(f"  for ({self.ix} {f} = blockIdx.x; {f} < {tiles}; {f} += gridDim.x) {{")
        out.append(f"    const {self.ix} {f}_v = ({f} % {nv}) * {tv}, {f}_u = ({f} / {nv} % {nu}) * {tu};")
        if outer:
            self._decompose(f"({f} / {nu * nv})", outer, out, "    ")
        kl: List[str] = []  # the run's values, once a tile: the first tu threads, into shared memory
        if kept:
            kl.append(f"    for (int k = threadIdx.y * 32 + threadIdx.x; k < {tu}; k += {32 * R}) {{")
            kl.append(f"      const {self.ix} i{u} = {f}_u + k, i{v} = {f}_v;")
            kl.append(f"      if (i{u} < {U}) {{")
            if len(run) > 1:
                self._decompose(f"i{u}", run, kl, "        ")
            self.tile_vars = (*run, v)  # a store here: by the tile at v = 0, the run's 0s
            for sc in self.nest_scopes[:-1]:
                self._emit_items(sc, kl, "        ")
            self.tile_vars = ()
            kl += [f"        tq{k}[k] = {self._name(x, self.nest_scopes[-2])};" for k, x in enumerate(kept)]
            kl += ["      }", "    }"]

        def tile_loop(rows, cols, iu, iv, body):  # rows of TRANSPOSE_ROWS, columns of 32 threads
            out.append("    #pragma unroll")
            if m == 1:
                out.append(f"    for (int r = 0; r < {rows}; r += {R}) {{")
                out.append("      #pragma unroll")
                out.append(f"      for (int c = 0; c < {cols}; c += 32) {{")
            else:  # the block's threads in turn over the tile's values, e (H200: 117 against
                # 154 us for the [64, 128, 64, 64] group norm's tiles than by rows and columns)
                out.append(f"    for (int k = 0; k < {tu * tv // (32 * R)}; ++k) {{")
                out.append(f"      {{ const unsigned e = threadIdx.y * 32u + threadIdx.x + k * {32 * R}u;")
            out.append(f"        const {self.ix} i{u} = {f}_u + {iu}, i{v} = {f}_v + {iv};")
            out.append(f"        if (i{u} < {U} && i{v} < {V}) {{")
            if len(run) > 1:
                self._decompose(f"i{u}", run, out, "          ")
            out.extend(body() + ["        }", "      }", "    }"])

        # reading along u (a warp's threads take m runs of tu values), writing along v
        ru, rv = ("threadIdx.x + c", "threadIdx.y + r") if m == 1 else (f"e % {tu}u", f"e / {tu}u")
        wu, wv = ("threadIdx.y + r", "threadIdx.x + c") if m == 1 else (f"e / {tv}u", f"e % {tv}u")
        # the elements' other loads, read ahead into registers (each thread's values of the
        # tile, in the order the tile's elements take them), so that they and the transposed
        # loads are in flight together before the barrier
        ahead = [x for k, x in self.nest_scopes[-1].items
                 if k == "expr" and x.op == "load" and x not in loads]
        j = f"(r / {R}) * {tv // 32} + c / 32" if m == 1 else "k"
        out += [f"    {self.ctype(x.dtype)} pf{k}[{tu * tv // (32 * R)}];" for k, x in enumerate(ahead)]
        if ahead:
            tile_loop(tu, tv, wu, wv, lambda: [f"          pf{k}[{j}] = b{x.args[0]}[{self._addr(x.args[1])}];"
                                               for k, x in enumerate(ahead)])
        if kept and ahead:  # the tile's loads into registers, then the run's values, then the tile
            out += [f"    {self.ctype(x.dtype)} ld{k}[{tu * tv // (32 * R)}];" for k, x in enumerate(loads)]
            jt = f"(r / {R}) * {tu // 32} + c / 32" if m == 1 else "k"
            tile_loop(tv, tu, ru, rv, lambda: [f"          ld{k}[{jt}] = b{x.args[0]}[{self._addr(x.args[1])}];"
                                               for k, x in enumerate(loads)])
            out += kl
            tile_loop(tv, tu, ru, rv, lambda: [f"          tp{k}[{rv}][{ru}] = ld{k}[{jt}];"
                                               for k, x in enumerate(loads)])
        else:
            out += kl
            tile_loop(tv, tu, ru, rv,
                      lambda: [f"          tp{k}[{rv}][{ru}] = b{x.args[0]}[{self._addr(x.args[1])}];"
                               for k, x in enumerate(loads)])
        out.append("    __syncthreads();")
        self.tiled = {x: f"tp{k}[{wv}][{wu}]" for k, x in enumerate(loads)}
        self.tiled.update((x, f"pf{k}[{j}]") for k, x in enumerate(ahead))

        def values():
            lines: List[str] = []
            self.tile_vars = tuple(order)
            if kept:  # the run's values from shared memory; its stores were written above
                lines += [f"          const {self.ctype(x.dtype)} {self.nest_scopes[-2].lookup(x)} = tq{k}[{wu}];"
                          for k, x in enumerate(kept)]
            for sc in self.nest_scopes if not kept else self.nest_scopes[-1:]:
                self._emit_items(sc, lines, "          ")
            self.tile_vars = ()
            return lines
        tile_loop(tu, tv, wu, wv, values)
        self.tiled = {}
        out.append("    __syncthreads();")
        out.append("  }")
        return out, min(tiles, MAX_GRID), (32, R)


def _tiles_bytes(loads: List[Expr], tu: int, tv: int) -> int:
    """Shared memory of the tiles of ``loads``, ``tv`` rows of ``tu + 1`` values each."""
    return sum(tv * (tu + 1) * x.dtype.itemsize for x in loads)
