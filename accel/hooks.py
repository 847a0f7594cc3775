"""Escape hooks: the Python entry points through which tensor data leaves the dispatcher's
sight, wrapped so that a deferred result is never read or handed out unfilled.

Reads of tensor data that bypass the dispatcher (``numpy()``, ``tolist()``, ``data_ptr()``,
DLPack, pickling, printing, ``backward``), and the host's ways of ordering GPU work or
waiting for it (streams, events, CUDA graph capture and replay, synchronizing), and the
ways a thread hands work or a signal to another, each flush the calling thread's pending
region first (:func:`accel.interceptor.flush`). Entry points
that share memory with code outside torch register the storage (accel/shared.py); C++
functions that read aten results directly run with the thread's calls passing through
eagerly; ``torch.autograd.backward`` also ends the thread's step for step sampling
(accel/sampling.py). :func:`install` wraps them all, once per process.
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading

import torch
import torch.nn.parallel.comm

from . import shared

__all__ = ["install", "remove"]

_ic = None  # accel.interceptor, which installs the hooks (and imports this module)
_lock = threading.Lock()
_installed = False

_untyped_storage = torch._C.TensorBase.untyped_storage  # not the flushing hook


def _flushing(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _ic.flush()
        return fn(*args, **kwargs)

    return wrapper


_TENSOR_HOOKS = ("tolist", "data_ptr", "__reduce_ex__", "__repr__", "__format__",
                 "untyped_storage", "_typed_storage", "storage", "backward", "__setstate__")
#: ``torch.utils.swap_tensors`` (``nn.Module._apply`` under the swap conversion) exchanges
#: two tensors' contents under their Python objects, as ``Tensor.data = t`` replaces one's
#: (``_data_setter``), outside the dispatcher.
_MODULE_HOOKS = ((torch, "save"), (torch.utils, "swap_tensors"))


def _data_setter(descriptor):
    """``Tensor.data`` as a property that reads as ``descriptor`` (``TensorBase.data``) does
    and flushes before it sets. ``t.data = u`` gives the Python object ``t`` the storage,
    shape and dtype of ``u`` outside the dispatcher, and a pending region holds its inputs
    and outputs as those objects: unflushed, a deferred call on ``t`` (an external input)
    would read ``u``'s memory, and a deferred result ``t`` would be written there
    (``nn.Module.to(dtype)``, ``half()`` and ``cuda()`` set their parameters so, after a
    forward whose result is unread: wrong values)."""
    def set_data(self, value):
        _ic.flush()
        descriptor.__set__(self, value)

    return property(descriptor.__get__, set_data, doc=descriptor.__doc__)


def _backward_pass(fn, step):
    """``torch.autograd.backward`` (which ``Tensor.backward`` calls; ``step``) and
    ``torch.autograd.grad``: flush, then (``step``) end the thread's step (step sampling,
    accel/sampling.py) before the backward pass begins, so that autograd's device threads
    inherit the state of the step that begins. A pass that raises ran no final callback:
    what it recorded on an engine thread is flushed before the exception goes on
    (:func:`accel.interceptor.flush_workers`).

    With CUDA in use the calling thread's calls pass through eagerly during the pass: the
    pass's CPU nodes run on this thread and its CUDA nodes on autograd's device threads,
    which read a CPU node's result as soon as the node returns (a CPU gradient that a
    custom function's backward copies to the GPU), in memory a call deferred here would
    leave unfilled until this thread's next flush (wrong gradients on a GPU)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _ic.flush()
        st = _ic._state
        # a pass begun inside another (a reentrant checkpoint's backward) is neither a
        # step boundary (the outer pass's engine restores the dispatch modes it began with
        # after each node: a mode taken off the stack there came back, and the exit of
        # accel.eager() then popped an empty stack) nor the calling thread's own (its
        # thread is the outer pass's; an engine thread's calls stay deferred, flushed by
        # its worker)
        outermost = _ic._current_graph_task_id() == -1
        if step and st.depth and outermost:
            _ic.runtime.STEPS[0] += 1
            if _ic._sampling:
                _ic._step_boundary(st)
        try:
            if outermost and torch.cuda.is_initialized():
                return _passing_through(st.region, fn, *args, **kwargs)
            return fn(*args, **kwargs)
        except BaseException:
            _ic.flush_workers()
            raise

    return wrapper


def _passing_through(region, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the calls of ``region``'s thread passing through
    eagerly (on the mode's path and the filter's), unless they already do."""
    if region.busy:
        return fn(*args, **kwargs)
    region.busy = True
    try:
        return fn(*args, **kwargs)
    finally:
        region.busy = False


def _exporting(fn):
    """``fn`` hands the memory of tensor ``self`` to code outside the dispatcher (a NumPy
    array, a DLPack capsule): flush, then register the storage (accel/shared.py)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        _ic.flush()
        out = fn(self, *args, **kwargs)
        shared.share(self)
        return out

    return wrapper


def _importing(fn):
    """``fn`` returns a tensor, over memory another library owns (``torch.from_numpy``, a
    DLPack producer's, a buffer's) or a copy: register the storage of the former
    (accel/shared.py), which torch did not allocate (not resizable), unless it is the
    storage of the input tensor itself (``torch.as_tensor(t)``)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not _untyped_storage(out).resizable() and not (
                args and isinstance(args[0], torch.Tensor)
                and _untyped_storage(args[0])._cdata == _untyped_storage(out)._cdata):
            shared.share(out)
        return out

    return wrapper


def _sharing(fn):
    """``fn`` moves a CPU storage to shared memory, or returns one another process
    shares: register it (accel/shared.py)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if out.device.type == "cpu":
            shared.share(out)
        return out

    return wrapper


#: Entry points that share memory with code outside the dispatcher, which reads and writes
#: it at any time, not at a flush: see accel/shared.py.
_SHARED_MEMORY_HOOKS = (
    [(torch.Tensor, n, _exporting) for n in ("numpy", "__array__", "__dlpack__")]
    + [(torch.utils.dlpack, "to_dlpack", _exporting)]
    + [(o, n, _importing) for o, n in ((torch, "from_numpy"), (torch, "as_tensor"),
                                       (torch, "asarray"), (torch, "frombuffer"),
                                       (torch, "from_dlpack"), (torch.utils.dlpack, "from_dlpack"))]
    + [(o, n, _sharing) for o, n in ((torch.UntypedStorage, "share_memory_"),
                                     (torch.multiprocessing.reductions, "rebuild_storage_fd"),
                                     (torch.multiprocessing.reductions, "rebuild_storage_filename"))])

#: The host's ways of ordering GPU work and waiting for it, outside the dispatcher. Eager
#: has launched every call before them: a region still pending would be launched after
#: an event recorded to mark its work (``Event.record``; ``Stream.wait_stream`` records
#: one), after a wait the host believes covers it, on another stream than its calls'
#: (``set_stream``: ``torch.cuda.stream(s)`` enters and leaves through it, so a region's
#: calls are all recorded, and it is launched, on one stream), outside the CUDA graph
#: being captured (``capture_end``), or after a replay that reads its outputs
#: (``static_input.copy_(x); graph.replay()``). Each flushes the calling thread's region
#: first. (torch's device-generic ``torch.Stream`` and ``torch.Event`` are C types,
#: whose methods cannot be wrapped.)
_STREAM_HOOKS = ((torch.cuda, "synchronize"), (torch.cuda, "set_stream"),
                 (torch.cuda.Stream, "synchronize"), (torch.cuda.Stream, "query"),
                 (torch.cuda.Event, "record"), (torch.cuda.Event, "synchronize"),
                 (torch.cuda.Event, "query"), (torch.cuda.CUDAGraph, "capture_begin"),
                 (torch.cuda.CUDAGraph, "capture_end"), (torch.cuda.CUDAGraph, "replay"),
                 (getattr(torch, "accelerator", None), "synchronize"),
                 (getattr(torch, "accelerator", None), "set_stream"))


#: Python-bound C++ functions that call aten ops and then read or write the results in
#: C++ (an ``accessor``, ``data_ptr``), where no hook sees it: DDP's check that every rank
#: has the same parameters (it read a deferred ``copy_``'s output unfilled: "params[0] in
#: this process with sizes [64, 32] appears not to match sizes of the same param in
#: process 0"), and its broadcast of the parameters from rank 0; and TorchScript's
#: functions and methods (scripted, traced or loaded), whose graph executor runs fused
#: groups of ops as kernels of its own (NNC on GPUs), reading its inputs' memory: a
#: deferred input, or a deferred result of the graph's own unfused ops, unfilled (wrong
#: results on a GPU). Each runs with the calling thread's calls passing through eagerly,
#: its pending region flushed first.
_EAGER_HOOKS = ((getattr(torch, "distributed", None), "_verify_params_across_processes"),
                (getattr(torch, "distributed", None), "_broadcast_coalesced"),
                (torch._C.ScriptFunction, "__call__"), (torch._C.ScriptMethod, "__call__"))


def _eagerly(fn, every_thread=False):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _ic.flush()
        if every_thread:
            _ic.flush_workers(after_failed_pass=False)
        st = _ic._state
        w = st.worker
        return _passing_through(st.region if w is None else w.region, fn, *args, **kwargs)

    return wrapper


#: ``torch.nn.parallel.comm``: DataParallel's copies and reductions between GPUs, in C++
#: (NCCL, or copies) reading and writing memory directly. In the backward its gradient
#: reduction (``reduce_add_coalesced``, the backward of the parameters' broadcast) runs on
#: one GPU's device thread over gradients another GPU's device thread computed, which
#: that thread's worker may still hold: every engine thread's worker is flushed first,
#: then the call runs eagerly.
_COMM_HOOKS = tuple((torch.nn.parallel.comm, n) for n in (
    "broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"))


#: The ways a thread hands tensors to another: ``Condition.notify`` (``notify_all`` calls
#: it), through which ``threading.Event.set``, ``queue.Queue.put``, semaphores, barriers
#: and ``concurrent.futures`` results signal; starting a thread (its arguments); and
#: ``ThreadPoolExecutor.submit`` (whose work queue is a C ``SimpleQueue``). Each flushes
#: the calling thread's region first (another thread's reads do not pass through this
#: thread's mode: they read its memory directly). Not covered: a bare ``threading.Lock`` released (a C
#: type, whose methods cannot be wrapped), a ``queue.SimpleQueue``, and a thread that reads
#: a tensor another thread stored with no signal at all (README, Limitations).
_HANDOFF_HOOKS = ((threading.Condition, "notify"), (threading.Thread, "start"),
                  (concurrent.futures.ThreadPoolExecutor, "submit"))


def _ctc_lengths_as_lists(fn):
    """``torch.ctc_loss`` (``F.ctc_loss`` calls it) with CPU length tensors and
    log-probabilities on another device, under a dispatch mode: the lengths as lists, as
    eager's composite ``ctc_loss.Tensor`` passes them to the kernel without a mode. Under
    any dispatch mode (accel's) that composite takes its path for tensor subclasses
    instead, whose ``_ctc_loss.Tensor`` CUDA kernel refuses lengths on the CPU ("Expected
    all tensors to be on the same device"), where eager ran the program. Where cuDNN takes
    the call eager passes the tensors too (``_use_cudnn_ctc_loss``): so does the hook."""
    @functools.wraps(fn)
    def wrapper(log_probs, targets, input_lengths, target_lengths, *args, **kwargs):
        if (_ic._len_modes() and isinstance(log_probs, torch.Tensor) and log_probs.device.type != "cpu"
                and _cpu_lengths(input_lengths) and _cpu_lengths(target_lengths)
                and not (log_probs.device.type == "cuda" and torch._use_cudnn_ctc_loss(
                    log_probs, targets, input_lengths, target_lengths,
                    args[0] if args else kwargs.get("blank", 0)))):
            input_lengths, target_lengths = input_lengths.tolist(), target_lengths.tolist()
        return fn(log_probs, targets, input_lengths, target_lengths, *args, **kwargs)

    return wrapper


def _cpu_lengths(t) -> bool:
    """``t`` is a plain CPU tensor of integers (eager's fast path takes such lengths)."""
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype != torch.bool
            and not t.dtype.is_floating_point and not t.dtype.is_complex
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _table():
    """(owner, name, original, wrapper) for every hooked entry point (built once)."""
    global _HOOKS
    if _HOOKS is None:
        targets = [(torch.Tensor, n) for n in _TENSOR_HOOKS] + list(_MODULE_HOOKS)
        targets += [(o, n) for o, n in _STREAM_HOOKS if hasattr(o, n)] + list(_HANDOFF_HOOKS)
        _HOOKS = [(o, n, getattr(o, n), _flushing(getattr(o, n))) for o, n in targets]
        _HOOKS += [(torch.Tensor, "data", torch.Tensor.data, _data_setter(torch.Tensor.data)),
                   (torch, "ctc_loss", torch.ctc_loss, _ctc_lengths_as_lists(torch.ctc_loss))]
        _HOOKS += [(torch.autograd, "backward", torch.autograd.backward,
                    _backward_pass(torch.autograd.backward, True)),
                   (torch.autograd, "grad", torch.autograd.grad,
                    _backward_pass(torch.autograd.grad, False))]
        _HOOKS += [(o, n, getattr(o, n), _eagerly(getattr(o, n))) for o, n in _EAGER_HOOKS
                   if hasattr(o, n)]
        _HOOKS += [(o, n, getattr(o, n), _eagerly(getattr(o, n), every_thread=True))
                   for o, n in _COMM_HOOKS if hasattr(o, n)]
        _HOOKS += [(o, n, getattr(o, n), wrap(getattr(o, n))) for o, n, wrap in _SHARED_MEMORY_HOOKS
                   if hasattr(o, n)]
    return _HOOKS


_HOOKS = None


def install(interceptor) -> None:
    """Wrap the entry points, once per process, their flushes and steps going to module
    ``interceptor`` (accel.interceptor): when accel is imported (unless
    ``ACCEL_DISABLE=1``), so that memory shared outside the dispatcher from then on is
    known before the first enable (accel/shared.py), else at the first enable. They stay
    wrapped after the last disable: each wrapper's flush returns at once when nothing is
    pending, and setting attributes of ``torch.Tensor`` at every enable and disable would
    cost more (and invalidate the type's attribute caches) than the wrappers ever do."""
    global _installed, _ic
    if _installed:
        return
    _ic = interceptor
    with _lock:
        if not _installed:
            for owner, name, _, wrapper in _table():
                setattr(owner, name, wrapper)
            _installed = True


def remove() -> None:
    """Restore the original entry points (tests; accel itself leaves them wrapped)."""
    global _installed
    with _lock:
        if _installed:
            for owner, name, original, _ in _table():
                setattr(owner, name, original)
            _installed = False
