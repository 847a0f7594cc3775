"""C++/OpenMP backend: one ``extern "C"`` entry point per region, a loop nest per IR nest.

Outer iterations run across OpenMP threads; the innermost loop is ``#pragma omp simd`` so
gcc vectorizes it, calling libmvec's vector math (see ``include/accel/cpu_math.h``).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..lowering import Addr, Expr, LoopIR, Nest
from . import CodegenError, CStyle, coalesce

#: nests with fewer elements run on one thread (fork/join costs more than the work).
PARALLEL_MIN = 32768
#: elements per OpenMP work item in a one-dimensional nest.
CHUNK = 4096


class CppRenderer(CStyle):
    """Renders a :class:`LoopIR` as a C++ translation unit for gcc/clang with OpenMP."""

    prefix = '#include "accel/cpu_math.h"\n'

    def render(self, ir: LoopIR, name: str) -> str:
        lines = [self.prefix, f'extern "C" int {name}(void* const* bufs, const accel_scalar_t* s) {{']
        written = {st.buf for nest in ir.nests for st in nest.stores}
        for i, b in enumerate(ir.buffers):
            q = "" if i in written else "const "
            r = " __restrict__" if b.output else ""
            t = self.ctype(b.dtype)
            lines.append(f"  {q}{t}*{r} b{i} = ({q}{t}*)bufs[{i}];")
        self.scalar_decls: Dict[tuple, str] = {}
        body: List[str] = []
        for nest in ir.nests:
            body += self.render_nest(nest, ir)
        for (k, dtype), var in self.scalar_decls.items():
            field = "f" if ir.scalar_types[k] == "f" else "i"
            src = torch.float64 if field == "f" else torch.int64
            lines.append(f"  const {self.ctype(dtype)} {var} = {self.cast(f's[{k}].{field}', src, dtype)};")
        lines += body
        lines += ["  return ACCEL_OK;", "}", ""]
        return "\n".join(lines)

    def render_nest(self, nest: Nest, ir: LoopIR) -> List[str]:
        # collect every access (load and store) to coalesce dims consistently
        exprs: List[Expr] = []
        seen = set()

        def visit(e: Expr):
            if e in seen:
                return
            seen.add(e)
            for a in e.args:
                if isinstance(a, Expr):
                    visit(a)
            exprs.append(e)

        for st in nest.stores:
            visit(st.value)
        addrs = [e.args[1] for e in exprs if e.op == "load"] + [st.addr for st in nest.stores]
        uniq = list(dict.fromkeys(a.coeffs for a in addrs))
        shape, new = coalesce(nest.shape, uniq) if nest.shape else ((), uniq)
        remap = dict(zip(uniq, new))
        numel = 1
        for s in nest.shape:
            numel *= s
        if numel == 0:
            return []
        nd = len(shape)
        out: List[str] = ["  {"]
        ind = "    "
        if nd == 0:
            idx = []
        elif nd == 1:
            n = shape[0]
            chunks = -(-n // CHUNK)
            if numel >= PARALLEL_MIN:
                out.append(f"{ind}#pragma omp parallel for schedule(static)")
            out.append(f"{ind}for (int64_t c = 0; c < {chunks}; ++c) {{")
            out.append(f"{ind}  const int64_t lo = c * {CHUNK}, hi = lo + {CHUNK} < {n} ? lo + {CHUNK} : {n};")
            out.append(f"{ind}  #pragma omp simd")
            out.append(f"{ind}  for (int64_t i0 = lo; i0 < hi; ++i0) {{")
            ind += "    "
            idx = ["i0"]
        else:
            outer = 1
            for s in shape[:-1]:
                outer *= s
            if numel >= PARALLEL_MIN and outer > 1:
                out.append(f"{ind}#pragma omp parallel for schedule(static)")
            out.append(f"{ind}for (int64_t o = 0; o < {outer}; ++o) {{")
            out.append(f"{ind}  int64_t r = o;")
            for d in range(nd - 2, -1, -1):
                if d == 0:
                    out.append(f"{ind}  const int64_t i0 = r;")
                else:
                    out.append(f"{ind}  const int64_t i{d} = r % {shape[d]}; r /= {shape[d]};")
            out.append(f"{ind}  #pragma omp simd")
            out.append(f"{ind}  for (int64_t i{nd-1} = 0; i{nd-1} < {shape[-1]}; ++i{nd-1}) {{")
            ind += "    "
            idx = [f"i{d}" for d in range(nd)]

        def addr(a: Addr) -> str:
            cs = remap[a.coeffs]
            terms = [f"{c} * {v}" if c != 1 else v for c, v in zip(cs, idx) if c != 0]
            return " + ".join(terms) if terms else "0"

        names: Dict[Expr, str] = {}
        for k, e in enumerate(exprs):
            if e.op == "const":
                names[e] = self.const(e.args[0], e.dtype)
                continue
            if e.op == "scalar":
                names[e] = self.scalar_decls.setdefault((e.args[0], e.dtype), f"s{e.args[0]}_{len(self.scalar_decls)}")
                continue
            if e.op == "load":
                rhs = f"b{e.args[0]}[{addr(e.args[1])}]"
            elif e.op == "cast":
                a = e.args[0]
                rhs = self.cast(names[a], a.dtype, e.dtype)
            else:
                rhs = self.op(e, [names[a] if isinstance(a, Expr) else repr(a) for a in e.args])
            v = f"t{k}"
            out.append(f"{ind}const {self.ctype(e.dtype)} {v} = {rhs};")
            names[e] = v
        for st in nest.stores:
            out.append(f"{ind}b{st.buf}[{addr(st.addr)}] = {names[st.value]};")
        if nd >= 1:
            out.append(f"{ind[:-2]}}}")
            out.append(f"{ind[:-4]}}}")
        out.append("  }")
        return out
