"""Column reductions on the CPU: a reduction over a strided dim whose results vary along the
contiguous innermost loop (column sums, a softmax over dim 0, batch norm's statistics of
[N, C]) accumulates a vector of a block's columns over the rows, with unit-stride vector
loads, instead of walking each column down its rows. A part of
:class:`accel.codegen.cpp.CppRenderer` (the mixin :class:`ColumnLoops`).
"""
from __future__ import annotations

from typing import Dict, List

from . import machine_threads
from .scopes import ARG, SIMPLE, Group, Scope

#: results per block of a reduction over a strided dimension (a column sum): as few blocks
#: as give every thread the same number, each at most VBLOCK_MAX results, a multiple of
#: VBLOCK. Wider blocks read longer runs of each row: float32 column sums on the 2-core dev
#: VM, caches cold, ms with 256 columns a block / one block a thread: [2048, 4096] 2.8 /
#: 1.5 (eager 1.3-1.5), [2048, 3000] 1.6 / 0.85, [8192, 1024] 2.4 / 2.0 (blocks of 128:
#: 3.0). Each thread's accumulators (VBLOCK_MAX doubles each: 16 KiB) stay in L1.
VBLOCK = 32
VBLOCK_MAX = 2048
#: rows a step of a column reduction's innermost loop (:meth:`ColumnLoops._vertical_group`).
VROWS = 4
#: the pairwise form of a plain reduction's operator (SIMPLE's clause)
_PAIR = {"+": "({} + {})", "*": "({} * {})", "accel_max": "accel::maximum({}, {})",
         "accel_min": "accel::minimum({}, {})"}


def _pairwise(xs: List[str], pair: str) -> str:
    """``xs`` combined by ``pair`` as a balanced tree, neighbours first."""
    while len(xs) > 1:
        xs = [pair.format(*xs[i:i + 2]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def vertical_block(n: int, threads: int) -> int:
    """Results per block of a column reduction over ``n`` results on ``threads`` threads
    (see :data:`VBLOCK_MAX`)."""
    per = -(-n // (threads * VBLOCK_MAX))  # blocks per thread
    vb = -(-n // (threads * per))
    return min(VBLOCK_MAX, max(VBLOCK, -(-vb // VBLOCK) * VBLOCK))


class ColumnLoops:
    """:class:`accel.codegen.cpp.CppRenderer`'s column nests (its ``_emit_loop`` calls
    :meth:`_vertical` and :meth:`_emit_vertical` for a nest's innermost loop)."""

    def _vertical(self, v: int, scope: Scope) -> bool:
        """Reductions over a strided dimension whose results vary along the contiguous
        innermost loop ``v`` (column sums; a column softmax's max, then its sum of
        exponentials; a column mean and variance): worth accumulating a vector of ``v``
        values. Each is a plain reduction, a Welford one or an arg one; every load is contiguous along
        ``v`` or the same for all of it (LayerNorm backward's per-row mean and rstd in its
        weight gradient), and one strides along the reduction."""
        groups = [x for k, x in scope.items if k == "group"]
        strided = False
        for g in groups:
            if not g.rvars or not (g.category == "simple" or g.members[0].args[0] in ("welford", *ARG)):
                return False
            last = g.rvars[-1]
            loads = [x.args[1] for k, x in self.group_scope[id(g)].items if k == "expr" and x.op == "load"]
            if not all(a.coeff(v) in (0, 1) for a in loads):
                return False
            strided |= any(a.coeff(v) == 1 and abs(a.coeff(last)) > 1 for a in loads)
        return strided

    def _emit_vertical(self, v: int, scope: Scope, out: List[str], ind: str, parallel: bool) -> None:
        """Loop ``v`` in blocks of up to :data:`VBLOCK_MAX` results: for each reduction group
        in turn, the block accumulates a vector of results over the group's loops
        (unit-stride, vectorized loads; a later group reads an earlier one's results), then
        finishes the block."""
        n = self.ir.sizes[v]
        vb = vertical_block(n, machine_threads() if parallel else 1)
        b = f"v{self.ntemp}"
        self.ntemp += 1
        if parallel:
            out.append(f"{ind}#pragma omp parallel for schedule(static)")
        out.append(f"{ind}for (int64_t {b} = 0; {b} < {n}; {b} += {vb}) {{")
        ind2 = ind + "  "
        out.append(f"{ind2}const int64_t {b}_n = {n} - {b} < {vb} ? {n} - {b} : {vb};")
        before = Scope(scope.bound, scope.parent)  # the values before the group at hand
        before.names = scope.names
        for kind, x in scope.items:
            if kind == "group":
                self._vertical_group(x, before, b, v, vb, out, ind2)
            else:
                before.items.append((kind, x))
        tail: List[str] = []
        self._emit_items(before, tail, "")
        self._vector_loop(b, v, tail, out, ind2)
        out.append(f"{ind}}}")

    def _vertical_group(self, g: Group, before: Scope, b: str, v: int, vb: int, out: List[str],
                        ind: str) -> None:
        """One group of :meth:`_emit_vertical`'s block ``b``: a vector of accumulators a
        distinct reduction, the group's loops around a vector loop over the block, and the
        members' names pointing at their results. A Welford reduction accumulates shifted
        sums (by its first value in each column, as ``accel::ShiftedMoments`` on CUDA) in
        its dtype: the mean is shift + sum / n, the sum of squared deviations
        sum of squares - sum * (sum / n), at least 0. The innermost reduction loop takes
        :data:`VROWS` rows a step, combined pairwise before they meet the accumulators (a
        quarter of the accumulators' loads and stores: float64 column sums of rows in the
        cache 1.3 -> 1.0 ms on the dev VM). An argmax or argmin keeps each column's value
        and index, one row a step (the first of equal values wins, as eager's)."""
        inner = self.group_scope[id(g)]
        rv = list(g.rvars)
        tag = f"a{self.ntemp}"
        self.ntemp += 1
        body: List[str] = []
        self._emit_items(before, body, "")
        self._emit_items(inner, body, "")
        results: Dict[tuple, str] = {}  # (body, which) -> the array holding it
        accs: List[tuple] = []  # (the row's value, the update of rows' values xs)
        finish: List[str] = []  # after the rows, per column (Welford: the moments)
        kind = g.members[0].args[0]
        if kind in ARG:
            init, better = ARG[kind]
            bodies = g.members[0].args[1]
            vt = bodies[0].dtype
            av, ai = f"{tag}_v", f"{tag}_i"
            out.append(f"{ind}{self.ctype(vt)} {av}[{vb}];")
            out.append(f"{ind}int64_t {ai}[{vb}];")
            out.append(f"{ind}for (int64_t k = 0; k < {vb}; ++k) {{ {av}[k] = {self._lim(init, vt)}; {ai}[k] = 0; }}")
            x, i = (self._name(e, inner) for e in bodies)
            accs.append((x, self.ctype(vt), lambda xs, i=i: (
                f"{{ const bool w = {better}({xs[0]}, {av}[{b}_k]); "
                f"{av}[{b}_k] = w ? {xs[0]} : {av}[{b}_k]; {ai}[{b}_k] = w ? {i} : {ai}[{b}_k]; }}")))
            results[(bodies, 0)], results[(bodies, 1)] = av, ai
        elif g.category == "simple":
            for key, (a, init, e) in self._accumulators(g, tag).items():
                out.append(f"{ind}{self.ctype(e.dtype)} {a}[{vb}];")
                out.append(f"{ind}for (int64_t k = 0; k < {vb}; ++k) {a}[k] = {init};")
                pair = _PAIR[SIMPLE[key[0]][2]]
                accs.append((self._name(key[1][0], inner), self.ctype(e.dtype),
                             lambda xs, a=a, k=key[0], pair=pair: SIMPLE[k][1].format(
                                 a=f"{a}[{b}_k]", x=_pairwise(xs, pair))))
                results.update({(key[1], w): a for w in (0, 1)})
        else:
            rows = self._size(rv)
            t = self.ctype(g.members[0].dtype)
            shifts: List[str] = []
            for k, bodies in enumerate(dict.fromkeys(e.args[1] for e in g.members)):
                sh, sm, sq = f"{tag}_{k}k", f"{tag}_{k}s", f"{tag}_{k}q"
                x = self._name(bodies[0], inner)
                out.append(f"{ind}{t} {sh}[{vb}], {sm}[{vb}], {sq}[{vb}];")
                shifts.append(f"{sh}[{b}_k] = {x}; {sm}[{b}_k] = 0; {sq}[{b}_k] = 0;")

                def update(xs, sh=sh, sm=sm, sq=sq):
                    ds = [f"({x} - {sh}[{b}_k])" for x in xs]
                    return (f"{{ {' '.join(f'const {t} d{u} = {d};' for u, d in enumerate(ds))} "
                            f"{sm}[{b}_k] += {_pairwise([f'd{u}' for u in range(len(xs))], _PAIR['+'])}; "
                            f"{sq}[{b}_k] += {_pairwise([f'd{u} * d{u}' for u in range(len(xs))], _PAIR['+'])}; }}")
                accs.append((x, t, update))
                results[(bodies, 1)], results[(bodies, 0)] = sm, sq
                if rows:
                    finish.append(f"{{ const {t} m = {sm}[{b}_k] / {t}({rows}); "
                                  f"const {t} q = {sq}[{b}_k] - {sm}[{b}_k] * m; "
                                  f"{sm}[{b}_k] = {sh}[{b}_k] + m; {sq}[{b}_k] = q > 0 ? q : {t}(0); }}")
                else:  # over no values: a NaN mean (0 / 0, as eager), no deviations
                    finish.append(f"{sm}[{b}_k] = {t}(NAN); {sq}[{b}_k] = 0;")
            if rows:  # the shifts: each column's first value
                out.append(f"{ind}{{")
                out += [f"{ind}  const int64_t i{r} = 0;" for r in rv]
                self._vector_loop(b, v, body + shifts, out, ind + "  ")
                out.append(f"{ind}}}")
        loops_ind = ind
        for r in rv[:-1]:
            out.append(f"{loops_ind}for (int64_t i{r} = 0; i{r} < {self.ir.sizes[r]}; ++i{r}) {{")
            loops_ind += "  "
        r, n = rv[-1], self.ir.sizes[rv[-1]]
        start = 0
        if n >= 2 * VROWS and kind not in ARG:  # VROWS rows a step: each row's values in a block of their own
            start = n - n % VROWS
            out.append(f"{loops_ind}for (int64_t i{r}_s = 0; i{r}_s < {start}; i{r}_s += {VROWS}) {{")
            step: List[str] = [f"{ct} {tag}_x{k}_{u};" for k, (_, ct, _) in enumerate(accs) for u in range(VROWS)]
            for u in range(VROWS):
                step += [f"{{ const int64_t i{r} = i{r}_s + {u};"] + [f"  {x}" for x in body]
                step += [f"  {tag}_x{k}_{u} = {x};" for k, (x, _, _) in enumerate(accs)] + ["}"]
            step += [upd([f"{tag}_x{k}_{u}" for u in range(VROWS)]) for k, (_, _, upd) in enumerate(accs)]
            self._vector_loop(b, v, step, out, loops_ind + "  ")
            out.append(f"{loops_ind}}}")
        if start < n:
            out.append(f"{loops_ind}for (int64_t i{r} = {start}; i{r} < {n}; ++i{r}) {{")
            self._vector_loop(b, v, body + [upd([x]) for x, _, upd in accs], out, loops_ind + "  ")
            out.append(f"{loops_ind}}}")
        for _ in rv[:-1]:
            loops_ind = loops_ind[:-2]
            out.append(f"{loops_ind}}}")
        if finish:
            self._vector_loop(b, v, finish, out, ind)
        for e in g.members:
            before.names[e] = f"{results[(e.args[1], e.args[3])]}[{b}_k]"

    def _vector_loop(self, b: str, v: int, body: List[str], out: List[str], ind: str) -> None:
        out.append(f"{ind}#pragma omp simd")
        out.append(f"{ind}for (int64_t {b}_k = 0; {b}_k < {b}_n; ++{b}_k) {{")
        out.append(f"{ind}  const int64_t i{v} = {b} + {b}_k;")
        out += [f"{ind}  {x}" for x in body]
        out.append(f"{ind}}}")
