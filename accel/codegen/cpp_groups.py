"""Reduction groups on the CPU: the loops of one group of reductions over the same domain
(plain sums, maxima and minima as OpenMP reduction clauses, float32 sums in float64 lanes,
argmax and argmin, and the blockwise ``welford`` and ``online_softmax`` helpers of
``include/accel/cpu_math.h``). A part of :class:`accel.codegen.cpp.CppRenderer` (the mixin
:class:`GroupLoops`).
"""
from __future__ import annotations

import itertools
from typing import Dict, List

import torch

from ..loop_ir import walk
from . import CodegenError, machine_threads
from .columns import _pairwise, _widened_f32
from .scopes import ARG, BLOCKED, SIMPLE, Group, Scope, f16_round

#: nests with less work than this (elements visited) run on one thread.
PARALLEL_MIN = 32768
#: a float32 sum along a contiguous loop of at least LANES_MIN values adds LANES_ROWS runs of
#: LANES float32 values pairwise, then widens them into LANES float64 accumulators
#: (:meth:`GroupLoops._lanes_sum`): a C++ microbenchmark of row sums of [8192, 1024] on the
#: dev VM, one thread, 1.64-1.71 -> 1.35-1.36 ms (rows in the cache: 2x)
LANES, LANES_ROWS, LANES_MIN = 8, 4, 64
#: ... and LANES_WIDE float32 lanes (one 512-bit vector; two of float64 accumulators) where
#: the values summed cost more than a few additions each (an op outside :data:`CHEAP_OPS`: a
#: SiLU's derivative, an exponential): at LANES their computation ran at half the vector
#: width. GroupNorm -> SiLU training step [32, 64, 56, 56] on the dev VM, its backward's
#: per-channel sums 2.96 -> 2.05 ms and the step 9.08 -> 7.77 ms (min of 40, 3 rounds);
#: ``x.exp().sum(-1)`` of [8192, 1024] 1.82 -> 1.33 ms; plain sums, whose loads are all
#: their work, are as fast at either (a C++ microbenchmark of row sums of [1024, 1024], one
#: thread: 46.2 and 46.6 us), and stay at LANES, whose last values are fewer.
LANES_WIDE = 16
#: the ops that keep a float32 sum's values at LANES lanes (loads, conversions, arithmetic
#: no costlier than a multiplication, selections)
CHEAP_OPS = frozenset(("load", "scalar", "const", "index", "cast", "add", "sub", "mul", "neg",
                       "abs", "maximum", "minimum", "where", "fma", "mul_rn", "eq", "ne", "lt",
                       "le", "gt", "ge"))
#: elements per block of a blockwise reduction (welford, online_softmax). Each block's
#: horizontal sums and merge are serial work; blocks of 64 spent [8192, 1024] bfloat16
#: add + LayerNorm's time there (1.59 -> 1.43 ms; bench/README.md, 28th round).
BLOCK = 512


class GroupLoops:
    """The CPU renderer's reduction groups (:meth:`_emit_group`); it relies on the
    renderer's planning state (``group_scope``, ``row_cache``, ``cached``) and helpers
    (``_emit_items``, ``_name``, ``_size``)."""

    def _lim(self, which: str, dtype) -> str:
        if dtype == torch.bool:
            return "false" if which == "$lowest" else "true"
        if dtype.is_floating_point:
            return ("-" if which == "$lowest" else "") + f"{self.ctype(dtype)}(INFINITY)"
        lim = "lowest" if which == "$lowest" else "max"
        return f"std::numeric_limits<{self.ctype(dtype)}>::{lim}()"

    def _emit_group(self, g: Group, scope: Scope, out: List[str], ind: str) -> None:
        inner = self.group_scope[id(g)]
        rv = list(g.rvars)
        first = g.members[0]
        kind = first.args[0]
        tag = f"r{self.ntemp}"
        self.ntemp += 1
        body_lines: List[str] = []
        kept = self.row_cache.get(id(g), [])
        for x, name in kept:
            out.append(f"{ind}{self.ctype(x.dtype)} {name}[{self.ir.sizes[rv[0]]}];")
        rounded = [(x, name) for x, name in kept if f16_round(x)] if self.f16_row_passes else []
        if rounded and len(rv) == 1 and not any(k == "group" for k, _ in inner.items):
            # kept float16 roundings: a loop of their own computes them unrounded, one pass
            # rounds the row (see _plan_f16_rows), the reduction's loop reads them
            lines: List[str] = []
            self._emit_items(inner, lines, "")
            lines += [f"{name}[i{rv[0]}] = {self._name(x.args[0].args[0], inner)};" for x, name in rounded]
            self._loops(rv, lines, out, ind, "simd", None)
            out += [f"{ind}accel::f16_round_row({name}, {self.ir.sizes[rv[0]]});" for _, name in rounded]
            for x, name in rounded:
                self.cached[(id(inner), x)] = f"{name}[i{rv[0]}]"
            kept = [(x, name) for x, name in kept if (x, name) not in rounded]
        _emit_items = self._emit_items

        def emit_inner(sc, lines, ind_):
            _emit_items(sc, lines, ind_)
            if sc is inner:
                lines += [f"{name}[i{rv[0]}] = {inner.names[x]};" for x, name in kept]
        self._emit_items = emit_inner
        if kind in SIMPLE:
            # reduction clauses and update lines, each marked whether it is a max's or min's
            accs, clauses, updates, fixes, wide = {}, [], [], [], False
            self._emit_items(inner, body_lines, "")
            for e in g.members:  # one accumulator per distinct (kind, body)
                key = (e.args[0], e.args[1])
                mm = e.args[0] in ("amax", "amin")
                # a bool maximum or minimum: in an int, gcc 12 vectorizes no || or && clause
                boolean = mm and e.dtype == torch.bool
                if key not in accs:
                    a = accs[key] = f"a{self.ntemp}_{len(accs)}"
                    x = self._name(e.args[1][0], inner)
                    init, update, clause = SIMPLE[e.args[0]]
                    if mm:  # built-in clauses vectorize; NaN aside
                        gt = ">" if e.args[0] == "amax" else "<"
                        if boolean:
                            update, clause = ("{a} |= {x};", "|") if gt == ">" else ("{a} &= {x};", "&")
                        else:
                            update, clause = f"{{a}} = {{x}} {gt} {{a}} ? {{x}} : {{a}};", e.args[0][1:]
                        if e.dtype.is_floating_point:
                            out.append(f"{ind}int {a}_nan = 0;")
                            clauses.append((mm, "|", f"{a}_nan"))
                            updates.append((mm, f"{a}_nan |= ({x} != {x});"))
                            fixes.append(f"if ({a}_nan) {a} = {self.ctype(e.dtype)}(NAN);")
                    init = self._lim(init, e.dtype) if init.startswith("$") else init
                    out.append(f"{ind}{'int' if boolean else self.ctype(e.dtype)} {a} = {init};")
                    clauses.append((mm, clause, a))
                    updates.append((mm, update.format(a=a, x=x)))
                    wide |= e.dtype in (torch.float64, torch.int64)
                scope.names[e] = f"static_cast<bool>({accs[key]})" if boolean else accs[key]
            # with a 64-bit accumulator, maxima and minima get a loop of their own: GCC 12
            # miscompiled one with a 64-bit sum and 16-bit conversions (test_opinfo_reductions)
            split = wide and len({mm for mm, _, _ in clauses}) == 2
            size, when = self._size(rv), ""
            if self._static(size):
                par = not scope.bound and size >= PARALLEL_MIN and machine_threads() > 1
            else:  # (a whole reduction of run-time length: threads decided in the kernel)
                par, when = not scope.bound and machine_threads() > 1, f" if({size} >= {PARALLEL_MIN})"

            def plain(out, ind):
                for part in ((False,), (True,)) if split else ((False, True),):
                    merged: Dict[str, List[str]] = {}
                    for mm, c, a in clauses:
                        if mm in part:
                            merged.setdefault(c, []).append(a)
                    red = " ".join(f"reduction({c}:{', '.join(v)})" for c, v in merged.items())
                    self._loops(rv, body_lines + [u for mm, u in updates if mm in part], out, ind,
                                f"simd {red}", f"parallel for {red}{when}" if par else None)

            lanes = self._lanes(rv, g, accs)
            if lanes:
                sums = [(a, self._name(key[1][0].args[0], inner)) for key, a in accs.items()]
                n = self.ir.sizes[rv[-1]]
                if not self._static(n):  # the static kernel's choice, in the kernel
                    out.append(f"{ind}if ({n} >= {LANES_MIN}) {{")
                    self._lanes_sum(rv, body_lines, sums, [u for _, u in updates], out, ind + "  ", par,
                                    lanes, when)
                    out.append(f"{ind}}} else {{")
                    plain(out, ind + "  ")
                    out.append(f"{ind}}}")
                else:
                    self._lanes_sum(rv, body_lines, sums, [u for _, u in updates], out, ind, par, lanes)
                self._emit_items = _emit_items
                return
            plain(out, ind)
            out += [ind + f for f in fixes]
        elif kind in ARG:
            init, better = ARG[kind]
            vt = first.args[1][0].dtype
            av, ai = f"a{self.ntemp}_v", f"a{self.ntemp}_i"
            out.append(f"{ind}{self.ctype(vt)} {av} = {self._lim(init, vt)};")
            out.append(f"{ind}int64_t {ai} = 0;")
            self._emit_items(inner, body_lines, "")
            x, i = (self._name(b, inner) for b in first.args[1])
            if self.unrolled_groups:  # selects, inside the vectorized loop over results
                body_lines.append(f"{{ const bool w = {better}({x}, {av}); {av} = w ? {x} : {av}; "
                                  f"{ai} = w ? {i} : {ai}; }}")
            else:
                body_lines.append(f"if ({better}({x}, {av})) {{ {av} = {x}; {ai} = {i}; }}")
            for e in g.members:
                scope.names[e] = av if e.args[3] == 0 else ai
            self._loops(rv, body_lines, out, ind, None, None)
        elif kind == "welford" and self.unrolled_groups:
            self._small_welford(g, inner, body_lines, scope, out, ind)
        elif kind in BLOCKED:
            t = self.ctype(first.dtype)
            acc = f"a{self.ntemp}"
            out.append(f"{ind}{BLOCKED[kind]}<{t}> {acc};")
            self._emit_items(inner, body_lines, "")
            body_lines.append(f"{tag}[{tag}_o + {tag}_k] = {self._name(first.args[1][0], inner)};")
            self._blocked(rv, body_lines, out, ind, t, tag, acc)
            if kind == "welford":
                out.append(f"{ind}{acc}.finish();")
            names = {"welford": ("{a}.m2", "{a}.mean_or_nan()"), "online_softmax": ("{a}.m", "{a}.s")}[kind]
            for e in g.members:
                scope.names[e] = names[e.args[3]].format(a=acc)
        else:
            raise CodegenError(f"no rendering for reduction {kind}")
        self._emit_items = _emit_items

    def _small_welford(self, g: Group, inner: Scope, body: List[str], scope: Scope, out: List[str],
                       ind: str) -> None:
        """A Welford group over a few values a result (:meth:`accel.codegen.cpp.CppRenderer.
        _small_rows`: its loops unrolled inside the vectorized loop over the results): Welford's
        update one value at a time in the group's dtype, as eager's ``WelfordOps``
        (aten/src/ATen/native/SharedReduceOps.h) in the loop's order, so that an infinity
        gives eager's NaN or infinite mean (an infinite last value: infinite; any other: NaN)
        and NaN moments; the division by the count is a product with its reciprocal."""
        first = g.members[0]
        t, a, rv = self.ctype(first.dtype), f"a{self.ntemp}", list(g.rvars)
        self._emit_items(inner, body, "")
        x = self._name(first.args[1][0], inner)
        out.append(f"{ind}{t} {a}_m = 0, {a}_m2 = 0;")
        count = " + ".join(f"i{r} * {self._size(rv[k + 1:])}" for k, r in enumerate(rv))
        body.append(f"{{ const {t} d = {x} - {a}_m; {a}_m += d * ({t}(1) / {t}({count} + 1)); "
                    f"{a}_m2 += d * ({x} - {a}_m); }}")
        self._loops(rv, body, out, ind, None, None)
        for e in g.members:
            scope.names[e] = f"{a}_m2" if e.args[3] == 0 else f"{a}_m"

    def _lanes(self, rv, g: Group, accs) -> int:
        """How many float32 lanes a group's plain reductions run in as :meth:`_lanes_sum`
        (:data:`LANES`, or :data:`LANES_WIDE` where a value costs more than
        :data:`CHEAP_OPS`), or 0: not so. They do where every one is a sum of widened float32
        values (:func:`accel.codegen.columns._widened_f32`) over one loop of at least
        :data:`LANES_MIN` values (the innermost of its loops; the loops around it without a
        row cache), which every load walks contiguously or not at all, none of a bool
        buffer."""
        if not rv or (len(rv) > 1 and (self.row_cache.get(id(g)) or self.unrolled_groups)):
            return 0
        n = self.ir.sizes[rv[-1]]
        if self._static(n) and n < LANES_MIN:
            return 0  # (a run-time length: :meth:`_emit_group` tests it in the kernel)
        if not all(kind == "sum" and _widened_f32(bodies[0]) for kind, bodies in accs):
            return 0
        seen: set = set()
        values = [e for m in g.members for b in m.args[1] for e in walk(b, seen, into_reduce=False)]
        # a bool load: gcc 12 vectorizes no loop of LANES values over bytes (it does the
        # plain reduction, at 64-byte vectors)
        if not all(e.args[1].coeff(rv[-1]) in (0, 1) and self.ir.buffers[e.args[0]].dtype != torch.bool
                   for e in values if e.op == "load"):
            return 0
        if all(e.op in CHEAP_OPS for e in values):
            return LANES
        # (a loop of run-time length, or one whose last values, summed one at a time, would be
        # more at LANES_WIDE than at LANES and more than a sixteenth of it: LANES)
        if not self._static(n):
            return LANES
        tail = n % (LANES_ROWS * LANES_WIDE)
        return LANES_WIDE if tail <= n % (LANES_ROWS * LANES) or 16 * tail <= n else LANES

    def _lanes_sum(self, rv, body: List[str], sums, tail: List[str], out: List[str], ind: str,
                   par: bool, w: int, when: str = "") -> None:
        """The loops over ``rv`` of float32 sums ``sums`` (float64 accumulator, float32 value
        names), the innermost (``r``) in steps of :data:`LANES_ROWS` x ``w`` (:meth:`_lanes`)
        values: the values at ``k``, ``k + w``, ... added pairwise in float32 (each value
        meets at most two float32 additions, as a column sum's rows,
        :func:`accel.codegen.columns._widened_f32`), widened into accumulator lane ``k``:
        several float64 vectors a step instead of one chain of additions a value, one
        conversion for four values. The lanes are then added pairwise into the accumulator;
        the last values (``tail``: the plain updates) one at a time. The loops around ``r``
        (a batch norm's channel sums over the batch and the spatial positions) share the
        lanes, each iteration's last values summed after its steps. With ``par`` each OpenMP
        thread keeps lanes of its own over its share of the steps (of the outermost loop's
        iterations, where there are loops around ``r``), and the accumulators are the
        threads' reduction (``when``: an OpenMP ``if()`` clause deciding that at run time)."""
        r, outer = rv[-1], rv[:-1]
        n, u_n = self.ir.sizes[r], LANES_ROWS
        step, t = w * u_n, f"l{self.ntemp}"
        self.ntemp += 1
        steps = n // step if self._static(n) else f"({n} / {step})"
        lines = [f"float {a}_y{u};" for a, _ in sums for u in range(u_n)]
        for u in range(u_n):
            lines += ["{", f"  const int64_t i{r} = {t}_c * {step} + {t}_k + {u * w};"]
            lines += [f"  {b}" for b in body] + [f"  {a}_y{u} = {x};" for a, x in sums] + ["}"]
        plus = "({} + {})"
        lines += [f"{a}_l[{t}_k] += static_cast<double>({_pairwise([f'{a}_y{u}' for u in range(u_n)], plus)});"
                  for a, _ in sums]
        left = []  # the last values of a row, one at a time
        if not self._static(n) or n % step:
            first = steps * step if self._static(n) else f"{steps} * {step}"
            left = [f"for (int64_t i{r} = {first}; i{r} < {n}; ++i{r}) {{", *[f"  {x}" for x in body + tail], "}"]
        if par:
            out.append(f"{ind}#pragma omp parallel reduction(+: {', '.join(a for a, _ in sums)}){when}")
        out.append(f"{ind}{{")
        out += [f"{ind}  double {a}_l[{w}] = {{}};" for a, _ in sums]
        if par:
            out.append(f"{ind}  #pragma omp for schedule(static)")
        steps_loop = [f"for (int64_t {t}_c = 0; {t}_c < {steps}; ++{t}_c) {{", "  #pragma omp simd",
                      f"  for (int64_t {t}_k = 0; {t}_k < {w}; ++{t}_k) {{", *[f"    {x}" for x in lines],
                      "  }", "}"]
        if outer:  # (each row's last values inside the loops around it)
            self._loops(outer, steps_loop + left, out, ind + "  ", None, None)
        else:
            out += [f"{ind}  {x}" for x in steps_loop]
        out += [f"{ind}  {a} += {_pairwise([f'{a}_l[{k}]' for k in range(w)], plus)};" for a, _ in sums]
        out.append(f"{ind}}}")
        if not outer:
            out += [f"{ind}{x}" for x in left]

    def _loops(self, rv, body, out, ind, simd_clause, par_clause) -> None:
        """Loops over ``rv`` (outermost first) around ``body``; the innermost one ``omp
        simd``, the outermost ``omp parallel for`` if ``par_clause``; with
        :attr:`unrolled_groups`, ``body`` once for each of their values instead, in a block
        of its own (gcc 12 left a loop of two such loops, ``#pragma GCC unroll`` on each, as
        they were, and the loop around them scalar: a logsumexp over 5 values)."""
        if not rv:
            out.append(f"{ind}{{")
            out += [f"{ind}  {b}" for b in body]
            out.append(f"{ind}}}")
            return
        if self.unrolled_groups:  # inside the vectorized loop over results (_small_rows)
            for idx in itertools.product(*(range(self.ir.sizes[v]) for v in rv)):
                out.append(f"{ind}{{")
                out += [f"{ind}  const int64_t i{v} = {k};" for v, k in zip(rv, idx)]
                out += [f"{ind}  {b}" for b in body]
                out.append(f"{ind}}}")
            return
        for k, v in enumerate(rv):
            last = k == len(rv) - 1
            if k == 0 and par_clause and last and simd_clause:
                out.append(f"{ind}#pragma omp parallel for {simd_clause}")
            elif k == 0 and par_clause:
                out.append(f"{ind}#pragma omp {par_clause}")
            elif last and simd_clause:
                out.append(f"{ind}#pragma omp {simd_clause}")
            out.append(f"{ind}for (int64_t i{v} = 0; i{v} < {self.ir.sizes[v]}; ++i{v}) {{")
            ind += "  "
        out += [f"{ind}{b}" for b in body]
        for _ in rv:
            ind = ind[:-2]
            out.append(f"{ind}}}")

    def _blocked(self, rv, body, out, ind, t, tag, acc) -> None:
        """Loops over ``rv``; the innermost in blocks of :data:`BLOCK` values handed to the
        accumulator ``acc`` (``acc.add(values, n)``); ``body`` stores its value at
        ``{tag}[{tag}_o + {tag}_k]``. An innermost loop shorter than half a block shares a
        block with iterations of the loop around it (a channels-last group norm's 8
        channels of a group at 64 spatial positions: one call of ``add``, not 64)."""
        last = rv[-1] if rv else None
        n = self.ir.sizes[last] if rv else 1
        rows = BLOCK // n if len(rv) > 1 and 0 < n <= BLOCK // 2 else 1
        outer = rv[:-2] if rows > 1 else rv[:-1]
        for v in outer:
            out.append(f"{ind}for (int64_t i{v} = 0; i{v} < {self.ir.sizes[v]}; ++i{v}) {{")
            ind += "  "
        # the block: rows of the loop around (p) each n values long, or n's values in turn
        p, m, size, k = (rv[-2], self.ir.sizes[rv[-2]], n, rows) if rows > 1 else (last, n, 1, BLOCK)
        out.append(f"{ind}for (int64_t {tag}_b = 0; {tag}_b < {m}; {tag}_b += {k}) {{")
        out.append(f"{ind}  const int64_t {tag}_r = {m} - {tag}_b < {k} ? {m} - {tag}_b : {k};")
        out.append(f"{ind}  {t} {tag}[{k * size}];")
        inner = ind + "  "
        if rows > 1:
            out.append(f"{inner}for (int64_t {tag}_j = 0; {tag}_j < {tag}_r; ++{tag}_j) {{")
            out.append(f"{inner}  const int64_t i{p} = {tag}_b + {tag}_j, {tag}_o = {tag}_j * {n};")
            inner += "  "
            count = str(n)
        else:
            out.append(f"{inner}const int64_t {tag}_o = 0;")
            count = f"{tag}_r"
        out.append(f"{inner}#pragma omp simd")
        out.append(f"{inner}for (int64_t {tag}_k = 0; {tag}_k < {count}; ++{tag}_k) {{")
        if last is not None:
            out.append(f"{inner}  const int64_t i{last} = {tag}_k;" if rows > 1 else
                       f"{inner}  const int64_t i{last} = {tag}_b + {tag}_k;")
        out += [f"{inner}  {b}" for b in body]
        out.append(f"{inner}}}")
        if rows > 1:
            out.append(f"{ind}  }}")
        out.append(f"{ind}  {acc}.add({tag}, {tag}_r * {size});")
        out.append(f"{ind}}}")
        for _ in outer:
            ind = ind[:-2]
            out.append(f"{ind}}}")
