"""The dispatch filter: C++ that does what the interceptor's dispatch mode would do with a
call, where it can tell: it runs past the mode the calls the mode would only pass through
unchanged (flushing a pending region first, as the mode would), and records into the
thread's region the deferred calls the mode has recorded the same way before
(``include/accel/dispatch_filter.cpp`` says which, and why this is the same as the mode's
path).

A dispatch mode's crossing into Python and back costs about 10-30 µs a call; in a model's
training step most calls are matmuls, views and other ops accel never defers, and most
deferred calls repeat the previous step's. The filter is a boxed fallback on a mode
dispatch key above autograd, included in the thread's dispatch key set while accel is
enabled, with unboxed kernels on that key for the ops a model's step calls most (boxing a
call's arguments costs about 0.7 µs in a step's cold caches on the dev VM: the fallback
alone cost the host-bound CPU proxy of bench/host_parts.py a sixth of eager's time), and a
second fallback just below the Python key, which only the calls the filter sends there
reach (below autograd, where the mode sees them).

It is a torch C++ extension built at run time against the installed torch and Python
(as ``torch.utils.cpp_extension`` builds one: the same C++ standard and ABI), kept in the
store under a key naming the compiler, torch's build and Python's ABI, and loaded with
ctypes. A process that misses it builds it in the background (about 35 s on the 2-core
dev machine, 33 s on the H100 host), in a process of its own at the lowest CPU priority
where the store is on disk: a program that ends first does not wait for it, and the build
goes on to store the filter for the next process (as a thread, for an in-memory store).
Until it is loaded every call takes the mode's path, as it does where the filter cannot be
built or registered (warned once, stored as a negative entry) and under
``ACCEL_DISPATCH_FILTER=0``.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Optional, Tuple

from . import build, config

log = logging.getLogger("accel")

__all__ = ["SOURCE", "store_key", "prefetch", "start", "active", "loaded", "wait", "set_included", "bind",
           "counts", "recorded", "unboxed", "small_region_calls", "set_small_regions", "eager_first", "off_reason",
           "set_matmul", "matmuls", "set_matmul_pool", "pooled_matmuls"]

SOURCE = os.path.join(build.INCLUDE_DIR, "accel", "dispatch_filter.cpp")
#: the headers it includes (its store key hashes them): the region view it shares with the
#: region core, the core's helpers, the unboxed kernels, the calls' keys and trie edges, its
#: matmul kernels and the CPU gemm they run
HEADERS = tuple(os.path.join(build.INCLUDE_DIR, "accel", h)
                for h in ("region_view.h", "core_helpers.h", "unboxed_kernels.h", "call_keys.h",
                          "matmul_kernels.inc", "gemm.h"))

_lock = threading.Lock()
_lib = None  # the loaded library, its fallback registered
_include = None  # set_included's function: the region core's filter_include, once loaded
_future = None  # its background build
_off: Optional[str] = None  # why the filter is not used, once that is decided
building = False  # a background build is in flight or done and not loaded yet
_small_regions = True  # ACCEL_EAGER_SMALL_REGIONS (set_small_regions)
_MATMUL_MODES = {"off": 0, "auto": 1, "on": 2}
_matmul = 1  # ACCEL_CPU_MATMUL (set_matmul)
_matmul_pool = False  # matmul outputs from accel's CPU output pool (set_matmul_pool)
_prefetch: Optional[threading.Thread] = None  # prefetch()'s thread, until start() waits for _found
_prefetched = None  # what it found: (store, key, entry, fallbacks registered), or None
_found = threading.Event()  # set once that thread is done with the filter
_registering = threading.Lock()  # held while that thread registers the filter's fallbacks


def _after_fork_in_child() -> None:
    """A forked child has no thread waiting for the parent's build of the filter: where it
    was in flight, the child's next start() looks for it in the store again (builds it
    there if the parent's build has not stored it yet: one build, under its key's lock)."""
    global _lock, _future, building, _prefetch, _prefetched, _found
    _lock = threading.Lock()
    # the parent's prefetch thread is gone, and the store it opened may hold its locks
    _prefetch = _prefetched = None
    _found = threading.Event()  # (the parent's thread may have held the old one's lock)
    if _future is not None and not _future.done():
        _future, building = None, False


os.register_at_fork(before=_registering.acquire, after_in_parent=_registering.release,
                    after_in_child=_registering.release)  # (before _after_fork_in_child)
os.register_at_fork(after_in_child=_after_fork_in_child)


def _source() -> str:
    with open(SOURCE) as f:
        return f.read()


def store_key() -> str:
    """The filter's store key: a hash of its source, the compiler and flags, torch's build
    and Python's ABI.

    Raises:
        BuildError: the C++ compiler cannot be found.
        OSError: the source cannot be read.
    """
    from .store import STORE_VERSION

    text = _source()
    for h in HEADERS:
        with open(h) as f:
            text += f.read()
    parts = {"store": STORE_VERSION, "dispatch_filter": hashlib.sha256(text.encode()).hexdigest(),
             "toolchain": build.torch_extension_key()}
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()


def _build(key: str, store):
    """Under the store's compile lock: the filter's entry, built and stored unless another
    process stored it meanwhile; a failure is stored as a negative entry, but for a
    timeout (:class:`accel.build.BuildTimeout`, raised), which a later process retries."""
    import torch

    with store.compile_lock(key):
        entry = store.get(key)
        if entry is not None:
            return entry
        t0 = time.perf_counter()
        source = _source()
        try:
            artifact = build.build_torch_extension(source, "accel_dispatch_filter")
        except build.BuildTimeout:  # at the lowest priority on a busy machine: not remembered,
            raise  # the next process builds it again (this one keeps the mode's path)
        except Exception as e:  # noqa: BLE001 - any failure: the mode's path
            reason = f"{type(e).__name__}: {e}"
            store.put_negative(key, reason, {"readable": "dispatch filter"})
            return store.get(key)
        dt = time.perf_counter() - t0
        log.info("built the dispatch filter in %.2f s", dt)
        return store.put(key, artifact, {"readable": f"dispatch filter (torch {torch.__version__})",
                                         "source": source, "compile_time_s": dt})


def prefetch() -> None:
    """Where the kernel store exists already (at ``import accel`` with torch imported: see
    ``accel._preload``), open it in a background thread, find the filter's entry in it,
    load the library and register its two boxed fallbacks (``accel_filter_fallbacks``,
    safe while the program makes calls: see its comment), and then fault in the CPU
    output pool's blocks the program's last process recorded
    (:func:`accel.allocator.prefill`, where the pool is in use), after reading its trie
    nodes and loading its kernels ahead (:func:`accel.runtime.prefetch_working_set`).
    The first enable makes that store the process's, where it is still the one the
    environment names
    (:func:`accel.runtime.adopt_store`: a program may set ``ACCEL_CACHE_DIR`` after the
    import), and then only registers the filter's unboxed kernels (about 2 ms on the dev
    VM), which must happen on a thread that makes no call meanwhile; opening the store,
    looking the filter up (about 9 ms) and the fallbacks (about 20 ms) are done while the
    program builds its model instead of in its first iteration. The enable waits for the
    filter's part only; a fork waits for the fallbacks' registration (which holds the
    dispatcher's lock) to end.
    Creates nothing: without a store, or under ``ACCEL_DISABLE=1``, it does nothing; with
    ``ACCEL_DISPATCH_FILTER=0`` only the pool's and the working set's parts run. Never
    raises: an invalid ``ACCEL_*`` value or a broken store is left to the first enable to
    report."""
    global _prefetch
    from . import allocator

    try:
        if (_prefetch is not None or config.flag("ACCEL_DISABLE")
                or not os.path.isdir(os.path.join(config.cache_dir(), "index"))):
            return
        find = config.flag("ACCEL_DISPATCH_FILTER")
        pool = allocator.prefill_plan()
        program = allocator.program_key()
    except (config.ConfigError, OSError):
        return
    if find or pool is not None or program is not None:
        _found.clear()
        _prefetch = threading.Thread(target=_prefetch_run, args=(find, pool, program),
                                     name="accel-prefetch", daemon=True)
        _prefetch.start()


def _prefetch_run(find: bool, pool, program) -> None:
    global _prefetched
    from . import allocator, runtime
    from .store import Store

    try:
        store = Store()  # raises where the disk store is unusable: left to the first enable
        _prefetched = (store, None, None, False)
        if find:
            key = store_key()
            entry = store.get(key)
            registered = False
            if entry is not None and not entry.negative:
                lib = ctypes.CDLL(entry.path, mode=ctypes.RTLD_LOCAL)  # mapped and relocated now
                lib.accel_filter_fallbacks.restype = ctypes.c_char_p
                with _registering:  # (a fork waits for it: the dispatcher's lock is held)
                    registered = not lib.accel_filter_fallbacks()  # else the enable reports it
            _prefetched = (store, key, entry, registered)
    except Exception:  # noqa: BLE001 - start() looks again and reports what it finds
        return
    finally:
        _found.set()
    if program is not None:
        runtime.prefetch_working_set(store, program)
    if pool is not None:
        allocator.prefill(store, *pool)


def _join_prefetch() -> None:
    """Wait for the import's thread to have looked the filter up (not for its pool work)."""
    global _prefetch
    if _prefetch is not None:
        _found.wait()
        _prefetch = None


def start() -> None:
    """Find the filter in the store and load it, or start building it in the background
    (once per process; called at each enable). Never raises: a problem is warned about
    once and leaves every call on the mode's path."""
    global _future, _off, building, _prefetched
    if _lib is not None or _off is not None or _future is not None:
        return
    _join_prefetch()
    with _lock:
        if _lib is not None or _off is not None or _future is not None:
            return
        from .runtime import _pool, adopt_store, get_store

        pre, _prefetched = _prefetched, None
        adopted = pre is not None and adopt_store(pre[0])  # (its working set too)
        if not config.flag("ACCEL_DISPATCH_FILTER"):
            _off = "ACCEL_DISPATCH_FILTER=0"
            return
        try:
            store = get_store()
            key = store_key()
            entry = pre[2] if adopted and pre[1] == key and pre[2] is not None else store.get(key)
            if pre is not None and pre[3]:  # its library holds the fallbacks: it is the one used
                if entry is None and pre[1] == key:  # (the program chose another store since)
                    with open(pre[2].path, "rb") as f:
                        store.put(key, f.read(), pre[2].meta)
                entry = pre[2]
        except Exception as e:  # noqa: BLE001 - no compiler, a broken store
            _give_up(f"{type(e).__name__}: {e}")
            return
        if entry is not None:
            _load(entry)
            return
        _future = _build_apart(key, store) if store.persistent else _pool().submit(_build, key, store)
        building = True


def _build_apart(key: str, store) -> Future:
    """Build the filter into ``store`` (on disk) in a process of its own, in a session of its
    own (a program that ends, or is interrupted, before the build does leaves it running:
    the next process finds the filter stored); a daemon thread waits for it. Returns a
    future of the stored entry; its exception, where the process stored none, names the
    process's exit status and the last line it wrote (its output is kept in the store's
    locks/ folder until it stores an entry)."""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this accel
    env = dict(os.environ, ACCEL_CACHE_DIR=store.location,
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    env.pop("ACCEL_EAGER", None)  # the builder must not turn accel on (and build again)
    log_path = os.path.join(store.location, "locks", f"dispatch-filter-{key[:16]}.log")
    cmd = [sys.executable, "-c", "import sys; from accel.dispatch import _build_here; "
           "_build_here(sys.argv[1], sys.argv[2])", key, str(store.size_limit_bytes >> 20)]

    def wait() -> None:
        try:
            with open(log_path, "wb") as out:
                code = subprocess.call(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            entry = store.get(key)
            if entry is None:
                with open(log_path, errors="replace") as f:
                    last = (f.read().strip().splitlines() or [""])[-1]
                raise RuntimeError(f"the build process exited ({code}) without storing it: {last}")
            with contextlib.suppress(OSError):
                os.unlink(log_path)
            fut.set_result(entry)
        except BaseException as e:  # noqa: BLE001 - reported where the future is read
            fut.set_exception(e)

    threading.Thread(target=wait, name="accel-filter-build", daemon=True).start()
    return fut


def _build_here(key: str, size_limit_mb: str) -> None:
    """The build process's work (see :func:`_build_apart`): build the filter into the
    store at ``$ACCEL_CACHE_DIR`` under ``key``, unless another process has. At the lowest
    CPU priority (:func:`_lower_priority`): the program's own threads come first.
    """
    from .store import Store

    _lower_priority()
    _build(key, Store(size_limit_mb=int(size_limit_mb)))


def _lower_priority() -> None:
    """Put the calling process at the lowest CPU priority: ``SCHED_IDLE`` (Linux; nice 19
    where that is refused) and, where the process leads a session of its own, that
    session's autogroup at nice 19. With autogroups (``kernel.sched_autogroup_enabled``,
    on in most distributions) Linux shares the CPU between sessions before it looks at
    priorities within one: a ``SCHED_IDLE`` build in a session of its own otherwise takes
    half the cores' time from a program that wants all of them (the demo's CPU step: 1.0 s
    instead of 0.1 s while the filter built on the 2-core dev VM)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    # a session of its own only: never the autogroup of the caller's session
    if hasattr(os, "getsid") and os.getsid(0) == os.getpid():
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("19")
        except OSError:  # no autogroups here
            pass


def _give_up(reason: str) -> None:
    global _off, building
    from .interceptor import warn_once

    _off, building = reason, False
    warn_once(("dispatch filter", reason[:80]), "accel: no dispatch filter (%s); every aten "
              "call crosses into Python", build.summary(reason))


def _load(entry) -> None:
    """dlopen the filter's library and register its fallback (caller holds ``_lock``)."""
    global _lib, _include, building
    if entry is None or entry.negative:
        _give_up(entry.reason if entry is not None else "not built")
        return
    import torch

    from .ops import fusible_ops

    try:
        lib = ctypes.CDLL(entry.path, mode=ctypes.RTLD_LOCAL)
        lib.accel_filter_register.restype = ctypes.c_char_p
        lib.accel_filter_register.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_void_p]
        lib.accel_filter_include.restype = ctypes.c_int
        lib.accel_filter_include.argtypes = [ctypes.c_int]
        lib.accel_filter_bind.argtypes = [ctypes.c_void_p]
        lib.accel_filter_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.accel_filter_recorded.restype = ctypes.c_uint64
        lib.accel_filter_small.restype = ctypes.c_uint64
        lib.accel_filter_unboxed.restype = ctypes.c_int
        lib.accel_filter_set_unboxed.restype = ctypes.c_int
        lib.accel_filter_set_unboxed.argtypes = [ctypes.c_int]
        lib.accel_filter_eager_first.argtypes = [ctypes.c_void_p]
        lib.accel_filter_small_regions.argtypes = [ctypes.c_int]
        lib.accel_filter_small_regions(_small_regions)
        lib.accel_filter_matmul.restype = ctypes.c_int
        lib.accel_filter_matmul.argtypes = [ctypes.c_int]
        lib.accel_filter_matmuls.restype = ctypes.c_uint64
        lib.accel_filter_matmul(_matmul)
        lib.accel_filter_pool.argtypes = [ctypes.py_object]
        lib.accel_filter_pooled.restype = ctypes.c_uint64
        _set_pool(lib)
        err = _register(lib, fusible_ops())
    except (OSError, AttributeError) as e:
        _give_up(f"{type(e).__name__}: {e}")
        return
    if err:
        _give_up(err.decode(errors="replace"))
        return
    from .region import native

    native.set_helpers(*(ctypes.cast(f, ctypes.c_void_p).value
                         for f in (lib.accel_empty_strided, lib.accel_liveness,
                                   lib.accel_ext_overlap, lib.accel_reuse_blocks)))
    native.set_include_fn(ctypes.cast(lib.accel_filter_include, ctypes.c_void_p).value)
    lib.accel_filter_shared.argtypes = [ctypes.c_void_p]
    lib.accel_filter_shared(native.shared_table_address() or None)
    _lib, _include, building = lib, native.filter_include, False
    log.info("dispatch filter loaded (torch %s)", torch.__version__)


def _register(lib, deferrable) -> Optional[bytes]:
    """Register (or re-register) the filter's fallback with the ops it may defer
    (``deferrable``, OpOverloads; with them :data:`accel.ops.MODE_OPS`, which the mode must
    see) and the view ops; returns the reason it cannot, or None."""
    from .interceptor import AccelMode, _DynamoSafeAccelMode, flush
    from .ops import MODE_OPS, VIEW_OPS
    from .region import RegionCore

    names = "\n".join(_name(op) for op in [*deferrable, *MODE_OPS]).encode()
    views = "\n".join(_name(op) for op in VIEW_OPS).encode()
    replay = getattr(RegionCore, "_replay", None)  # the native core's (the twin: never called)
    return lib.accel_filter_register(names, views, id(AccelMode), id(_DynamoSafeAccelMode),
                                     id(replay), id(flush)) or None


def set_deferrable(ops) -> None:
    """Tell the loaded filter which ops it may defer (``ops``: OpOverloads; the rest it
    runs past the mode, or passes on where they decompose), its unboxed kernels registered
    again to take the new kinds. For benchmarks that measure interception with nothing
    deferred (bench/step_phases.py); ``fusible_ops()`` restores it. Call it only while no
    other thread makes calls (the dispatcher's tables change). Needs :func:`loaded`.

    Raises:
        RuntimeError: the filter refused the registration.
    """
    err = _register(_lib, ops)
    if err:
        raise RuntimeError(f"accel: {err.decode(errors='replace')}")
    set_unboxed(False)
    set_unboxed(True)


def _name(op) -> str:
    """``aten::add.Tensor`` for ``torch.ops.aten.add.Tensor`` (``aten::view`` for a default
    overload), as the dispatcher names operators."""
    return op.name()  # OpOverload.name(): the schema's name, "." and a non-empty overload name


def active() -> bool:
    """True if the filter is loaded (no other work: for the dispatch path)."""
    return _lib is not None


def loaded() -> bool:
    """True if the filter is loaded; loads a background build that has finished."""
    if _lib is not None:
        return True
    fut = _future
    if fut is None or not fut.done() or _off is not None:
        return False
    with _lock:
        if _lib is None and _off is None:
            try:
                _load(fut.result())
            except Exception as e:  # noqa: BLE001 - a broken store
                _give_up(f"{type(e).__name__}: {e}")
    return _lib is not None


def wait(timeout: Optional[float] = None) -> bool:
    """Start the filter if need be and wait for its build, at most ``timeout`` seconds;
    True if it is loaded (tests and benchmarks use this to measure the steady state)."""
    start()
    fut = _future
    if fut is not None and _lib is None:
        from concurrent.futures import wait as wait_futures

        wait_futures([fut], timeout=timeout)
    return loaded()


def set_included(on: bool) -> bool:
    """Include the filter's dispatch key in the calling thread's key set, or not (only
    accel includes it: at its outermost enable on a thread, until the matching disable);
    returns whether it was included. Needs :func:`loaded`."""
    return _include(on)


def bind(region) -> None:
    """Point the calling thread's filter at ``region``'s view (its pending byte, which the
    region sets while it has calls and clears at flush, and what the filter needs to
    record calls into it; include/accel/region_view.h). The region must outlive the
    binding: a thread binds its own region, which lives as long as the thread."""
    _lib.accel_filter_bind(region.pending_address())


def counts() -> Tuple[int, int, int, int]:
    """The calling thread's filter counts: (calls run past the mode, calls passed on to
    it, calls the filter recorded into the thread's region itself, small or idle regions'
    first calls it ran eagerly, also counted as run past the mode or as passed on)."""
    if _lib is None:
        return 0, 0, 0, 0
    out = (ctypes.c_uint64 * 4)()
    _lib.accel_filter_counts(out)
    return out[0], out[1], out[2], out[3]


def recorded() -> int:
    """Calls the filter recorded into a region itself, on every thread of the process
    (autograd's device threads included)."""
    return 0 if _lib is None else _lib.accel_filter_recorded()


def small_region_calls() -> int:
    """Small regions' first calls the filter ran eagerly, on every thread of the process
    (see ``accel.eager_regions.SMALL_REGION_CALLS``)."""
    return 0 if _lib is None else _lib.accel_filter_small()


def unboxed() -> int:
    """How many ops have the filter's unboxed kernels (``ACCEL_UNBOXED_OPS`` in
    include/accel/unboxed_kernels.h: the views, factories, matmuls, composite and
    deferrable ops a model's step calls most, those this torch has); 0 while the filter is
    not loaded."""
    return 0 if _lib is None else _lib.accel_filter_unboxed()


def set_unboxed(on: bool) -> int:
    """Register the filter's unboxed kernels, or remove them (every call then takes its
    boxed fallback); returns how many are registered. For benchmarks comparing the two in
    one process (bench/dispatch_cost.py): call it only while no other thread makes calls.
    Needs :func:`loaded`."""
    return _lib.accel_filter_set_unboxed(1 if on else 0)


def set_small_regions(on: bool) -> None:
    """Whether the filter runs eagerly the first calls it has been told begin small
    regions (``ACCEL_EAGER_SMALL_REGIONS``, set at each enable; kept for a filter loaded
    later)."""
    global _small_regions
    _small_regions = bool(on)
    if _lib is not None:
        _lib.accel_filter_small_regions(_small_regions)


def set_matmul(mode: str) -> bool:
    """Where float32 CPU ``mm``, ``addmm`` (beta = alpha = 1) and ``bmm`` calls the filter
    runs past the mode run accel's matmul kernel (include/accel/gemm.h) instead of eager's
    (``ACCEL_CPU_MATMUL``: "auto", AMD CPUs from Zen 5 on, whose cores run AVX-512 at full
    width (``accel_gemm::faster_than_eagers``); "on", any CPU with AVX-512F;
    "off"; set at each enable, kept for a filter loaded later). Returns whether they now
    do: never while the filter is not loaded.

    Raises:
        KeyError: ``mode`` is none of the three.
    """
    global _matmul
    _matmul = _MATMUL_MODES[mode]
    return bool(_lib.accel_filter_matmul(_matmul)) if _lib is not None else False


def set_matmul_pool(on: bool) -> bool:
    """Whether the CPU ``mm``, ``bmm`` and ``addmm`` calls the filter runs past the mode
    write outputs of at least 32 MiB (float32, float64, float16, bfloat16: glibc's largest
    adaptive mmap threshold, above which its blocks are always mapped afresh; see
    ``kPoolMinBytes`` in include/accel/dispatch_filter.cpp) into blocks of accel's CPU
    output pool (:func:`accel.allocator.empty_strided`)
    through their ``out=`` overloads: the same kernels and bits, without the first-touch
    page faults of a freshly mapped output. The interceptor turns it on at each enable where
    regions use the pool (``ACCEL_CPU_POOL``, glibc's malloc defaults), off elsewhere; kept
    for a filter loaded later. Returns whether they now do: never while the filter is not
    loaded."""
    global _matmul_pool
    _matmul_pool = bool(on)
    if _lib is None:
        return False
    _set_pool(_lib)
    return _matmul_pool


def _set_pool(lib) -> None:
    from . import allocator

    lib.accel_filter_pool(allocator.empty_strided if _matmul_pool else None)


def pooled_matmuls() -> int:
    """Matmul outputs the filter has taken from accel's CPU output pool, on every thread of
    the process; 0 while the filter is not loaded."""
    return 0 if _lib is None else _lib.accel_filter_pooled()


def matmuls() -> int:
    """Matmuls run by accel's kernel, on every thread of the process; 0 while the filter
    is not loaded."""
    return 0 if _lib is None else _lib.accel_filter_matmuls()


def eager_first(node) -> None:
    """Tell the filter that trie node ``node`` is a small region's first call, which runs
    eagerly from now on (``TrieNode.eager_first``)."""
    if _lib is not None:
        _lib.accel_filter_eager_first(id(node))


def off_reason() -> Optional[str]:
    """Why the filter is not used (None while it is, or still may be)."""
    return _off
