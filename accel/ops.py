"""Op tables, as data: which aten op overloads accel defers into regions, and how it reads
their arguments.

The pointwise set comes from torch's own op tags (``torch.Tag.pointwise``), restricted to
ops that ``torch._decomp`` can decompose to prims (the semantics accel compiles) and that
are not random. Views run eagerly without reading data. Anything else flushes the region
and runs eagerly.
"""
from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional, Tuple

import torch

aten = torch.ops.aten

# Argument kinds of an op schema, as the hot path reads them.
TENSOR, SCALAR, CONST = 0, 1, 2

#: marker in a trie node: the call cannot be deferred (its meta evaluation raised).
NOT_DEFERRABLE = type("NotDeferrable", (), {"__repr__": lambda self: "NOT_DEFERRABLE"})()


class Deferred(Exception):
    """Internal: a call cannot join the region; ``args[0]`` says why (``"alias"``: it reads
    a view of a pending output, so flush and retry)."""

#: dtypes whose results accel computes; float16/bfloat16/complex stay eager (v0).
DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.bool})

#: ops that run eagerly without flushing: they create views or metadata, read no data.
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default,
    aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.slice.Tensor, aten.select.int, aten.as_strided.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.narrow.default,
    aten.view_as_real.default, aten.unfold.default, aten.diagonal.default,
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.lift_fresh.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
    aten.sym_storage_offset.default, aten.is_same_size.default,
})

#: pointwise ops not tagged as such in torch, or whose decomposition accel relies on.
_EXTRA = (aten._to_copy.default, aten.copy_.default, aten.fill_.Scalar, aten.zero_.default,
          aten.fill.Scalar, aten.scalar_tensor.default)

#: scalar arguments whose *value* eager specializes on (e.g. pow(x, 2) is x*x, pow(x, 0.5)
#: is sqrt): they are part of the key, never runtime arguments.
_VALUE_SPECIALIZED = {"pow": {"exponent", "self"}, "float_power": {"exponent", "self"},
                      "round": {"decimals"}}

#: ops that eager refuses to run on integer tensors with a zero divisor, raising at the call;
#: a kernel cannot raise there, so on integer (and bool) results they run eagerly.
INTEGER_DIVISION = frozenset({"div", "floor_divide", "remainder", "fmod"})

#: pointwise-tagged ops accel does not take: no useful decomposition, or non-numeric results.
_DENY = {"equal", "polygamma", "polygamma_", "_conj_physical", "angle", "rrelu",
         "logit_backward"}


class OpSpec(NamedTuple):
    """How the hot path reads one op overload's arguments.

    ``pos`` gives the kind (TENSOR / SCALAR / CONST) of each positional argument and
    ``kw`` of each keyword argument; ``mutates`` lists the argument names written in place
    (``self`` for ``add_``, ``out`` for ``add.out``).
    """

    pos: Tuple[int, ...]
    kw: Dict[str, int]
    mutates: Tuple[str, ...]


def _kind(op_name: str, arg) -> int:
    t = str(arg.type)
    if "Tensor" in t:
        return TENSOR if t in ("Tensor", "Optional[Tensor]") else -1
    if t in ("number", "float", "Optional[number]", "Optional[float]"):
        return CONST if arg.name in _VALUE_SPECIALIZED.get(op_name.rstrip("_"), ()) else SCALAR
    return CONST


def _spec(op) -> Optional[OpSpec]:
    name = op._schema.name.split("::")[1]
    pos, kw, mut = [], {}, []
    for a in op._schema.arguments:
        k = _kind(name, a)
        if k < 0:
            return None  # Tensor[] and friends: not pointwise-fusible here
        if a.alias_info is not None and a.alias_info.is_write:
            mut.append(a.name)
        if a.kwarg_only:
            kw[a.name] = k
        else:
            pos.append(k)
    rets = op._schema.returns
    if len(rets) != 1 or str(rets[0].type) != "Tensor":
        return None
    return OpSpec(tuple(pos), kw, tuple(mut))


@functools.lru_cache(maxsize=None)
def fusible_ops() -> Dict[object, OpSpec]:
    """Map each deferrable aten ``OpOverload`` to its :class:`OpSpec` (built once, ~0.3 s)."""
    from torch._decomp import decomposition_table

    table = {}
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::"):
            continue
        name = s.name[6:]
        if name in _DENY or name.startswith("special_") or name.startswith("_foreach"):
            continue
        try:
            op = getattr(getattr(aten, name), s.overload_name or "default")
        except (AttributeError, RuntimeError):
            continue
        tags = op.tags
        if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
            continue
        if op not in decomposition_table:
            continue
        spec = _spec(op)
        if spec is not None:
            table[op] = spec
    for op in _EXTRA:
        spec = _spec(op)
        if spec is not None:
            table[op] = spec
    return table
