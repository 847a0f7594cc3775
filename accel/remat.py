"""Rematerializing the values autograd saves from a region: recomputed in the backward.

An eager program's autograd saves the intermediates its backward formulas need. A bias +
tanh-GELU (``0.5 * h * (1 + tanh(c * (h + 0.044715 * h ** 3))))``, the GPT-2 MLP's) saves
``h``, ``0.5 * h``, ``tanh(...)`` and ``1 + tanh(...)``: its region writes them besides its
result, and the backward reads them back. torch.compile's partitioner
(``min_cut_rematerialization_partition``, AOT autograd) saves ``h`` alone and recomputes the
rest inside the backward's fused kernel. This module does the same for accel's regions,
through autograd's own per-tensor hooks (``SavedTensor.register_hooks``, the API under
``torch.autograd.graph.saved_tensors_hooks``):

- At a region's flush, before its liveness is read, each value the region's calls saved
  is found through the calls' autograd nodes (``outs[i].grad_fn``, whose ``_raw_saved_<arg>``
  is the call's argument ``<arg>`` or its ``result``). A saved output that pointwise calls
  of the region compute from *anchors* (outputs or inputs autograd saves as themselves, or
  leaves that require grad: kept alive anyway) is packed as a recipe, not a tensor. Nothing
  else holds it, so the region's kernel no longer writes it. A call with several results
  counts too (a normalization saves its input; ``resultK`` is its output K), and a group
  norm's or a training batch norm's output is rebuilt from its input and statistics by a
  call of accel's (:data:`_DERIVED`: ``accel.group_norm_apply``, ``accel.batch_norm_apply``),
  which a SiLU after the norm saves.
- In the backward, unpacking it runs the recipe's calls on the anchors (under
  ``no_grad``). Under ``accel.eager()`` those calls are recorded into the backward's region
  and fused with the formula that reads the value (CSE merges the recipes' shared calls).
- An output still live at the flush (the program holds it) is written as before, and the
  hook returns it. An anchor modified in place since raises eager's error at the unpack.

A plan per trie node (``TrieNode.remat``) says which (node, saved name) pairs to hook; it is
built at the node's first flush with autograd nodes, from the calls' schemas, without
unpacking anything (a saved value may carry a program's own hooks: ``register_hooks``
then refuses, and the value is saved as before). Regions writing an output in place are
left alone; a call writing an input (a batch norm's running statistics) leaves the rest
planned, unless a recipe reads that input or its storage. ``ACCEL_REMAT``: ``auto`` (values
of at least :data:`AUTO_MIN_BYTES`: 2 MiB on the CPU, 128 MiB on a GPU), ``on`` (every value,
every device), ``off``.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from . import library  # noqa: F401 - registers torch.ops.accel.* (accel.group_norm_apply)
from .ops import op_spec, resolver, written_refs
from .region import ROOT, storage_base
from .runtime import STATS

log = logging.getLogger("accel.remat")

__all__ = ["prepare", "set_mode", "RecomputeGroup", "RecomputedValue", "MAX_RECIPE_CALLS", "PLAN_TRIES",
           "AUTO_MIN_BYTES"]

#: the most calls one recomputed value's recipe may take (its cost in the backward)
MAX_RECIPE_CALLS = 12
#: flushes of a trie node whose calls had no autograd node before it is planned as nothing
PLAN_TRIES = 3

#: ``ACCEL_REMAT=auto``: the bytes a saved value must have, by device type, to be recomputed
#: (None or no entry: none is). Recomputing a value saves its write in the forward and its
#: read in the backward, and costs the host its hooks and its recipe's calls in the
#: backward: 90-100 us a GroupNorm -> SiLU step recomputing two values, on the 2-core dev
#: VM and on the H100's host alike (``scratch``'s ``hook_cost.py``, off and on alternated
#: call by call, each call synchronized; the ninety-sixth round). On the dev VM the step
#: broke even at 2 MiB a value (770 us off, 798 on) and gained from there (3 MiB: 1181 ->
#: 962 us; 4 MiB: 1530 -> 1108). On the H100 it lost 100 us up to 32 MiB a value (1026 ->
#: 1127) and gained at 128 MiB (1349 -> 1308); cat_groupnorm_train's 256 MiB value: 1.88 ->
#: 1.62 ms a step. A GPU step bound by its host (the demo's: 4 MiB values) is left alone.
AUTO_MIN_BYTES: Dict[str, Optional[int]] = {"cpu": 2 << 20, "cuda": 128 << 20}

_NONE: tuple = ()
_mode = "auto"  # ACCEL_REMAT, read at each enable
_planned: Optional[str] = None  # the mode the trie's plans were made under (auto or on)
_SavedTensor = torch._C._autograd.SavedTensor
_pointwise = torch.Tag.pointwise
_saved_names: Dict[type, Tuple[str, ...]] = {}  # autograd node class -> its saved tensors' names
_node_prefix: Dict[object, str] = {}  # OpOverload -> its autograd node's class name prefix
#: excluded while the hooks are registered and kept values detached, inside a flush: packing
#: a value saved as itself detaches it, and such calls go straight to their kernels (the
#: mode would pass them through; a flush can run below the key that notes the thread's key
#: set for the Python key's fallback)
_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def set_mode(mode: str) -> None:
    """``ACCEL_REMAT``: ``auto`` (values of :data:`AUTO_MIN_BYTES`), ``on`` (every value on
    every device) or ``off``. A trie node keeps the plan its first flush made; switching
    between ``auto`` and ``on`` forgets every plan, to be made again under the new mode
    (``off`` plans nothing and forgets nothing)."""
    global _mode, _planned
    _mode = mode
    if mode != "off" and mode != _planned:
        if _planned is not None:
            stack = [ROOT]
            while stack:
                node = stack.pop()
                node.remat = None
                stack.extend(node.children.values())
        _planned = mode


def _names(cls) -> Tuple[str, ...]:
    names = _saved_names.get(cls)
    if names is None:
        names = _saved_names[cls] = tuple(a[11:] for a in dir(cls) if a.startswith("_raw_saved_"))
    return names


def _prefix(func) -> str:
    """The class name autograd's codegen gives ``func``'s node, up to the overload's number
    (``aten.pow.Tensor_Scalar`` -> ``PowBackward``, ``aten._softmax`` -> ``SoftmaxBackward``)."""
    p = _node_prefix.get(func)
    if p is None:
        base = func._schema.name.split("::")[-1]
        p = _node_prefix[func] = "".join(w[:1].upper() + w[1:] for w in base.split("_") if w) + "Backward"
    return p


class RecomputeGroup:
    """The values one flush of a region hooked, recomputed together in the backward.

    ``plan`` is the trie node's (see :func:`_plan`): the union of the values' recipes as
    ``(output index, OpOverload, arg templates, kwarg templates)`` in call order, over
    anchors ``("o", i)``, ``("x", k)`` and views of anchors ``("v", i, shape, stride)``,
    runtime scalars ``("s", k)`` and constants ``("c", v)``; and for each target output
    the recipe's output indices it needs. The group keeps the anchors and their version
    counters at the flush, the runtime scalars, the targets still live at the flush
    (``kept``: written by the kernel, returned as themselves), and the values computed for
    one unpack that a later one needs (``cache``, dropped once no pending unpack needs
    them: a value the backward's region no longer needs is not written).

    Raises (``unpack``):
        RuntimeError: an anchor or a kept output was modified in place after it was saved
            (eager's "modified by an inplace operation" error).
    """

    __slots__ = ("calls", "needs", "outs", "ext", "scalars", "versions", "kept", "cache",
                 "remaining", "views")

    def __init__(self, plan, outs, ext, scalars):
        _entries, calls, needs, o_anchors, x_anchors, s_idx = plan
        self.calls, self.needs = calls, needs
        self.outs = {a: outs[a] for a in o_anchors}
        self.ext = {a: ext[a] for a in x_anchors}
        self.scalars = {a: scalars[a] for a in s_idx}
        self.versions = (tuple(t._version for t in self.outs.values()),
                         tuple(t._version for t in self.ext.values()))
        self.kept: Dict[int, tuple] = {}
        self.cache: Dict[int, torch.Tensor] = {}
        self.remaining: Dict[int, int] = {}
        self.views: Dict[tuple, torch.Tensor] = {}  # the anchors' views the recipes read

    def expect(self, j) -> None:
        """One more hooked saved value will unpack target ``j``."""
        for o in self.needs[j]:
            self.remaining[o] = self.remaining.get(o, 0) + 1

    def forget(self, j) -> None:
        """A hook for target ``j`` was not registered after all."""
        for o in self.needs[j]:
            self.remaining[o] -= 1

    def unpack(self, j, first: bool):
        kept = self.kept.get(j)
        if kept is not None:
            if kept[0]._version != kept[1]:
                _modified(kept[0], kept[1])
            return kept[0]
        for d, vs in zip((self.outs, self.ext), self.versions):
            for t, v in zip(d.values(), vs):
                if t._version != v:
                    _modified(t, v)
        need = self.needs[j]
        vals = dict(self.outs)
        vals.update(self.cache)
        res = resolver(self.ext, vals, self.scalars, self.views)

        with torch.no_grad():
            for o in need:
                if o not in vals:
                    func, targs, tkw = self.calls[o]
                    vals[o] = func(*[res(r) for r in targs], **{n: res(r) for n, r in tkw.items()})
        out = vals[j]
        if first:  # keep what later unpacks need, and only that
            rem, cache = self.remaining, self.cache
            for o in need:
                n = rem.get(o, 0) - 1
                rem[o] = n
                if n > 0:
                    cache[o] = vals[o]
                else:
                    cache.pop(o, None)
        return out


class RecomputedValue:
    """One hooked saved value: target output ``j`` of a :class:`RecomputeGroup`. ``pack``
    and ``unpack`` are its ``SavedTensor.register_hooks`` hooks."""

    __slots__ = ("group", "j", "unpacked")

    def __init__(self, group, j):
        self.group, self.j, self.unpacked = group, j, False
        group.expect(j)

    def pack(self, _tensor):
        return self

    def unpack(self, _self):
        first = not self.unpacked
        self.unpacked = True
        return self.group.unpack(self.j, first)


def _modified(t, expected) -> None:
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected "
        f"version {expected} instead. (accel recomputes this saved value from it in the "
        "backward; ACCEL_REMAT=off saves it as eager does.)")


def _plan(region, min_bytes: int = 0) -> tuple:
    """The plan for ``region``'s trie node: ``(entries, calls, needs, anchor outputs,
    anchor inputs, scalar indices)``; ``entries`` the saved values to hook, as (index of
    the output whose autograd node saved it, the node's class, the saved name, the saved
    output's index); ``calls`` the recipes' calls by output index; ``needs`` each target's
    recipe (output indices, call order). Saved values of fewer than ``min_bytes`` bytes
    are saved as themselves. ``()`` where there is nothing to recompute, ``None`` where no
    call of the region has an autograd node yet (decided later)."""
    calls, outs, ext = region.calls, region.outs, region.ext
    producer: Dict[int, int] = {}  # output index -> call index (single-output calls)
    first_out: List[Optional[int]] = []
    written = []  # the inputs calls write (a batch norm's running statistics)
    k = 0
    for ci, (func, targs, tkw, n_new) in enumerate(calls):
        if func._schema.is_mutable:
            refs = written_refs(op_spec(func), targs, tkw)
            if any(r[0] != "x" for r in refs if r != ("c", None)):
                return _NONE  # an output written in place: left alone
            written.extend(ext[r[1]] for r in refs if r[0] == "x")
        first_out.append(k if n_new else None)
        if n_new == 1:
            producer[k] = ci
        k += n_new
    if k != len(outs):
        return _NONE
    derived = {}  # output index -> the call that computes it from its call's other results
    for ci, (func, targs, tkw, n_new) in enumerate(calls):
        rule = _DERIVED.get(func)
        if rule is not None and outs[first_out[ci]].dtype in (torch.float32, torch.float64):
            call = rule(first_out[ci], targs)
            if call is not None:
                derived[first_out[ci]] = call
    saved: Dict[tuple, List[tuple]] = {}  # ("o", j) / ("x", k) -> [(i, node class, name)]
    viewed = set()  # ("o", j) of outputs a saved view keeps
    any_node = False
    for ci, (func, targs, tkw, n_new) in enumerate(calls):
        i = first_out[ci]
        if i is None:
            continue
        node = outs[i].grad_fn  # a multi-output call's outputs share their node
        if node is None:
            continue
        any_node = True
        cls = type(node)
        if not cls.__name__.startswith(_prefix(func)):
            continue  # not this call's node (the call ran inside another op's kernel)
        args = func._schema.arguments
        for name in _names(cls):
            if name == "result" and n_new == 1:
                ref = ("o", i)
            elif name[:6] == "result" and name[6:].isdigit():  # resultK: output K of several
                if int(name[6:]) >= n_new:
                    continue
                ref = ("o", i + int(name[6:]))
            else:
                pos = next((p for p, a in enumerate(args) if a.name == name), None)
                if pos is None:
                    continue
                ref = targs[pos] if pos < len(targs) else tkw.get(name)
                if ref is None or ref[0] not in ("o", "x", "v"):
                    continue
                if ref[0] == "v":  # a view of an output, saved: the output is kept
                    viewed.add(("o", ref[1]))
                    continue
            saved.setdefault(ref, []).append((i, cls, name))
    if not any_node:
        return None
    anchors = {r for r in saved if r[0] == "x"} | viewed
    anchors.update(("x", j) for j, t in enumerate(ext) if t.is_leaf and t.requires_grad)
    # saved outputs that no recipe computes (a reduction's, a statistic a normalization
    # returns beside its output): anchors before any recipe is made
    anchors.update(r for r in saved if r[0] == "o" and r[1] not in producer and r[1] not in derived)
    entries, calls_of, needs, leaves = [], {}, {}, set()
    for ref in sorted((r for r in saved if r[0] == "o"), key=lambda r: r[1]):
        t = outs[ref[1]]
        recipe = None
        if t.numel() * t.element_size() >= min_bytes:
            recipe = _recipe(ref[1], calls, producer, derived, anchors)
        if recipe is None:
            anchors.add(ref)
            continue
        needs[ref[1]] = tuple(o for o, _, _, _ in recipe)
        for o, func, targs, tkw in recipe:
            calls_of[o] = (func, targs, tkw)
            leaves.update((r[0] if r[0] != "v" else "o", r[1]) for r in (*targs, *tkw.values())
                          if r[0] in ("o", "x", "v"))
            leaves.update(("s", r[1]) for r in (*targs, *tkw.values()) if r[0] == "s")
        entries.extend((i, cls, name, ref[1]) for i, cls, name in saved[ref])
    if not entries:
        return _NONE
    if written:  # a recipe reading an input the region writes, or one sharing its storage
        bases = {storage_base(t) for t in written}
        if any(storage_base(ext[j]) in bases for t, j in leaves if t == "x"):
            return _NONE
    return (tuple(entries), calls_of, needs,
            tuple(sorted(j for t, j in leaves if t == "o" and ("o", j) in anchors)),
            tuple(sorted(j for t, j in leaves if t == "x")),
            tuple(sorted(j for t, j in leaves if t == "s")))


def _recipe(j, calls, producer, derived, anchors):
    """The pointwise calls that compute output ``j`` from ``anchors``, in call order, as
    (output index, func, arg templates, kwarg templates); None where there are none (or
    more than MAX_RECIPE_CALLS). ``derived``: outputs of several-output calls that a call
    of their own computes (:data:`_DERIVED`)."""
    need: Dict[int, tuple] = {}
    todo = [j]
    while todo:
        o = todo.pop()
        if o in need or ("o", o) in anchors and o != j:
            continue
        if o in derived:
            func, targs, tkw = derived[o]
        else:
            ci = producer.get(o)
            if ci is None:
                return None
            func, targs, tkw, _ = calls[ci]
            if _pointwise not in func.tags:
                return None
        for r in (*targs, *tkw.values()):
            tag = r[0]
            if tag == "o":
                if ("o", r[1]) not in anchors:
                    todo.append(r[1])
            elif tag == "x":
                if r not in anchors:
                    return None
            elif tag == "v":  # a view of an output the recipe does not compute
                if ("o", r[1]) not in anchors:
                    return None
            elif tag not in ("s", "c"):
                return None
        need[o] = (o, func, targs, tkw)
        if len(need) > MAX_RECIPE_CALLS:
            return None
    return [need[o] for o in sorted(need)]


def _group_norm_output(i, targs) -> tuple:
    """``native_group_norm``'s output (index ``i``) from its input and the call's mean and
    rstd (outputs ``i + 1``, ``i + 2``): ``accel.group_norm_apply``'s call, as (func, arg
    templates, kwarg templates)."""
    inp, weight, bias, group = targs[0], targs[1], targs[2], targs[6]
    return torch.ops.accel.group_norm_apply.default, (inp, ("o", i + 1), ("o", i + 2), weight, bias, group), {}


def _batch_norm_output(i, targs) -> Optional[tuple]:
    """A training batch norm's output (index ``i``) from its input and the call's saved mean
    and inverse standard deviation (outputs ``i + 1``, ``i + 2``): ``accel.batch_norm_apply``'s
    call; None in eval mode (those outputs are then empty or the running statistics')."""
    if targs[5] != ("c", True):
        return None
    inp, weight, bias = targs[0], targs[1], targs[2]
    return torch.ops.accel.batch_norm_apply.default, (inp, ("o", i + 1), ("o", i + 2), weight, bias), {}


#: several-output calls whose first output a call of accel's computes from the call's
#: inputs and other outputs, elementwise: OpOverload -> rule(first output's index, arg
#: templates) -> (func, arg templates, kwarg templates), or None where it does not apply.
#: A normalization's output, which a SiLU after a group norm or a batch norm saves,
#: recomputed from the saved input and statistics.
#: float32 and float64 outputs only (16-bit statistics are rounded: the output recomputed
#: from them is not the one the forward computed).
_DERIVED = {torch.ops.aten.native_group_norm.default: _group_norm_output,
            torch.ops.aten.native_batch_norm.default: _batch_norm_output,
            torch.ops.aten._native_batch_norm_legit.default: _batch_norm_output}


def prepare(region) -> None:
    """Before ``region``'s flush (its calls' autograd nodes made): hook the saved outputs
    its plan recomputes, so that nothing holds them but the program; those the program
    still holds stay saved as themselves (see the module's docstring). Errors leave the
    values saved as autograd saved them."""
    if _mode == "off":
        return
    node = region.node
    plan = node.remat
    if plan is None or type(plan) is int:
        limit = 0
        if _mode == "auto":
            limit = AUTO_MIN_BYTES.get("cpu" if region.device is None else region.device.type)
            if limit is None:
                node.remat = _NONE
                return
        try:
            new = _plan(region, limit)
        except Exception as e:  # noqa: BLE001 - a schema or node accel did not expect
            log.debug("accel: no rematerialization plan (%s: %s)", type(e).__name__, e)
            new = _NONE
        if new is None:  # no autograd node (no_grad, a backward): asked again, PLAN_TRIES times
            tries = (plan or 0) + 1
            node.remat = _NONE if tries >= PLAN_TRIES else tries
            return
        node.remat = plan = new
    if not plan:
        return
    outs = region.outs
    hooked: List[tuple] = []
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        empty = _hook(plan, region, hooked)
        if hooked:
            live = region.liveness()
            n = 0
            for j, group in hooked:
                if not live[j]:
                    n += 1
                elif j not in group.kept:
                    # the program holds it: the kernel writes it, the hook returns it; detached
                    # (the same storage and version counter), as autograd saves an output for
                    # its own node: the node would otherwise hold itself through the hook
                    group.kept[j] = (outs[j].detach(), outs[j]._version)
            STATS["recomputed_saves"] += n
    if empty:  # saved only where an input needs a gradient, and none did: not hooked again
        entries = tuple(e for e in plan[0] if e not in empty)
        node.remat = (entries, *plan[1:]) if entries else _NONE


def _hook(plan, region, hooked: List[tuple]) -> list:
    """Register the hooks of ``plan``'s entries whose autograd node is the one planned for
    (one :class:`RecomputeGroup` for them all); append (target, group) to ``hooked``.
    ``register_hooks`` refuses a saved value that has hooks already (the program's: it stays
    as it is) or holds nothing (a multiplication by a constant saves the other factor only
    where the constant needs a gradient): those entries are returned."""
    outs = region.outs
    group = None
    empty = []
    for i, cls, name, j in plan[0]:
        node = outs[i].grad_fn
        if type(node) is not cls:
            continue
        if group is None:
            group = RecomputeGroup(plan, outs, region.ext, region.scalars)
        raw = getattr(node, "_raw_saved_" + name, None)
        if type(raw) is not _SavedTensor:
            continue
        v = RecomputedValue(group, j)
        try:
            raw.register_hooks(v.pack, v.unpack)
        except RuntimeError as e:
            group.forget(j)
            if "value None" in str(e):
                empty.append((i, cls, name, j))
            continue
        hooked.append((j, group))
    return empty
