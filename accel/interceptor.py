"""The interceptor: a ``TorchDispatchMode`` that sees every aten call and either defers it
into the thread's pending region or flushes the region and runs the call eagerly.

Reads of tensor data that bypass the dispatcher, and the host's ways of ordering GPU work
or waiting for it, flush the pending region first through hooks on those Python entry
points (:mod:`accel.hooks`, installed when accel is imported or at the first enable).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import allocator, config, dispatch, eager_regions, hooks, launch, remat, runtime, sampling
from . import library, losses  # (importing library registers torch.ops.accel.*)
from .ops import VIEW_OPS, fusible_ops, op_spec
from .region import (NEW_NODES, PENDING_NODES, Deferred, Region, native, set_cuda_half,
                     set_small_regions)
from .launch import set_launch_ahead_min, speculate
from .runtime import CompiledRegion, execute
from .eager_regions import run_and_reset as _run

log = logging.getLogger("accel")

__all__ = ["eager", "enable", "disable", "is_enabled", "flush", "AccelMode"]


class _State(threading.local):
    def __init__(self):
        self.region = Region()
        self.depth = 0  # nesting of eager()/enable() on this thread
        self.modes = []
        self.spare = []  # exited modes of this thread, for reuse
        self.worker = None  # a _Worker, on an autograd engine thread that recorded
        self.bound = False  # the dispatch filter reads this thread's region's pending byte
        self.filtered = False  # accel included the dispatch filter's key on this thread
        self.sampler = None  # the thread's step sampling (accel/sampling.py), once enabled
        self.suspended = False  # step sampling took the outermost mode off the stack
        self.stack_len = 0  # the dispatch mode stack's length once it did
        self.backward_steps = False  # steps end at backward calls (else at outermost enables)
        self.backward_in_block = False  # a backward call since the last outermost enable


_state = _State()
_get_ident = threading.get_ident

#: A torch function mode on the stack (``torch.set_default_device``, ``with
#: torch.device(...)``, a user's TorchFunctionMode) sees every tensor method accel's own
#: code calls, by its public name: ``torch._C.TensorBase.data_ptr(t)`` reaches the mode as
#: ``torch.Tensor.data_ptr``, accel's flushing hook, which flushed the region being
#: recorded or flushed (wrong results, a crash); and a factory accel calls without a device
#: (a CPU output) got the mode's default device. accel's work runs with torch function
#: handling off (:func:`_without_torch_function`; the dispatch filter does the same in C++
#: around the region core's ``_replay``).
_tf_mode_on = torch._C._is_torch_function_mode_enabled
_NoTorchFunction = torch._C.DisableTorchFunction


def _without_torch_function(fn):
    """``fn`` with torch function modes and subclasses off while it runs (see above)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _tf_mode_on():
            return fn(*args, **kwargs)
        with _NoTorchFunction():
            return fn(*args, **kwargs)

    return wrapper


_warned = set()


def warn_once(key, msg, *args):
    """Log ``msg`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


@_without_torch_function
def flush() -> None:
    """Execute the calling thread's pending region, filling every live output."""
    w = _state.worker
    if w is None:
        _flush_region(_state.region)
    else:
        with w.lock:
            _flush_region(w.region)


#: whether the rules of :mod:`accel.eager_regions` apply: ACCEL_EAGER_SMALL_REGIONS, and
#: ACCEL_EAGER_IDLE_REGIONS with it (read at each enable)
_eager_small = True
_eager_idle = True


def _flush_region(region) -> None:
    if region.busy or not region.calls:
        return
    node = region.node
    small = node.depth <= eager_regions.SMALL_REGION_CALLS and _eager_small
    if small and eager_regions.decide_small(region, node):
        _run(region, runtime.run_small)
        return
    if node.idle >= 0 and _eager_idle and eager_regions.sample_idle(region, node):
        return
    if node.remat is None or node.remat:  # a plan not made yet, or values to recompute
        remat.prepare(region)
    if not region.run_cached(runtime.STATS, CompiledRegion, launch._ahead_min, bool(PENDING_NODES)):
        _run(region, execute)
    if dispatch.building:  # a background build of the filter: use it once it is loaded
        _filter_on(_state)


def _filter_on(st) -> None:
    """Include the dispatch filter's key on this thread where accel is enabled here and
    the filter is loaded (see :mod:`accel.dispatch`), and let it record calls into the
    thread's region, up to the innermost mode's region size cap. Not in a step that step
    sampling runs eagerly (accel's mode off the stack)."""
    if st.suspended and st.depth == 1:
        return
    if st.depth and not st.filtered and dispatch.loaded():
        _bind(st)
        dispatch.set_included(True)
        st.filtered = True
    mode = _innermost(st) if st.filtered else None
    if mode is not None:  # none in the flush of disable() leaving the last block: disable()
        _set_replay(st, mode)  # turns the filter off after it


def _innermost(st):
    """The innermost enabled mode of the thread (None: there is none)."""
    return next((m for m in reversed(st.modes) if m is not None), None)


def _set_replay(st, mode) -> None:
    st.region.set_replay(True, mode.cap, None, mode.on_first)


def _bind(st) -> None:
    if not st.bound:
        dispatch.bind(st.region)
        st.bound = True


_EAGER = object()


def _record(mode, region, func, spec, args, kwargs):
    """Defer ``func`` into ``region``; ``_EAGER`` where it must run now (the region is
    flushed first where the call needs its values)."""
    try:
        out = region.record(func, spec, args, kwargs)
    except Deferred as e:
        _flush_region(region)
        if e.args[0] != "alias":
            if e.args[0] == "small region":
                runtime.STATS["small_region_calls"] += 1
            else:
                log.debug("accel: %s runs eagerly (%s)", func, e.args[0])
            return _EAGER
        try:  # it read a view of a pending output: now a plain input
            out = region.record(func, spec, args, kwargs)
        except Exception:  # noqa: BLE001 - Deferred, or as below
            return _EAGER
    except Exception as e:  # noqa: BLE001 - allocating its output failed, say: eager decides
        log.debug("accel: %s runs eagerly (%s: %s)", func, type(e).__name__, e)
        _flush_region(region)
        return _EAGER
    n = len(region.calls)
    if n == 1 and mode.on_first is not None:
        mode.on_first(region)
    if n >= mode.cap:
        _flush_region(region)
    return out


def _first_call(region) -> None:
    """A region's first call: where its kernel may be launched ahead (``ACCEL_LAUNCH_AHEAD``;
    see :func:`accel.launch.speculate`)."""
    region.first = node = region.node
    region.first_n_ext = len(region.ext)
    pred = node.predict
    if pred is not None and pred.count >= pred.need:
        try:
            if speculate(region, pred):
                runtime.STATS["speculative_launches"] += 1
        except Exception as e:  # noqa: BLE001 - (out of memory, say) the flush runs it as usual
            region.ahead = region.speculation = None
            log.debug("accel: no launch ahead (%s: %s)", type(e).__name__, e)


_IS_CUDA: dict = {}


def _first_call_on_gpu(region) -> None:
    """:func:`_first_call` for a region on a GPU (``ACCEL_LAUNCH_AHEAD=cuda``)."""
    d = region.device
    cuda = _IS_CUDA.get(d)
    if cuda is None:  # (a device's .type builds a string: slower than this lookup)
        cuda = _IS_CUDA[d] = d is not None and d.type == "cuda"
    if cuda:
        _first_call(region)


#: ACCEL_LAUNCH_AHEAD -> what runs after a region's first call is recorded, by the mode or
#: by the dispatch filter (through the region core's _replay)
_FIRST_HOOKS = {"off": None, "cuda": _first_call_on_gpu, "all": _first_call}


class _Worker:
    """The region of an autograd engine thread (CUDA backward runs on one thread per device,
    which inherits the caller's dispatch modes). It is flushed on that thread like any
    other, and at the end of every backward pass that recorded into it by a final callback
    of the autograd engine (running on the thread that called backward), so no gradient
    is left pending; ``lock`` keeps the two threads apart.

    A backward pass that raises runs no final callback: the pass that queued one is known
    by its graph task id (``torch._C._current_graph_task_id``), so the next pass queues its
    own, and the caller's entry point flushes what the failed pass recorded
    (:func:`flush_workers`) before the exception reaches the program."""

    def __init__(self, region):
        self.region = region
        self.lock = threading.RLock()
        self.task = None  # the graph task (backward pass) whose final callback is queued
        self.stream = None  # the CUDA stream the backward ran on
        # what the dispatch filter calls to record into the region (RegionCore._replay under
        # the lock, once the final callback is queued; raises Deferred outside a backward)
        self.replay_fn = native.WorkerReplay(self, region, self.lock)
        _WORKERS.add(self)

    @property
    def queued(self) -> bool:
        """Whether the running backward pass has this worker's final callback queued."""
        return self.task is not None and self.task == _current_graph_task_id()

    def queue_final_callback(self) -> bool:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.final)
        except RuntimeError:  # not inside a backward pass: this thread runs eagerly
            return False
        self.task = _current_graph_task_id()
        if torch.cuda.is_initialized():
            self.stream = torch.cuda.current_stream()
        return True

    @_without_torch_function
    def final(self) -> None:
        with self.lock:
            self.task = None
            if not self.region.calls:
                return
            if self.stream is None:
                _flush_region(self.region)
            else:
                with torch.cuda.stream(self.stream):
                    _flush_region(self.region)


_current_graph_task_id = torch._C._current_graph_task_id
#: every engine thread's worker (weakly: a worker lives as long as its thread's state)
_WORKERS: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


def flush_workers(after_failed_pass: bool = True) -> None:
    """Flush what every autograd engine thread's worker holds, and order the calling
    thread's current stream of each GPU after the kernels that launched there. Called by
    the backward entry points (accel/hooks.py) when a pass raises (it left its recorded
    calls there, with no final callback to run them), before the exception reaches the
    program, so that gradients already accumulated are filled; a flush that fails there is
    logged (``after_failed_pass``: the pass's own exception is the one to raise). Called
    also before code that reads other threads' results outside the dispatcher (DataParallel's
    gradient reduction on one device thread of gradients computed on another)."""
    for w in list(_WORKERS):
        try:
            w.final()
        except Exception:  # noqa: BLE001
            if not after_failed_pass:
                raise
            log.warning("accel: flushing an engine thread's calls after a failed backward "
                        "pass raised", exc_info=True)
            continue
        if w.stream is not None:
            current = torch.cuda.current_stream(w.stream.device)
            if current != w.stream:
                current.wait_stream(w.stream)


class AccelMode(TorchDispatchMode):
    """Dispatch mode that defers fusible aten calls into regions (see DESIGN.md)."""

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo, whose first call
        # imports torch._dynamo (about 1.3 s) and which costs about 1 µs a call (5 % of a
        # small model's step); instead _DYNAMO_SKIPS marks the code object itself, which
        # dynamo's frame evaluation then skips in C (_DynamoSafeAccelMode where it cannot)
        return False

    def __init__(self):
        super().__init__()
        self.table, self.views = _op_ids()
        self.cap = config.flag("ACCEL_MAX_REGION")
        self.on_first = _FIRST_HOOKS[config.flag("ACCEL_LAUNCH_AHEAD")]
        self.owner = threading.get_ident()
        self.region = _state.region  # the owner thread's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _tf_mode_on():  # (False again inside: one level of recursion)
            with _NoTorchFunction():
                return self.__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        spec = self.table.get(id(func))  # by id: OpOverload's __hash__ is Python code
        if spec is not None and _len_modes() and _traced_below():
            spec = None  # another mode below records the calls: eager (regions flushed)
        if _get_ident() != self.owner:  # an autograd engine thread
            if spec is None and id(func) in self.views:  # (unpacking a saved output: detach)
                return func._op(*args, **kwargs)
            return self._worker_dispatch(func, spec, args, kwargs)
        region = self.region
        if spec is not None and not region.busy:
            out = _record(self, region, func, spec, args, kwargs)
            return func(*args, **kwargs) if out is _EAGER else out
        if func is _NLL_BACKWARD and _may_record_whole(region):
            out = _nll_loss_backward(self, region, args, kwargs)
            if out is not None:
                return out
        if (func is _CAT or func is _STACK) and _may_record_whole(region):
            out = _cat(self, region, func, args, kwargs)
            if out is not None:
                return out
        if id(func) not in self.views and region.calls:
            if func is _NLL_FORWARD and _may_record_whole(region):
                out = _nll_of_log_softmax(self, region, args, kwargs)
                if out is not None:
                    return out
            _flush_region(region)
        return func._op(*args, **kwargs)  # the C++ op itself, past OpOverload.__call__

    def _worker_dispatch(self, func, spec, args, kwargs):
        st = _state
        w = st.worker
        if w is None:
            w = st.worker = _Worker(st.region)
        if not st.bound and dispatch.active():
            _bind(st)
        if st.bound:
            st.region.set_replay(True, self.cap, w.replay_fn, self.on_first)
        with w.lock:
            region = w.region
            if spec is not None and not w.queued and not w.queue_final_callback():
                spec = None
            if spec is not None and not region.busy:
                out = _record(self, region, func, spec, args, kwargs)
                if out is not _EAGER:
                    return out
            elif func is _NLL_BACKWARD and _may_record_whole(region) and (w.queued or w.queue_final_callback()):
                out = _nll_loss_backward(self, region, args, kwargs)
                if out is not None:
                    return out
            elif ((func is _CAT or func is _STACK) and _may_record_whole(region)
                  and (w.queued or w.queue_final_callback())):  # a split's or chunk's gradient
                out = _cat(self, region, func, args, kwargs)
                if out is not None:
                    return out
            if spec is None and id(func) not in self.views and region.calls:
                _flush_region(region)
        return func._op(*args, **kwargs)


_NLL_FORWARD = torch.ops.aten.nll_loss_forward.default
_NLL_BACKWARD = torch.ops.aten.nll_loss_backward.default
_NLL_OF_LOG_SOFTMAX = torch.ops.accel.nll_of_log_softmax.default
_NLL_BACKWARD_DENSE = torch.ops.accel.nll_loss_backward.default
_CAT = torch.ops.aten.cat.default
_STACK = torch.ops.aten.stack.default
_ACCEL_CAT = torch.ops.accel.cat.default


def _may_record_whole(region) -> bool:
    """Whether the mode may record an accel op in place of a call of ``accel.ops.MODE_OPS``:
    not while the region flushes or replays, nor under another tracing mode."""
    return not region.busy and not (_len_modes() and _traced_below())


def _record_whole(mode, region, op, args, learnt=False):
    """Record ``op`` (an accel op: ``accel.library``) in ``region`` in place of the call of
    ``accel.ops.MODE_OPS`` being dispatched; its result, or None where the region could not
    take it (then flushed: the call runs as usual). The dispatch filter learns its edge only
    where ``learnt`` (it keys such a call by ``op``'s arguments: cat_arguments in C++)."""
    out = _record(mode, region, op, op_spec(op), args, {})
    if out is _EAGER:
        return None
    if not learnt:
        region.last_call = None
    return out


def _nll_of_log_softmax(mode, region, args, kwargs):
    """``nll_loss_forward`` of a pending log-softmax (:func:`accel.losses.nll_of_log_softmax`),
    recorded as ``accel.nll_of_log_softmax``: ``(output, total_weight)`` as eager's call
    returns them, or None (the call then runs as usual: the region flushed, eager's call on
    the log-softmax, raising its error)."""
    plan = losses.nll_of_log_softmax(region, args, kwargs)
    out = None if plan is None else _record_whole(mode, region, _NLL_OF_LOG_SOFTMAX, plan[0])
    if out is None:
        return None
    return out if plan[0][3] else (out[0], plan[1])  # reduction none: eager's total weight


def _cat(mode, region, func, args, kwargs):
    """Eager's ``cat`` or ``stack`` recorded as ``accel.cat`` where
    :func:`accel.library.cat_call` takes it: the result (pending), or None (the call then
    runs as usual: a region flushed first, eager's call with its checks and errors)."""
    region.last_call = region.eager_call = None  # (what the filter learns from: this call's)
    op_args = library.cat_call(func is _STACK, args, kwargs)
    return None if op_args is None else _record_whole(mode, region, _ACCEL_CAT, op_args, learnt=True)


def _nll_loss_backward(mode, region, args, kwargs):
    """Autograd's ``nll_loss_backward`` (:func:`accel.losses.nll_loss_backward`), recorded as
    ``accel.nll_loss_backward``: the gradient (pending), or None (the call runs as usual)."""
    op_args = losses.nll_loss_backward(region, args, kwargs)
    return None if op_args is None else _record_whole(mode, region, _NLL_BACKWARD_DENSE, op_args)


_stack_at = torch._C._get_dispatch_stack_at


def _traced_below() -> bool:
    """Whether a dispatch mode other than accel's is below accel's mode (inside
    ``__torch_dispatch__`` the stack holds the modes below): make_fx's proxy mode (also
    under ``torch.func.linearize``), ``torch.export``'s functionalization, FakeTensorMode,
    a user's mode entered before accel. Deferred, a call would reach such a mode as the
    allocation of an unfilled output, its values written by a kernel it never sees (a
    traced graph of ``empty_strided`` calls); so there calls run eagerly, below accel,
    and a region pending from before is flushed first."""
    return any(not isinstance(_stack_at(i), AccelMode) for i in range(_len_modes()))


@functools.lru_cache(maxsize=1)
def _op_ids():
    """The fusible-op table and the view ops, keyed by ``id`` of the OpOverload (they live as
    long as the process)."""
    return {id(op): spec for op, spec in fusible_ops().items()}, frozenset(map(id, VIEW_OPS))


class _DynamoSafeAccelMode(AccelMode):
    """:class:`AccelMode` with torch's wrapper that keeps dynamo from tracing into it (for
    a torch without code execution strategies; see :func:`_skip_dynamo`)."""

    _should_skip_dynamo = classmethod(lambda cls: True)
    __torch_dispatch__ = AccelMode.__torch_dispatch__


def _skip_dynamo(code) -> bool:
    """Have TorchDynamo skip ``code``'s frames and every frame they call, as
    ``torch._dynamo.disable(fn, recursive=True)`` does, but marked once on the code object
    (``set_code_exec_strategy``, which ``torch._dynamo.eval_frame.skip_code`` uses) rather
    than by a wrapper run at every call; torch._dynamo is not imported. A torch.compile'd
    function called under accel would otherwise trace accel's dispatch into its graph.
    Returns False where this torch lacks the mechanism."""
    ef = getattr(torch._C, "_dynamo", None)
    ef = getattr(ef, "eval_frame", None)
    try:
        skip = ef._FrameAction.SKIP
        ef.set_code_exec_strategy(code, ef._FrameExecStrategy(skip, skip))
    except (AttributeError, TypeError, RuntimeError):
        return False
    return True


_DYNAMO_SKIPS = _skip_dynamo(AccelMode.__torch_dispatch__.__code__)


# -- step sampling (accel/sampling.py) ----------------------------------------------------
_sampling = True  # ACCEL_STEP_SAMPLING is not "off"; read at each enable
_sampling_cuda = False  # it is "all": steps timed on a GPU too
_current_mode = torch.utils._python_dispatch._get_current_dispatch_mode
_len_modes = torch._C._len_torch_dispatch_stack


def _quiet_fingerprint() -> tuple:
    """Changes whenever a step was not quiet: a kernel compiled, loaded from the store or
    failed to build, or a call met for the first time after its predecessor."""
    s = runtime.STATS
    return s["compiles"], s["compile_failures"], s["store_hits"], NEW_NODES[0]


def _sampler(st) -> sampling.Sampler:
    if st.sampler is None:
        st.sampler = sampling.Sampler(_quiet_fingerprint)
    st.sampler.cuda = _sampling_cuda
    return st.sampler


def _sampled(s, method) -> bool:
    """``method()`` of sampler ``s``; where it raises (its clock: a CUDA error, say),
    sampling stops on the thread, which intercepts every step from then on."""
    try:
        return method()
    except Exception as e:  # noqa: BLE001 - the program goes on, intercepted
        warn_once("sampling", "accel: step sampling stopped on this thread (%s: %s); every "
                  "step is intercepted", type(e).__name__, e)
        s.give_up(f"{type(e).__name__}: {e}")
        return True


def _end_step(s) -> bool:
    """End the thread's step: whether the next intercepts."""
    if not s.intercept:
        runtime.STATS["bypassed_steps"] += 1
    return _sampled(s, s.boundary)


def _step_boundary(st) -> None:
    """End the thread's step at a backward call (one enable deep or more, nothing pending)
    and put the thread in the state the sampler chose for the next."""
    s = _sampler(st)
    st.backward_in_block = True
    if not st.backward_steps:  # the thread's steps end at backward calls from now on
        st.backward_steps = True
        s.restart()
        s.intercept = not st.suspended
    intercept = _end_step(s)
    if intercept == st.suspended and not (_resume(st) if intercept else _suspend(st)):
        s.restart()
        s.intercept = not st.suspended


def _suspend(st) -> bool:
    """Take the thread's only accel mode off the dispatch mode stack and the filter's key out
    of its key set (the region flushed): the thread runs eagerly. False where accel's mode
    is not the innermost mode, or is nested."""
    mode = st.modes[-1] if st.depth == 1 and len(st.modes) == 1 else None
    if mode is None or _current_mode() is not mode:
        return False
    flush()
    mode.__exit__(None, None, None)
    if st.filtered:
        dispatch.set_included(False)
        st.filtered = False
        st.region.set_replay(False, 0)
    st.suspended = True
    st.stack_len = _len_modes()
    return True


def _resume(st) -> bool:
    """Undo :func:`_suspend`; False where another mode was pushed since, or accel's own
    (a nested enable): the thread stays as it is."""
    if st.depth != 1 or _len_modes() != st.stack_len:
        return False
    st.modes[-1].__enter__()
    st.suspended = False
    _filter_on(st)
    return True


# -- enablement -------------------------------------------------------------------------
def is_enabled() -> bool:
    """True if accel is intercepting aten calls on this thread."""
    return _state.depth > 0


_applied = None  # the settings enable() last applied (a config.current() dict)


def _apply(cfg) -> None:
    """Apply the process-wide settings each enable reads, where they changed since the last
    (config.current() returns the same dict until the environment changes)."""
    global _applied, _eager_small, _eager_idle, _sampling, _sampling_cuda
    _sampling = cfg["ACCEL_STEP_SAMPLING"] != "off"
    _sampling_cuda = cfg["ACCEL_STEP_SAMPLING"] == "all"
    if cfg["ACCEL_MALLOC_TUNING"]:
        allocator.tune_allocator()
    pool = allocator.configure(cfg["ACCEL_CPU_POOL_MB"], cfg["ACCEL_CPU_POOL"])
    native.set_cpu_pool(pool)
    dispatch.set_matmul_pool(pool)
    set_cuda_half(cfg["ACCEL_CUDA_HALF"])
    set_launch_ahead_min(cfg["ACCEL_LAUNCH_AHEAD_MIN_MB"])
    _eager_small = cfg["ACCEL_EAGER_SMALL_REGIONS"]
    _eager_idle = _eager_small and cfg["ACCEL_EAGER_IDLE_REGIONS"]
    set_small_regions(_eager_small)
    dispatch.set_small_regions(_eager_small)
    dispatch.set_matmul(cfg["ACCEL_CPU_MATMUL"])
    remat.set_mode(cfg["ACCEL_REMAT"])
    _applied = cfg


def enable() -> None:
    """Turn accel on for the calling thread until :func:`disable` (no-op under
    ``ACCEL_DISABLE=1``). Calls nest: each ``enable`` needs its ``disable``.

    Raises:
        ConfigError: an ``ACCEL_*`` environment variable is invalid.
    """
    cfg = config.current()
    st = _state
    if cfg["ACCEL_DISABLE"]:
        st.modes.append(None)
        return
    if cfg is not _applied:
        _apply(cfg)
    cls = _DynamoSafeAccelMode if "torch._dynamo" in sys.modules and not _DYNAMO_SKIPS else AccelMode
    mode = st.spare.pop() if st.spare and type(st.spare[-1]) is cls else cls()
    mode.cap = cfg["ACCEL_MAX_REGION"]
    mode.on_first = _FIRST_HOOKS[cfg["ACCEL_LAUNCH_AHEAD"]]
    dispatch.start()  # outside the mode: loading it from the store is not the program's work
    hooks.install(_this)
    intercept = True
    if st.depth == 0:
        runtime.STEPS[0] += 1
    if st.suspended:  # nested in a step that step sampling runs eagerly: this block is not
        st.sampler.restart()  # (a step of its own; the sampler starts again)
    elif st.depth == 0 and _sampling:
        s = _sampler(st)
        if st.backward_steps and not st.backward_in_block:
            # the last block called no backward: outermost blocks are the steps again
            # (an evaluation after training, say), sampled afresh
            st.backward_steps = False
            s.restart()
            s.intercept = True
        st.backward_in_block = False
        intercept = _end_step(s) if not st.backward_steps else s.intercept
        _sampled(s, s.start)
    flush()  # calls recorded by an outer mode belong before this one
    st.modes.append(mode)
    st.depth += 1
    if not intercept:  # step sampling: this step runs eagerly (accel/sampling.py)
        st.suspended = True
        st.stack_len = _len_modes()
        return
    mode.__enter__()
    _filter_on(st)


def disable() -> None:
    """Undo the latest :func:`enable` on this thread, flushing the pending region.

    Raises:
        RuntimeError: there is no matching :func:`enable`.
    """
    st = _state
    if not st.modes:
        raise RuntimeError("accel.disable() without a matching accel.enable()")
    mode = st.modes.pop()
    if mode is None:
        return
    try:
        flush()
    finally:
        if st.suspended and st.depth == 1:  # the mode step sampling took off the stack
            st.suspended = False
        else:
            mode.__exit__(None, None, None)
        st.depth -= 1
        st.spare.append(mode)  # the thread's next enable at this depth takes it again
        if st.depth == 0 and st.sampler is not None:
            _sampled(st.sampler, st.sampler.stop)
        if (st.depth == 0 or st.suspended) and st.filtered:
            dispatch.set_included(False)
            st.filtered = False
            st.region.set_replay(False, 0)
        elif st.filtered:  # the outer mode's cap
            _set_replay(st, _innermost(st))


class eager(contextlib.ContextDecorator):
    """Context manager (and decorator): accelerate the eager PyTorch code inside it.

    Nestable and exception-safe; the pending region is flushed on exit, so every tensor
    computed inside holds its values outside. Per thread, like every dispatch mode.
    (A class rather than a ``contextlib.contextmanager`` generator: entering and leaving
    it is part of every call of a function wrapped in it, and a generator costs about a
    microsecond more.)

    Raises:
        ConfigError: an ``ACCEL_*`` environment variable is invalid (on entry).

    Example:
        >>> import torch, accel
        >>> x = torch.linspace(-1, 1, 8)
        >>> with accel.eager():
        ...     y = torch.sin(x) * 2 + 1
        >>> torch.testing.assert_close(y, torch.sin(x) * 2 + 1)
    """

    def __enter__(self) -> None:
        enable()

    def __exit__(self, *exc) -> bool:
        disable()
        return False


_this = sys.modules[__name__]  # for accel.hooks, whose wrappers call flush and the step's end

try:
    if not config.flag("ACCEL_DISABLE"):
        hooks.install(_this)
except config.ConfigError:  # an invalid value: the first enable says so
    pass
