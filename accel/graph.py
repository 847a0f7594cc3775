"""Region -> ``torch.fx`` graph of prims, through torch's own functionalization and
decompositions (``torch.func.functionalize``, ``make_fx`` with ``torch._decomp``'s table,
which maps aten ops to ``torch._refs`` and ``prims``). accel writes no op semantics here.

Runtime scalars are traced as *sentinels*: unusual values that are then turned back into
scalar placeholders. Tracing twice with two sentinel sets and comparing the graphs proves
that no scalar was folded into another constant or steered a branch; if one was, the
region runs eagerly (``TraceError``). Scalars an op's decomposition folds that way are
keyed by value instead (``ops._VALUE_SPECIALIZED``).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, List, Sequence

import torch
import torch.fx as fx
from torch.fx import traceback as fx_traceback

from .decompositions import decomposition_table
from .operands import eager_operands
from .ops import run_calls

log = logging.getLogger("accel.graph")

#: two sentinel sets (float, int) per scalar slot k, positive; a negative scalar's sentinels
#: are negated (the sign is part of the region key, zero a constant). The two differ in
#: integer part and fraction, so a truncation or a comparison folded at trace time shows up.
_SENTINELS = (
    (lambda k: 1000.2345678901234 + k * 3.0517578125e-05, lambda k: 1000003 + 7 * k),
    (lambda k: 2000.7654321098765 + k * 6.103515625e-05, lambda k: 2000029 + 11 * k),
)


class TraceError(Exception):
    """The region could not be traced to prims (an op without decomposition, ...)."""


@dataclass
class TraceResult:
    """A traced region.

    ``gm`` has one placeholder per external input (``x0``, ``x1``, ...) followed by one per
    runtime scalar (``s0``, ...) and returns the live outputs in order. Input mutations are
    ``aten.copy_.default(placeholder, value)`` nodes at its end.
    """

    gm: fx.GraphModule
    n_ext: int
    n_scalars: int


def _sentinels(scalar_types: Sequence[str], which: int) -> List[Any]:
    f, i = _SENTINELS[which]
    vals = [f(k) if t[0] == "f" else i(k) for k, t in enumerate(scalar_types)]
    return [-v if t.endswith("-") else v for v, t in zip(vals, scalar_types)]


def _region_fn(calls, n_ext, n_out_slots, live_idx, scalars, out_dtypes=None):
    calls = [(eager_operands(func),
              *rest) for func, *rest in calls]

    def fn(*ext):
        outs: List[Any] = [None] * n_out_slots

        def put(i, t):  # a result in eager's dtype where it differs from the decomposition's
            outs[i] = t if out_dtypes is None or t.dtype == out_dtypes[i] else t.to(out_dtypes[i])

        run_calls(calls, ext, outs, scalars, put)
        return tuple(outs[i] for i in live_idx)

    return fn


#: the key of ``node.meta["custom"]`` that numbers the eager kernel a traced node belongs to:
#: each aten call that reaches the tracer's decomposition table from the region's own code
#: (a recorded call, or one of the calls a composite op's kernel or decomposition makes) is
#: one kernel of eager's, and every node its decomposition makes carries its number. A pass
#: that replaces a node gives the nodes it builds that node's tag (``specialize_pow``,
#: ``sink_collapse_views``); other nodes passes build carry none.
#: :func:`accel.passes.round_products_across_kernels` reads it.
KERNEL = "accel_kernel"
_kernels = itertools.count()


def kernel_of(node: fx.Node):
    """The number of the eager kernel ``node`` computes part of (:data:`KERNEL`), or None."""
    custom = node.meta.get("custom")
    return custom.get(KERNEL) if isinstance(custom, dict) else None


@functools.lru_cache(maxsize=1)
def _kernel_tagged():
    """:func:`accel.decompositions.decomposition_table` with each decomposition, where it is
    called outside another, setting a new :data:`KERNEL` number in ``torch.fx.traceback``'s
    current node meta for the nodes it makes (copied onto them under
    ``preserve_node_meta``, as torch.export's ``fx.traceback.annotate`` does)."""
    def tagged(decompose):
        @functools.wraps(decompose)
        def run(*args, **kwargs):
            meta = fx_traceback.current_meta
            custom = meta.get("custom")
            if isinstance(custom, dict) and KERNEL in custom:  # a call inside a decomposition
                return decompose(*args, **kwargs)
            meta["custom"] = {**(custom or {}), KERNEL: next(_kernels)}
            try:
                return decompose(*args, **kwargs)
            finally:
                if custom is None:
                    meta.pop("custom", None)
                else:
                    meta["custom"] = custom
        return run

    return {op: tagged(f) for op, f in decomposition_table().items()}


def _trace(calls, ext_examples, n_out_slots, live_idx, scalars, out_dtypes=None) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functionalize

    from torch.utils._python_dispatch import _disable_current_modes

    fn = _region_fn(calls, len(ext_examples), n_out_slots, live_idx, scalars, out_dtypes)
    # the calls were recorded below autograd: traced without it, so that a parameter (a
    # leaf requiring grad) updated in place under no_grad, as an optimizer step does, traces
    # like any other input. Inference tensors may be written in place only inside
    # torch.inference_mode, where the program recorded such a call (its flush may come after
    # the block): traced in inference mode then, and only then (inference_mode(False) would
    # turn grad mode back on)
    inference = any(t.is_inference() for t in ext_examples)
    try:
        with _disable_current_modes(), (torch.inference_mode() if inference else
                                        contextlib.nullcontext()), torch.no_grad():
            with fx_traceback.preserve_node_meta():  # (copies each node's KERNEL tag)
                return make_fx(functionalize(fn, remove="mutations_and_views"),
                               decomposition_table=_kernel_tagged(),
                               tracing_mode="fake")(*ext_examples)
    except Exception as e:  # noqa: BLE001 - any tracing failure means: run eagerly
        raise TraceError(f"{type(e).__name__}: {e}") from e


def _match(a, b, sa, sb, uses):
    """Compare two traced constants; record scalar uses. Returns False on a mismatch."""
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_match(x, y, sa, sb, uses) for x, y in zip(a, b)))
    if isinstance(a, fx.Node):
        return isinstance(b, fx.Node) and a.name == b.name
    if type(a) in (int, float) and type(b) in (int, float):
        for k, (x, y) in enumerate(zip(sa, sb)):
            if a == x and b == y:
                uses.append(k)
                return True
        # a NaN constant of a decomposition (xlogy's, say) is the same constant in both
        return type(a) is type(b) and (a == b or (a != a and b != b))
    return type(a) is type(b) and a == b


def trace_region(calls, ext_examples, n_out_slots, live_idx, scalar_types,
                 out_dtypes=None) -> TraceResult:
    """Trace a region's calls into a prims graph with scalar placeholders.

    Args:
        calls: (OpOverload, arg templates, kwarg templates, number of new outputs) per call;
            templates are ``("x", j)`` external input, ``("o", i)`` region output,
            ``("s", k)`` runtime scalar, ``("c", value)`` constant.
        ext_examples: tensors (real or meta) with the external inputs' metadata.
        n_out_slots: number of region outputs; live_idx: the ones the graph returns.
        scalar_types: per runtime scalar ``"f"`` (float) or ``"i"`` (int), suffixed ``"-"``
            for a negative value (``"+"`` or nothing: positive), as in the region key.
        out_dtypes: the dtype of each region output as eager's kernel returns it (None:
            as traced); a traced result of another dtype is converted to it (CPU layer
            norm of bfloat16 returns its mean and rstd in bfloat16, its decomposition in
            float32), so that the calls after it and the kernel's buffer see eager's.

    Raises:
        TraceError: tracing failed, or a scalar is used in a way the sentinels cannot prove
            value-independent (the caller then runs the region eagerly).
    """
    sa, sb = _sentinels(scalar_types, 0), _sentinels(scalar_types, 1)
    ga = _trace(calls, ext_examples, n_out_slots, live_idx, sa, out_dtypes)
    if scalar_types:
        gb = _trace(calls, ext_examples, n_out_slots, live_idx, sb, out_dtypes)
        na, nb = list(ga.graph.nodes), list(gb.graph.nodes)
        if len(na) != len(nb):
            raise TraceError("scalar value changes the traced graph")
        repl = {}
        for x, y in zip(na, nb):
            uses: List[int] = []
            if x.op != y.op or x.target != y.target or not _match(
                    (x.args, tuple(x.kwargs.items())), (y.args, tuple(y.kwargs.items())),
                    sa, sb, uses):
                raise TraceError(f"scalar value changes the traced graph at {x.format_node()}")
            if uses:
                repl[x] = True
    else:
        repl = {}
    g = ga.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    anchor = phs[-1] if phs else None
    sph = []
    for k in range(len(scalar_types)):
        if anchor is None:
            with g.inserting_before(next(iter(g.nodes))):
                p = g.placeholder(f"s{k}")
        else:
            with g.inserting_after(anchor):
                p = g.placeholder(f"s{k}")
        p.meta["scalar_type"] = scalar_types[k][0]
        anchor = p
        sph.append(p)

    def sub(a):
        if isinstance(a, (list, tuple)):
            return type(a)(sub(v) for v in a)
        if type(a) in (int, float):
            for k, v in enumerate(sa):
                if a == v:
                    return sph[k]
        return a

    for n in repl:
        n.args = sub(n.args)
        n.kwargs = {k: sub(v) for k, v in n.kwargs.items()}
    g.lint()
    return TraceResult(fx.GraphModule(ga, g), len(phs), len(scalar_types))
