"""Pattern replacement: rewrite known prims subgraphs into accel's own ops (:mod:`accel.library`,
which also declares the rewrites: :data:`accel.library.REWRITES`).

A rewrite is data (Inductor's ``register_replacement``): a search function, a replacement
function and two example input sets. Both functions are traced exactly as regions are
(:func:`accel.graph.trace_region`: functionalized, decomposed to prims, runtime scalars as
placeholders ``s0, s1, ...``), then normalized by the passes that come before this one in
:data:`accel.passes.PASSES` (all of them while it is not listed there).

Search patterns are serialized to ``accel/_patterns/<name>.json`` (Inductor's
``gen_register_replacement`` / ``_serialize_pattern``), so start-up loads them without
tracing. ``python -m accel.patterns --regenerate`` rewrites them; ``--check`` (and
``tests/test_patterns.py``) fails when one differs from a fresh trace. The search function is
traced for both example sets (they differ in rank, sizes and parameters); each literal is
stored as a constant (equal in both), ``{"param": name}`` (equal to that parameter in both)
or ``{"any": value}`` (shape-dependent: a ``broadcast_in_dim`` shape, a mean's divisor).

Matching a pattern:

1. structure: ``torch.fx``'s ``SubgraphMatcher`` with the literals as wildcards (same ops and
   wiring; no inner node used outside the match);
2. parameters (reduction dims, ...) are read off the matched nodes and must agree;
3. exactness: the search function, traced again for the matched inputs' shapes, strides and
   dtypes and those parameters, must equal the matched subgraph literal for literal.

A runtime scalar matches a pattern constant (the ``0.5`` of ``0.5 * x``) only if the caller
passes the scalars' values and it is equal; the rewritten graph is then valid for that value
only: ``gm.meta["accel_scalar_guards"] = {slot: value}``.
"""
from __future__ import annotations

import functools
import json
import logging
import operator
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher
from torch.utils._pytree import tree_leaves

from . import library

log = logging.getLogger("accel.passes")
prims = torch.ops.prims
PATTERN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_patterns")
FORMAT = 1


@dataclass(frozen=True)
class Replacement:
    """One rewrite. ``search(*tensors, *scalars, **params)`` and ``replace`` (same arguments,
    same number of results) are traced on float32 tensors; ``examples`` is two
    ``(tensor shapes, params)`` sets differing in rank, sizes and parameter values;
    ``n_scalars`` runtime scalars (an ``eps``) follow the tensors."""

    name: str
    search: Callable
    replace: Callable
    examples: Tuple[Tuple[tuple, dict], Tuple[tuple, dict]]
    n_scalars: int = 0


#: The registered rewrites, in the order they are tried.
REPLACEMENTS: List[Replacement] = []


def register_replacement(name, search, replace, examples, n_scalars=0) -> Replacement:
    """Register a rewrite (:class:`Replacement`); :func:`apply_patterns` uses it once its
    pattern is serialized (``python -m accel.patterns --regenerate``)."""
    r = Replacement(name, search, replace, examples, n_scalars)
    REPLACEMENTS.append(r)
    return r


# -- tracing -----------------------------------------------------------------------------
def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def _thawed(v):
    return [_thawed(x) for x in v] if isinstance(v, tuple) else v


@functools.lru_cache(maxsize=512)
def _traced(fn: Callable, metas: tuple, n_scalars: int, params: tuple,
            replacement: bool = False) -> fx.GraphModule:
    """``fn`` traced as a region and normalized: tensor inputs with ``metas`` ((shape,
    stride, dtype) each), ``n_scalars`` runtime scalars, ``params`` (frozen ``(name,
    value)`` pairs) as constants. A ``replacement`` also loses the clones that
    functionalizing ``unsqueeze`` leaves and gets its ``broadcast_in_dim`` chains composed.

    Raises:
        accel.graph.TraceError: ``fn`` cannot be traced with these inputs.
    """
    from .graph import trace_region
    from .passes import PASSES

    ext = [torch.empty_strided(s, st, dtype=dt, device="meta") for s, st, dt in metas]
    call = functools.partial(fn, **{k: _thawed(v) for k, v in params})
    tmpl = tuple(("x", i) for i in range(len(ext))) + tuple(("s", k) for k in range(n_scalars))
    n_out = len(tree_leaves(call(*ext, *[1.0] * n_scalars)))  # a run on meta tensors
    gm = trace_region([(call, tmpl, {}, n_out)], ext, n_out, tuple(range(n_out)),
                      ["f+"] * n_scalars).gm
    names = [name for name, _ in PASSES]
    for _, p in PASSES[:names.index("patterns") if "patterns" in names else len(PASSES)]:
        p(gm)  # the passes before this one
    if replacement:
        _simplify(gm.graph)
    return gm


def _simplify(g: fx.Graph) -> None:
    """Drop clones of intermediates (identities in a functional graph) and compose
    ``bid(bid(t, s1, d1), s2, d2)`` into ``bid(t, s2, [d2[i] for i in d1])``."""
    bid = prims.broadcast_in_dim.default
    for n in list(g.nodes):
        src = n.args[0] if n.args else None
        if n.target is prims.clone.default and src.op != "placeholder":
            n.replace_all_uses_with(src)
            g.erase_node(n)
        elif n.target is bid and src.target is bid and len(src.users) == 1:
            n.args = (src.args[0], n.args[1], [n.args[2][i] for i in src.args[2]])
            g.erase_node(src)


# -- serialization -----------------------------------------------------------------------
def _lit(v):
    if isinstance(v, (list, tuple)):
        return [_lit(x) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).split(".")[1]}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ValueError(f"cannot serialize literal {v!r}")


def _same_lit(a, b) -> bool:
    """Literal equality: lists = tuples, ints = floats of equal value, NaN = NaN, and a
    ``meta`` device (patterns are traced on meta tensors) = any device."""
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same_lit(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.device) and isinstance(b, torch.device):
        return a.type == "meta" or a == b
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


def _has_node(a) -> bool:
    return any(isinstance(x, fx.Node) for x in tree_leaves(a))


def _encode(a, b, pa: dict, pb: dict):
    """One argument of the first example trace, compared with the second's."""
    if isinstance(a, fx.Node) or _has_node(a) or _has_node(b):
        if isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.name == b.name:
            return {"node": a.name}
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            return [_encode(x, y, pa, pb) for x, y in zip(a, b)]
        raise ValueError(f"the example traces differ: {a} vs {b}")
    for p in pa:
        if _same_lit(a, pa[p]) and _same_lit(b, pb[p]):
            return {"param": p}
    return _lit(a) if _same_lit(a, b) else {"any": _lit(a)}


def serialize(r: Replacement) -> str:
    """``r``'s search pattern as JSON text, one node a line.

    Raises:
        ValueError: the two example traces differ in structure.
    """
    na, nb = ([*_traced(r.search, tuple((tuple(s), torch.empty(s).stride(), torch.float32)
                                         for s in shapes), r.n_scalars,
                        _frozen(sorted(params.items()))).graph.nodes]
              for shapes, params in r.examples)
    if [(n.op, n.target) for n in na] != [(n.op, n.target) for n in nb]:
        raise ValueError(f"{r.name}: the example traces differ in structure")
    pa, pb = r.examples[0][1], r.examples[1][1]
    lines = []
    for a, b in zip(na, nb):
        if a.op == "placeholder":
            lines.append(["placeholder", a.name, "scalar" if "scalar_type" in a.meta else "tensor"])
        elif a.op == "output":
            lines.append(["output", "output", [n.name for n in tree_leaves(a.args)]])
        else:
            target = "operator.getitem" if a.target is operator.getitem else str(a.target)
            lines.append(["call_function", a.name, target, _encode(a.args, b.args, pa, pb),
                          {k: _encode(v, b.kwargs[k], pa, pb) for k, v in a.kwargs.items()}])
    head = {"format": FORMAT, "name": r.name, "torch": torch.__version__,
            "params": {k: _lit(v) for k, v in sorted(pa.items())}}
    body = ",\n  ".join(json.dumps(x, sort_keys=True) for x in lines)
    return json.dumps(head, sort_keys=True)[:-1] + ',\n "nodes": [\n  ' + body + "\n ]}\n"


def regenerate(directory: str = PATTERN_DIR) -> List[str]:
    """Trace every registered search function and write its pattern; return the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, r.name + ".json") for r in REPLACEMENTS]
    for r, path in zip(REPLACEMENTS, paths):
        with open(path, "w") as f:
            f.write(serialize(r))
    return paths


def is_current(r: Replacement) -> bool:
    """True if ``r``'s serialized pattern equals a fresh trace (the ``torch`` version stamp
    aside: it is informative)."""
    try:
        with open(os.path.join(PATTERN_DIR, r.name + ".json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return False
    new = json.loads(serialize(r))
    old.pop("torch", None)
    new.pop("torch", None)
    return old == new


# -- loading -----------------------------------------------------------------------------
_WILD = type("Wildcard", (), {"__repr__": lambda self: "*"})()  # every literal, for the matcher


class _Matcher(SubgraphMatcher):
    """``SubgraphMatcher`` whose pattern literals are :data:`_WILD`, matching any literal or
    scalar placeholder. (Its own ``ignore_literals`` also lets a pattern node match a
    literal, cutting off the subtree behind it.)"""

    def _match_literals(self, pn, gn, match) -> bool:
        return pn is _WILD or super()._match_literals(pn, gn, match)


@dataclass
class Pattern:
    """A loaded search pattern: the matcher over its structural graph, each call node with
    its serialized arguments, the tensor and scalar placeholders, and the outputs."""

    rep: Replacement
    matcher: SubgraphMatcher
    calls: List[Tuple[fx.Node, list, dict]]
    tensors: List[fx.Node]
    scalars: List[fx.Node]
    outputs: List[fx.Node]


def _load(r: Replacement, text: str) -> Pattern:
    d = json.loads(text)
    if d.get("format") != FORMAT:
        raise ValueError(f"format {d.get('format')} != {FORMAT}")
    g, env = fx.Graph(), {}
    calls, phs, outputs = [], {"tensor": [], "scalar": []}, []

    def struct(a):  # node references kept, every literal (list) one wildcard
        if isinstance(a, dict) and "node" in a:
            return env[a["node"]]
        s = [struct(x) for x in a] if isinstance(a, list) else []
        return s if any(x is not _WILD for x in s) else _WILD

    for entry in d["nodes"]:
        if entry[0] == "placeholder":
            env[entry[1]] = g.placeholder(entry[1])
            phs[entry[2]].append(env[entry[1]])
        elif entry[0] == "output":
            outputs = [env[n] for n in entry[2]]
            g.output(tuple(outputs))
        else:
            _, name, target, args, kwargs = entry
            fn = operator.getitem if target == "operator.getitem" else functools.reduce(
                getattr, target.split("."), torch.ops)
            env[name] = g.call_function(fn, tuple(struct(a) for a in args),
                                        {k: struct(v) for k, v in kwargs.items()})
            calls.append((env[name], args, kwargs))
    m = _Matcher(g, match_output=False, match_placeholder=False,
                 remove_overlapping_matches=False, ignore_literals=False)
    return Pattern(r, m, calls, phs["tensor"], phs["scalar"], outputs)


@functools.lru_cache(maxsize=1)
def load_patterns() -> Tuple[Pattern, ...]:
    """The serialized patterns of :data:`REPLACEMENTS`, read once without tracing; a missing
    or unreadable one is logged and skipped."""
    out = []
    for r in REPLACEMENTS:
        try:
            with open(os.path.join(PATTERN_DIR, r.name + ".json")) as f:
                out.append(_load(r, f.read()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            log.warning("pattern %s unusable (%s): python -m accel.patterns --regenerate",
                        r.name, e)
    return tuple(out)


# -- matching ----------------------------------------------------------------------------
def _scalar_slot(v, g: fx.Graph) -> Optional[int]:
    """The slot of a runtime-scalar placeholder of an accel graph, else None."""
    if not isinstance(v, fx.Node) or v.op != "placeholder" or "scalar_type" not in v.meta:
        return None
    return [p for p in g.nodes if p.op == "placeholder" and "scalar_type" in p.meta].index(v)


class _Match:
    """A structural match (pattern node -> graph node or literal) and what checking it
    finds: parameters, guards, the graph's inputs (tensors, then scalars)."""

    def __init__(self, pat: Pattern, nodes_map, moved):
        self.pat, self.nm, self.moved = pat, nodes_map, moved
        self.params: Dict[str, Any] = {}
        self.guards: Dict[int, Any] = {}
        self.inputs = [self._resolve(self.nm[p]) for p in pat.tensors + pat.scalars]

    def _resolve(self, v):  # an input that an earlier rewrite replaced
        while isinstance(v, fx.Node) and v in self.moved:
            v = self.moved[v]
        return v

    def metas(self, g: fx.Graph):
        """(shape, stride, dtype) of each tensor input; None unless the tensor inputs are
        tensors and the scalar inputs runtime scalars or numbers."""
        n_t = len(self.pat.tensors)
        if any(_scalar_slot(v, g) is None and type(v) not in (int, float)
               for v in self.inputs[n_t:]):
            return None
        vals = [v.meta.get("val") if isinstance(v, fx.Node) else None for v in self.inputs[:n_t]]
        if not all(isinstance(t, torch.Tensor) for t in vals):
            return None
        return tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in vals)

    def read_params(self) -> bool:
        """Read each ``{"param": name}`` literal off the graph; all reads must agree."""
        def walk(enc, a) -> bool:
            if isinstance(enc, list) and isinstance(a, (list, tuple)) and len(enc) == len(a):
                return all(walk(e, x) for e, x in zip(enc, a))
            if not (isinstance(enc, dict) and "param" in enc):
                return True  # checked by the re-trace
            p = enc["param"]
            if isinstance(a, fx.Node) or (p in self.params and not _same_lit(a, self.params[p])):
                return False
            self.params[p] = _thawed(_frozen(a))
            return True

        for pn, args, kwargs in self.pat.calls:
            gn = self.nm[pn]
            if len(gn.args) != len(args) or set(gn.kwargs) != set(kwargs):
                return False
            if not (walk(args, gn.args) and all(walk(e, gn.kwargs[k]) for k, e in kwargs.items())):
                return False
        return True

    def same(self, ra, ta, env, g: fx.Graph, scalars) -> bool:
        """Argument ``ra`` of the re-traced search graph against ``ta`` of the graph."""
        if isinstance(ra, fx.Node):
            v = env[ra]
            return v is ta if isinstance(v, fx.Node) else _same_lit(v, ta)
        if isinstance(ra, (list, tuple)):
            return (isinstance(ta, (list, tuple)) and len(ra) == len(ta)
                    and all(self.same(x, y, env, g, scalars) for x, y in zip(ra, ta)))
        k = _scalar_slot(ta, g)
        if k is None:
            return not isinstance(ta, fx.Node) and _same_lit(ra, ta)
        # a runtime scalar where the pattern has a constant: equal now, so a guard
        if (scalars is None or k >= len(scalars) or type(ra) not in (int, float)
                or float(scalars[k]) != float(ra)):
            return False
        self.guards[k] = scalars[k]
        return True

    def verify(self, g: fx.Graph, scalars) -> bool:
        """Re-trace the search function for the matched inputs and parameters: the match
        holds if the trace is the matched subgraph, literal for literal."""
        metas = self.metas(g)
        if metas is None or not self.read_params():
            return False
        rep = self.pat.rep
        try:
            rg = _traced(rep.search, metas, rep.n_scalars, _frozen(sorted(self.params.items())))
        except Exception as e:  # noqa: BLE001 - parameters the function rejects: no match
            log.debug("pattern %s: re-trace failed: %s", rep.name, e)
            return False
        rnodes = list(rg.graph.nodes)
        calls = [pn for pn, _, _ in self.pat.calls]
        if len(rnodes) != len(self.inputs) + len(calls) + 1:
            return False
        env = dict(zip(rnodes, self.inputs + [self.nm[pn] for pn in calls]))
        for rn, pn in zip(rnodes[len(self.inputs):-1], calls):
            gn = self.nm[pn]
            if (rn.target is not pn.target or set(rn.kwargs) != set(gn.kwargs)
                    or not self.same(rn.args, gn.args, env, g, scalars)
                    or not all(self.same(v, gn.kwargs[k], env, g, scalars)
                               for k, v in rn.kwargs.items())):
                return False
        outs = [env[n] for n in tree_leaves(rnodes[-1].args)]
        return outs == [self.nm[p] for p in self.pat.outputs]

    def rewrite(self, gm: fx.GraphModule) -> bool:
        """Insert the traced replacement after the last input, reroute the matched outputs
        to it and erase the matched nodes. False (nothing changed) if no place fits."""
        g, rep = gm.graph, self.pat.rep
        rg = _traced(rep.replace, self.metas(g), rep.n_scalars,
                     _frozen(sorted(self.params.items())), True).graph
        order = {n: i for i, n in enumerate(g.nodes)}
        matched = {self.nm[pn] for pn, _, _ in self.pat.calls}
        olds = [self.nm[pn] for pn in self.pat.outputs]
        after = max([v for v in self.inputs if isinstance(v, fx.Node)]
                    + [n for n in g.nodes if n.op == "placeholder"], key=order.__getitem__)
        if any(order[u] <= order[after] for o in olds for u in o.users if u not in matched):
            return False
        env = dict(zip([n for n in rg.nodes if n.op == "placeholder"], self.inputs))
        with g.inserting_before(after.next):
            for rn in rg.nodes:
                if rn.op == "call_function":
                    env[rn] = g.node_copy(rn, env.__getitem__)
        news = [env[n] for n in tree_leaves(list(rg.nodes)[-1].args)]
        for old, new in zip(olds, news):
            old.replace_all_uses_with(new)
            self.moved[old] = new
        for n in sorted(matched, key=order.__getitem__, reverse=True):
            g.erase_node(n)
        log.debug("pattern %s: %s -> %s, params %s, scalar guards %s", rep.name,
                  [o.name for o in olds], [n.name for n in news], self.params, self.guards)
        return True


def apply_patterns(gm: fx.GraphModule, scalars: Optional[Sequence[Any]] = None) -> int:
    """Apply the loaded patterns (:func:`load_patterns`) to ``gm`` in place; return the
    number of replacements, each logged on the ``accel.passes`` logger.

    Args:
        gm: an accel graph (:func:`accel.graph.trace_region`, then the other passes):
            tensor placeholders, then the runtime scalar placeholders ``s0, s1, ...``.
        scalars: the runtime scalars' values, by slot. Without them no pattern constant
            matches a runtime scalar; with them an equal one does, and
            ``gm.meta["accel_scalar_guards"][slot] = value`` says that the rewritten graph
            holds for that value only (the caller must key the kernel on it or check it).
    """
    count = 0
    for pat in load_patterns():
        present = {n.target for n in gm.graph.nodes}
        if not all(pn.target in present for pn, _, _ in pat.calls):
            continue  # (also: SubgraphMatcher drops an anchor that has no candidate)
        moved: Dict[fx.Node, fx.Node] = {}  # outputs rewritten -> their replacements
        dead = set()  # nodes of rewritten matches
        for im in pat.matcher.match(gm.graph):
            if any(pn not in im.nodes_map or im.nodes_map[pn] in dead for pn, _, _ in pat.calls):
                continue  # overlaps a rewritten match
            m = _Match(pat, im.nodes_map, moved)
            if m.verify(gm.graph, scalars) and m.rewrite(gm):
                dead.update(m.nm[pn] for pn, _, _ in pat.calls)
                if m.guards:
                    gm.meta.setdefault("accel_scalar_guards", {}).update(m.guards)
                count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


for _spec in library.REWRITES:
    register_replacement(*_spec)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m accel.patterns --regenerate`` rewrites ``accel/_patterns/*.json``;
    ``--check`` exits 1 if one is stale."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--regenerate"]:
        print("\n".join(regenerate()))
        return 0
    if argv == ["--check"]:
        stale = [r.name for r in REPLACEMENTS if not is_current(r)]
        print("stale: " + ", ".join(stale) if stale else "all patterns current")
        return 1 if stale else 0
    print("usage: python -m accel.patterns --regenerate | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
