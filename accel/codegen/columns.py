"""Column reductions on the CPU: a reduction over a strided dim whose results vary along the
contiguous innermost loop (column sums, a softmax over dim 0, batch norm's statistics of
[N, C]) accumulates a vector of a block's columns over the rows, with unit-stride vector
loads, instead of walking each column down its rows. A part of
:class:`accel.codegen.cpp.CppRenderer` (the mixin :class:`ColumnLoops`).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..loop_ir import Expr
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
#: rows a thread at least, for a column reduction's rows to be split among the threads
#: (:meth:`ColumnLoops._emit_rows`)
SPLIT_ROWS = 64
#: columns at least for the row split, where the threads' blocks would be as many as the
#: threads. Kernel times on the 2-core dev VM (ms, column split -> row split, float32
#: inputs in the L3 cache): column sums [8192, 1024] 1.22 -> 0.80, [32768, 256] 1.89 ->
#: 1.26, [50176, 128] 0.67 -> 0.80, [100352, 64] 0.65 -> 1.15; column means and variances
#: [8192, 1024] 1.38 -> 1.00, [32768, 256] 2.54 -> 1.82, [50176, 128] 1.59 -> 1.15,
#: [100352, 64] 0.56 -> 0.73.
SPLIT_COLUMNS = 256
#: the pairwise form of a plain reduction's operator (SIMPLE's clause)
_PAIR = {"+": "({} + {})", "*": "({} * {})", "accel_max": "accel::maximum({}, {})",
         "accel_min": "accel::minimum({}, {})"}


def _pairwise(xs: List[str], pair: str) -> str:
    """``xs`` combined by ``pair`` as a balanced tree, neighbours first."""
    while len(xs) > 1:
        xs = [pair.format(*xs[i:i + 2]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _widened_f32(x) -> bool:
    """``x`` is a float32 value widened to float64 (a float32 sum's accumulated value): the
    :data:`VROWS` rows of a step are then summed in float32, pairwise, and that sum
    widened and accumulated in float64. Each value meets at most two float32 additions
    (an error of at most 2 ulp of the rows' magnitudes, below eager's own float32
    accumulation), and a step converts one vector instead of four: the kernel of a float32
    mean over the middle dim of [64, 512, 256] on the dev VM, 0.61-0.70 -> 0.46-0.60 ms
    (eager's whole call 0.48-0.55)."""
    return (x.op == "cast" and x.dtype == torch.float64 and isinstance(x.args[0], Expr)
            and x.args[0].dtype == torch.float32)


def _share(rows: int, nt: str):
    """The first of thread ``t``'s rows of ``rows`` split among ``nt`` threads (C++
    expressions): ``rows * t / nt``, the same formula for a thread's loop and for the
    merge's counts."""
    return lambda t: f"{rows} * {t} / {nt}"


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
        finishes the block. Blocks go to threads, unless :meth:`_row_split` splits rows."""
        if parallel and self._row_split(self.ir.sizes[v], scope):
            self._emit_rows(v, scope, out, ind)
        else:
            self._column_blocks(v, scope, out, ind, parallel)

    def _column_blocks(self, v: int, scope: Scope, out: List[str], ind: str, parallel: bool,
                       when: str = "") -> None:
        """:meth:`_emit_vertical`'s blocks of columns, one a thread at a time where
        ``parallel`` (``when``: an OpenMP ``if()`` clause deciding it at run time). A
        column's result does not depend on its block: the same bits for any threads."""
        n = self.ir.sizes[v]
        vb = vertical_block(n, machine_threads() if parallel else 1)
        b = f"v{self.ntemp}"
        self.ntemp += 1
        if parallel:
            out.append(f"{ind}#pragma omp parallel for schedule(static){when}")
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

    def _row_split(self, n: int, scope: Scope) -> bool:
        """Whether a parallel column reduction over ``n`` results splits its rows among the
        threads rather than its columns: when one block holds every column
        (:data:`VBLOCK_MAX`), each group's outermost reduction loop has :data:`SPLIT_ROWS`
        rows a thread, and either the columns are at least :data:`SPLIT_COLUMNS` or too few
        blocks of :data:`VBLOCK` for every thread. Each thread then reads whole rows, where
        a column split reads a run of each row a thread."""
        threads = machine_threads()
        rows = [self.ir.sizes[x.rvars[0]] for k, x in scope.items if k == "group"]
        if n > VBLOCK_MAX or min(rows, default=0) < SPLIT_ROWS * threads:
            return False
        return n >= SPLIT_COLUMNS or -(-n // vertical_block(n, threads)) < threads

    def _emit_rows(self, v: int, scope: Scope, out: List[str], ind: str) -> None:
        """:meth:`_emit_vertical` with every column in one block and the rows split among
        the threads: for each group, each thread accumulates its share of the outermost
        reduction loop into its own accumulators and publishes them (``accel::Partials``);
        after a barrier the threads combine the partials of a share of the columns, in
        thread order (the same results for the same thread count): plain reductions by
        their operator, arg reductions keeping the earlier of equal values, mean and
        variance by Chan et al.'s pairwise update ("Updating formulae and a pairwise
        algorithm for computing sample variances", 1979; as ``accel::ShiftedMoments``'
        merge). The results live in arrays shared by the threads."""
        n = self.ir.sizes[v]
        b = f"v{self.ntemp}"
        self.ntemp += 1
        shared: List[str] = []  # declared before the parallel region
        body: List[str] = []
        ind2 = ind + "  "
        body.append(f"{ind2}const int64_t {b} = 0, {b}_n = accel::opaque({n});")
        body.append(f"{ind2}const int64_t {b}_t = omp_get_thread_num(), {b}_nt = omp_get_num_threads();")
        before = Scope(scope.bound, scope.parent)
        before.names = scope.names
        for kind, x in scope.items:
            if kind == "group":
                self._vertical_group(x, before, b, v, n, body, ind2, shared)
            else:
                before.items.append((kind, x))
        tail: List[str] = []
        self._emit_items(before, tail, "")
        self._vector_loop(b, v, tail, body, ind2, "omp for simd schedule(static)")
        out.append(f"{ind}{{")
        out += [f"{ind2}{x}" for x in shared]
        out.append(f"{ind2}#pragma omp parallel")
        out.append(f"{ind2}{{")
        out += ["  " + x for x in body]
        out.append(f"{ind2}}}")
        out.append(f"{ind}}}")

    def _vertical_group(self, g: Group, before: Scope, b: str, v: int, vb: int, out: List[str],
                        ind: str, shared: Optional[List[str]] = None) -> None:
        """One group of :meth:`_emit_vertical`'s block ``b``: a vector of accumulators a
        distinct reduction, the group's loops around a vector loop over the block, and the
        members' names pointing at their results. A Welford reduction accumulates shifted
        sums (by its first value in each column, as ``accel::ShiftedMoments`` on CUDA) in
        its dtype: the mean is shift + sum / n, the sum of squared deviations
        sum of squares - sum * (sum / n), at least 0. The innermost reduction loop takes
        :data:`VROWS` rows a step, combined pairwise before they meet the accumulators (a
        quarter of the accumulators' loads and stores: float64 column sums of rows in the
        cache 1.3 -> 1.0 ms on the dev VM). An argmax or argmin keeps each column's value
        and index, one row a step (the first of equal values wins, as eager's).

        With ``shared`` (:meth:`_emit_rows`: declarations before the parallel region), the
        thread takes its share of the outermost reduction loop, then the threads combine
        their partials into shared arrays."""
        inner = self.group_scope[id(g)]
        rv = list(g.rvars)
        tag = f"a{self.ntemp}"
        self.ntemp += 1
        body: List[str] = []
        self._emit_items(before, body, "")
        self._emit_items(inner, body, "")
        results: Dict[tuple, str] = {}  # (kind, body, which) -> the array holding it
        accs: List[tuple] = []  # (the row's value, the update of rows' values xs)
        finish: List[str] = []  # after the rows, per column (Welford: the moments)
        merges: List[tuple] = []  # (arrays with their C++ types, the threads' partials' merge)
        kind = g.members[0].args[0]
        lo, hi = "0", str(self.ir.sizes[rv[0]])
        share = _share(self.ir.sizes[rv[0]], f"{b}_nt")  # thread t's rows: from share(t)
        if shared is not None:  # this thread's rows of the outermost reduction loop
            lo, hi = f"{tag}_lo", f"{tag}_hi"
            out.append(f"{ind}const int64_t {lo} = {share(f'{b}_t')}, {hi} = {share(f'({b}_t + 1)')};")
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
            results[(kind, bodies, 0)], results[(kind, bodies, 1)] = av, ai
            merges.append((((av, self.ctype(vt)), (ai, "int64_t")), lambda r, p: (
                f"{{ const bool w = {better}({p[0]}, {r[0]}); {r[0]} = w ? {p[0]} : {r[0]}; "
                f"{r[1]} = w ? {p[1]} : {r[1]}; }}")))
        elif g.category == "simple":
            for key, (a, init, e) in self._accumulators(g, tag).items():
                out.append(f"{ind}{self.ctype(e.dtype)} {a}[{vb}];")
                out.append(f"{ind}for (int64_t k = 0; k < {vb}; ++k) {a}[k] = {init};")
                pair = _PAIR[SIMPLE[key[0]][2]]
                x = key[1][0]
                if key[0] == "sum" and _widened_f32(x):  # the rows' float32 values paired first
                    x, wide = x.args[0], f"static_cast<{self.ctype(e.dtype)}>({{}})"
                else:
                    wide = "{}"
                accs.append((self._name(x, inner), self.ctype(x.dtype),
                             lambda xs, a=a, k=key[0], pair=pair, wide=wide: SIMPLE[k][1].format(
                                 a=f"{a}[{b}_k]", x=wide.format(_pairwise(xs, pair)))))
                results.update({(*key, w): a for w in (0, 1)})
                merges.append((((a, self.ctype(e.dtype)),),
                               lambda r, p, k=key[0]: SIMPLE[k][1].format(a=r[0], x=p[0])))
        else:
            rows = self._size(rv)
            t = self.ctype(g.members[0].dtype)
            rest = self._size(rv[1:])
            count = f"{t}(({hi} - {lo}) * {rest})" if shared is not None else f"{t}({rows})"
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
                results[(kind, bodies, 1)], results[(kind, bodies, 0)] = sm, sq
                if not self._static(rows) or rows:  # (a run-time length is at least 1)
                    finish.append(f"{{ const {t} m = {sm}[{b}_k] / {count}; "
                                  f"const {t} q = {sq}[{b}_k] - {sm}[{b}_k] * m; "
                                  f"{sm}[{b}_k] = {sh}[{b}_k] + m; {sq}[{b}_k] = q > 0 ? q : {t}(0); }}")
                else:  # over no values: a NaN mean (0 / 0, as eager), no deviations
                    finish.append(f"{sm}[{b}_k] = {t}(NAN); {sq}[{b}_k] = 0;")
                merges.append((((sm, t), (sq, t)), lambda r, p, t=t, share=share, rest=rest: (
                    f"{{ const {t} nb = {t}(({share('(u + 1)')} - {share('u')}) * {rest}); "
                    f"if (nb > 0 && na == 0) {{ {r[0]} = {p[0]}; {r[1]} = {p[1]}; na = nb; }} "
                    f"else if (nb > 0) {{ const {t} d = {p[0]} - {r[0]}, n = na + nb; "
                    f"{r[0]} += d * (nb / n); {r[1]} += {p[1]} + d * d * (na / n * nb); na = n; }} }}"),
                    f"{t} na = 0;"))
            if not self._static(rows) or rows:  # the shifts: each column's first value
                out.append(f"{ind}{{")
                out += [f"{ind}  const int64_t i{r} = {lo if r == rv[0] else 0};" for r in rv]
                self._vector_loop(b, v, body + shifts, out, ind + "  ")
                out.append(f"{ind}}}")
        loops_ind = ind
        for r in rv[:-1]:
            a, z = (lo, hi) if r == rv[0] else ("0", self.ir.sizes[r])
            out.append(f"{loops_ind}for (int64_t i{r} = {a}; i{r} < {z}; ++i{r}) {{")
            loops_ind += "  "
        r, n = rv[-1], self.ir.sizes[rv[-1]]
        a, z = (lo, hi) if len(rv) == 1 else ("0", str(n))
        start, tail = a, True
        # VROWS rows a step, each row's values in a block of their own (from 2 VROWS rows)
        if (not self._static(n) or n >= 2 * VROWS) and kind not in ARG:
            if a == "0" and self._static(n):
                start, tail = str(n - n % VROWS), n % VROWS > 0
            else:
                start = f"{tag}_e"
                few = "" if self._static(n) else f"{n} < {2 * VROWS} ? {a} : "
                out.append(f"{loops_ind}const int64_t {start} = {few}{a} + ({z} - {a}) / {VROWS} * {VROWS};")
            out.append(f"{loops_ind}for (int64_t i{r}_s = {a}; i{r}_s < {start}; i{r}_s += {VROWS}) {{")
            step: List[str] = [f"{ct} {tag}_x{k}_{u};" for k, (_, ct, _) in enumerate(accs) for u in range(VROWS)]
            for u in range(VROWS):
                step += [f"{{ const int64_t i{r} = i{r}_s + {u};"] + [f"  {x}" for x in body]
                step += [f"  {tag}_x{k}_{u} = {x};" for k, (x, _, _) in enumerate(accs)] + ["}"]
            step += [upd([f"{tag}_x{k}_{u}" for u in range(VROWS)]) for k, (_, _, upd) in enumerate(accs)]
            self._vector_loop(b, v, step, out, loops_ind + "  ")
            out.append(f"{loops_ind}}}")
        if tail:
            out.append(f"{loops_ind}for (int64_t i{r} = {start}; i{r} < {z}; ++i{r}) {{")
            self._vector_loop(b, v, body + [upd([x]) for x, _, upd in accs], out, loops_ind + "  ")
            out.append(f"{loops_ind}}}")
        for _ in rv[:-1]:
            loops_ind = loops_ind[:-2]
            out.append(f"{loops_ind}}}")
        if finish:
            self._vector_loop(b, v, finish, out, ind)
        if shared is not None:
            self._merge_partials(merges, b, v, vb, out, ind, shared)
            results = {key: f"{x}_r" for key, x in results.items()}
        for e in g.members:
            before.names[e] = f"{results[(e.args[0], e.args[1], e.args[3])]}[{b}_k]"

    def _merge_partials(self, merges: List[tuple], b: str, v: int, n: int, out: List[str], ind: str,
                        shared: List[str]) -> None:
        """:meth:`_emit_rows`' merge of a group's partials: each thread publishes its
        accumulators, and after a barrier each column's result is thread 0's partial merged
        with the others' in thread order (``merges``: the accumulators with their C++
        types, the merge of partials ``p`` into results ``r``, a declaration it needs)."""
        publish: List[str] = []
        merge: List[str] = []
        for arrays, fn, *decl in merges:
            for x, ct in arrays:
                shared.append(f"{ct} {x}_r[{n}];")
                shared.append(f"accel::Partials<{ct}> {x}_p({n});")
                shared.append(f"if (!{x}_p.p) return ACCEL_ERROR;")
                publish.append(f"{x}_p.p[{b}_t * {n} + {b}_k] = {x}[{b}_k];")
            r = [f"{x}_r[{b}_k]" for x, _ in arrays]
            p = [f"{x}_p.p[u * {n} + {b}_k]" for x, _ in arrays]
            if decl:  # merged from no values up (Welford: by the partials' counts)
                merge += [f"{{ {decl[0]}", f"  for (int64_t u = 0; u < {b}_nt; ++u) {fn(r, p)}", "}"]
            else:
                merge += [f"{x} = {y};" for x, y in zip(r, [f"{a}_p.p[{b}_k]" for a, _ in arrays])]
                merge.append(f"for (int64_t u = 1; u < {b}_nt; ++u) {fn(r, p)}")
        self._vector_loop(b, v, publish, out, ind)
        out.append(f"{ind}#pragma omp barrier")
        self._vector_loop(b, v, merge, out, ind, "omp for simd schedule(static)")

    def _vector_loop(self, b: str, v: int, body: List[str], out: List[str], ind: str,
                     pragma: str = "omp simd") -> None:
        out.append(f"{ind}#pragma {pragma}")
        out.append(f"{ind}for (int64_t {b}_k = 0; {b}_k < {b}_n; ++{b}_k) {{")
        out.append(f"{ind}  const int64_t i{v} = {b} + {b}_k;")
        out += [f"{ind}  {x}" for x in body]
        out.append(f"{ind}}}")
