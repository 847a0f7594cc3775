"""Storages whose memory is shared outside torch's dispatcher, which regions leave alone.

A deferred call reads its inputs and writes its outputs when its region flushes, and
every read through torch flushes first. Memory that code outside torch also sees is read
and written with no such hook: a NumPy array from ``Tensor.numpy()``, ``np.asarray`` or
DLPack, a tensor made by ``torch.from_numpy``, ``torch.as_tensor``, ``torch.frombuffer``
or ``torch.from_dlpack`` over another library's memory, and shared memory that other
processes read and write (``share_memory_()``, tensors received through
``torch.multiprocessing``). Had ``t.add_(1)`` been deferred, ``t.numpy()``'s array, taken
before it, would show the old values until some flush; had ``y = t * 2`` been deferred
over ``torch.from_numpy(a)``, writing ``a[:] = 5`` before the flush would change ``y``.

So the interceptor's hooks on those entry points register the storage (:func:`share`),
and a call with an external input on a registered storage is not deferred: the region is
flushed and the call runs eagerly, in order with the code around it (``Deferred("shared
memory")`` in the region core; the dispatch filter leaves such calls to the interceptor).
A storage stays registered while it lives, held by a weak reference
(``torch.multiprocessing.reductions.StorageWeakRef``): its StorageImpl, and so its
address, cannot be reused while the reference lives, so a dead one is never mistaken for
a new storage; dead ones are dropped as registrations accumulate. The region core keeps
the addresses in a table the filter reads (``accel_shared_set`` in
``include/accel/region_view.h``); past its 64 entries, every call with an external input
takes the interceptor's path, which looks the storage up here.
"""
from __future__ import annotations

import os
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import allocator
from .region import native

__all__ = ["share", "is_shared", "clear"]

_untyped_storage = torch._C.TensorBase.untyped_storage  # not accel's flushing hook
_lock = threading.Lock()
_refs: dict = {}  # StorageImpl address -> StorageWeakRef
_alive = 0  # how many were alive when dead ones were last dropped


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _storage(obj):
    if isinstance(obj, torch.Tensor):
        return _untyped_storage(obj)
    if isinstance(obj, torch.TypedStorage):
        return obj._untyped_storage
    return obj if isinstance(obj, torch.UntypedStorage) else None


def share(obj) -> None:
    """Register the storage of ``obj`` (a tensor, an ``UntypedStorage`` or a
    ``TypedStorage``; anything else is ignored) as shared outside the dispatcher: calls
    reading or writing it run eagerly while it lives. Amortized O(1): dead storages are
    dropped once the registered ones outgrow the region core's table and twice the
    number alive at the last drop."""
    global _alive
    st = _storage(obj)
    if st is None or st.device.type == "meta":
        return
    with _lock:
        if st._cdata in _refs:  # this storage: a registered one's address is not reused
            return
        _refs[st._cdata] = StorageWeakRef(st)
        if len(_refs) > max(native.SHARED_MAX, 2 * _alive):
            for p in [p for p, ref in _refs.items() if ref.expired()]:
                del _refs[p]
            _alive = len(_refs)
        _publish()


def _forget(st) -> None:
    """A pool block handed out again (accel.allocator): nothing else held its storage."""
    with _lock:
        if _refs.pop(st._cdata, None) is not None:
            _publish()


def _publish() -> None:
    """Hand the registered storages to the region core (None: more than its table holds,
    each then looked up here)."""
    native.set_shared(list(_refs) if len(_refs) <= native.SHARED_MAX else None, _lookup)
    allocator.on_reuse = _forget if _refs else None


def _lookup(address: int) -> bool:
    ref = _refs.get(address)
    return ref is not None and not ref.expired()


def is_shared(t: torch.Tensor) -> bool:
    """Whether the storage of tensor ``t`` is registered as shared outside the dispatcher."""
    return _lookup(_untyped_storage(t)._cdata)


def clear() -> None:
    """Forget every registered storage (tests)."""
    global _alive
    with _lock:
        _refs.clear()
        _alive = 0
        _publish()
