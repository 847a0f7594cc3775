"""Host memory for accel's outputs: a pool of reused CPU blocks, and glibc's malloc tuning.

On Linux, glibc gives every block above ``M_MMAP_THRESHOLD`` (128 KiB, adapting up to
32 MiB) fresh pages from ``mmap`` and unmaps them at ``free``, so each fresh large output
is page-faulted in on first touch: on the dev VM, 16M float32 ``x + 1`` takes 19 ms into a
fresh tensor against 4 ms into a reused one. Two remedies, both here:

* :func:`empty_strided` — the pool. A region's large CPU outputs (at least ``MIN_BLOCK``
  bytes) are carved from storages the pool keeps; once every tensor on a block is gone
  (its storage's use count is back to the pool's own reference) the next output of that
  size reuses it, already mapped. It affects only accel's outputs, whatever the process's
  allocator, and holds at most ``ACCEL_CPU_POOL_MB`` (blocks in use included); the
  idea is the CUDA caching allocator's (``c10/cuda/CUDACachingAllocator.cpp``), kept to
  exact sizes. :func:`empty_cache` returns the free blocks. It is used only where malloc
  maps large blocks afresh (:func:`configure`, ``ACCEL_CPU_POOL``): where the heap reuses
  freed memory, regions allocate as eager does, and their live outputs take their dead
  intermediates' blocks at each flush (``accel._core.reuse_blocks``).
* :func:`tune_allocator` — ``mallopt`` settings for the whole process
  (``ACCEL_MALLOC_TUNING``), as PyTorch's CPU performance guides get from jemalloc or
  tcmalloc; it also speeds up the eager code around accel's regions.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections import OrderedDict
from typing import Optional

import torch

from . import config

log = logging.getLogger("accel")

__all__ = ["empty_strided", "empty_cache", "pool_stats", "set_capacity", "configure",
           "maps_large_blocks", "tune_allocator", "MIN_BLOCK"]

#: smallest output (bytes) taken from the pool: below it glibc's heap reuses freed memory
MIN_BLOCK = 1 << 20

_use_count = torch._C._storage_Use_Count
_untyped_storage = torch._C.TensorBase.untyped_storage  # not accel's flushing hook
_refcount = sys.getrefcount
_empty = torch.empty
_lock = threading.Lock()
_blocks: OrderedDict = OrderedDict()  # id(block) -> _Block, oldest first
_by_size: dict = {}  # nbytes -> [_Block, ...]
_held = 0  # bytes of every block in the pool, in use or free
_cap = None  # most bytes held (ACCEL_CPU_POOL_MB as of the last enable); None: not read yet
#: called with a free block's storage as it is handed out again, while storages are
#: registered as shared outside the dispatcher (accel.shared forgets it: nothing holds it)
on_reuse = None


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Block:
    """One pooled storage: its Python object (the pool's only reference to it), its size
    and its data address when pooled."""

    __slots__ = ("storage", "nbytes", "ptr")

    def __init__(self, storage, nbytes: int):
        self.storage, self.nbytes, self.ptr = storage, nbytes, storage.data_ptr()

    def free(self) -> bool:
        """Nothing but the pool holds the storage: no tensor (view, autograd's saved
        value, a NumPy array's or DLPack capsule's tensor) and no Python reference to its
        storage object (a storage's Python object is unique: ``untyped_storage()`` hands
        out the pool's own)."""
        return _use_count(self.storage._cdata) == 1 and self._refs() == _POOL_REFS

    def _refs(self) -> int:
        st = self.storage
        return _refcount(st)

    def own(self) -> bool:
        """The storage still has the block's memory (not resized in place, nor moved to
        shared memory, which another process may still read)."""
        st = self.storage
        return st.nbytes() == self.nbytes and st.data_ptr() == self.ptr


def _pool_refs() -> int:
    """What :meth:`_Block._refs` counts when the pool's is the only reference (measured
    on a stand-in: the interpreter's own references on the stack differ between Python
    versions)."""
    b = _Block.__new__(_Block)
    b.storage = object()
    return b._refs()


_POOL_REFS = _pool_refs()


def empty_strided(shape, stride, dtype: torch.dtype, nbytes: int, device=None) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` and ``stride`` (elements) and ``dtype`` whose
    storage spans ``nbytes`` bytes, on ``device`` (None: the CPU). On the CPU it comes
    from a reused pool block where one of exactly that size is free (no first-touch page
    faults), else it is freshly allocated (and kept in the pool while the pool holds less
    than ``ACCEL_CPU_POOL_MB``); elsewhere it is ``torch.empty_strided``'s.

    The tensor owns its storage like any other (no ``_base``, its own version counter);
    the pool only keeps a reference to the storage, and reuses it once nothing else holds
    it (see :meth:`_Block.free`) and its memory is still the block's own
    (:meth:`_Block.own`).

    Raises:
        RuntimeError: the allocation failed (out of memory), as ``torch.empty_strided``.
    """
    global _held
    if device is not None and device.type != "cpu":
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    cap = _cap if _cap is not None else _capacity()
    if nbytes < MIN_BLOCK or cap <= 0:
        return torch.empty_strided(shape, stride, dtype=dtype)
    with _lock:
        same = _by_size.get(nbytes, ())
        for i, b in enumerate(same):
            if b.free():
                if b.own():
                    # to the back: the blocks handed out longest ago, the likeliest free,
                    # come first, so a search usually ends at the first block it tries
                    del same[i]
                    same.append(b)
                    if on_reuse is not None:
                        on_reuse(b.storage)
                    return _empty(0, dtype=dtype).set_(b.storage, 0, shape, stride)
                _drop(b)
                break
        t = torch.empty_strided(shape, stride, dtype=dtype)
        st = _untyped_storage(t)
        if st.nbytes() != nbytes:
            return t
        if _held + nbytes > cap:
            _evict(_held + nbytes - cap)
        if _held + nbytes <= cap:
            b = _Block(st, nbytes)
            _blocks[id(b)] = b
            _by_size.setdefault(nbytes, []).append(b)
            _held += nbytes
        return t


def set_capacity(mib: int) -> int:
    """Hold at most ``mib`` MiB of blocks from now on (``ACCEL_CPU_POOL_MB``, which every
    :func:`accel.enable` reads: a lookup of the environment at each allocation cost more
    than the rest of it); 0 turns the pool off. Returns the capacity in bytes. Free blocks
    over a lowered capacity are released at the next allocation that needs room."""
    global _cap
    _cap = mib << 20
    return _cap


def configure(mib: int, mode: str) -> bool:
    """Whether regions take their large CPU outputs from the pool, and its capacity
    (``ACCEL_CPU_POOL`` and ``ACCEL_CPU_POOL_MB``, which every :func:`accel.enable` reads):
    ``mode`` "on", "off", or "auto": where :func:`maps_large_blocks` is not False. Returns
    whether the pool is in use (``mib`` > 0 too); where it is not, its capacity is 0 and
    the region core reuses dead outputs' blocks at each flush instead
    (``accel._core.reuse_blocks``).

    Where the heap reuses freed memory the pool only costs: a region's output then goes to
    a block the pool keeps apart, which nothing else has written lately, where eager's
    output would have reused a temporary's block still in the cache (hand-written RMSNorm on
    [8192, 1024] float32 on the dev VM, tuned malloc, timed between eager's and
    torch.compile's calls: 1.80 ms from the pool, 1.60 without it, 1.48 with buffer reuse;
    torch.compile 1.52).
    """
    use = mode == "on" or (mode == "auto" and maps_large_blocks() is not False)
    set_capacity(mib if use else 0)
    return use and mib > 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def maps_large_blocks() -> Optional[bool]:
    """Whether the process's malloc gives a large block (64 MiB) fresh pages from ``mmap``,
    unmapped again at ``free``, so that every large output page-faults afresh: glibc's
    defaults (its ``M_MMAP_THRESHOLD`` adapts up to 32 MiB at most). False where the block
    comes from memory the heap keeps: glibc tuned (:func:`tune_allocator`,
    ``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``), or another malloc such as jemalloc or
    tcmalloc preloaded, which glibc's counters do not see. None where glibc's
    ``mallinfo2`` is missing (glibc before 2.33, musl). Measured: glibc's count of mmapped
    blocks before and after one ``malloc`` of 64 MiB, freed at once (no page touched)."""
    try:
        libc = ctypes.CDLL(None)
        info, malloc, free = libc.mallinfo2, libc.malloc, libc.free
    except (OSError, AttributeError):
        return None
    info.restype, info.argtypes = _Mallinfo2, []
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    before = info().hblks
    p = malloc(64 << 20)
    if not p:
        return None
    after = info().hblks
    free(p)
    return after > before


def _capacity() -> int:
    """The capacity in bytes, read from the environment where no enable has set it."""
    return set_capacity(config.flag("ACCEL_CPU_POOL_MB"))


def _drop(b: _Block) -> None:
    global _held
    del _blocks[id(b)]
    same = _by_size[b.nbytes]
    same.remove(b)
    if not same:
        del _by_size[b.nbytes]
    _held -= b.nbytes


def _evict(need: int) -> None:
    """Release free blocks, oldest first, until ``need`` bytes are released or none is
    free."""
    freed = 0
    for b in list(_blocks.values()):
        if freed >= need:
            break
        if b.free():
            _drop(b)
            freed += b.nbytes


def empty_cache() -> int:
    """Release the pool's free blocks to the allocator (blocks still in use stay pooled
    until they are free). Returns the bytes released. Mirrors ``torch.cuda.empty_cache``."""
    with _lock:
        before = _held
        _evict(_held)
        return before - _held


def pool_stats() -> dict:
    """``{"blocks", "held_bytes", "free_bytes", "capacity_bytes"}`` of the CPU output pool."""
    with _lock:
        free = sum(b.nbytes for b in _blocks.values() if b.free())
        return {"blocks": len(_blocks), "held_bytes": _held, "free_bytes": free,
                "capacity_bytes": _cap if _cap is not None else _capacity()}


# -- glibc --------------------------------------------------------------------------------
#: glibc mallopt parameters (malloc.h): never mmap a block, never trim the heap's top
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


@functools.lru_cache(maxsize=1)
def tune_allocator() -> bool:
    """Keep freed memory in glibc's heap for reuse, once per process: large blocks are
    not mmapped (and unmapped at free) and the heap is not trimmed, so a fresh output
    reuses memory already mapped instead of page-faulting on first touch (a fresh 64 MiB
    output: about 5x faster here). PyTorch's CPU performance guides get the same effect
    from jemalloc or tcmalloc. Returns False where glibc's ``mallopt`` is missing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok = (mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
          and mallopt(_M_TOP_PAD, 64 << 20) == 1)
    log.info("accel: glibc malloc tuned (no mmap, no trim): %s", ok)
    return ok
