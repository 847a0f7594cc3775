"""Regions: runs of deferred aten calls, recorded against a trie of per-call keys and
executed at flush by one compiled kernel (or, as a fallback, eagerly).

A deferred call returns real tensors at once (``torch.empty_strided`` from the output
metadata cached in its trie node); their contents are written when the region flushes.
Wiring in a per-call key says which earlier region output (``("o", i)``), which view of one
(``("v", i, shape, stride[, offset])``: a split of its dims or a strided view,
:func:`accel.ops.pending_view`) or which
external input (``("x", j, dtype, shape, stride, offset)``) each tensor argument is, so the
trie path of a region is a complete, static description of the program it runs.
"""
from __future__ import annotations

import hashlib
import logging
import warnings
from typing import Any, Dict, List, Optional

import torch

from . import config
from .ops import (DTYPES, EMPTY_RESULTS, HALF, INTEGER_DIVISION, NOT_DEFERRABLE, REAL_SIZE_PROBES,
                  ROUNDED_RESULTS, RUNS_EAGERLY, Deferred, written_refs)

if config.flag("ACCEL_PURE_PYTHON"):
    from . import _core_py as native
else:
    try:
        from . import _core as native
    except ImportError as _e:  # an uncompiled checkout: the pure-Python twin
        logging.getLogger("accel").warning("accel._core unavailable (%s); using pure Python", _e)
        from . import _core_py as native
RegionCore = native.RegionCore
set_cuda_half = native.set_cuda_half
set_small_regions = native.set_small_regions

log = logging.getLogger("accel")

_data_ptr = torch._C.TensorBase.data_ptr  # the real one: Tensor.data_ptr is an escape hook


def storage_base(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: its data pointer less its offset in bytes (through
    the real ``data_ptr``: accel's ``Tensor.data_ptr`` hook flushes the region)."""
    return _data_ptr(t) - t.storage_offset() * t.element_size()
_untyped_storage = torch._C.TensorBase.untyped_storage  # likewise


def _above_python():
    """The dispatch keys above the Python key, the ones the interceptor's dispatch mode runs
    below (autograd, ADInplaceOrView, autocast, functorch's layers and transforms,
    functionalization, the dispatch filter's...), less the keys that say how a tensor's
    data reads (conjugate, negative and zero tensors)."""
    K, keyset = torch._C.DispatchKey, torch._C.DispatchKeySet
    above = torch._C._dispatch_keyset_full() - torch._C._dispatch_keyset_full_after(K.Python)
    for k in (K.Conjugate, K.Negative, K.ZeroTensor):
        above = above - keyset(k)
    return above


_ABOVE_PYTHON = _above_python()


class TrieNode:
    """One step of a region: the call that led here and what follows it.

    ``outs`` holds the output metadata of that call: a tuple of (shape, stride, dtype,
    bytes spanned) for each tensor it returns (``None`` for an undefined one), or
    ``NOT_DEFERRABLE``; ``multi``: it returns a tuple; ``n_new``: how many new tensors;
    ``ret`` says which argument an in-place or ``out=`` call returns (``None`` for new
    tensors); ``writes_ext``: it writes an external input. ``kernels`` maps a liveness mask
    to the compiled region ending here; ``predict``, on a region's first call, how the last
    regions that began with it ended (for launching their kernel ahead); ``written``, once
    a region ending here was flushed, the external inputs it writes (indices);
    ``overlap_args``, once recorded where it writes an external input, which of the call's
    arguments to check for shared storage (:func:`accel.ops.overlap_args`);
    ``eager_first``, on a region's first call, whether the call runs eagerly instead
    (the first region that began here was small, or the regions that began here flushed
    while their GPU was idle: see ``accel.interceptor``; None: not decided yet). ``idle``,
    on a region's first call, how many flushes in a row of regions that began here found
    their GPU idle, and on any node -1 once the regions ending (or, at a first call,
    beginning) here are no longer sampled for that. ``remat``, on a region's last node, the
    saved values its flush hooks to recompute in the backward (:mod:`accel.remat`; None: not
    planned yet; an int: flushes so far without autograd nodes).
    """

    __slots__ = ("children", "outs", "ret", "multi", "n_new", "writes_ext", "kernels", "call",
                 "parent", "depth", "digest", "predict", "written", "eager_first", "idle",
                 "overlap_args", "remat")

    def __init__(self, parent=None, call=None):
        self.children: Dict[tuple, TrieNode] = {}
        self.outs = None
        self.ret = None
        self.multi = False
        self.n_new = 0
        self.writes_ext = False
        self.kernels: Dict[tuple, Any] = {}
        self.predict = None  # regions starting here: how the last ones ended (launch.Prediction)
        self.written = None
        self.overlap_args = None  # where it writes an external input: accel.ops.overlap_args
        self.eager_first = None
        self.remat = None  # the saved values recomputed in the backward (accel.remat)
        self.idle = 0
        self.call = call
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        # names this path in the store: the node's metadata survives the process
        seed = parent.digest if parent is not None else _root_seed()
        self.digest = hashlib.blake2b(seed + repr(call).encode(), digest_size=16).digest()

    def record(self) -> Optional[tuple]:
        """The node's metadata as stored: None if not deferrable."""
        if self.outs is NOT_DEFERRABLE:
            return None
        return (self.outs, self.ret, self.multi, self.writes_ext)

    def set(self, rec: Optional[tuple]) -> None:
        """Fill the node from :meth:`record`'s value."""
        if rec is None:
            self.outs, self.ret = NOT_DEFERRABLE, None
            return
        self.outs, self.ret, self.multi, self.writes_ext = rec
        self.n_new = 0 if self.ret is not None else sum(m is not None for m in self.outs)

    def path(self) -> List[tuple]:
        """The per-call keys from the root to this node."""
        keys, n = [], self
        while n.parent is not None:
            keys.append(n.call)
            n = n.parent
        return keys[::-1]


def _root_seed() -> bytes:
    from .build import source_hash

    return f"{source_hash()}|{torch.__version__}".encode()


ROOT = TrieNode()

#: trie node metadata computed in this process, not yet written to the store
PENDING_NODES: Dict[bytes, Optional[tuple]] = {}
#: trie nodes made in this process (calls met for the first time after their predecessor)
NEW_NODES = [0]


#: node metadata read ahead from the store (:func:`accel.runtime.prefetch_working_set`),
#: by digest: taken where that store (``runtime.prefetched_from``) is the process's
PREFETCHED_NODES: Dict[bytes, object] = {}


def _stored_node(digest: bytes):
    """The node's metadata from the store (read ahead where the import's thread did):
    the record, or ``_MISS``."""
    from . import runtime

    try:
        store = runtime.get_store()
        rec = PREFETCHED_NODES.pop(digest, None) if store is runtime.prefetched_from else None
        if rec is None:
            rec = store.get_node(digest)
    except Exception:  # noqa: BLE001 - a store problem: compute it
        return _MISS
    if rec is None:
        return _MISS
    return None if rec == _NOT_DEFERRABLE_TAG else rec


_MISS = object()
_NOT_DEFERRABLE_TAG = "not deferrable"


def _meta_of(t: torch.Tensor) -> tuple:
    """(shape, stride, dtype, bytes spanned) of a result, for allocating it."""
    span = 1 + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()) if sz > 0)
    return (tuple(t.shape), t.stride(), t.dtype, span * t.element_size() if t.numel() else 0)


class Region(RegionCore):
    """The pending region of one thread.

    ``ext`` are the external input tensors, ``outs`` the pending output tensors (strong
    refs until flush), ``scalars`` the runtime scalar arguments, ``calls`` the recorded
    calls as (func, arg template, kwarg template) with wiring references in place of
    tensors.
    """

    def __init__(self):
        self.busy = False  # inside flush, replay or a meta evaluation: calls pass through
        self.scratch = {}  # kernel key -> this thread's scratch buffers for it
        self.reset()

    def scratch_for(self, kern) -> list:
        """This thread's scratch buffers for ``kern`` (allocated once, reused: no page
        faults after the first call)."""
        bufs = self.scratch.get(kern.key)
        if bufs is None:
            # below the keys above Python: a flush inside a torch.func transform (``grad``)
            # would get functorch's wrappers, which have no storage to point a kernel at
            with torch._C._ExcludeDispatchKeyGuard(_ABOVE_PYTHON):
                bufs = self.scratch[kern.key] = [torch.empty(max(n, 1), dtype=torch.uint8,
                                                             device=self.device or "cpu")
                                                 for n in kern.scratch]
        return bufs

    def reset(self):
        """Start an empty region at the trie root."""
        self.clear(ROOT)

    def _resolve(self, ref):
        return self.outs[ref[1]] if ref[0] == "o" else self.ext[ref[1]]

    def meta_args(self, targs, tkw, scalars=None):
        """Meta tensors standing for a call's arguments (for output metadata)."""
        sc = self.scalars if scalars is None else scalars

        def m(r):
            if r[0] == "o":
                shape, stride, dtype = self.out_meta[r[1]][:3]
                return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if r[0] == "v":  # a view of an output (ops.pending_view)
                return torch.empty_strided(r[2], r[3], dtype=self.out_meta[r[1]][2], device="meta")
            if r[0] == "x":
                t = self.ext[r[1]]
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            return sc[r[1]] if r[0] == "s" else r[1]

        return [m(r) for r in targs], {k: m(r) for k, r in tkw.items()}

    def _new_node(self, func, spec, key, targs, tkw):
        """The trie node of a call seen for the first time after the current one: its output
        metadata, or ``NOT_DEFERRABLE`` when eager must run the call (see :meth:`_outputs`),
        also where its meta evaluation warns (an ``out=`` tensor of another shape, resized:
        eager's warning then comes from the call, under the program's warning filters)."""
        node = TrieNode(self.node, key)
        NEW_NODES[0] += 1
        rec = _stored_node(node.digest)
        if rec is _MISS:
            busy, self.busy = self.busy, True  # a hooked Tensor method called here must not flush
            try:
                with warnings.catch_warnings(record=True) as warned:
                    warnings.simplefilter("always")
                    rec = self._outputs(func, spec, targs, tkw)
                if warned:  # (an out= tensor resized) eager warns at the call, as it should
                    raise Deferred(f"warns: {warned[0].message}")
            except Exception as e:  # eager will raise the user-facing error, if any
                log.debug("not deferring %s: %s", func, e)
                rec = None
            finally:
                self.busy = busy
            PENDING_NODES[node.digest] = _NOT_DEFERRABLE_TAG if rec is None else rec
        node.set(rec)
        self.node.children[key] = node
        return node

    def _outputs(self, func, spec, targs, tkw):
        """``(outs, ret, multi, writes_ext)`` of a :class:`TrieNode`, from a meta evaluation
        of the call.

        Raises (the call then runs eagerly, which raises the user-facing error if any):
            Exception: the meta function rejects the call; a result is not a tensor of a
                dtype in ``DTYPES``; it is an integer division (eager raises on a zero
                divisor at the call, a kernel could not); an op of ``RUNS_EAGERLY`` on
                its devices (and dtypes); it writes in place into a tensor whose elements
                overlap
                (eager refuses); eager's kernel rejects it where the meta function does
                not, or returns other dtypes than it (:meth:`_probe`).
        """
        margs, mkw = self.meta_args(targs, tkw)
        res = func(*margs, **mkw)
        multi = isinstance(res, (tuple, list))
        results = tuple(res) if multi else (res,)
        if not results or any(r is not None and (not isinstance(r, torch.Tensor) or r.dtype not in DTYPES)
                              for r in results):
            raise Deferred("result type")
        if func._opname.rstrip("_") in INTEGER_DIVISION and not results[0].dtype.is_floating_point:
            raise Deferred("integer division")
        rule = RUNS_EAGERLY.get(func._opname.rstrip("_"))
        if rule is not None:
            devices, half_only, why = rule
            if ((devices is None or (self.device.type if self.device else "cpu") in devices)
                    and (not half_only or any(r is not None and r.dtype in HALF for r in results))):
                raise Deferred(why)
        writes = [ref for ref in written_refs(spec, targs, tkw) if ref[0] in ("x", "o", "v")]
        if any(ref[0] == "v" for ref in writes):
            raise Deferred("writes a view of a pending output")
        for ref in writes:
            if ref[0] == "x" and torch._debug_has_internal_overlap(self.ext[ref[1]]) == 1:
                raise Deferred("in-place write into overlapping elements")
        writes_ext = any(ref[0] == "x" for ref in writes)
        if spec.returns_input:
            outs, ret = (), writes[0]
        else:
            outs, ret = tuple(None if r is None else _meta_of(r) for r in results), None
        got = self._probe(func, targs, tkw)
        got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        for k, (g, r) in enumerate(zip(got, results)):
            if (func._opname in EMPTY_RESULTS and isinstance(g, torch.Tensor)
                    and isinstance(r, torch.Tensor) and g.shape == (0,) and r.numel()):
                # eager's CPU kernel returns an empty result where the meta function's has
                # elements: the region returns eager's, as its decomposition does on the CPU
                empty = _meta_of(torch.empty(0, dtype=g.dtype, device="meta"))
                outs = outs[:k] + (empty,) + outs[k + 1:]
                continue
            if isinstance(g, torch.Tensor) and isinstance(r, torch.Tensor) and g.dtype != r.dtype:
                # the meta function disagrees with this device's kernel (CPU layer norm of
                # bfloat16 returns its mean and rstd in bfloat16, the meta function in
                # float32): for ROUNDED_RESULTS a floating result is eager's dtype, rounded
                # from the meta function's (the region's graph converts it:
                # accel.graph.trace_region)
                if func._opname not in ROUNDED_RESULTS or not g.dtype.is_floating_point:
                    raise Deferred("result dtype differs from eager's")
                outs = outs[:k] + (_meta_of(torch.empty_strided(r.shape, r.stride(), dtype=g.dtype,
                                                                device="meta")),) + outs[k + 1:]
        return outs, ret, multi, writes_ext

    def _probe(self, func, targs, tkw):
        """Run the call eagerly on stand-in tensors of the same dtypes and ranks (and the
        real scalars), so that checks only eager's CPU kernel makes (``abs`` of a bool
        tensor, a float ``alpha`` with bool tensors) raise here, at the call, as in eager.
        The stand-ins have at most 2 elements per dim; where the op checks sizes (layer
        norm's ``normalized_shape``) a second try uses the real sizes and strides, as the
        only try does for ops of ``REAL_SIZE_PROBES``.

        Returns:
            eager's result on the stand-ins (its dtypes are checked against the meta
            function's).

        Raises:
            Exception: whatever eager raises.
        """
        if func._opname not in REAL_SIZE_PROBES:
            try:
                return self._run_probe(func, targs, tkw, small=True)
            except Exception:  # noqa: BLE001 - maybe only the small sizes: try the real ones
                pass
        return self._run_probe(func, targs, tkw, small=False)

    def _run_probe(self, func, targs, tkw, small: bool):
        device = self.device or "cpu"

        def arg(r):
            if r[0] == "o":
                shape, stride, dtype = self.out_meta[r[1]][:3]
            elif r[0] == "v":
                shape, stride, dtype = r[2], r[3], self.out_meta[r[1]][2]
            elif r[0] == "x":
                t = self.ext[r[1]]
                shape, stride, dtype = t.shape, t.stride(), t.dtype
            elif r[0] == "s":
                return self.scalars[r[1]]
            else:
                return list(r[1]) if isinstance(r[1], tuple) else r[1]
            if small:  # ones for floats, zeros for integers (a valid index, never a divisor)
                fill = 1 if dtype.is_floating_point else 0
                return torch.full([min(s, 2) for s in shape], fill, dtype=dtype, device=device)
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)  # floats: unused
            return t if dtype.is_floating_point else t.zero_()

        args = [arg(r) for r in targs]
        kwargs = {k: arg(r) for k, r in tkw.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return func(*args, **kwargs)

    # -- flush -----------------------------------------------------------------------
    def traffic(self, outs=None) -> int:
        """Bytes a kernel of the region reads and writes: every external input, and the
        outputs at indices ``outs`` (None: all of them)."""
        spans = (m[3] for m in self.out_meta) if outs is None else (self.out_meta[i][3] for i in outs)
        return sum(t.nbytes for t in self.ext) + sum(spans)

    def ext_overlap(self) -> bool:
        """True if an external input the region writes shares storage with another external
        input (external inputs that are only read may share it: ``x`` and ``x.t()``)."""
        written = self.node.written  # the calls' wiring is the trie path's
        if written is None:
            from .ops import op_spec

            written = self.node.written = tuple(sorted(
                {ref[1] for func, targs, tkw, _ in self.calls
                 for ref in written_refs(op_spec(func), targs, tkw) if ref[0] == "x"}))
        return native.ext_overlap(self.ext, written)
