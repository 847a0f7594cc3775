"""Vector loads and stores on a GPU: which buffers a kernel moves 16 bytes at a time
(``float4``/``int4``, 8 halves), and the elementwise tiles that do. A part of
:class:`accel.codegen.cuda.CudaRenderer` (the mixin :class:`VectorLoads`): its
``render`` renders each nest twice where :meth:`VectorLoads._vector_width` finds buffers,
the launch plan taking the vector variant where they are all aligned (and
:meth:`VectorLoads._vector_condition` holds), the scalar one otherwise.
"""
from __future__ import annotations

from ..loop_ir import Addr, LoopIR, Nest, free_vars
from ..ops import HALF
from .cuda_shapes import BLOCK, VEC, VEC16, VEC_ILP, VEC_TYPES, WEAVE_MAX


class VectorLoads:
    """The vector variant of a nest: its buffers (:attr:`vw` elements a vector) and, for an
    elementwise nest, its tiles. Row kernels read :attr:`row_vec` in ``_rhs`` and
    ``_thread_loop``."""

    vw = VEC  # elements a vector
    row_vec = frozenset()  # a row kernel's vector variant: the buffers moved as vectors

    def _vector_width(self, nest: Nest, ir: LoopIR) -> frozenset:
        """The buffers ``nest``'s vector variant moves (see :meth:`_vector_buffers`), and its
        width in :attr:`vw`: 16 bytes of 16-bit floats (8) where every such buffer holds
        them and the same buffers qualify at that width; else 4."""
        self.vw = VEC
        vbufs = self._vector_buffers(nest, ir)
        if vbufs and all(ir.buffers[b].dtype in HALF for b in vbufs):
            self.vw = VEC16
            if self._vector_buffers(nest, ir) != vbufs:
                self.vw = VEC
        return vbufs

    def _vector_condition(self, nest: Nest, ir: LoopIR) -> dict:
        """What else a launch of ``nest``'s vector variant requires, beside its buffers'
        alignment (a shape-generic kernel's: a run-time length's multiple)."""
        return {}

    def _vector_buffers(self, nest: Nest, ir: LoopIR) -> frozenset:
        """Buffers an elementwise nest moves as vectors of :attr:`vw` elements
        (:data:`VEC_TYPES`): those with an access :meth:`_aligned` along the innermost loop
        (its size a multiple of ``vw``). Each such access is one aligned vector a thread;
        the buffer's other loads stay scalar (a slice at an odd offset, a load that does not
        vary along the loop), as do a buffer's stores where one is not aligned, and a store
        of one value along the loop (:meth:`_broadcast_store`).
        Empty where any access strays from that: a reduction, another stride along the
        innermost loop, another store that does not run contiguously along it (but for
        :meth:`_interleaved` ones, a buffer's vectors whole), a buffer both read and written
        at different addresses (another thread's elements)."""
        self._plan(nest, ir)
        if any(k == "group" for sc in self.nest_scopes for k, _ in sc.items):
            return self._row_vector_buffers(nest, ir)
        if not nest.vars:
            return frozenset()
        inner = nest.vars[-1]
        woven = self._interleaved(nest, inner, ir)
        if ir.sizes[inner] % self.vw or any(st.addr.coeff(inner) != 1 and st.buf not in woven
                                            and not self._broadcast_store(st, inner) for st in nest.stores):
            return frozenset()
        loads = [x for sc in self.nest_scopes for k, x in sc.items if k == "expr" and x.op == "load"]
        stored, loaded = {}, {x.args[0] for x in loads}
        for st in nest.stores:
            stored.setdefault(st.buf, set()).add(st.addr)
        vbufs = set(woven) - loaded
        for buf, addr in [(x.args[0], x.args[1]) for x in loads] + [(st.buf, st.addr) for st in nest.stores]:
            if buf in woven and buf not in loaded:
                continue
            if addr.coeff(inner) not in (0, 1) or buf in loaded and stored.get(buf, {addr}) != {addr}:
                return frozenset()
            if self._aligned(buf, addr, inner, ir):
                vbufs.add(buf)
        return frozenset(vbufs - {b for b, addrs in stored.items() if b not in woven
                                  and not all(self._aligned(b, a, inner, ir) for a in addrs)})

    def _interleaved(self, nest: Nest, inner: int, ir: LoopIR) -> dict:
        """Buffers whose stores interleave ``c`` values along loop ``inner`` (``torch.stack``
        along the last dim, ``view_as_complex``'s pairs): ``c`` stores (2 to
        :data:`WEAVE_MAX`) at ``c`` times the nest's flat index plus offsets ``o`` to
        ``o + c - 1`` (a contiguous output), ``o`` a multiple of :attr:`vw`. A vector tile's
        ``vw`` lanes of them fill ``c`` aligned vectors, which a warp writes whole through
        shared memory (:meth:`_weave_stores`). Buffer -> ``(c, the address at o)``."""
        addrs: dict = {}
        for st in nest.stores:
            addrs.setdefault(st.buf, set()).add(st.addr)
        strides, step = {}, 1  # each loop's stride in the nest's flat index
        for v in reversed(nest.vars):
            strides[v] = step
            step = step * ir.sizes[v] if type(step) is int and type(ir.sizes[v]) is int else None
        out = {}
        for buf, group in addrs.items():
            base = min(group, key=lambda a: a.offset)
            c = base.coeff(inner)
            if (2 <= c <= WEAVE_MAX and len(group) == c and ir.buffers[buf].dtype in VEC_TYPES
                    and {(a.terms, a.offset - base.offset) for a in group} == {(base.terms, k) for k in range(c)}
                    and base.offset % self.vw == 0 and all(strides.get(v) is not None and k == c * strides[v]
                                                           for v, k in base.terms)
                    and len(base.terms) == len(nest.vars)):
                out[buf] = (c, base)
        return out

    @staticmethod
    def _broadcast_store(st, inner: int) -> bool:
        """Whether store ``st`` writes one value along loop ``inner`` (a group norm's mean
        and rstd beside its output): a scalar store, by the lane at ``inner`` = 0 alone
        (the tiles' guards: ``CudaRenderer._store``)."""
        return st.addr.coeff(inner) == 0 and inner not in free_vars(st.value)

    def _aligned(self, buf: int, addr, inner: int, ir: LoopIR) -> bool:
        """Whether ``addr`` into ``buf`` reads (or writes) one aligned vector of :attr:`vw`
        elements a thread: contiguous along ``inner``, every other stride and the offset
        multiples of ``vw`` (the buffer's own address checked at launch)."""
        return addr.coeff(inner) == 1 and addr.offset % self.vw == 0 and ir.buffers[buf].dtype in VEC_TYPES \
            and all(c % self.vw == 0 for v, c in addr.terms if v != inner)

    def _row_vector_buffers(self, nest: Nest, ir: LoopIR) -> frozenset:
        """Buffers a row kernel (as just rendered: :attr:`elems` set) can move as vectors of
        :attr:`vw`, each thread taking that many neighbouring elements of the row at a time:
        :data:`VEC_TYPES` buffers read only in the row's loops, contiguously along each (a loop per
        reduction over the whole row, and the loop over the row), or written only in the
        loop over the row, contiguously; every other stride a multiple of ``vw``. Empty where
        the row's length is not a multiple of ``vw`` or a reduction runs over another domain.
        Block loops (:meth:`_block_loop_vars`) take the same rule, each loop along its own
        variable, and a full reduction over many blocks (grid mode) along its last
        variable."""
        w = self.vw
        if self.mode == "grid":  # a full reduction: its loop over vectors (_grid_loop)
            g = next(g for sc in self.nest_scopes for k, g in sc.items if k == "group")
            if any(type(ir.sizes[r]) is not int for r in g.rvars) or ir.sizes[g.rvars[-1]] % w:
                return frozenset()
            loop_var = {id(self.group_scope[id(g)]): g.rvars[-1]}
        elif self.mode != "block":
            return frozenset()
        elif self.elems is None:  # block loops
            loop_var = self._block_loop_vars(nest, ir)
            if loop_var is None:
                return frozenset()
        else:
            v, outer, inner = self._row(nest.vars[self.block_lvl:], self.block_lvl)
            n = ir.sizes[v]
            if n % w or -(-self.elems // w) * w > self.row_limit:
                return frozenset()
            loop_var = {id(inner): v} if inner is not None else {}
            for k, g in outer.items:
                if k == "group":
                    if len(g.rvars) != 1 or ir.sizes[g.rvars[0]] != n:
                        return frozenset()
                    loop_var[id(self.group_scope[id(g)])] = g.rvars[0]
        scopes = list(self.nest_scopes) + list(self.group_scope.values())
        ok, bad = set(), set()

        def access(buf, addr, scope):
            r = loop_var.get(id(scope))
            if r is not None and addr.coeff(r) == 1 and ir.buffers[buf].dtype in VEC_TYPES \
                    and addr.offset % w == 0 and all(c % w == 0 for u, c in addr.terms if u != r):
                ok.add(buf)
            else:
                bad.add(buf)
        loaded = set()
        for sc in scopes:
            for k, x in sc.items:
                if k == "expr" and x.op == "load":
                    access(x.args[0], x.args[1], sc)
                    loaded.add(x.args[0])
                elif k == "store":
                    access(x.buf, x.addr, sc)
        bad |= loaded & {st.buf for st in nest.stores}  # read and written: scalar
        return frozenset(ok - bad)

    def _vector_tiles(self, order, n, nest, vbufs, out) -> None:
        """Elementwise, 4 consecutive elements per thread and ``VEC_ILP`` such groups a
        block apart: each vector buffer read once as a float4/int4 before the unrolled
        loop over the 4 and written once after it."""
        inner = order[-1]
        t, f = f"tile{self.ntemp}", f"f{self.ntemp}"
        self.ntemp += 1
        per = BLOCK * self.vw * VEC_ILP
        out.append(f"  for ({self.ix} {t} = blockIdx.x; {t} < {self._cdiv(n, per)}; {t} += gridDim.x) {{")
        out.append("    #pragma unroll")
        out.append(f"    for (int u = 0; u < {VEC_ILP}; ++u) {{")
        out.append(f"      const {self.ix} {f} = ({t} * {BLOCK * VEC_ILP} + u * {BLOCK} + threadIdx.x) * {self.vw};")
        woven = {b: cw for b, cw in self._interleaved(nest, inner, self.ir).items() if b in vbufs}
        weave = {}  # buffer -> the array of its c vectors (declared before the guard: the warp stages them)
        for buf, (c, addr) in woven.items():
            weave[buf] = f"w{self.ntemp}"
            self.ntemp += 1
            out.append(f"      {self._vec(buf)} {weave[buf]}[{c}];")
        out.append(f"      if ({f} < {n}) {{")
        ind = "        "
        self._decompose(f, order, out, ind)
        base = {inner: f"ib{inner}"}
        out.append(f"{ind}const {self.ix} ib{inner} = i{inner};")
        self.vec = {}
        seen = {}
        for sc in self.nest_scopes:
            for k, x in sc.items:
                if k == "expr" and x.op == "load" and x.args[0] in vbufs and self._aligned(*x.args, inner, self.ir):
                    key = (x.args[0], x.args[1])
                    if key not in seen:
                        seen[key] = f"v{self.ntemp}"
                        self.ntemp += 1
                        t4 = self._vec(x.args[0])
                        out.append(f"{ind}const {t4} {seen[key]} = *reinterpret_cast<const {t4}*>"
                                   f"(b{x.args[0]} + {self._addr(x.args[1], base)});")
                    self.vec[x] = seen[key]
        stores, writes = {}, []  # (buffer, address) -> lane v's lvalue; the vectors written after
        for buf, (c, addr) in woven.items():  # value k of lane v: element v * c + k of the c vectors
            for k in range(c):
                e = f"v * {c} + {k}"
                stores[buf, Addr(addr.terms, addr.offset + k)] = \
                    f"accel::lane_ref({weave[buf]}[({e}) / {self.vw}], ({e}) % {self.vw})"
        for st in nest.stores:
            if st.buf in vbufs and (st.buf, st.addr) not in stores:
                w = f"w{self.ntemp}"
                self.ntemp += 1
                out.append(f"{ind}{self._vec(st.buf)} {w};")
                stores[st.buf, st.addr] = f"accel::lane_ref({w}, v)"
                writes.append((st.buf, st.addr, w))
        self.vec_stores = stores
        out.append(f"{ind}#pragma unroll")
        out.append(f"{ind}for (int v = 0; v < {self.vw}; ++v) {{")
        out.append(f"{ind}  const {self.ix} i{inner} = ib{inner} + v;")
        self.tile_vars = tuple(order)  # (a store along fewer loops: by the lanes at their 0s)
        for sc in self.nest_scopes:
            self._emit_items(sc, out, ind + "  ")
        self.tile_vars = ()
        out.append(f"{ind}}}")
        for buf, addr, w in writes:
            out.append(f"{ind}*reinterpret_cast<{self._vec(buf)}*>(b{buf} + {self._addr(addr, base)}) = {w};")
        out.append("      }")
        for buf, (c, addr) in woven.items():
            self._weave_stores(buf, c, addr.offset, weave[buf], f, n, out)
        out += ["    }", "  }"]
        self.vec, self.vec_stores = None, {}

    def _weave_stores(self, buf: int, c: int, offset: int, w: str, f: str, n, out) -> None:
        """Write a warp's ``c`` vectors a thread of interleaved values (:meth:`_interleaved`)
        into ``buf``: staged in shared memory (thread ``t``'s at ``t * c``), then read back
        in order and written as ``c`` coalesced rows of the warp's 32 vectors, where each
        thread's own ``c`` vectors ``c * 16`` bytes apart took a store each (stack3 of 64M
        float32 on the H100: 767 us, one scalar store a value 489, Triton's 361). ``f``: the
        thread's first element (a multiple of :attr:`vw`) of the nest's ``n``; every lane of
        the warp runs this (outside the tile's guard), a vector written where its thread's
        elements are in the nest."""
        t = self._vec(buf)
        s = f"stage{self.ntemp}"
        self.ntemp += 1
        out += [f"      __shared__ {t} {s}[{BLOCK * c}];  // {32 * c} vectors a warp",
                f"      {{",
                f"        {t}* const sw = {s} + (threadIdx.x & ~31u) * {c};",
                f"        #pragma unroll",
                f"        for (int m = 0; m < {c}; ++m) sw[(threadIdx.x & 31u) * {c} + m] = {w}[m];",
                f"        __syncwarp();",
                f"        const {self.ix} f0 = {f} - ({self.ix})(threadIdx.x & 31u) * {self.vw};  // the warp's first",
                f"        #pragma unroll",
                f"        for (int m = 0; m < {c}; ++m) {{",
                f"          const int q = m * 32 + (int)(threadIdx.x & 31u);",
                f"          if (f0 + (q / {c}) * {self.vw} < {n})",
                f"            *reinterpret_cast<{t}*>(b{buf} + {f'{offset} + ' if offset else ''}{c} * f0 + q * {self.vw}) = sw[q];",
                f"        }}",
                f"        __syncwarp();",
                f"      }}"]

    def _vec(self, buf: int) -> str:
        """The C++ type of a vector of :attr:`vw` elements of buffer ``buf``."""
        return f"accel::vec_t<{self.ctype(self.ir.buffers[buf].dtype)}, {self.vw}>"
