"""CUDA backend: one module (a cubin) per region, one ``extern "C" __global__`` kernel per
IR nest, and a launch plan (grid, block, the 16-byte variant's alignment condition) that the
core runs through the driver API, in order, on the caller's stream.

The loop IR and the placement of every value (:meth:`CppRenderer._plan`: a value lives in
the outermost loop that binds what it depends on) are the C++ backend's; what differs is
how loops map to threads, by nest:

* no reduction: a grid-stride loop, one thread per element of the flattened loops;
* row reductions (their loads contiguous along the reduction): one block per iteration of
  the loops the reductions depend on; the block's threads share each reduction (strided over
  it, then warp shuffles and shared memory, every thread getting the result) and the loops
  inside (a softmax or layer norm row per block; a row short enough for one warp runs a
  warp per row, several rows a block). A row each thread keeps a few values of in
  registers is a row kernel (read once), as are statistics alone over one row (a
  ``logsumexp``, a softmax's for a transposed output); a longer row, or group norm's group,
  runs block loops that read it again (a softmax's maximum and sum of exponentials in one
  pass, ``accel::SoftmaxState``), in 16-byte vectors where every loop allows;
* reductions along a strided dimension whose result varies along a contiguous one (a column
  sum): one thread per result, each running its reduction on its own, neighbouring threads
  reading neighbouring addresses.

Math comes from ``include/accel/cuda_math.cuh`` under the C++ backend's names, so the
expression tables are shared (:class:`accel.codegen.CStyle`). Threads a block, values a
thread and the other launch shapes, with the measurements that chose them:
:mod:`accel.codegen.cuda_shapes`.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..loop_ir import Expr, LoopIR, Nest, free_vars, walk
from ..ops import HALF
from . import CodegenError
from .cpp import CppRenderer
from .cuda_columns import COLUMN_KINDS, ColumnTiles
from .cuda_merges import COMBINE, PartialMerges
from .cuda_tiles import TransposeTiles
from .cuda_vectors import VectorLoads
from .cuda_shapes import (ALONE_MAX, BLOCK, BLOCK_UNROLL, BLOCK_VEC_UNROLL, GRID_MIN, GRID_UNROLL, ILP, MAX_GRID,
                          COL_SPLIT_TYPES, MOMENTS_HALF_BLOCK_BYTES, MOMENTS_HALF_BLOCK_THREADS,
                          NARROW_MOMENTS_MAX, ROW_ELEMS, ROW_ELEMS_MOMENTS, ROW_HALF_SCALE, ROW_REGISTERS,
                          ROW_REGISTERS_32, ROW_SPLIT_BLOCKS, ROW_SPLIT_MIN, ROW_THREADS, ROW_WARPS,
                          STATS_ROW_THREADS, STATS_ROW_UNROLL, VEC_ILP)
from .scopes import ARG, SIMPLE, Group, Scope, subst


def _dim3(v) -> list:
    """A launch dimension (an int, a shape-generic kernel's formula, a dict: see
    :func:`accel.codegen.generic.launches_for`, or a tuple of up to 3 of them) as CUDA's
    [x, y, z]."""
    v = (v,) if isinstance(v, (int, dict)) else tuple(v)
    return [d if isinstance(d, dict) else int(d) for d in v] + [1] * (3 - len(v))


#: a kernel indexes in 32-bit ints (Triton's int32 indexing) where every loop length is
#: static and below this, as is every element offset it computes, and its flat indices
#: (past the end by at most a grid's threads, MAX_GRID * 1024 < 2**26, stay below 2**31).
#: 64-bit index arithmetic takes twice the instructions: H100, ``torch.diff`` of
#: [65536, 1024] float32 in a kernel of its own, 215 -> 179 us (torch.compile's 180, a
#: copy of as many bytes 187; bench/README.md, the eighty-eighth round).
INDEX_32_LIMIT = 1 << 30


def index_type(nest: Nest, ir: LoopIR) -> str:
    """The C type of ``nest``'s kernel's loop variables and flat indices: ``int`` where
    every flat index (over the nest's loops, or over a reduction's) and every load's,
    store's and index's element offset stays below :data:`INDEX_32_LIMIT`, else
    ``int64_t``. A shape-generic kernel's is chosen for the lengths of the region it is
    built for and is part of its store key (:func:`accel.codegen.generic.generic_layout`):
    regions whose lengths fit share one kernel in 32 bits, the others one in 64."""
    if any(type(n) is not int for n in ir.sizes):
        return "int64_t"
    # a flat index runs over some of the nest's loops, or over one reduction's
    flat, addrs, seen = [nest.vars], [st.addr for st in nest.stores], set()
    for st in nest.stores:
        for e in walk(st.value, seen):
            if e.op == "load":
                addrs.append(e.args[1])
            elif e.op == "index":
                addrs.append(e.args[0])
            elif e.op == "reduce":
                flat.append(e.args[2])
    if any(math.prod(ir.sizes[v] for v in vs) >= INDEX_32_LIMIT for vs in flat):
        return "int64_t"
    for a in addrs:
        lo, hi = a.extent(ir.sizes)
        if lo <= -INDEX_32_LIMIT or hi >= INDEX_32_LIMIT:
            return "int64_t"
    return "int"


class CudaRenderer(VectorLoads, ColumnTiles, TransposeTiles, PartialMerges, CppRenderer):
    """Renders a :class:`LoopIR` as CUDA C++ for ``nvcc -cubin``: the kernels, and their
    launch plan in :attr:`launches` (see :meth:`render`)."""

    prefix = '#include "accel/cuda_math.cuh"\n'
    ix = "int64_t"  # the C type of loop variables and flat indices (index_type(), by kernel)
    row_caching = False  # a row's values come back from L1/L2
    cache_across_reductions = False  # (row kernels: registers; not measured on the GPU)
    keep_widened_f16 = False  # (one instruction here; the row's loads are kept already)
    f16_row_passes = False  # (conversions are single instructions in device code)
    stream_stores = False  # (CPU only)
    reciprocal_numbers = True  # (div_true_kernel_cuda: a number divisor's reciprocal)
    expand_invariants = False  # (CPU only)
    tile_transposes = False  # (CPU only)
    #: a row kernel's kept values are a thread's share of the row (at most row_limit)
    row_cache_max = float("inf")
    x86_conversions = False  # a C++ cast in device code is CUDA's saturating one, eager's there
    gcc_shapes = False
    vec = None  # in a vector tile: load Expr -> its vector's name
    vec_stores: Dict[tuple, str] = {}  # (buffer, Addr) -> a vector variant's lane v of it
    tile_vars: tuple = ()  # the loops a thread mode tile's threads take an element of each

    def render(self, ir: LoopIR, name: str) -> str:
        """The module's source: one ``extern "C" __global__`` kernel per nest (and its
        16-byte-vector variant where one applies). How to launch them is left in
        :attr:`launches`: one entry per nest, in order, each ``{"kernel": name, "grid":
        [x, y, z], "block": [x, y, z]}`` plus, for a vector variant, ``"vector"``: the same
        for the variant and ``"buffers"``, the indices of the buffers whose addresses must
        all be multiples of 16 for it to run. Both kernels take the buffers and the
        scalars by value, as ``accel_bufs<N>`` and ``accel_scalars<M>``
        (include/accel/cuda_math.cuh)."""
        self.ntemp = 0
        self.launches: List[dict] = []
        kernels: List[str] = []
        written = {st.buf for nest in ir.nests for st in nest.stores}
        index_types = self._index_types(ir)
        for k, nest in enumerate(ir.nests):
            if self._empty(nest, ir):
                continue
            kname, self.ix = f"{name}_k{k}", index_types[k]
            text, grid, block = self._kernel(kname, nest, ir, written, None)
            kernels += text
            launch = {"kernel": kname, "grid": _dim3(grid), "block": _dim3(block)}
            vbufs = self._vector_width(nest, ir) if not self.transposing else frozenset()
            if vbufs:  # 16-byte loads and stores where every such pointer is aligned
                text, vgrid, vblock = self._kernel(kname + "v", nest, ir, written, vbufs)
                kernels += text
                launch["vector"] = {"kernel": kname + "v", "grid": _dim3(vgrid),
                                    "block": _dim3(vblock), "buffers": sorted(vbufs),
                                    **self._vector_condition(nest, ir)}
            self.launches.append(launch)
        return "\n".join([self.prefix, *kernels])

    def _index_types(self, ir: LoopIR) -> List[str]:
        """Each nest's kernel's index type (:func:`index_type`)."""
        return [index_type(nest, ir) for nest in ir.nests]

    def _kernel(self, kname, nest, ir, written, vbufs):
        """``nest``'s ``__global__`` function (lines), grid and block; with ``vbufs``, the
        variant that moves those buffers 16 bytes at a time."""
        nb, ns = max(1, len(ir.buffers)), max(1, self._n_scalars(ir))
        self.scalar_decls: Dict[tuple, str] = {}
        self.kname, self.globals = kname, []
        body, grid, block = self.render_kernel(nest, ir, vbufs)
        head = self.globals + [f'extern "C" __global__ void __launch_bounds__(1024) {kname}(const accel_bufs<{nb}> bf, '
                f"const accel_scalars<{ns}> sc) {{",
                *self._scratch_decl()]
        for i, b in enumerate(ir.buffers):
            q = "" if i in written else "const "
            t = self.ctype(b.dtype)
            head.append(f"  {q}{t}* __restrict__ b{i} = ({q}{t}*)bf.p[{i}];")
        for (j, dtype), var in self.scalar_decls.items():
            field_ = "f" if ir.scalar_types[j] == "f" else "i"
            src = torch.float64 if field_ == "f" else torch.int64
            head.append(f"  const {self.ctype(dtype)} {var} = "
                        f"{self.cast(f'sc.v[{j}].{field_}', src, dtype)};")
        head[len(self.globals) + 3:len(self.globals) + 3] = self.preamble(ir)
        return head + body + ["}", ""], grid, block

    def _scratch_decl(self) -> List[str]:
        """The block reductions' shared scratch (``smem``): the block's, or each warp's own
        where the block runs a row a warp (:attr:`rows`)."""
        if self.rows == 1:
            return ["  __shared__ __align__(16) char smem[128 * 8];", "  (void)smem;"]
        return [f"  __shared__ __align__(16) char smem_rows[{self.rows}][128 * 8];",
                "  char* const smem = smem_rows[threadIdx.y];", "  (void)smem;"]

    def render_kernel(self, nest: Nest, ir: LoopIR, vbufs=None):
        """The body of ``nest``'s kernel, and its grid and block sizes (``vbufs``: the
        variant with those buffers moved as 16-byte vectors, elementwise or a row kernel)."""
        self.rows = 1  # rows a block (block mode: ROW_WARPS where a row takes one warp)
        self.split = 1  # blocks a row (block mode: _row_split)
        self._plan(nest, ir)
        order = nest.vars
        levels = self._levels()
        out: List[str] = []
        self.elems = None  # set for a row kernel; block mode without it runs block loops
        self.vec = None
        self.row_vec = frozenset()
        self.row_vec_regs: Dict[tuple, str] = {}  # (buffer, address) -> a row kernel's store vector
        self.unroll = BLOCK_UNROLL  # block loops' (scalar) unrolling
        self.row_regs, self.row_decls = {}, []  # row kernels' vector registers (_rhs)
        self.load_hints = {}  # block loops: (scope id, buffer) -> L2 priority (_plan_load_hints)
        self.transposing = False
        self.merge_leaves, self.merge_roots = frozenset(), {}  # (block mode: _plan_merges)
        if not levels:  # elementwise
            n = self._size(order)
            self.mode = "thread"
            tiled = self._plan_transpose(order) if not vbufs else None
            if tiled:
                return self._transpose_tiles(order, tiled, out)
            if vbufs:
                self._vector_tiles(order, n, nest, vbufs, out)
                return out, self._grid(n, BLOCK * self.vw * VEC_ILP), BLOCK
            self._tiles(order, n, 0, out, "  ")
            return out, self._grid(n, BLOCK * ILP), BLOCK
        lvl = max(levels)
        outer, inner = order[:lvl], order[lvl:]
        n_out = self._size(outer)
        if self._one_thread_per_result(outer, self.nest_scopes[lvl]):
            if self._columns_fit(order, lvl, n_out):
                self._online_columns(nest, ir, order, lvl, n_out)
                return self._column_tiles(order, n_out, lvl, out)
            self.mode = "thread"
            self._tiles(order, n_out, 0, out, "  ", upto=lvl)
            return out, self._grid(n_out, BLOCK * ILP), BLOCK
        self.mode = "block"
        rsize = max(self._size(g.rvars) for sc in self.nest_scopes for k, g in sc.items if k == "group")
        if self._grid_fits(order, rsize):
            return self._grid_reduction(rsize, out, vbufs)
        span = max(self._size(inner), rsize, 1)  # a loop of the row's
        longest = max(span, self._row_length(lvl))  # its values in all its pieces' loops
        moments = any(k == "group" and g.members[0].args[0] == "welford"
                      for sc in self.nest_scopes for k, g in sc.items)
        scale = ROW_HALF_SCALE if self._half_row(nest, ir) else 1
        self.row_limit = ROW_REGISTERS * scale
        if scale == 1 and self._widest(nest, ir) <= 4:
            self.row_limit = ROW_REGISTERS_32
        # values a thread: statistics alone (nothing reads the row after its reductions: a
        # row sum, a logsumexp, a softmax's maximum and sum for a transposed output) as many
        # as registers hold, fewer threads a row and more rows in flight (a logsumexp over
        # [16384, 4096] float32 on the H200: 106 -> 62 us, 512 -> 128 threads)
        each = self.row_limit if not inner else (ROW_ELEMS_MOMENTS if moments else ROW_ELEMS) * scale
        per = -(-longest // each)  # threads a row
        self.threads = max(32, min(ROW_THREADS, 1 << (per - 1).bit_length()))
        if not inner and not vbufs and -(-longest // ROW_THREADS) > each:  # statistics alone, scalar block loops
            self.threads, self.unroll = STATS_ROW_THREADS, STATS_ROW_UNROLL
        if (moments and -(-longest // ROW_THREADS) > ROW_ELEMS_MOMENTS
                and self._row_bytes_read(ir, n_out, longest) <= MOMENTS_HALF_BLOCK_BYTES):
            self.threads = MOMENTS_HALF_BLOCK_THREADS
        elems = -(-span // self.threads)
        if self.threads == 32:  # a row a warp, several a block (see ROW_WARPS)
            self.rows = ROW_WARPS
        self.block_lvl, self.block_outer = lvl, outer
        if vbufs:  # vw neighbouring elements a thread at a time
            self.row_vec = vbufs
            # a vector a store (a concatenation's pieces are stores into one buffer)
            for st in nest.stores:
                if st.buf in vbufs and (st.buf, st.addr) not in self.row_vec_regs:
                    k = sum(1 for b, _ in self.row_vec_regs if b == st.buf)
                    self.row_vec_regs[st.buf, st.addr] = name = f"w{st.buf}_{k}" if k else f"w{st.buf}"
                    out.append(f"  {self._vec(st.buf)} {name};")
        row = self._row(inner, lvl)
        if -(-longest // self.threads) <= self.row_limit and row is not None:  # a row kernel: the row in registers
            v, groups, loop = row
            if vbufs:
                self.row_vars = {v} | {g.rvars[0] for k, g in groups.items if k == "group"}
                elems = -(-elems // self.vw) * self.vw
            self.elems = elems
            if loop is not None:
                self._plan_row_cache(v, groups, loop, "j")
            self._plan_load_cache(v, groups, loop)
        else:  # block loops: a softmax's statistics in one pass over the row, not two
            self._plan_online(nest, ir, lambda: max(self._levels()) == lvl)
            if vbufs:
                self._plan_load_hints()
        self._plan_merges()
        self.split = self._row_split(n_out, lvl, rsize)
        at = len(out)
        self._block_loop(order, n_out, lvl, out)
        out[at:at] = self.row_decls
        grid = self._grid(n_out, self.rows)
        return out, grid if self.split == 1 else (grid, self.split), (self.threads, self.rows)

    def _row_split(self, n_out, lvl: int, rsize) -> int:
        """Block loops' statistics alone (one reduction group, at ``lvl``, nothing in loops
        after it) over ``n_out`` rows too few to fill the GPU: the blocks each row's
        ``rsize`` values are split among, so that about :data:`ROW_SPLIT_BLOCKS` run, each
        thread taking :data:`ROW_SPLIT_MIN` values or more (1: a block a row). Each block's
        result goes to a partial, which the row's last block combines
        (:meth:`_row_split_finish`), as column mode splits its tiles' rows
        (:func:`accel.codegen.cuda_columns.col_split`) and Inductor its split reductions.
        Static lengths only (a shape-generic kernel's row takes one block)."""
        groups = [(j, g) for j, sc in enumerate(self.nest_scopes) for k, g in sc.items if k == "group"]
        if (self.elems is not None or self.rows != 1 or self.merge_leaves or len(groups) != 1
                or groups[0][0] != lvl or any(sc.items for sc in self.nest_scopes[lvl + 1:])
                or type(n_out) is not int or type(rsize) is not int or 2 * n_out > ROW_SPLIT_BLOCKS):
            return 1
        g = groups[0][1]
        if self._alone(g) or not all(e.args[0] in COLUMN_KINDS and e.dtype in COL_SPLIT_TYPES for e in g.members):
            return 1
        return max(1, min(-(-ROW_SPLIT_BLOCKS // n_out), rsize // (self.threads * ROW_SPLIT_MIN)))

    def _row_split_finish(self, parts: List[tuple], finish: List[str]) -> None:
        """Block loops with each row split among :attr:`split` blocks (:meth:`_row_split`):
        each block writes its result of the group's reductions (``parts``: each accumulator's
        name, C++ type and combining functor) to a ``__device__`` array of partials, and the
        row's last block to finish (a ticket counter a row, reset by that block;
        ``accel::col_ticket``) combines them in block order, deterministically, and goes on
        to the stores; the others return (a block takes one row: the grid's x is the row
        count). CUDA's threadFenceReduction sample."""
        if self.split == 1:
            return
        o, n = self.block_flat, self.block_rows
        finish += self._ticket_partials(parts, "row", o, n, self.split * n, "r")

    def _plan_online(self, nest: Nest, ir: LoopIR, keeps) -> None:
        """Plans ``nest`` again with its online softmax reductions kept whole
        (:attr:`online_softmax`: ``accel::SoftmaxState``, a running maximum and sum of
        exponentials a thread, merged across threads as Milakov & Gimelshein's pairs), one
        pass over the values instead of the maximum's and then the sum's; where ``keeps()``
        is false for that plan (it would not take the mode chosen), the two-pass plan
        again. Nothing for a nest without an online softmax."""
        if not any(e.op == "reduce" and e.args[0] == "online_softmax"
                   for st in nest.stores for e in walk(st.value, set())):
            return
        self.online_softmax = True
        try:
            self._plan(nest, ir)
        finally:
            self.online_softmax = False
        if not (self._levels() and keeps()):
            self._plan(nest, ir)

    def _row_length(self, lvl: int) -> int:
        """Values a row of the reductions at ``lvl`` holds in registers: for each kind of
        reduction, the sizes of its variables, each once; the most of any kind. A
        reduction along a concatenation has a variable a piece, the pieces' loops side by
        side, each keeping its values (a softmax's maxima over ``cat([a, b], -1)``: the
        two pieces' sizes); a two-pass reduction's passes read the same values through
        variables of their own (a logsumexp's maximum, then its sum: the row once)."""
        by_kind: Dict[str, set] = {}
        for k, g in self.nest_scopes[lvl].items:
            if k == "group" and len(g.rvars) == 1:
                for e in g.members:
                    by_kind.setdefault(e.args[0], set()).add(g.rvars[0])
        return max((sum(self.ir.sizes[v] for v in vs) for vs in by_kind.values()), default=0)

    def _row(self, inner, lvl: int):
        """A row kernel's row: (its variable, the scope of its reductions, the scope of the
        loop over it after them), for a nest whose reductions at ``lvl`` are followed by
        one loop (softmax, layer norm), or (the first reduction's variable, that scope,
        None) for statistics alone (a softmax's maximum and sum of exponentials written
        for a later nest that reads the rows transposed), where every reduction at ``lvl``
        runs over one variable of the same size and a later one reads the row again; else
        None (block loops: a row sum alone reads its row once either way)."""
        if len(inner) == 1:
            return inner[0], self.nest_scopes[-2], self.nest_scopes[-1]
        scope = self.nest_scopes[lvl]
        groups = [g for k, g in scope.items if k == "group"]
        if (inner or len(groups) < 2 or any(len(g.rvars) != 1 for g in groups)
                or len({self.ir.sizes[g.rvars[0]] for g in groups}) != 1):
            return None
        return groups[0].rvars[0], scope, None

    def _loaded(self) -> set:
        """The buffers the nest being rendered loads."""
        bufs = set()
        for sc in list(self.nest_scopes) + list(self.group_scope.values()):
            bufs |= {x.args[0] for k, x in sc.items if k == "expr" and x.op == "load"}
        return bufs

    def _accessed(self, nest: Nest) -> set:
        """The buffers ``nest`` loads or stores."""
        return self._loaded() | {st.buf for st in nest.stores}

    def _row_bytes_read(self, ir: LoopIR, rows: int, n: int) -> int:
        """Bytes a row of ``n`` values reads from the buffers holding ``rows`` such rows or
        more (not a layer norm's weight, which every row shares)."""
        return sum(n * ir.buffers[b].dtype.itemsize for b in self._loaded()
                   if math.prod(ir.buffers[b].shape) >= rows * n)

    def _block_loop_vars(self, nest: Nest, ir: LoopIR):
        """Block loops (rows too long for registers, group norm's groups): the variable each
        thread loop's scope moves vectors along (a reduction's own variable; the last of
        the loops after the block's, for their scopes), by scope id; None where some thread
        loop cannot step a vector at a time (a reduction over several variables, or a
        size, or the last loop's, not a multiple of :attr:`vw`). A group each thread reduces
        alone (:meth:`_alone`) is no thread loop: its loads stay scalar."""
        w, lvl = self.vw, self.block_lvl
        loop_var = {}
        for sc in self.nest_scopes[:lvl + 1]:
            for k, g in sc.items:
                if k == "group" and not self._alone(g):
                    if len(g.rvars) != 1 or ir.sizes[g.rvars[0]] % w:
                        return None
                    loop_var[id(self.group_scope[id(g)])] = g.rvars[0]
        inner = nest.vars[lvl:]
        if inner:
            if ir.sizes[inner[-1]] % w:
                return None
            loop_var.update((id(sc), inner[-1]) for sc in self.nest_scopes[lvl + 1:])
        return loop_var

    def _half_row(self, nest: Nest, ir: LoopIR) -> bool:
        """Every buffer ``nest`` loads or stores holds 16-bit floats."""
        bufs = self._accessed(nest)
        return bool(bufs) and all(ir.buffers[b].dtype in HALF for b in bufs)

    def _widest(self, nest: Nest, ir: LoopIR) -> int:
        """Bytes of the widest element ``nest`` loads or stores."""
        return max((ir.buffers[b].dtype.itemsize for b in self._accessed(nest)), default=0)

    def _plan_load_hints(self) -> None:
        """Block loops of vectors (a row too long for registers, read again by a later
        pass): a buffer of rows (its address varies with the row) that several of the row's
        thread loops read (the reductions' loops, then the loop after them) is read with L2
        priority ``L2_KEEP`` in all but the last of them and ``L2_LAST`` in that one
        (``accel::load_vec``), so that the row stays in L2 between its passes and leaves it
        after; the others (a layer norm's weight, read by every row, in one loop or several)
        keep the normal priority."""
        lvl = self.block_lvl
        rows = set(self.block_outer)
        loops = [[self.group_scope[id(g)]] for sc in self.nest_scopes[:lvl + 1]
                 for k, g in sc.items if k == "group"]
        loops.append(list(self.nest_scopes[lvl + 1:]))
        readers: Dict[int, list] = {}  # buffer -> the loops reading its rows, in order
        for i, scopes in enumerate(loops):
            for b in sorted({x.args[0] for sc in scopes for k, x in sc.items if k == "expr" and x.op == "load"
                             and any(v in rows for v, _ in x.args[1].terms)}):
                readers.setdefault(b, []).append(i)
        for b, ls in readers.items():
            for i in ls if len(ls) > 1 else ():
                for sc in loops[i]:
                    self.load_hints[(id(sc), b)] = "accel::L2_LAST" if i == ls[-1] else "accel::L2_KEEP"

    def _plan_load_cache(self, v: int, outer: Scope, inner) -> None:
        """Row kernels: an element the row's first loop loads (softmax's max, layer norm's
        sums) is kept in registers for the row's later loops (the sum of exponentials, the
        output; ``inner``, the loop over the row after the reductions, None where there is
        none), which read it there instead of loading it again."""
        n = self.ir.sizes[v]
        loops = [(self.group_scope[id(g)], g, g.rvars[0]) for k, g in outer.items
                 if k == "group" and len(g.rvars) == 1 and self.ir.sizes[g.rvars[0]] == n]
        if inner is not None:
            loops.append((inner, None, v))
        first: Dict[Expr, str] = {}  # a load, in the row loop's form -> its register array
        for scope, g, r in loops:
            for k, x in scope.items:
                if k != "expr" or x.op != "load" or (id(scope), x) in self.cached or (id(scope), x) in self.dead:
                    continue
                y = subst(x, r, v)
                if y in first:
                    self.cached[(id(scope), x)] = f"{first[y][0]}[j]"
                    first[y][1] = True
                elif g is not None:
                    first[y] = [f"c{self.ntemp}", False, g, x]
                    self.ntemp += 1
        for name, used, g, x in first.values():
            if used:
                self.row_cache.setdefault(id(g), []).append((x, name))

    def _addr(self, a, names=None) -> str:
        if not names:
            return super()._addr(a)
        terms = [f"{c} * {n}" if c != 1 else n for n, c in ((names.get(v, f"i{v}"), c) for v, c in a.terms)]
        if a.offset:
            terms.append(str(a.offset))
        return " + ".join(terms) if terms else "0"

    def _rhs(self, e: Expr, scope: Scope) -> str:
        if self.vec and e in self.vec:
            return f"accel::lane({self.vec[e]}, v)"
        if self.row_vec and e.op == "load" and e.args[0] in self.row_vec:
            # element j % vw of its vector, read whole into a register at its first lane:
            # one vector load (read through the pointer, nvcc narrowed it to a scalar load
            # per element: softmax f16 0.120 -> 0.093 ms, add+LayerNorm bf16 0.153 -> 0.136
            # on the H100 with the wider rows; float32 rows alike)
            m, sh, t, a = self.vw - 1, self.vw.bit_length() - 1, self._vec(e.args[0]), e.args[1]
            if self.elems is None:  # block loops: lane j is j elements on from the vector's first
                ptr = f"reinterpret_cast<const {t}*>(b{e.args[0]} + {self._addr(a)} - j)"
            else:
                r = next(v for v, c in a.terms if c == 1 and v in self.row_vars)
                ptr = f"reinterpret_cast<const {t}*>(b{e.args[0]} + {self._addr(a, {r: self._row_vec_first()})})"
            reg = self.row_regs.get((e.args[0], ptr))
            if reg is None:
                reg = self.row_regs[(e.args[0], ptr)] = f"rv{self.ntemp}"
                self.ntemp += 1
                self.row_decls.append(f"  {t} {reg}" + (f"[{self.elems // self.vw}];" if self.elems else ";"))
            if self.elems is None:  # block loops: the thread's current vector
                hint = self.load_hints.get((id(scope), e.args[0]))
                return f"accel::lane(accel::load_once{f'<{hint}>' if hint else ''}({reg}, {ptr}, j == 0), j)"
            return f"accel::lane(accel::load_once({reg}[j >> {sh}], {ptr}, (j & {m}) == 0), j & {m})"
        if e in self.merge_roots:  # pieces' reductions merged a thread at a time (cuda_merges)
            return self._merged(e, scope)
        return super()._rhs(e, scope)

    def _alone(self, g: Group) -> bool:
        """Block loops' reduction group ``g`` over at most :data:`ALONE_MAX` values, which
        each thread of the block reduces alone (the same values in every thread, no block
        reduction: its barriers and shuffles cost more than the few loads, which the
        block's threads share in cache). A group norm's backward over groups of 2
        channels: the per-group sums of the channels' sums, four block reductions a row
        before, and its loads of the channels' values scalar (:meth:`_block_loop_vars`:
        a loop over 2 values takes no vector of 4). The group's loads are of no vector
        buffer (no thread loop reads them: :meth:`_row_vector_buffers`), so the vector
        variant reduces it alike."""
        n = self._size(g.rvars)
        return (self.mode == "block" and self.elems is None and type(n) is int and n <= ALONE_MAX
                and g.members[0].args[0] != "online_softmax")

    def _narrow_moments(self, red: Expr, coop: bool) -> bool:
        """Block loops' mean and variance (``red``, a ``welford`` reduction) of float32 or
        16-bit values accumulated in float64, where a thread sums at most
        ``NARROW_MOMENTS_MAX`` of them: each thread's shifted sums in float32 (shifted by its
        first value: Chan, Golub & LeVeque's shifted data), widened to float64 for the
        block's merge (``accel::widen``). Eager's CUDA layer and group norms keep float32
        Welford sums throughout (``at::acc_type<float, true>``)."""
        body = red.args[1][0]
        return (coop and self.elems is None and red.dtype == torch.float64 and body.op == "cast"
                and body.args[0].dtype in (torch.float32, torch.float16, torch.bfloat16)
                and -(-self._size(red.args[2]) // self.threads) <= NARROW_MOMENTS_MAX)

    def _grid_fits(self, order, rsize) -> bool:
        """Grid mode: a full reduction (no loops outside it) of at least ``GRID_MIN``
        elements, one accumulator combined by a plain operator."""
        groups = [g for sc in self.nest_scopes for k, g in sc.items if k == "group"]
        if order or rsize < GRID_MIN or len(groups) != 1:
            return False
        kinds = {(e.args[0], e.args[1]) for e in groups[0].members}
        return len(kinds) == 1 and groups[0].members[0].args[0] in SIMPLE

    def _grid_reduction(self, rsize, out, vbufs=None):
        """A full reduction over many blocks: each block reduces a grid-strided share,
        writes its partial to a ``__device__`` array, and the last block to finish (a
        ticket counter; CUDA's threadFenceReduction sample) combines the partials in block
        order and runs what follows. The counter is reset by that block, so launches on one
        stream follow each other safely; the same region on two streams at once is not.
        ``vbufs``: the variant reading those buffers a 16-byte vector at a time
        (:meth:`_grid_loop`)."""
        self.mode = "grid"
        self.threads = ROW_THREADS
        self.row_vec = vbufs or frozenset()
        self.grid = self._grid(rsize, ROW_THREADS * 8, ROW_THREADS)
        self._emit_items(self.nest_scopes[0], out, "  ")
        out[0:0] = self.row_decls
        return out, self.grid, self.threads

    def _grid_loop(self, n, out: List[str], ind: str) -> str:
        """Open a full reduction's grid-strided loop over ``n`` elements (grid mode, blocks
        of ``ROW_THREADS``); return its iteration variable. Unrolled by ``GRID_UNROLL``
        so that a thread has that many loads in flight (one a thread at a time kept an
        H100's full reduction of 64M float32 values at 1.9 TB/s). In the vector variant
        (:attr:`row_vec`), vector ``q`` of the thread's and its lanes ``j`` unrolled, as
        block loops take them (two braces close it, else one)."""
        f, t = f"r{self.ntemp}", ROW_THREADS
        self.ntemp += 1
        if self.row_vec:
            out.append(f"{ind}#pragma unroll {GRID_UNROLL}")
            out.append(f"{ind}for ({self.ix} q = blockIdx.x * ({self.ix}){t} + threadIdx.x; q < {self._cdiv(n, self.vw)}; "
                       f"q += ({self.ix})gridDim.x * {t}) {{")
            out.append(f"{ind}  #pragma unroll")
            out.append(f"{ind}  for (int j = 0; j < {self.vw}; ++j) {{")
            out.append(f"{ind}    const {self.ix} {f} = q * {self.vw} + j;")
            return f
        out.append(f"{ind}#pragma unroll {GRID_UNROLL}")
        out.append(f"{ind}for ({self.ix} {f} = blockIdx.x * ({self.ix}){t} + threadIdx.x; {f} < {n}; "
                   f"{f} += ({self.ix})gridDim.x * {t}) {{")
        return f

    def _n_scalars(self, ir: LoopIR) -> int:
        """How many run-time scalars the kernels take (``accel_scalars<N>``)."""
        return len(ir.scalar_types)

    def _cdiv(self, n, k: int):
        """``ceil(n / k)``, for the source (a shape-generic renderer's may be C text)."""
        return -(-n // k)

    def _grid(self, n, per: int, cap: int = MAX_GRID):
        """Blocks for ``n`` iterations, ``per`` a block, at most ``cap`` (the kernels'
        loops stride over the grid, so any count is correct)."""
        return min(-(-n // per), cap)

    def _levels(self) -> List[int]:
        """The indices of the planned scopes that hold a reduction group."""
        return [j for j, sc in enumerate(self.nest_scopes) for k, _ in sc.items if k == "group"]

    def _tiles(self, order, n, lvl, out, ind, upto=None) -> None:
        """Thread mode: tiles of ILP * BLOCK iterations per block, each thread taking ILP of
        them a block apart (coalesced, and that many loads in flight per thread)."""
        upto = len(order) if upto is None else upto
        t, f = f"tile{self.ntemp}", f"f{self.ntemp}"
        self.ntemp += 1
        out.append(f"{ind}for ({self.ix} {t} = blockIdx.x; {t} < {self._cdiv(n, BLOCK * ILP)}; {t} += gridDim.x) {{")
        out.append(f"{ind}  #pragma unroll")
        out.append(f"{ind}  for (int u = 0; u < {ILP}; ++u) {{")
        out.append(f"{ind}    const {self.ix} {f} = {t} * {BLOCK * ILP} + u * {BLOCK} + threadIdx.x;")
        out.append(f"{ind}    if ({f} < {n}) {{")
        self._decompose(f, order[lvl:upto], out, ind + "      ")
        self.tile_vars = order[lvl:upto]
        for j in range(lvl, upto + 1):
            self._emit_items(self.nest_scopes[j], out, ind + "      ")
        self.tile_vars = ()
        if upto < len(order) and any(s.items for s in self.nest_scopes[upto + 1:]):
            self._inner_loop(order[upto:], upto, out, ind + "      ")
        out += [f"{ind}    }}", f"{ind}  }}", f"{ind}}}"]

    def _thread_loop(self, n: int, open_lines: List[str], ind: str) -> str:
        """Open a loop of this thread's share of ``n`` iterations (block mode: threadIdx.x,
        then a block apart, or vector ``q`` and its lanes ``j``; a row kernel's fully
        unrolled, iteration ``j``, so that its cached values stay in registers); return the
        iteration variable. Two braces close it."""
        f = f"f{self.ntemp}"
        self.ntemp += 1
        if self.elems is not None:
            open_lines.append(f"{ind}#pragma unroll")
            open_lines.append(f"{ind}for (int j = 0; j < {self.elems}; ++j) {{")
            if self.row_vec:  # the vector variant: element j % vw of the thread's (j / vw)th vector
                base = self._row_vec_first()
                open_lines.append(f"{ind}  const {self.ix} {f} = {base} + (j & {self.vw - 1});")
                guard = f"{base} < {n}"  # n % vw == 0: a vector's elements are in or out together
            else:
                open_lines.append(f"{ind}  const {self.ix} {f} = ({self.ix})threadIdx.x + j * {self.threads};")
                guard = f"{f} < {n}"
            # no guard where the threads' elements cover the row exactly: the unrolled lanes
            # of a vector then share its load (a guard per element keeps a load per element)
            open_lines.append(f"{ind}  if ({'true' if self.elems * self.threads == n else guard}) {{")
            return f
        # (a row split among blocks, _row_split: the block's share of the row, blocks apart)
        first = "threadIdx.x" if self.split == 1 else f"blockIdx.y * {self.threads} + threadIdx.x"
        step = self.threads * self.split
        if self.row_vec:  # vector q of the row, a block apart; its lanes j unrolled
            open_lines.append(f"{ind}#pragma unroll {BLOCK_VEC_UNROLL}")
            open_lines.append(f"{ind}for ({self.ix} q = {first}; q < {n // self.vw}; q += {step}) {{")
            open_lines.append(f"{ind}  #pragma unroll")
            open_lines.append(f"{ind}  for (int j = 0; j < {self.vw}; ++j) {{")
            open_lines.append(f"{ind}    const {self.ix} {f} = q * {self.vw} + j;")
            return f
        # the block's size as a constant: nvcc then unrolls the loop and puts BLOCK_UNROLL
        # loads in flight per thread, where the loop's trip count at runtime kept one
        open_lines.append(f"{ind}#pragma unroll {self.unroll}")
        open_lines.append(f"{ind}for ({self.ix} {f} = {first}; {f} < {n}; {f} += {step}) {{")
        open_lines.append(f"{ind}  {{")
        return f

    def _row_vec_first(self) -> str:
        """A row kernel's vector variant: the row index of the first element of the vector
        holding element ``j`` of the thread's share (the same expression for its lanes).
        In the kernel's (signed) index type: an unsigned ``threadIdx.x * 4`` may wrap, so
        nvcc computes each lane's address apart and keeps it; this way they are one base
        and constant offsets
        (residual add + LayerNorm [2048, 32768] float32, 32 values a thread: ptxas's spills
        140 -> 20 bytes a thread)."""
        return f"(({self.ix})threadIdx.x + (j >> {self.vw.bit_length() - 1}) * {self.threads}) * {self.vw}"

    def _decompose(self, flat: str, vars_, out: List[str], ind: str) -> None:
        """The loop variables ``i<v>`` of ``vars_`` (outermost first) from ``flat``, their
        flattened index (below the product of their lengths). Where every divisor is a
        static length, the divisions run in 32 bits while the index fits, as Triton's
        int32 indexing does (a 64-bit division by a constant takes several times the
        instructions: H100, ``torch.diff`` of [65536, 1024] float32, 229 -> see
        bench/README.md's eighty-seventh round); beyond 2**32 they take 64 bits."""
        sizes = [self.ir.sizes[v] for v in vars_]
        if len(vars_) < 2 or any(type(n) is not int for n in sizes[1:]):  # (a run-time divisor)
            out += [f"{ind}const {self.ix} i{v} = {e};" for v, e in self._divisions(flat, vars_, "")]
            return
        u = f"u{self.ntemp}"
        self.ntemp += 1
        short = [f"{ind}const uint32_t {u} = (uint32_t)({flat});"]
        if self.ix == "int" or all(type(n) is int for n in sizes) and math.prod(sizes) < 1 << 31:  # (and a tile past the end)
            out += short + [f"{ind}const {self.ix} i{v} = {e};" for v, e in self._divisions(u, vars_, "u")]
            return
        out.append(f"{ind}{self.ix} {', '.join(f'i{v}' for v in vars_)};")
        out.append(f"{ind}if ({flat} < 4294967296LL) {{")
        out += ["  " + x for x in short] + [f"{ind}  i{v} = {e};" for v, e in self._divisions(u, vars_, "u")]
        out.append(f"{ind}}} else {{")
        out += [f"{ind}  i{v} = {e};" for v, e in self._divisions(flat, vars_, "")]
        out.append(f"{ind}}}")

    def _divisions(self, flat: str, vars_, suffix: str) -> List[tuple]:
        """``(v, expression)`` of each of ``vars_`` from their flattened index ``flat``
        (``suffix`` on the lengths: ``u`` for 32-bit unsigned division)."""
        rest, exprs = flat, []
        for j, v in enumerate(reversed(vars_)):
            if j == len(vars_) - 1:
                exprs.append((v, rest))
            else:
                size = f"{self.ir.sizes[v]}{suffix}"
                exprs.append((v, f"{rest} % {size}"))
                rest = f"({rest} / {size})"
        return exprs

    def _block_loop(self, order, n, upto, out) -> None:
        """Block mode: blocks stride over the flattened loops ``order[:upto]`` (``n``
        iterations) and emit the scopes they bind; the loops after ``upto`` as the block's
        threads' loop."""
        f = f"f{self.ntemp}"
        self.ntemp += 1
        self.block_flat, self.block_rows = f, n  # (a row's partials and ticket: _row_split_finish)
        if self.rows == 1:
            out.append(f"  for ({self.ix} {f} = ({self.ix})blockIdx.x; {f} < {n}; {f} += ({self.ix})gridDim.x) {{")
        else:  # a row a warp: the warps of a block need not take as many rows
            out.append(f"  for ({self.ix} {f} = ({self.ix})blockIdx.x * {self.rows} + threadIdx.y; {f} < {n}; "
                       f"{f} += ({self.ix})gridDim.x * {self.rows}) {{")
        self._decompose(f, order[:upto], out, "    ")
        for j in range(upto + 1):
            self._emit_items(self.nest_scopes[j], out, "    ")
        if upto < len(order) and any(s.items for s in self.nest_scopes[upto + 1:]):
            self._inner_loop(order[upto:], upto, out, "    ")
        out.append("    __syncthreads();" if self.rows == 1 else "    __syncwarp();")
        out.append("  }")

    def _inner_loop(self, vars_, lvl, out, ind) -> None:
        """The loops ``vars_`` inside level ``lvl``: the block's threads' share of them
        (block mode) or all of them (a thread's own, thread mode)."""
        if self.mode == "block":
            f = self._thread_loop(self._size(vars_), out, ind)
            close = [f"{ind}  }}", f"{ind}}}"]
            ind2 = ind + "    "
        else:
            f = f"f{self.ntemp}"
            self.ntemp += 1
            out.append(f"{ind}for ({self.ix} {f} = 0; {f} < {self._size(vars_)}; ++{f}) {{")
            close, ind2 = [f"{ind}}}"], ind + "  "
        self._decompose(f, vars_, out, ind2)
        saved, self.mode = self.mode, "thread"  # every thread its own elements now
        for j in range(lvl + 1, len(self.nest_scopes)):
            self._emit_items(self.nest_scopes[j], out, ind2)
        self.mode = saved
        out += close

    def _store(self, st, scope: Scope) -> str:
        """As the C++ backend's, but a vector tile's store goes to its lane of the vector,
        and in block, grid and column modes a store outside the threads' own loops is
        written by one thread (of the block, or of the column)."""
        if self.vec is not None and (st.buf, st.addr) in self.vec_stores:
            return f"{self.vec_stores[st.buf, st.addr]} = {self._name(st.value, scope)};"
        if self.row_vec and st.buf in self.row_vec:  # the vector is written with its last element
            m, w = self.vw - 1, self.row_vec_regs[st.buf, st.addr]
            return (f"accel::lane_ref({w}, j & {m}) = {self._name(st.value, scope)}; "
                    f"if ((j & {m}) == {m}) *reinterpret_cast<{self._vec(st.buf)}*>(b{st.buf} + "
                    f"{self._addr(st.addr)} - {m}) = {w};")
        guard = {"block": "if (threadIdx.x == 0) ", "grid": "if (threadIdx.x == 0) ",
                 "col": "if (threadIdx.y == 0) "}.get(self.mode, "")
        if self.tile_vars and self.mode == "thread":
            # a thread a tile's element: a store that depends on fewer of the loops (a group
            # norm's mean and rstd outputs beside its [N, C, H, W] output) by the threads at 0
            # of the others alone, not once per element of them
            own = free_vars(st.value) | {v for v, _ in st.addr.terms}
            inner = [f"i{v} == 0" for v in self.tile_vars if v not in own]
            guard = f"if ({' && '.join(inner)}) " if inner else ""
        return guard + super()._store(st, scope)

    def _emit_group(self, g: Group, scope: Scope, out: List[str], ind: str) -> None:
        inner = self.group_scope[id(g)]
        rv, first = list(g.rvars), g.members[0]
        kind = first.args[0]
        grid = self.mode == "grid"
        coop = self.mode in ("block", "grid") and not self._alone(g)
        col = self.mode == "col"
        tag = f"a{self.ntemp}"
        self.ntemp += 1
        body: List[str] = []
        saved, self.mode = self.mode, "thread"  # inside the reduction's loop
        self._emit_items(inner, body, "")
        self.mode = saved
        finish: List[str] = []
        if kind in SIMPLE:
            accs = self._accumulators(g, tag)
            for (k, bodies), (a, init, e) in accs.items():
                t = self.ctype(e.dtype)
                out.append(f"{ind}{t} {a} = {init};")
                body.append(SIMPLE[k][1].format(a=a, x=self._name(bodies[0], inner)))
                if grid:
                    part, count = f"{self.kname}_part", f"{self.kname}_count"
                    self.globals += [f"__device__ {t} {part}[{ROW_THREADS}];",  # (the most blocks)
                                     f"__device__ unsigned int {count} = 0;"]
                    finish.append(f"if (!accel::grid_reduce({a}, {COMBINE[k]}, {t}({init}), "
                                  f"{part}, &{count}, smem)) return;")
                elif coop and not self._merge_partial([m for m in g.members if m.args[:2] == (k, bodies)], a):
                    finish.append(f"{a} = accel::block_reduce({a}, {COMBINE[k]}, smem);")
                elif col:
                    finish.append(f"{a} = accel::col_reduce({a}, {COMBINE[k]});")
            if coop and not grid:
                self._row_split_finish([(a, self.ctype(e.dtype), COMBINE[k]) for (k, _), (a, _, e)
                                        in accs.items()], finish)
            if col:  # the rows split among blocks: partials, a ticket
                self._col_split_finish([(a, self.ctype(e.dtype), COMBINE[k]) for (k, _), (a, _, e)
                                        in accs.items()], finish)
            for e in g.members:
                scope.names[e] = accs[(e.args[0], e.args[1])][0]
        elif kind in ARG:
            init, better = ARG[kind]
            vt = first.args[1][0].dtype
            av, ai = f"{tag}_v", f"{tag}_i"
            out.append(f"{ind}{self.ctype(vt)} {av} = {self._lim(init, vt)};")
            out.append(f"{ind}int64_t {ai} = INT64_MAX;  // none yet: the first element is taken")
            x, i = (self._name(b, inner) for b in first.args[1])
            body.append(f"if ({ai} == INT64_MAX || {better}({x}, {av})) {{ {av} = {x}; {ai} = {i}; }}")
            is_max = str(kind == "argmax").lower()
            if coop:
                finish.append(f"accel::block_arg<{self.ctype(vt)}, {is_max}>({av}, {ai}, smem);")
                if self.split > 1:
                    pair, comb = f"accel::ArgPair<{self.ctype(vt)}>", f"accel::ArgCombine<{is_max}>()"
                    finish.append(f"{pair} {tag}_p{{{av}, {ai}}};")
                    self._row_split_finish([(f"{tag}_p", pair, comb)], finish)
                    finish.append(f"{av} = {tag}_p.v; {ai} = {tag}_p.i;")
            elif col:  # the rows of threads combined, first index on a tie
                pair, comb = f"accel::ArgPair<{self.ctype(vt)}>", f"accel::ArgCombine<{is_max}>()"
                finish.append(f"{pair} {tag}_p = accel::col_reduce({pair}{{{av}, {ai}}}, {comb});")
                self._col_split_finish([(f"{tag}_p", pair, comb)], finish)
                finish.append(f"{av} = {tag}_p.v; {ai} = {tag}_p.i;")
            finish.append(f"if ({ai} == INT64_MAX) {ai} = 0;")
            for e in g.members:
                scope.names[e] = av if e.args[3] == 0 else ai
        elif kind == "welford":  # shifted sums per thread (accel::ShiftedMoments)
            t = self.ctype(first.dtype)
            x = self._name(first.args[1][0], inner)
            narrow = self._narrow_moments(first, coop)  # float32 sums a thread, widened to merge
            out.append(f"{ind}accel::ShiftedMoments<{'float' if narrow else t}> {tag}_a;")
            body.append(f"{tag}_a.add({f'static_cast<float>({x})' if narrow else x});")
            if coop:  # moved to one shift and summed: no division per thread
                a = f"accel::widen<{t}>({tag}_a)" if narrow else f"{tag}_a"
                finish.append(f"{'' if self.split > 1 else 'const '}accel::Moments<{t}> {tag} = "
                              f"accel::block_moments({a}, smem);")
                self._row_split_finish([(tag, f"accel::Moments<{t}>", "accel::MergeMoments()")], finish)
            elif col:
                finish.append(f"accel::Moments<{t}> {tag} = "
                              f"accel::col_reduce({tag}_a.moments(), accel::MergeMoments());")
                self._col_split_finish([(tag, f"accel::Moments<{t}>", "accel::MergeMoments()")], finish)
            else:
                finish.append(f"const accel::Moments<{t}> {tag} = {tag}_a.moments();")
            finish.append(f"const {t} {tag}_mean = {tag}.n > {t}(0) ? {tag}.mean : {t}(NAN);")
            for e in g.members:
                scope.names[e] = f"{tag}.m2" if e.args[3] == 0 else f"{tag}_mean"
        elif kind == "online_softmax" and (col or coop):  # one pass (_plan_online)
            st = f"accel::SoftmaxState<{self.ctype(first.dtype)}>"
            out.append(f"{ind}{st} {tag}{{-INFINITY, 0}};")
            body.append(f"{tag}.add({self._name(first.args[1][0], inner)});")
            if col:
                finish.append(f"{tag} = accel::col_reduce({tag}, accel::MergeSoftmax());")
                self._col_split_finish([(tag, st, "accel::MergeSoftmax()")], finish)
            else:
                finish.append(f"{tag} = accel::block_reduce({tag}, accel::MergeSoftmax(), smem);")
                self._row_split_finish([(tag, st, "accel::MergeSoftmax()")], finish)
            for e in g.members:
                scope.names[e] = f"{tag}.m" if e.args[3] == 0 else f"{tag}.s"
        else:  # online_softmax is two passes elsewhere (CppRenderer._plan)
            raise CodegenError(f"no CUDA rendering for reduction {kind}")
        n = self._size(rv)
        cache = self.row_cache.get(id(g), ())
        for x, name in cache:
            out.append(f"{ind}{self.ctype(x.dtype)} {name}[{self.elems}];")
        body += [f"{name}[j] = {inner.names[x]};" for x, name in cache]
        if grid:
            f = self._grid_loop(n, out, ind)
            close = [f"{ind}  }}", f"{ind}}}"] if self.row_vec else [f"{ind}}}"]
            ind2 = ind + "    " if self.row_vec else ind + "  "
        elif coop:
            f = self._thread_loop(n, out, ind)
            close, ind2 = [f"{ind}  }}", f"{ind}}}"], ind + "    "
        else:
            f = f"r{self.ntemp}"
            self.ntemp += 1
            if col:
                out += self._col_loop(f, n, ind)
            else:
                out.append(f"{ind}for ({self.ix} {f} = 0; {f} < {n}; {f} += 1) {{")
            close, ind2 = [f"{ind}}}"], ind + "  "
        self._decompose(f, rv, out, ind2)
        out += [f"{ind2}{b}" for b in body]
        out += close
        out += [f"{ind}{x}" for x in finish]
