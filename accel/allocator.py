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
  intermediates' blocks at each flush (``accel._core.reuse_blocks``). A program's blocks
  are recorded in the kernel store at its exit, and its next process faults them in ahead,
  in the background, at ``import accel`` (:func:`prefill`), so that its first iteration
  does not page-fault either.
* :func:`tune_allocator` — ``mallopt`` settings for the whole process
  (``ACCEL_MALLOC_TUNING``), as PyTorch's CPU performance guides get from jemalloc or
  tcmalloc; it also speeds up the eager code around accel's regions.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
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
           "maps_large_blocks", "program_key", "prefill_plan", "prefill", "tune_allocator",
           "MIN_BLOCK"]

#: smallest output (bytes) taken from the pool: below it glibc's heap reuses freed memory
MIN_BLOCK = 1 << 20

_use_count = torch._C._storage_Use_Count
_untyped_storage = torch._C.TensorBase.untyped_storage  # not accel's flushing hook
_refcount = sys.getrefcount
_empty = torch.empty
#: hides the pool's own aten calls from dispatch modes: with accel enabled twice (``accel
#: run`` around a script's ``accel.eager()``), the outer mode would take the ``set_`` of a
#: reused block, made while the inner one records a call, for the program's, and flush the
#: region in the middle of that call's recording
_no_modes = torch._C._DisableTorchDispatch
_lock = threading.Lock()
_blocks: OrderedDict = OrderedDict()  # id(block) -> _Block, oldest first
_by_size: dict = {}  # nbytes -> [_Block, ...]
_held = 0  # bytes of every block in the pool, in use or free
_cap = None  # most bytes held (ACCEL_CPU_POOL_MB as of the last enable); None: not read yet
_record = None  # (program, pid) whose used blocks are recorded at exit; None: not registered
_prefilled: list = []  # the record the pool was prefilled from (sizes): rewritten only if changed
#: called with a free block's storage as it is handed out again, while storages are
#: registered as shared outside the dispatcher (accel.shared forgets it: nothing holds it)
on_reuse = None


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Block:
    """One pooled storage: its Python object (the pool's only reference to it), its size,
    its data address when pooled, and whether an output has used it (a prefilled block
    that none has is left out of the program's record)."""

    __slots__ = ("storage", "nbytes", "ptr", "used")

    def __init__(self, storage, nbytes: int, used: bool = True):
        self.storage, self.nbytes, self.ptr, self.used = storage, nbytes, storage.data_ptr(), used

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
                    b.used = True
                    if on_reuse is not None:
                        on_reuse(b.storage)
                    with _no_modes():
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
            _add(_Block(st, nbytes))
        return t


def _add(b: _Block) -> None:
    """Pool ``b`` (under ``_lock``); the first block registers the exit's record."""
    global _held, _record
    _blocks[id(b)] = b
    _by_size.setdefault(b.nbytes, []).append(b)
    _held += b.nbytes
    if _record is None:
        _record = (program_key(), os.getpid())
        atexit.register(_save_record)


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
    use = _wanted(mode)
    set_capacity(mib if use else 0)
    if not use or mib <= 0:
        empty_cache()  # blocks prefilled at import, or pooled before a setting changed
    return use and mib > 0


def _wanted(mode: str) -> bool:
    """Whether ``ACCEL_CPU_POOL=mode`` uses the pool in this process now."""
    return mode == "on" or (mode == "auto" and maps_large_blocks() is not False)


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


# -- a program's record: the next process's first iteration finds its blocks mapped ------

def program_key() -> Optional[str]:
    """The running program's name in the store's pool records: a hash of its script's real
    path and its arguments (``sys.argv``), which a rerun of the same command repeats. None
    for ``python -c``, standard input and interactive sessions: nothing tells their
    programs apart."""
    argv = getattr(sys, "argv", None) or [""]
    if argv[0] in ("", "-c", "-"):
        return None
    return hashlib.sha256(repr((os.path.realpath(argv[0]), argv[1:])).encode()).hexdigest()[:32]


def prefill_plan() -> Optional[tuple]:
    """``(program, capacity in bytes)`` where regions' outputs will come from the pool
    (``ACCEL_CPU_POOL``, ``ACCEL_CPU_POOL_MB``: as :func:`configure` decides now) and the
    program has a name (:func:`program_key`); else None. Called at import, on the
    importing thread (malloc's probe counts the whole process's mapped blocks).

    Raises:
        accel.config.ConfigError: an ``ACCEL_*`` variable it reads is invalid.
    """
    mib, mode = config.flag("ACCEL_CPU_POOL_MB"), config.flag("ACCEL_CPU_POOL")
    if mib <= 0 or not _wanted(mode):
        return None
    program = program_key()
    return None if program is None else (program, mib << 20)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 (asm-generic/mman-common.h)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.lru_cache(maxsize=1)
def _madvise():
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return f


def _populate(ptr: int, nbytes: int) -> bool:
    """Fault in the whole pages of ``[ptr, ptr + nbytes)`` writable, their contents
    untouched (``madvise(MADV_POPULATE_WRITE)``, without the GIL). False where the kernel
    or libc lacks it."""
    madvise = _madvise()
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    return madvise is not None and (end <= start or madvise(start, end - start, _MADV_POPULATE_WRITE) == 0)


def prefill(store, program: str, cap: int) -> int:
    """Pool fresh blocks of the sizes ``program``'s last process used (its record in
    ``store``: :meth:`accel.store.Store.pool_record`), at most ``cap`` bytes held in all,
    and fault their pages in, so that its first iteration finds them mapped as later ones
    do (MLP fwd+bwd on the dev VM, glibc's defaults: 48 MiB, about 12 ms of the first
    iteration). Run by the import's background thread (:func:`accel.dispatch.prefetch`):
    each block is pooled before it is faulted in (populating leaves its contents alone),
    so an output that needs it meanwhile takes it rather than a block of its own. Stops
    at the first failure (out of memory; a kernel before Linux 5.14, without
    ``MADV_POPULATE_WRITE``). Returns the bytes pooled. Never raises."""
    global _prefilled
    try:
        sizes = store.pool_record(program)
    except Exception:  # noqa: BLE001 - an unusable store: nothing to go by
        return 0
    if not sizes:
        return 0
    _prefilled = sizes
    done = 0
    for n in sizes:
        if n < MIN_BLOCK:
            continue
        with _lock:
            if _held + n > min(cap, _cap if _cap is not None else cap):
                break
            try:
                b = _Block(_untyped_storage(torch.empty(n, dtype=torch.uint8)), n, used=False)
            except RuntimeError:  # out of memory
                break
            _add(b)  # the pool's is the only reference: the block is free at once
        ptr = b.ptr
        done += n
        if not _populate(ptr, n):
            break
    log.debug("accel: pool prefilled with %d MiB from the program's record", done >> 20)
    return done


def _save_record() -> None:
    """At exit: record the sizes of the blocks outputs used (the program's steady state),
    where they differ from the record the pool was prefilled from, in the process's store;
    not in a forked child, nor for a program without a name."""
    program, pid = _record
    if program is None or pid != os.getpid():
        return
    with _lock:
        sizes = sorted(b.nbytes for b in _blocks.values() if b.used)
    if not sizes or sizes == _prefilled:
        return
    from . import runtime

    store = runtime._store
    if store is None or not store.persistent:
        return
    try:
        store.put_pool_record(program, sizes)
    except Exception as e:  # noqa: BLE001 - only the next process's head start is lost
        log.debug("accel: the pool's record was not written (%s)", e)


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
