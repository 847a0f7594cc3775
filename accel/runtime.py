"""Runtime: turn a flushed region into a kernel call.

The kernel for (trie node, liveness mask) is looked up in the node (in memory), then in the
store (disk), and only then compiled: trace -> passes -> lowering -> codegen -> build ->
store -> load. A failure at any stage is remembered as a negative entry and the region runs
eagerly (replayed op by op, filling the outputs without bumping their version counters).
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from . import __version__, allocator, config, launch
from .ops import run_calls
from .region import _ABOVE_PYTHON, PENDING_NODES, PREFETCHED_NODES, ROOT, Region, TrieNode, native

log = logging.getLogger("accel")

STATS = {"flushes": 0, "kernel_runs": 0, "eager_replays": 0, "memory_hits": 0,
         "store_hits": 0, "compiles": 0, "compile_failures": 0, "compile_time_s": 0.0,
         "load_time_s": 0.0, "speculative_launches": 0, "speculative_hits": 0,
         "speculative_misses": 0, "small_region_calls": 0, "bypassed_steps": 0,
         "recomputed_saves": 0, "generic_hits": 0}
_small_base = 0  # the dispatch filter's count of small regions' first calls at reset_stats
_store = None
_store_lock = threading.Lock()
_MISSING = object()


def stats() -> dict:
    """Counters of this process: flushes, kernel runs, eager replays, in-memory and store
    hits, compiles (and their total time in seconds), kernels launched ahead (at a region's
    first call) and how many of those were kept or run again, small or idle regions'
    first calls run eagerly (``accel.eager_regions.SMALL_REGION_CALLS``, ``IDLE_FLUSHES``; by
    the mode or the dispatch filter), steps that step sampling ran without interception
    (``bypassed_steps``; accel/sampling.py), and values autograd saved from a region that
    its kernel did not write, to be recomputed in the backward (``recomputed_saves``;
    accel/remat.py), and regions compiled without a compiler run, served by the
    shape-generic kernel of a region of other outer lengths (``generic_hits``;
    accel/codegen/generic.py)."""
    from . import dispatch

    out = dict(STATS)
    out["small_region_calls"] += dispatch.small_region_calls() - _small_base
    return out


def reset_stats() -> None:
    """Zero :func:`stats`."""
    global _small_base
    from . import dispatch

    for k in STATS:
        STATS[k] = 0.0 if isinstance(STATS[k], float) else 0
    _small_base = dispatch.small_region_calls()


def get_store():
    """The process's kernel store (opened on first use; in memory if the disk is unusable)."""
    global _store
    with _store_lock:
        if _store is None:
            from .store import open_store

            _store = open_store()
        return _store


def adopt_store(store) -> bool:
    """Make ``store`` (a :class:`accel.store.Store` opened ahead, by the import's prefetch:
    :func:`accel.dispatch.prefetch`) the process's store, where none is open yet and it is
    the one :func:`get_store` would open now: the same directory and size limit (a program
    may set ``ACCEL_CACHE_DIR`` after ``import accel``). Returns whether it is the process's
    store now. Never raises (an invalid setting: False, and the next :func:`get_store`
    reports it)."""
    global _store
    from .config import ConfigError
    from .store import Store

    with _store_lock:
        if _store is None:
            try:
                if Store.settings() == (store.location, store.size_limit_bytes):
                    _store = store
            except ConfigError:
                pass
        return _store is store


def set_store(store) -> None:
    """Replace the process's store (tests; ``None`` reopens from the environment)."""
    global _store
    with _store_lock:
        _store = store


@dataclass
class CompiledRegion:
    """A loaded kernel: a CPU entry point's address, or (CUDA) a ``native.CudaKernel``;
    which pending outputs it writes, and the scratch buffers it needs (bytes each), passed
    after the outputs."""

    fn: object
    live_idx: Tuple[int, ...]
    key: str
    scratch: Tuple[int, ...] = ()
    cuda: bool = False
    traffic: int = -1  # bytes of its inputs and outputs (-1: not known yet; see _predict)
    sizes: list = field(default_factory=list)  # a shape-generic kernel's loop lengths: scalars after the region's


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _key_text(node: TrieNode, live) -> str:
    return repr((node.path(), live))


def _readable(calls, region: Region) -> str:
    ops = " > ".join(str(c[0]).replace("aten.", "") for c in calls[:12])
    more = f" (+{len(calls) - 12})" if len(calls) > 12 else ""
    shapes = ",".join("x".join(map(str, t.shape)) or "()" for t in region.ext[:4])
    return f"{ops}{more} [{shapes}]"


def store_key(node: TrieNode, live, device: str = "cpu") -> str:
    """The store key: a hash of named parts (accel version and source hash, torch version,
    compiler identity and flags, CPU ISA or GPU architecture, the region's trie path and
    liveness mask). ``device``: "cpu" or "cuda"."""
    return _hash_key("region", _key_text(node, live), device)


def _hash_key(kind: str, text: str, device: str) -> str:
    """A store key: ``text`` (a region's trie path and liveness, or a shape-generic
    kernel's IR, ``kind`` "generic") hashed with accel's, torch's and the compiler's
    identities."""
    from .build import compiler_key, source_hash
    from .store import STORE_VERSION

    parts = {"store": STORE_VERSION, "accel": f"{__version__}+{source_hash()}",
             "torch": torch.__version__, "compiler": compiler_key(device), kind: text}
    log.debug("key parts: %s", {k: v for k, v in parts.items() if k != kind})
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()


def _compile(region: Region, live, key: str, store):
    from .build import BuildError, build, summary as build_summary
    from .codegen.cpp import CppRenderer
    from .codegen.cuda import CudaRenderer
    from .codegen.generic import GenericCppRenderer, GenericCudaRenderer, NotGeneric, generic_layout, launches_for
    from .graph import trace_region
    from .loop_ir import BufferSpec
    from .lowering import lower
    from .passes import run_passes

    import sys

    t0 = time.perf_counter()
    with _TRACE_LOCK:  # tracing and codegen one region at a time; compilers run in parallel
        # lowering and codegen recurse along the region's dependence chains (<= ACCEL_MAX_REGION)
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * config.flag("ACCEL_MAX_REGION") + 1000))
        live_idx = tuple(i for i, a in enumerate(live) if a)
        scalar_types = ["f" if type(s) is float else "i" for s in region.scalars]
        signed = [t + ("-" if s < 0 else "+") for t, s in zip(scalar_types, region.scalars)]
        tr = trace_region(region.calls, region.ext, len(region.outs), live_idx, signed,
                          [m[2] for m in region.out_meta])
        pass_log = run_passes(tr.gm)
        ext = [BufferSpec(t.dtype, tuple(t.shape), t.stride(), False) for t in region.ext]
        outs = [BufferSpec(region.out_meta[i][2], tuple(region.out_meta[i][0]), tuple(region.out_meta[i][1]),
                           True) for i in live_idx]
        device = _device_type(region)
        ir = lower(tr.gm, ext, outs, scalar_types, device)
        gen = generic_layout(ir, device) if config.flag("ACCEL_GENERIC_KERNELS") else None
        if gen is not None:  # one kernel for every length of the outer loops (codegen/generic.py)
            gkey = _hash_key("generic", gen.text, device)
            name = "accel_region_" + gkey[:16]
            shared, source, launches = store.get(gkey), None, None
            if shared is None:
                try:
                    renderer = (GenericCppRenderer(gen.loops) if device == "cpu" else
                                GenericCudaRenderer(gen.loops, gen.index_types))
                    source = renderer.render(ir, name)
                    launches = renderer.launches
                except NotGeneric as e:
                    log.debug("accel: region %s is built for its sizes: %s", key[:16], e)
                    gen = None
    readable = _readable(region.calls, region)
    if gen is not None:
        try:
            artifact, source, launches = _shared_kernel(shared, gkey, source, launches, name, device,
                                                        store, readable)
        except BuildError as e:  # (not expected: the static kernel's code, its bounds at run time)
            log.warning("accel: a shape-generic kernel did not build; region %s is built for its "
                        "sizes (%s)", key[:16], build_summary(str(e)))
            gen = None
    if gen is not None and launches is not None:  # (CUDA: the grids for this region's lengths)
        launches = launches_for(launches, gen.sizes)
    if gen is None:
        with _TRACE_LOCK:
            name = "accel_region_" + key[:16]
            renderer = CppRenderer() if device == "cpu" else CudaRenderer()
            source = renderer.render(ir, name)
            launches = renderer.launches
        artifact = build(source, name, device, store)
    dt = time.perf_counter() - t0
    meta = {"readable": readable, "symbol": name, "source": source,
            "live_idx": list(live_idx), "pass_log": pass_log, "compile_time_s": dt,
            "graph": str(tr.gm.graph), "ir": ir.describe(), "torch": torch.__version__,
            "n_ext": len(ext), "n_out": len(outs), "scalar_types": scalar_types, "device": device,
            "scratch": [_prod(b.shape) * _itemsize(b.dtype) for b in ir.buffers if b.scratch]}
    if launches is not None:
        meta["launches"] = launches
    if gen is not None:
        meta["sizes"], meta["generic"] = gen.sizes, gkey
    with _TRACE_LOCK:
        STATS["compiles"] += 1
        STATS["compile_time_s"] += dt
    store.record("compiles")
    log.info("compiled region %s in %.2f s: %s", key[:16], dt, meta["readable"])
    return store.put(key, artifact, meta)


def _shared_kernel(shared, gkey: str, source, launches, name: str, device: str, store, readable: str):
    """The artifact, source and launch plan (CUDA; its grids' formulas, see
    :func:`accel.codegen.generic.launches_for`) of the shape-generic kernel of store key
    ``gkey``: ``shared``, its entry, or built now from ``source`` (under the key's compile
    lock: one builder across processes) and stored. A region served by an existing one
    counts as a ``generic_hits`` (no compiler run)."""
    from .build import build

    if shared is None:
        with store.compile_lock(gkey):
            shared = store.get(gkey)
            if shared is None:
                t0 = time.perf_counter()
                artifact = build(source, name, device, store)
                meta = {"readable": "shape-generic: " + readable, "symbol": name, "source": source,
                        "device": device, "compile_time_s": time.perf_counter() - t0,
                        "ir": "outer loops' lengths at run time", "torch": torch.__version__}
                if launches is not None:
                    meta["generic_launches"] = launches
                shared = store.put(gkey, artifact, meta)
                return artifact, source, launches
    with _TRACE_LOCK:
        STATS["generic_hits"] += 1
    with open(shared.path, "rb") as f:
        return f.read(), shared.meta["source"], shared.meta.get("generic_launches")


_POOL = None
_TRACE_LOCK = threading.RLock()
_IN_FLIGHT: set = set()  # futures of background builds (ACCEL_ASYNC_COMPILE)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, ``multiprocessing`` with ``fork``) has only the
    thread that forked: the parent's build threads are gone. Their pool would queue the
    child's builds with no thread to run them (its first flush to build waited forever),
    and a lock one of them held would stay held; the child starts both afresh (as
    Inductor's compile pools do). Builds the parent had in flight never finish here:
    their regions run eagerly in the child."""
    global _POOL, _store_lock, _TRACE_LOCK
    _POOL, _store_lock, _TRACE_LOCK = None, threading.Lock(), threading.RLock()
    _IN_FLIGHT.clear()
    if _store is not None:
        _store.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool():
    """The build threads (one per core, at most 8): fresh threads, so tracing starts from
    clean dispatch state even when a flush comes from inside ``__torch_dispatch__``."""
    global _POOL
    with _store_lock:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                       thread_name_prefix="accel-build")
        return _POOL


class _Pending:
    """A kernel being built in the background: its region runs eagerly until it is ready."""

    __slots__ = ("future",)

    def __init__(self, future):
        self.future = future


def wait_for_compiles(timeout: Optional[float] = None) -> int:
    """Wait for the kernels being built in the background (``ACCEL_ASYNC_COMPILE=1``) to be
    stored, at most ``timeout`` seconds (None: until they are); returns how many are still
    being built. The next flush of each region then runs its kernel."""
    from concurrent.futures import wait

    pending = list(_IN_FLIGHT)
    if pending:
        wait(pending, timeout=timeout)
    return sum(1 for f in pending if not f.done())


def _snapshot(region: Region):
    """What building ``region`` needs, detached from it (it is reset at once and reused):
    its calls, scalars and output metadata, and fake tensors for its inputs: their metadata
    on their own devices, without their memory. (Meta tensors failed the trace of a GPU
    region holding a factory: ``where(c, x, 0.5)``'s ``scalar_tensor`` on ``cuda:0``
    beside a meta input, "Tensor on device cuda:0 is not on the expected device meta".)"""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = mode.fake_tensor_converter.from_meta_and_device
    ext = [fake(mode, torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta"), t.device)
           for t in region.ext]
    return SimpleNamespace(calls=list(region.calls), ext=ext, outs=[None] * len(region.outs),
                           out_meta=list(region.out_meta), scalars=list(region.scalars),
                           node=region.node, device=region.device)


def _load(entry) -> CompiledRegion:
    """Load a store entry: dlopen a CPU library; read a cubin (its module is loaded into a
    GPU's context at the first launch there)."""
    t0 = time.perf_counter()
    cuda = entry.meta.get("device") == "cuda"
    if cuda:
        with open(entry.path, "rb") as f:
            fn = native.CudaKernel(f.read(), entry.meta["launches"])
    else:
        fn = native.load(entry.path, entry.meta["symbol"])
    STATS["load_time_s"] += time.perf_counter() - t0
    return CompiledRegion(fn, tuple(entry.meta["live_idx"]), entry.key,
                          tuple(entry.meta.get("scratch", ())), cuda, sizes=list(entry.meta.get("sizes", ())))


#: steps begun in this process, on every thread: backward passes (outermost) and outermost
#: accel.eager() / enable() blocks (accel.hooks, accel.interceptor)
STEPS = [0]
#: per shape-generic region signature (_signature): [the step of its first build, kernels
#: built in this process, of those built in a later step than the first, whether a shape
#: first met after that step was seen]
_SHAPES_BUILT: dict = {}
_LIMITED: set = set()  # the signatures past their limit (each logged once)


class _Deferred:
    """A trie node's entry for a shape refused in its signature's first step, past 4 L
    shapes (:func:`_may_build`), in step ``step``: the region runs eagerly, and its kernel
    is asked for again in a later step."""

    __slots__ = ("step",)

    def __init__(self, step: int):
        self.step = step


def _signature(region: Region, live) -> tuple:
    """What a region's kernels for different shapes share: its device type, liveness mask,
    ops in order, and its inputs' dtypes and ranks (not their sizes or strides, nor the
    calls' constant arguments, which may hold sizes)."""
    return (_device_type(region), live, tuple(c[0] for c in region.calls),
            tuple((t.dtype, t.dim()) for t in region.ext))


def _may_build(region: Region, live, deferred: bool = False):
    """Whether a kernel may be built for ``region`` at a new shape, under its signature's
    ``ACCEL_RECOMPILE_LIMIT`` (L): at most L shapes first built in a later step than the
    signature's first build, and 4 L in all; past either the region runs eagerly at new
    shapes in this process. A static program meets its shapes in its first step (a
    ResNet-50's batch norm + ReLU regions: 11 shapes of one signature), and then no new
    ones; shapes that keep changing (a sequence length per batch: 105 lengths in 150
    steps, each new one a build of 5 regions, ran 230x slower than eager; a generation's
    growing cache, each new token a build) stop being built after a few, as
    torch.compile's ``recompile_limit`` (8) stops recompiling a frame.

    A static program can meet more than 4 L shapes of one signature in its first step
    (DenseNet-121's batch norm + ReLU: 58 widths of concatenated features): the shapes
    refused there (``deferred``: met again in a later step, :class:`_Deferred`) are built
    then, as long as no shape new after the first step has come (a static program's
    steps meet the same shapes). Returns True, False, or a :class:`_Deferred` (eager now;
    ask again in a later step)."""
    limit = config.flag("ACCEL_RECOMPILE_LIMIT")
    if not limit:
        return True
    sig = _signature(region, live)
    step = STEPS[0]
    rec = _SHAPES_BUILT.get(sig)
    if rec is None:
        rec = _SHAPES_BUILT[sig] = [step, 0, 0, False]
    late = step != rec[0]
    if late and deferred and not rec[3]:
        rec[1] += 1  # a shape of the first step, built in a step that met no new shape
        return True
    if late and not deferred:
        rec[3] = True
    if rec[1] >= 4 * limit or (late and rec[2] >= limit):
        if sig not in _LIMITED:  # (the first signature a warning, the others info)
            (log.info if _LIMITED else log.warning)(
                "accel: region %s had kernels built for %d shapes, %d of them after its first "
                "step (ACCEL_RECOMPILE_LIMIT=%d: %d after it, %d in all); its new shapes run "
                "eagerly", _readable(region.calls, region), rec[1], rec[2], limit, limit, 4 * limit)
            _LIMITED.add(sig)
        return False if late else _Deferred(step)  # (rec[3] is only set in a later step)
    rec[1] += 1
    rec[2] += late
    return True


def kernel_for(region: Region, live, deferred: bool = False):
    """Find or build the kernel of ``region`` with liveness mask ``live``; ``None`` means
    run eagerly (a remembered failure, or past ``ACCEL_RECOMPILE_LIMIT``), a
    :class:`_Deferred` eagerly until a later step asks again (``deferred``), a
    :class:`_Pending` eagerly until its background build is done. Never raises for a
    compile problem."""
    from .interceptor import warn_once

    store = get_store()
    try:
        key = store_key(region.node, live, _device_type(region))
    except Exception as e:  # noqa: BLE001 - no compiler: eager, once warned
        warn_once(("key", type(e).__name__), "accel: kernels disabled (%s); running eagerly", e)
        return None
    if _ws_record is None:
        _record_at_exit(allocator.program_key(), None)
    kern = _PREFETCHED_KERNELS.pop(key, None) if store is prefetched_from else None
    if kern is not None:
        STATS["store_hits"] += 1
        store.record("hits")
        return kern
    try:
        entry = store.get(key)
        if entry is None:
            store.record("misses")
            may = _may_build(region, live, deferred)
            if may is not True:
                return may or None
            if config.flag("ACCEL_ASYNC_COMPILE"):
                future = _pool().submit(_build, _snapshot(region), live, key, store)
                _IN_FLIGHT.add(future)
                future.add_done_callback(_IN_FLIGHT.discard)
                return _Pending(future)
            entry = _pool().submit(_build, region, live, key, store).result()
        else:
            STATS["store_hits"] += 1
            store.record("hits")
        return _loaded(entry)
    except Exception as e:  # noqa: BLE001 - a broken store or library: eager, keep going
        warn_once(("runtime", type(e).__name__), "accel: region runs eagerly (%s: %s)",
                  type(e).__name__, e)
        return None


# -- a program's working set: its next process reads it ahead ---------------------------
#: kernels loaded ahead from the store by the import's thread, by key, and that store
_PREFETCHED_KERNELS: dict = {}
prefetched_from = None
_ws_record = None  # (program, pid, the working set read ahead) once the exit's record is due
#: the most nodes and kernels a working set keeps (the trie's first, breadth first)
WS_MAX_NODES, WS_MAX_KERNELS = 4096, 1024


def _record_at_exit(program, read) -> None:
    global _ws_record
    _ws_record = (program, os.getpid(), read)
    atexit.register(_save_working_set)


def _working_set() -> tuple:
    """This process's trie nodes (digests) and loaded kernels (store keys), breadth first
    from the root, at most :data:`WS_MAX_NODES` and :data:`WS_MAX_KERNELS`."""
    nodes, kernels, level = [], [], [ROOT]
    while level and len(nodes) < WS_MAX_NODES:
        below = [c for n in level for c in list(n.children.values())]
        nodes += [c.digest for c in below]
        kernels += [k.key for c in below for k in list(c.kernels.values())
                    if isinstance(k, CompiledRegion)]
        level = below
    return nodes[:WS_MAX_NODES], kernels[:WS_MAX_KERNELS]


def prefetch_working_set(store, program: str) -> int:
    """Read ahead what ``program``'s last process used (its record in ``store``:
    :meth:`accel.store.Store.working_set`): its trie nodes' metadata, and its kernels,
    loaded (dlopen; a CUDA cubin read), so that its first iteration takes them from
    memory instead of the store (the demo's GPT-2 step on the dev VM: about 60 nodes and
    23 kernels, 15-20 ms). Run by the import's background thread
    (:func:`accel.dispatch.prefetch`); used only where ``store`` becomes the process's
    store (:func:`adopt_store`). Returns how many kernels it loaded. Never raises."""
    global prefetched_from
    try:
        ws = store.working_set(program)
        if not ws:
            return 0
        prefetched_from = store
        if _ws_record is None:
            _record_at_exit(program, ws)
        nodes, keys = ws
        for d in nodes:
            rec = store.get_node(d)
            if rec is not None:
                PREFETCHED_NODES[d] = rec
        n = 0
        for k in keys:
            entry = store.get(k)
            if entry is not None and not entry.negative:
                _PREFETCHED_KERNELS[k] = _load(entry)
                n += 1
        log.debug("accel: read ahead %d trie nodes and %d kernels of the program's last run",
                  len(nodes), n)
        return n
    except Exception as e:  # noqa: BLE001 - a broken store or library: the first call looks itself
        log.debug("accel: the program's working set was not read ahead (%s)", e)
        return 0


def _save_working_set() -> None:
    """At exit: record the trie nodes and kernels this process used, for the program's
    next process, where they differ from the record read ahead; not in a forked child,
    nor for a program without a name (:func:`accel.allocator.program_key`)."""
    program, pid, read = _ws_record
    if program is None or pid != os.getpid():
        return
    ws = _working_set()
    store = _store
    if not ws[1] or (read is not None and ws == tuple(read)):
        return
    if store is None or not store.persistent:
        return
    try:
        store.put_working_set(program, *ws)
    except Exception as e:  # noqa: BLE001 - only the next process's head start is lost
        log.debug("accel: the working set's record was not written (%s)", e)


def _loaded(entry) -> Optional[CompiledRegion]:
    return None if entry is None or entry.negative else _load(entry)


def _build(region, live, key: str, store):
    """Under the store's compile lock (one builder of ``key`` across processes): the entry
    of ``key``, compiled unless another builder stored it meanwhile; ``None`` after a
    compile failure, which is stored as a negative entry."""
    from .build import summary as build_summary
    from .interceptor import warn_once

    with store.compile_lock(key):
        entry = store.get(key)
        if entry is not None:
            return entry
        try:
            return _compile(region, live, key, store)
        except Exception as e:  # noqa: BLE001 - every failure means: eager
            with _TRACE_LOCK:
                STATS["compile_failures"] += 1
            store.record("compile_failures")
            reason = f"{type(e).__name__}: {e}"
            store.put_negative(key, reason, {"readable": _readable(region.calls, region)})
            warn_once(("compile", type(e).__name__, str(e)[:80]),
                      "accel: region runs eagerly (%s)", build_summary(reason))
            return None


def _ready(node: TrieNode, live, pending: _Pending) -> Optional[CompiledRegion]:
    """The kernel of a background build that is done (loaded, or ``None``: eager), kept in
    the trie node from now on."""
    from .interceptor import warn_once

    try:
        kern = _loaded(pending.future.result())
    except Exception as e:  # noqa: BLE001 - a broken store or library: eager, keep going
        warn_once(("runtime", type(e).__name__), "accel: region runs eagerly (%s: %s)",
                  type(e).__name__, e)
        kern = None
    node.kernels[live] = kern
    return kern


def replay(region: Region, fallback: bool = True) -> None:
    """Run the region's calls eagerly, writing each result into its pending output.

    Runs where the interceptor's dispatch mode recorded them, below every key above the
    Python key, whatever the flush's context: neither the outputs' nor the mutated inputs'
    version counters change (autograd already counted the user's calls), autocast does not
    cast again, and a flush inside a torch.func transform (``grad``, ``vmap``) does not run
    the calls through the transform, which refused the outputs' ``copy_`` ("attempted to
    call in-place operation (aten::copy_) that would mutate a captured Tensor").
    ``fallback``: counted as an eager replay (not: a region run eagerly by choice, see
    :func:`run_eagerly`).
    """
    STATS["eager_replays"] += fallback
    outs = region.outs

    def fill(k, t):
        o = outs[k]
        if o.shape == t.shape:
            o.copy_(t)
        else:  # the op's meta function gave another shape than its kernel (eval-mode
            o.set_(t)  # batch norm's saved statistics: [C] there, [0] here): eager's wins

    with torch._C._ExcludeDispatchKeyGuard(_ABOVE_PYTHON):
        run_calls(region.calls, region.ext, outs, region.scalars, fill)


def _count_flush() -> None:
    """Count a flush, and store the trie nodes met since the last one."""
    STATS["flushes"] += 1
    if PENDING_NODES:
        _save_nodes()


def run_eagerly(region: Region) -> None:
    """Flush ``region`` by running its calls eagerly (:func:`replay`), building no kernel for
    it: what a region the idle-region rule is still sampling does (``accel.interceptor``),
    counted as an eager replay."""
    _count_flush()
    replay(region)


def run_small(region: Region) -> None:
    """As :func:`run_eagerly`, for a small region (``accel.eager_regions.SMALL_REGION_CALLS``):
    its calls count as ``small_region_calls``, not as an eager replay."""
    _count_flush()
    STATS["small_region_calls"] += len(region.calls)
    replay(region, fallback=False)


def _save_nodes() -> None:
    """Write the trie nodes met since the last flush to the store (a new process then
    skips their meta evaluation)."""
    batch = dict(PENDING_NODES)
    PENDING_NODES.clear()
    try:
        get_store().put_nodes(batch)
    except Exception as e:  # noqa: BLE001 - only start-up time is lost
        from .interceptor import warn_once

        warn_once(("nodes", type(e).__name__), "accel: trie metadata not saved (%s: %s)",
                  type(e).__name__, e)


def execute(region: Region) -> None:
    """Flush ``region``: keep the result of its kernel launched ahead, run its kernel, or
    replay it eagerly."""
    _count_flush()
    node = region.node
    live = region.liveness()
    sp = region.speculation
    if sp is not None:
        if launch.confirmed(region, sp, node, live):
            STATS["kernel_runs"] += 1
            STATS["speculative_hits"] += 1
            return
        STATS["speculative_misses"] += 1
        launch.mispredicted(region, sp)
    kern = node.kernels.get(live, _MISSING)
    if kern is _MISSING:
        kern = kernel_for(region, live)
        node.kernels[live] = kern
    elif kern.__class__ is _Deferred and kern.step != STEPS[0]:
        kern = node.kernels[live] = kernel_for(region, live, deferred=True)
    else:
        STATS["memory_hits"] += 1
    if kern.__class__ is _Pending:
        kern = _ready(node, live, kern) if kern.future.done() else None
    elif kern.__class__ is _Deferred:
        kern = None
    if kern is not None and not (region.mutates_ext and region.ext_overlap()):
        if not kern.cuda:
            native.reuse_blocks(region.outs, kern.live_idx)
        ptrs = launch.kernel_ptrs(kern, region, region.ext, region.outs)
        status, _ = launch.launch_kernel(kern, region, ptrs, region.scalars)
        if status == 0:
            STATS["kernel_runs"] += 1
            if region.first is not None and not region.mutates_ext:
                launch.predict(region, node, live, kern)
            return
        from .interceptor import warn_once

        node.kernels[live] = None  # this process runs the region eagerly from now on
        warn_once(("launch", kern.key), "accel: region %s (%s) failed to launch (%s); "
                  "it runs eagerly", kern.key[:16], _readable(region.calls, region),
                  native.cuda_error_string(status) if kern.cuda else f"status {status}")
    replay(region)


def _device_type(region: Region) -> str:
    d = region.device
    return "cuda" if d is not None and d.type == "cuda" else "cpu"
