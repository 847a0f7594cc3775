"""Regions: runs of deferred aten calls, recorded against a trie of per-call keys and
executed at flush by one compiled kernel (or, as a fallback, eagerly).

A deferred call returns real tensors at once (``torch.empty_strided`` from the output
metadata cached in its trie node); their contents are written when the region flushes.
Wiring in a per-call key says which earlier region output (``("o", i)``) or which external
input (``("x", j, dtype, shape, stride, offset)``) each tensor argument is, so the trie path
of a region is a complete, static description of the program it runs.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import config
from .ops import CONST, DTYPES, SCALAR, TENSOR, OpSpec

log = logging.getLogger("accel")

_data_ptr = torch._C.TensorBase.data_ptr  # the real one: Tensor.data_ptr is an escape hook
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_storage_use_count = torch._C._storage_Use_Count
_untyped_storage = torch._C.TensorBase.untyped_storage  # likewise

#: marker in a trie node: the call cannot be deferred (its meta evaluation raised).
NOT_DEFERRABLE = object()


class TrieNode:
    """One step of a region: the call that led here and what follows it.

    ``outs`` holds the output metadata of that call: a tuple of (shape, stride, dtype) for
    each new tensor, or ``NOT_DEFERRABLE``; ``ret`` says which argument an in-place or
    ``out=`` call returns (``None`` for a new tensor). ``kernels`` maps a liveness mask to
    the compiled region ending here.
    """

    __slots__ = ("children", "outs", "ret", "kernels", "call", "parent", "depth")

    def __init__(self, parent=None, call=None):
        self.children: Dict[tuple, TrieNode] = {}
        self.outs = None
        self.ret = None
        self.kernels: Dict[tuple, Any] = {}
        self.call = call
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1

    def path(self) -> List[tuple]:
        """The per-call keys from the root to this node."""
        keys, n = [], self
        while n.parent is not None:
            keys.append(n.call)
            n = n.parent
        return keys[::-1]


ROOT = TrieNode()


class Deferred(Exception):
    """Internal: the call cannot join the region (reason in args[0])."""


class Region:
    """The pending region of one thread.

    ``ext`` are the external input tensors, ``outs`` the pending output tensors (strong
    refs until flush), ``scalars`` the runtime scalar arguments, ``calls`` the recorded
    calls as (func, arg template, kwarg template) with wiring references in place of
    tensors.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.node = ROOT
        self.ext: List[torch.Tensor] = []
        self.ext_ids: Dict[int, int] = {}
        self.outs: List[torch.Tensor] = []
        self.out_ids: Dict[int, int] = {}
        self.out_meta: List[tuple] = []
        self.scalars: List[Any] = []
        self.calls: List[tuple] = []
        self.lo = sys.maxsize
        self.hi = 0
        self.mutates_ext = False

    def __len__(self):
        return len(self.calls)

    # -- recording -------------------------------------------------------------------
    def _tensor_sig(self, t):
        if type(t) not in _TENSOR_TYPES or not t.is_cpu or t.layout != torch.strided:
            raise Deferred("tensor kind")
        i = self.out_ids.get(id(t))
        if i is not None and self.outs[i] is t:
            return ("o", i), ("o", i)
        if t.dtype not in DTYPES:
            raise Deferred("dtype")
        if self.outs:
            p = _data_ptr(t)
            if self.lo <= p < self.hi and self._aliases_pending(p):
                raise Deferred("alias")  # a view of a pending output: flush, then retry
        j = self.ext_ids.get(id(t))
        if j is None or self.ext[j] is not t:
            j = len(self.ext)
            self.ext.append(t)
            self.ext_ids[id(t)] = j
        return ("x", j, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()), ("x", j)

    def _aliases_pending(self, p):
        for t in self.outs:
            b = _data_ptr(t)
            if b <= p < b + _untyped_storage(t).nbytes():
                return True
        return False

    def _arg(self, kind, v, key, tmpl):
        tv = type(v)
        if kind == TENSOR and tv in _TENSOR_TYPES:
            k, w = self._tensor_sig(v)
            key.append(k)
            tmpl.append(w)
        elif (kind == TENSOR or kind == SCALAR) and (
                (tv is float and self._float_ok) or (tv is int and self._int_ok)):
            key.append("f" if type(v) is float else "i")
            tmpl.append(("s", len(self.scalars)))
            self.scalars.append(v)
        else:
            if isinstance(v, list):
                v = tuple(v)
            elif tv not in (bool, int, float, str, type(None), torch.dtype, torch.device,
                            torch.memory_format, torch.layout, tuple):
                raise Deferred("argument type")
            if tv is torch.device and v.type != "cpu":
                raise Deferred("device")  # a device copy: flush, then eager
            if tv is float and v != v:
                v = "nan"  # NaN != NaN would break dict lookups
            key.append(v)
            tmpl.append(("c", v))

    def record(self, func, spec: OpSpec, args, kwargs):
        """Defer one call; return its (real, unfilled) result tensor.

        Raises:
            Deferred: the call cannot be deferred; the region is left as it was.
        """
        n_ext, n_sc = len(self.ext), len(self.scalars)
        # A scalar converted to an integer or bool tensor's dtype is folded by the trace,
        # so there it is part of the key; elsewhere it is a runtime kernel argument.
        self._float_ok = self._int_ok = True
        for v in args:
            if type(v) in _TENSOR_TYPES and not v.is_floating_point():
                self._float_ok = False
                if v.dtype == torch.bool:
                    self._int_ok = False
        try:
            key = [func]
            targs, tkw = [], {}
            for kind, v in zip(spec.pos, args):
                self._arg(kind, v, key, targs)
            for name, v in kwargs.items():
                kind = spec.kw.get(name)
                if kind is None:
                    raise Deferred("keyword")
                key.append(name)
                t = []
                self._arg(kind, v, key, t)
                tkw[name] = t[0]
            key = tuple(key)
            node = self.node.children.get(key)
            if node is None:
                node = self._new_node(func, spec, key, targs, tkw)
            if node.outs is NOT_DEFERRABLE:
                raise Deferred("meta")
        except Deferred:
            self._rollback(n_ext, n_sc)
            raise
        self.node = node
        self.calls.append((func, tuple(targs), tkw, 0 if node.ret is not None else len(node.outs)))
        if node.ret is not None:
            if spec.mutates and isinstance(node.ret, tuple) and node.ret[0] == "x":
                self.mutates_ext = True
            return self._resolve(node.ret)
        out = []
        for shape, stride, dtype in node.outs:
            t = torch.empty_strided(shape, stride, dtype=dtype)
            self.out_ids[id(t)] = len(self.outs)
            self.outs.append(t)
            self.out_meta.append((shape, stride, dtype))
            p = _data_ptr(t)
            if p < self.lo:
                self.lo = p
            e = p + _untyped_storage(t).nbytes()
            if e > self.hi:
                self.hi = e
            out.append(t)
        return out[0]

    def _rollback(self, n_ext, n_sc):
        for t in self.ext[n_ext:]:
            self.ext_ids.pop(id(t), None)
        del self.ext[n_ext:]
        del self.scalars[n_sc:]

    def _resolve(self, ref):
        return self.outs[ref[1]] if ref[0] == "o" else self.ext[ref[1]]

    def meta_args(self, targs, tkw, scalars=None):
        """Meta tensors standing for a call's arguments (for output metadata)."""
        sc = self.scalars if scalars is None else scalars

        def m(r):
            if r[0] == "o":
                shape, stride, dtype = self.out_meta[r[1]]
                return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if r[0] == "x":
                t = self.ext[r[1]]
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            return sc[r[1]] if r[0] == "s" else r[1]

        return [m(r) for r in targs], {k: m(r) for k, r in tkw.items()}

    def _new_node(self, func, spec, key, targs, tkw):
        node = TrieNode(self.node, key)
        try:
            margs, mkw = self.meta_args(targs, tkw)
            res = func(*margs, **mkw)
            if spec.mutates:
                name = spec.mutates[0]
                ref = tkw[name] if name in tkw else targs[0]
                node.ret = ref
                node.outs = ()
            else:
                if not isinstance(res, torch.Tensor) or res.dtype not in DTYPES:
                    raise TypeError("result dtype")
                node.outs = ((tuple(res.shape), res.stride(), res.dtype),)
        except Exception as e:  # eager will raise the user-facing error, if any
            log.debug("not deferring %s: %s", func, e)
            node.outs = NOT_DEFERRABLE
        self.node.children[key] = node
        return node

    # -- flush -----------------------------------------------------------------------
    def liveness(self) -> Tuple[bool, ...]:
        """Which pending outputs are still observable: held by Python, by another
        TensorImpl (autograd's saved values, views) or sharing storage with one."""
        live = []
        for t in self.outs:
            # refs: self.outs, the loop variable, getrefcount's argument
            live.append(sys.getrefcount(t) > 3 or t._use_count() > 1
                        or _storage_use_count(_untyped_storage(t)._cdata) > 2)
        return tuple(live)

    def ext_overlap(self) -> bool:
        """True if a mutated external input shares memory with another external input."""
        spans = []
        for t in self.ext:
            s = _untyped_storage(t)
            spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
        for i in range(len(spans)):
            for j in range(i):
                a, b = spans[i], spans[j]
                if a[0] < b[1] and b[0] < a[1]:
                    return True
        return False
