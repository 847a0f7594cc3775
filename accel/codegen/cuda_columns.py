"""Column mode on a GPU: reductions along a strided dimension whose results vary along a
contiguous one (a column sum, a batch norm's statistics, ``x.softmax(0)``) run as tiles of
32 neighbouring results a block, coalesced along them, the block's rows of threads (and,
for few tiles of long columns, several blocks) splitting each reduction. A part of
:class:`accel.codegen.cuda.CudaRenderer` (the mixin :class:`ColumnTiles`: its
``render_kernel`` takes column mode where :meth:`ColumnTiles._one_thread_per_result` and
:meth:`ColumnTiles._columns_fit` say so; its ``_emit_group`` renders each reduction kind's
column form and calls :meth:`ColumnTiles._col_split_finish`).
"""
from __future__ import annotations

from typing import List

from ..loop_ir import LoopIR, Nest
from .cuda_shapes import BLOCK_UNROLL, COL_BLOCKS, COL_MIN_ROWS, COL_ROWS, COL_SPLIT_TYPES, COL_TILE, MAX_GRID
from .scopes import ARG, SIMPLE, Scope

#: the reduction kinds column mode renders (and splits among blocks)
COLUMN_KINDS = frozenset({*SIMPLE, *ARG, "welford", "online_softmax"})


def col_rows(rsize: int) -> int:
    """Column mode: the rows of threads of a block (a power of 2, at most ``COL_ROWS``)
    for reductions of ``rsize`` rows: about an eighth of them."""
    return max(1, min(COL_ROWS, 1 << max(0, (rsize // 8).bit_length() - 1)))


def col_split(rsize: int, tiles: int) -> int:
    """Column mode: the blocks each of ``tiles`` tiles' ``rsize`` rows are split among, so
    that about ``COL_BLOCKS`` blocks run, each thread still taking ``COL_MIN_ROWS`` rows
    or more (1: no split)."""
    return max(1, min(-(-COL_BLOCKS // tiles), rsize // (col_rows(rsize) * COL_MIN_ROWS)))


class ColumnTiles:
    """:class:`accel.codegen.cuda.CudaRenderer`'s column mode."""


    def _one_thread_per_result(self, outer, scope: Scope) -> bool:
        """The reductions at this level read along a strided dimension while a loop they
        depend on is contiguous: one thread per result reads coalesced. Loads that do not
        vary along that loop (a layer norm's per-row mean and rstd in its weight gradient)
        are the same address for a warp's threads and do not count against it."""
        if not outer:
            return False
        for k, g in scope.items:
            if k != "group" or not g.rvars:
                continue
            loads = [x.args[1] for kk, x in self.group_scope[id(g)].items
                     if kk == "expr" and x.op == "load"]
            last = g.rvars[-1]
            col = outer[-1]
            if loads and all(abs(a.coeff(last)) != 1 or a.coeff(col) == 0 for a in loads) and any(
                    a.coeff(col) == 1 for a in loads):
                return True
        return False

    def _columns_fit(self, order, lvl, n_out) -> bool:
        """Column mode: the results come in whole warps (32 a tile), every reduction of the
        level is a plain, Welford or arg one, and nothing runs in loops after it."""
        if n_out % COL_TILE or any(s.items for s in self.nest_scopes[lvl + 1:]):
            return False
        return all(k != "group" or g.members[0].args[0] in COLUMN_KINDS
                   for k, g in self.nest_scopes[lvl].items)

    def _online_columns(self, nest: Nest, ir: LoopIR, order, lvl: int, n_out: int) -> None:
        """Column mode, a nest whose reductions include an online softmax: its statistics in
        one pass (:meth:`accel.codegen.cuda.CudaRenderer._plan_online`), so that a column
        is read once, not once for its maximum and again for its sum of exponentials (two
        reads of memory, as a column is too long for the cache), where that plan still
        takes column mode at ``lvl``."""
        self._plan_online(nest, ir, lambda: (
            max(self._levels()) == lvl and self._one_thread_per_result(order[:lvl], self.nest_scopes[lvl])
            and self._columns_fit(order, lvl, n_out)))

    def _column_tiles(self, order, n_out, lvl, out):
        """A block per tile of 32 neighbouring results (coalesced reads along them); its
        rows of threads (:func:`col_rows`) split each reduction and combine through shared
        memory (:func:`accel::col_reduce`), and row 0 stores the results. Blocks stride over
        the tiles. With few tiles, each tile's rows are split among blocks too
        (:func:`col_split`)."""
        self.mode = "col"
        groups = [g for k, g in self.nest_scopes[lvl].items if k == "group"]
        tiles = n_out // COL_TILE
        f, t = f"f{self.ntemp}", f"tile{self.ntemp}"
        self.ntemp += 1
        splits = (len(groups) == 1 and tiles < COL_BLOCKS and tiles <= MAX_GRID
                  and all(e.args[0] in COLUMN_KINDS and e.dtype in COL_SPLIT_TYPES for e in groups[0].members))
        rows, split = self._col_shape(groups, tiles, splits)
        self.col_tile, self.col_tiles = t, tiles
        out.append(f"  for ({self.ix} {t} = blockIdx.x; {t} < {tiles}; {t} += gridDim.x) {{")
        out.append(f"    const {self.ix} {f} = {t} * {COL_TILE} + threadIdx.x;")
        self._decompose(f, order[:lvl], out, "    ")
        for j in range(0, lvl + 1):
            self._emit_items(self.nest_scopes[j], out, "    ")
        out.append("  }")
        grid = min(tiles, MAX_GRID) if split == 1 else (tiles, split)
        return out, grid, (COL_TILE, rows)

    def _col_shape(self, groups, tiles: int, splits: bool):
        """The rows of threads a block (:func:`col_rows`) and the blocks a tile's rows are
        split among (:func:`col_split`; 1 unless ``splits``) for the reductions of
        ``groups``. Sets where a thread's rows start and their step (:attr:`col_start`,
        :attr:`col_step`: C), the most blocks a tile (:attr:`col_split_max`) and the
        condition of their partials (:attr:`col_split_if`), for this nest."""
        rsize = max(self._size(g.rvars) for g in groups)
        rows = col_rows(rsize)
        split = col_split(rsize, tiles) if splits else 1
        self.col_start = "threadIdx.y" if split == 1 else f"blockIdx.y * {rows} + threadIdx.y"
        self.col_step, self.col_split_max, self.col_split_if = rows * split, split, ""
        return rows, split

    def _col_loop(self, f: str, n, ind: str) -> List[str]:
        """The loop over a thread's rows ``f`` of ``n``: from :attr:`col_start` by
        :attr:`col_step`, constants, so that nvcc unrolls it with ``BLOCK_UNROLL`` loads in
        flight."""
        return [f"{ind}#pragma unroll {BLOCK_UNROLL}",
                f"{ind}for ({self.ix} {f} = {self.col_start}; {f} < {n}; {f} += {self.col_step}) {{"]

    def _col_split_finish(self, parts: List[tuple], finish: List[str]) -> None:
        """Column mode, rows split among ``col_split`` blocks a tile: each block writes its
        columns' results (``parts``: each accumulator's name, C++ type and combining
        functor; a Welford's moments, merged as Chan et al.'s pairs) to a ``__device__``
        array of partials, and the tile's last block to finish (a ticket counter per tile,
        reset by that block) combines them in block order, deterministically; the others
        return. Nothing where the rows are not split; in a shape-generic kernel, under
        :attr:`col_split_if` (its split chosen at launch, perhaps 1)."""
        t, tiles, n = self.col_tile, self.col_tiles, self.col_split_max
        if n == 1:
            return
        lines = self._ticket_partials(parts, "col", t, tiles, n * tiles * COL_TILE, "")
        finish += [self.col_split_if + "{", *lines, "}"] if self.col_split_if else lines

    def _ticket_partials(self, parts: List[tuple], fn: str, at: str, n, slots, tag: str) -> List[str]:
        """The lines that write each accumulator of ``parts`` (name, C++ type, combining
        functor) to a ``__device__`` array of ``slots`` partials (``accel::<fn>_part``, at
        index ``at`` of ``n``: a tile, or a row), take a ticket (one counter each of the
        ``n``; the others return) and, in the last block, combine the partials in block
        order (``accel::<fn>_combine``): CUDA's threadFenceReduction sample. The arrays are
        named ``<kernel>_<tag>part<i>`` and ``<kernel>_<tag>count``."""
        lines, arrays = [], []
        for i, (a, ctype, combine) in enumerate(parts):
            part = f"{self.kname}_{tag}part{i}"
            self.globals.append(f"__device__ {ctype} {part}[{slots}];")
            lines.append(f"accel::{fn}_part({a}, {part}, {at}, {n});")
            arrays.append((a, part, combine))
        count = f"{self.kname}_{tag}count"
        self.globals.append(f"__device__ unsigned int {count}[{n}];")
        lines.append(f"if (!accel::col_ticket({count}, {at})) return;")
        return lines + [f"{a} = accel::{fn}_combine({part}, {combine}, {at}, {n});" for a, part, combine in arrays]
