# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""accel's native core: loading compiled kernels and calling them without the GIL
(accel/_launch.pxi, included below; the kernel ABI is declared in include/accel/kernel.h),
and recording deferred calls into regions (RegionCore) and flushing them (run_cached).
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from cpython.ref cimport Py_REFCNT
from libc.stdlib cimport calloc, malloc, free
from posix.dlfcn cimport dlopen, dlsym, dlerror, RTLD_NOW, RTLD_LOCAL

# -- loading and launching kernels (CPU libraries, CUDA cubins) ---------------------------
include "_launch.pxi"


# -- recording: the per-call hot path (pure-Python twin: accel/_core_py.py) -----------------
import sys
import torch
from accel.allocator import MIN_BLOCK, empty_strided as _pool_empty_strided
from accel.ops import DTYPES, NOT_DEFERRABLE, SCALAR, TENSOR, Deferred, float_key as _float_key, overlap_args as _overlap_args, pending_view as _pending_view
from accel._core_py import ext_overlap as _ext_overlap_py

cdef object _data_ptr = torch._C.TensorBase.data_ptr
cdef object _untyped_storage = torch._C.TensorBase.untyped_storage
cdef object _storage_use_count = torch._C._storage_Use_Count
cdef object _Tensor = torch.Tensor
cdef object _Parameter = torch.nn.Parameter
cdef object _strided = torch.strided
cdef object _bool = torch.bool
cdef object _empty_strided = torch.empty_strided
cdef object _device = torch.device
cdef object _CPU = torch.device("cpu")
cdef object _f16 = torch.float16, _bf16 = torch.bfloat16
# the cudaStream_t of a GPU's current stream (Inductor's get_raw_stream); None without CUDA
cdef object _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
cdef list _NO_SCRATCH = []
cdef bint _cuda_half = True
cdef bint _small_regions = True
cdef bint _cpu_pool = True


def kernel_ptrs(list ext, list outs, tuple live_idx, list scratch):
    """A kernel's buffer addresses (ints): of the external inputs ``ext``, of the outputs
    it writes (``outs`` at ``live_idx``), then of its ``scratch`` buffers."""
    cdef list ptrs = [_data_ptr(t) for t in ext]
    for i in live_idx:
        ptrs.append(_data_ptr(outs[i]))
    for t in scratch:
        ptrs.append(_data_ptr(t))
    return ptrs


ctypedef object (*empty_strided_fn)(object, object, object, object)
ctypedef object (*liveness_fn)(object)
ctypedef object (*overlap_fn)(object, object)
ctypedef object (*reuse_fn)(object, object, Py_ssize_t)
cdef empty_strided_fn _fast_empty = NULL
cdef liveness_fn _fast_liveness = NULL
cdef overlap_fn _fast_overlap = NULL
cdef reuse_fn _fast_reuse = NULL


def set_helpers(size_t empty_strided, size_t liveness, size_t overlap=0, size_t reuse=0):
    """Use the dispatch filter's C++ helpers (include/accel/core_helpers.h; addresses,
    0: none): ``accel_empty_strided`` allocates deferred outputs (``torch.empty_strided``
    without the Python binding's argument parsing), ``accel_liveness`` computes
    :meth:`RegionCore.liveness` (without a Python call per output), ``accel_ext_overlap``
    :func:`ext_overlap` (without a storage object per input), ``accel_reuse_blocks``
    :func:`reuse_blocks` (none: no buffer reuse)."""
    global _fast_empty, _fast_liveness, _fast_overlap, _fast_reuse
    _fast_empty = <empty_strided_fn>empty_strided
    _fast_liveness = <liveness_fn>liveness
    _fast_overlap = <overlap_fn>overlap
    _fast_reuse = <reuse_fn>reuse


def set_cpu_pool(bint on):
    """Whether regions take their large CPU outputs (at least ``allocator.MIN_BLOCK``
    bytes) from accel's output pool (:func:`accel.allocator.empty_strided`); off, from
    ``torch.empty_strided``, and at each flush their live ones take the blocks of dead ones
    (:func:`reuse_blocks`). accel.interceptor sets it at each enable from
    :func:`accel.allocator.configure`."""
    global _cpu_pool
    _cpu_pool = on


cdef inline _reuse(list outs, tuple live_idx):
    if not _cpu_pool and _fast_reuse != NULL:
        _fast_reuse(outs, live_idx, _MIN_BLOCK)


def reuse_blocks(list outs, tuple live_idx):
    """Buffer reuse before a CPU kernel runs a region: each live output (``outs`` at
    ``live_idx``) of at least ``allocator.MIN_BLOCK`` bytes takes the memory of the earliest
    dead output before it of the same storage size (see ``accel_reuse_blocks`` in
    include/accel/core_helpers.h), so that it is written where eager's output would have
    been, into a temporary's block freed moments before. Only with the output pool off
    (:func:`set_cpu_pool`) and the dispatch filter's helper loaded; otherwise nothing.

    Raises:
        TypeError, IndexError: ``outs`` holds a non-tensor, or an index is out of range.
    """
    _reuse(outs, live_idx)


def device_empty_strided(tuple shape, tuple stride, dtype, device):
    """``torch.empty_strided(shape, stride, dtype=dtype, device=device)`` for a GPU
    ``device``, through the dispatch filter's ``accel_empty_strided`` once it is loaded
    (without the Python binding's argument parsing): outputs allocated when a kernel is
    launched ahead. Raises what ``torch.empty_strided`` raises (out of memory, say)."""
    if _fast_empty != NULL:
        return _fast_empty(shape, stride, dtype, device)
    return _empty_strided(shape, stride, dtype=dtype, device=device)


ctypedef int (*include_fn)(int) noexcept nogil
cdef include_fn _include = NULL


def set_include_fn(size_t address):
    """Use the dispatch filter's ``accel_filter_include`` (its ``address``; 0: none) for
    :func:`filter_include`."""
    global _include
    _include = <include_fn>address


def filter_include(bint on):
    """Include the dispatch filter's key in the calling thread's key set (or not), as
    ``accel_filter_include`` does (include/accel/dispatch_filter.cpp), without a ctypes
    call (about half a microsecond, paid at every enable and disable). Returns whether it
    was included.

    Raises:
        RuntimeError: :func:`set_include_fn` has not been given the function.
    """
    if _include == NULL:
        raise RuntimeError("accel: the dispatch filter is not loaded")
    return _include(on) != 0


def set_small_regions(bint on):
    """Whether :meth:`RegionCore.record` declines the first call of a region its trie node
    marks small (``TrieNode.eager_first``; ``ACCEL_EAGER_SMALL_REGIONS``, set at each
    enable): the call then runs eagerly."""
    global _small_regions
    _small_regions = on


def set_cuda_half(bint on):
    """Whether regions on CUDA devices take float16/bfloat16 tensors (``ACCEL_CUDA_HALF``,
    set at each enable); off, such calls run eagerly."""
    global _cuda_half
    _cuda_half = on


cdef object _overlap(list ext, tuple written):
    if _fast_overlap != NULL:
        return _fast_overlap(ext, written)
    return _ext_overlap_py(ext, written)


def ext_overlap(list ext, tuple written):
    """Whether an external input at an index in ``written`` shares memory with another of
    ``ext``: their storages' byte ranges intersect (the dispatch filter's C++ helper, else
    the pure-Python twin's :func:`accel._core_py.ext_overlap`)."""
    return _overlap(ext, written)


cdef tuple _CONST_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device,
                           torch.memory_format, torch.layout, tuple)
cdef int _TENSOR = TENSOR, _SCALAR = SCALAR
cdef Py_ssize_t _MIN_BLOCK = MIN_BLOCK
cdef str _FPOS = "f+", _FNEG = "f-", _IPOS = "i+", _INEG = "i-"
# how record() took an argument (RegionCore.last_call): the dispatch filter reads these
cdef int _NEW_EXT = 0, _RUNTIME = 1, _CONSTANT = 2


cdef extern from "accel/region_view.h":
    enum: ACCEL_VIEW_MAX
    ctypedef struct accel_region_view:
        unsigned char pending, replay, busy
        int n_calls, cap, n_ext, n_out
        void* node
        void* region
        void* replay_fn
        Py_ssize_t lo, hi
        void* ext[ACCEL_VIEW_MAX]
        void* out[ACCEL_VIEW_MAX]
        Py_ssize_t out_base[ACCEL_VIEW_MAX]
    enum: ACCEL_SHARED_MAX
    ctypedef struct accel_shared_set:
        int n
        void* storage[ACCEL_SHARED_MAX]


cdef accel_shared_set _shared
cdef object _shared_lookup = None


def shared_table_address():
    """The address of the set of storages shared outside the dispatcher
    (include/accel/region_view.h), which the dispatch filter reads."""
    return <size_t>&_shared


SHARED_MAX = ACCEL_SHARED_MAX


def set_shared(storages, lookup):
    """Make ``storages`` (a list of StorageImpl addresses, ints) the storages shared
    outside the dispatcher (accel/shared.py): a call with an external input on one of them
    is not deferred. ``None``, or more than ``SHARED_MAX`` of them: ``lookup(address)``
    says, for every external input (the dispatch filter leaves them all to the
    interceptor)."""
    global _shared_lookup
    cdef Py_ssize_t i
    _shared_lookup = lookup
    _shared.n = -1  # while the entries change, every input is looked up
    if storages is None or len(storages) > ACCEL_SHARED_MAX:
        return
    for i in range(len(storages)):
        _shared.storage[i] = <void*><size_t>storages[i]
    _shared.n = len(storages)


cdef bint _is_shared(t) except -1:
    cdef size_t p = _untyped_storage(t)._cdata
    cdef int i, n = _shared.n
    if n < 0:
        return _shared_lookup(p)
    for i in range(n):
        if _shared.storage[i] == <void*>p:
            return True
    return False


cdef bint _live(t):
    # references: the region's list and the argument (an output's storage object is the CPU pool's
    # where it has one, else made here: one reference of the storage's either way)
    return (Py_REFCNT(t) > 2 or t._use_count() > 1
            or _storage_use_count(_untyped_storage(t)._cdata) > 2)


cdef class RegionCore:
    """The recording half of a region (see accel.region.Region): builds the per-call key,
    steps the trie and allocates the deferred outputs.

    ``view`` (include/accel/region_view.h) mirrors what accel's dispatch filter reads: the
    pending byte, the trie node, and the TensorImpl of each external input and output;
    the filter records a call it has seen recorded here before through :meth:`_replay`,
    as :meth:`record` would (``last_call`` tells it how a call was recorded).
    """

    cdef public object node
    cdef public list ext, outs, out_meta, scalars, calls
    cdef public dict ext_ids, out_ids
    cdef public set out_bases
    cdef public bint mutates_ext
    cdef public object device  # the region's torch.device (None: not decided yet)
    cdef public list ahead, ahead_meta  # outputs allocated ahead (speculation), by index
    cdef public tuple last_call  # (parent node, node, call, plan) of the latest record()
    # (parent node, node, None, plan) where the latest record() ran a small or idle
    # region's first call eagerly (TrieNode.eager_first), for the dispatch filter to learn
    # that call's edge as one it runs eagerly itself; else None
    cdef public tuple eager_call
    # launching ahead (accel.runtime): the first call's trie node, where the region predicts
    # its end; how many external inputs the first call had; a kernel launched ahead
    cdef public object first, speculation
    cdef public Py_ssize_t first_n_ext
    cdef object _root
    cdef bint _float_ok, _int_ok
    cdef list _plan
    cdef object _replay_fn, _on_first
    cdef accel_region_view view

    property busy:
        """Inside flush, replay or a meta evaluation: calls pass through."""
        def __get__(self):
            return self.view.busy != 0

        def __set__(self, bint on):
            self.view.busy = on

    def pending_address(self):
        """The address of the region's view (include/accel/region_view.h), whose first byte
        is 1 while the region has recorded calls, 0 after :meth:`clear` (accel.dispatch
        binds the thread's dispatch filter to it)."""
        self.view.region = <void*>self
        return <size_t>&self.view

    def set_replay(self, bint on, int cap, fn=None, on_first=None):
        """Let the dispatch filter record calls into this region, up to a region of ``cap``
        calls (the interceptor flushes at ``cap``); ``fn``: what it calls instead of
        :meth:`_replay` (with the same arguments, the region left out), as on autograd's
        device threads (include/accel/region_view.h); ``on_first(region)``: called by
        :meth:`_replay` after it recorded a region's first call (where the interceptor may
        launch the region's kernel ahead)."""
        self._replay_fn = fn
        self._on_first = on_first
        self.view.replay_fn = <void*>fn
        self.view.replay = (2 if fn is not None else 1) if on else 0
        self.view.cap = cap

    def clear(self, root):
        """Start an empty region at trie node ``root``."""
        self._root = root
        self.first = self.speculation = None
        self.first_n_ext = 0
        self.view.pending = 0
        self.view.n_calls = self.view.n_ext = self.view.n_out = 0
        self.view.node = <void*>root
        self.node = root
        self.ext = []
        self.ext_ids = {}
        self.outs = []
        self.out_ids = {}
        self.out_bases = set()
        self.out_meta = []
        self.scalars = []
        self.calls = []
        self.view.lo = sys.maxsize
        self.view.hi = 0
        self.mutates_ext = False
        self.device = None
        self.ahead = None
        self.ahead_meta = None
        self.last_call = None
        self.eager_call = None

    def __len__(self):
        return len(self.calls)

    def run_cached(self, dict stats, compiled_type, Py_ssize_t ahead_min, bint nodes_pending):
        """Flush the region through its kernel where nothing else is to be done: the kernel
        of its trie node and liveness mask is in memory (a ``compiled_type``: accel.runtime's
        CompiledRegion); nothing was launched ahead; no external input the region writes
        shares storage with another (``ext_overlap``); no trie metadata is waiting to be
        stored (``nodes_pending``); and where the region recorded its first call for
        launching ahead and writes no external input, its kernel is too small to be launched
        ahead (under ``ahead_min`` bytes). Scratch buffers are the region's own
        (``scratch_for``); on the CPU, live outputs first take dead ones' blocks
        (:func:`reuse_blocks`). That is accel.runtime.execute's path for such a region,
        without its Python calls.

        Returns:
            True: the kernel ran (on a GPU: was launched), ``stats`` counted it (flushes,
            memory hits, kernel runs) and the region is empty. False: nothing observable
            changed (the caller runs accel.runtime.execute), also where the launch failed
            (outputs may have exchanged blocks: they are unwritten either way).
        """
        cdef int status
        if self.speculation is not None or nodes_pending:
            return False
        node = self.node
        kern = node.kernels.get(self.liveness())
        if type(kern) is not compiled_type:
            return False
        first = self.first
        if self.mutates_ext:
            written = node.written
            if self.ext_overlap() if written is None else _overlap(self.ext, written):
                return False
            first = None  # execute predicts nothing for a region writing its inputs
        elif first is not None:
            traffic = kern.traffic
            if traffic < 0 or traffic >= ahead_min:
                return False
        if not kern.cuda:
            _reuse(self.outs, kern.live_idx)
        ptrs = kernel_ptrs(self.ext, self.outs, kern.live_idx,
                           self.scratch_for(kern) if kern.scratch else _NO_SCRATCH)
        scalars = self.scalars + kern.sizes if kern.sizes else self.scalars  # (a shape-generic kernel's loop lengths)
        if kern.cuda:
            if _raw_stream is None:
                return False
            dev = self.device.index
            if dev is None:
                dev = torch.cuda.current_device()
            status = (<CudaKernel>kern.fn).launch(ptrs, scalars, _raw_stream(dev), dev)
        else:
            status = launch(kern.fn, ptrs, scalars)
        if status != 0:
            return False
        if first is not None:
            first.predict = None  # as launch.predict, for a kernel this small
        stats["flushes"] += 1
        stats["memory_hits"] += 1
        stats["kernel_runs"] += 1
        self.clear(self._root)
        return True

    def liveness(self):
        """Which pending outputs are still observable (a tuple of bools): held by Python,
        by another TensorImpl (autograd's saved values, views) or sharing storage with one."""
        cdef tuple fast
        cdef Py_ssize_t i
        if _fast_liveness != NULL:
            fast = _fast_liveness(self.outs)
            if None not in fast:
                return fast
            return tuple([_live(self.outs[i]) if fast[i] is None else fast[i]
                          for i in range(len(fast))])
        return tuple([_live(t) for t in self.outs])

    cdef bint _aliases_pending(self, t, Py_ssize_t p):
        # the start of t's storage is a pending output's (every view shares its storage)
        return (p - <Py_ssize_t>t.storage_offset() * <Py_ssize_t>t.element_size()) in self.out_bases

    cdef _add_ext(self, t):
        cdef Py_ssize_t j = len(self.ext)
        self.ext.append(t)
        self.ext_ids[id(t)] = j
        if j < ACCEL_VIEW_MAX:
            self.view.ext[j] = <void*><size_t>t._cdata
        self.view.n_ext = j + 1
        return j

    cdef _tensor_sig(self, t, list key, list tmpl, where):
        cdef Py_ssize_t p
        if t.layout is not _strided:
            raise Deferred("tensor kind")
        if t.is_cpu:
            d = _CPU
        elif t.is_cuda:
            d = t.device
        else:
            raise Deferred("tensor kind")
        if self.device is None:
            self.device = d
        elif d != self.device:
            raise Deferred("device")  # a region runs on one device
        i = self.out_ids.get(id(t))
        if i is not None and self.outs[i] is t:
            w = ("o", i)
            key.append(w)
            tmpl.append(w)
            return
        dtype = t.dtype
        if dtype not in DTYPES:
            raise Deferred("dtype")
        if (dtype is _f16 or dtype is _bf16) and not _cuda_half and d is not _CPU:
            raise Deferred("dtype")
        if self.outs:
            p = _data_ptr(t)
            if self.view.lo <= p < self.view.hi and self._aliases_pending(t, p):
                w = _pending_view(t, self.outs, p - <Py_ssize_t>t.storage_offset() * <Py_ssize_t>t.element_size())
                if w is None:
                    raise Deferred("alias")
                key.append(w)
                tmpl.append(w)
                return
        if _shared.n != 0 and _is_shared(t):
            raise Deferred("shared memory")
        j = self.ext_ids.get(id(t))
        if j is None or self.ext[j] is not t:
            j = self._add_ext(t)
            self._plan.append((where, _NEW_EXT, None))
        key.append(("x", j, dtype, tuple(t.shape), t.stride(), t.storage_offset(), d))
        tmpl.append(("x", j))

    cdef _arg(self, int kind, v, list key, list tmpl, where):
        tv = type(v)
        if kind == _TENSOR and (tv is _Tensor or tv is _Parameter):
            self._tensor_sig(v, key, tmpl, where)
        elif (kind == _TENSOR or kind == _SCALAR) and v and v == v and (
                (tv is float and self._float_ok) or (tv is int and self._int_ok)):
            # nonzero numbers are runtime arguments; their sign is part of the key
            key.append((_FNEG if v < 0 else _FPOS) if tv is float else (_INEG if v < 0 else _IPOS))
            tmpl.append(("s", len(self.scalars)))
            self.scalars.append(v)
            self._plan.append((where, _RUNTIME, None))
        else:
            if tv is list:
                v = tuple(v)
            elif tv not in _CONST_TYPES:
                raise Deferred("argument type")
            if tv is _device:  # a factory's device: the region's
                if self.device is None:
                    self.device = v
                elif v != self.device:
                    raise Deferred("device")
            if tv is float or tv is int:  # the filter checks the value of such a constant
                self._plan.append((where, _CONSTANT, v))
            if tv is float and v != v:
                v = "nan"
            # with its type: 0 == 0.0 == False as dict keys (x + 0.0 found x + 0's node and
            # returned int64); and -0.0 apart from 0.0 (ops.float_key)
            if tv is float and v == 0.0:
                key.append((tv, _float_key(v)))
            else:
                key.append((tv, v) if tv is int or tv is float or tv is bool else v)
            tmpl.append(("c", v))

    def record(self, func, spec, tuple args, dict kwargs):
        """Defer one call; return its (real, unfilled) result tensor.

        Raises:
            Deferred: the call cannot be deferred; the region is left as it was.
        """
        cdef Py_ssize_t n_ext = len(self.ext), n_sc = len(self.scalars)
        cdef list key, targs, t
        cdef dict tkw
        cdef tuple pos = spec.pos
        cdef Py_ssize_t i, n = min(len(pos), len(args))
        self._float_ok = self._int_ok = True
        for v in args:
            tv = type(v)
            if (tv is _Tensor or tv is _Parameter) and not v.is_floating_point():
                self._float_ok = False
                if v.dtype is _bool:
                    self._int_ok = False
        self._plan = []
        self.eager_call = None
        try:
            key = [func]
            targs = []
            tkw = {}
            for i in range(n):
                self._arg(pos[i], args[i], key, targs, i)
            if kwargs:
                kw = spec.kw
                for name, v in kwargs.items():
                    kind = kw.get(name)
                    if kind is None:
                        raise Deferred("keyword")
                    key.append(name)
                    t = []
                    self._arg(kind, v, key, t, name)
                    tkw[name] = t[0]
            k = tuple(key)
            node = self.node.children.get(k)
            if node is None:
                node = self._new_node(func, spec, k, targs, tkw)
            if node.outs is NOT_DEFERRABLE:
                raise Deferred("meta")
            if node.eager_first is True and _small_regions:  # (accel.interceptor)
                self.eager_call = (self.node, node, None, self._plan)
                raise Deferred("small region")
        except Deferred:
            self._rollback(n_ext, n_sc, len(self.outs))
            raise
        parent = self.node
        call = (func, tuple(targs), tkw, node.n_new)
        res = self._emit(node, call, n_ext, n_sc)
        self.last_call = (parent, node, call, self._plan)
        return res

    def _replay(self, node, tuple call, tuple new_ext, tuple scalars, device):
        """Record a call the dispatch filter has matched to trie child ``node`` of the
        current node: as :meth:`record` did for a call with the same key (``call`` is the
        call it recorded, ``device`` the region's device after it), given the call's new
        external inputs and its runtime scalars in the order :meth:`record` took them.
        Returns the call's result.

        Raises:
            Deferred: a new external input is of a type or dtype the region does not take
                now; the region is left as it was (the call then takes the usual path).
        """
        cdef Py_ssize_t n_ext = len(self.ext), n_sc = len(self.scalars)
        try:
            for t in new_ext:
                tt = type(t)
                if tt is not _Tensor and tt is not _Parameter:
                    raise Deferred("argument type")
                dtype = t.dtype
                if (dtype is _f16 or dtype is _bf16) and not _cuda_half and not t.is_cpu:
                    raise Deferred("dtype")
                self._add_ext(t)
            self.scalars.extend(scalars)
            if self.device is None:
                self.device = device
        except BaseException:
            self._rollback(n_ext, n_sc, len(self.outs))
            raise
        res = self._emit(node, call, n_ext, n_sc)
        if self.view.n_calls == 1 and self._on_first is not None:
            self._on_first(self)
        return res

    cdef _emit(self, node, tuple call, Py_ssize_t n_ext, Py_ssize_t n_sc):
        """Allocate the outputs of a call recorded as ``call`` at trie child ``node`` and step
        to it; on failure (out of memory, say) the call is not recorded."""
        ret = node.ret
        n_out = len(self.outs)
        try:
            if node.writes_ext and self._shares_written(node, call):
                raise Deferred("written input shares storage")
            if ret is not None:
                res = self.ext[ret[1]] if ret[0] == "x" else self.outs[ret[1]]
            elif not node.multi:
                res = self._alloc(node.outs[0])
            else:
                res = tuple([None if m is None else self._alloc(m) for m in node.outs])
        except BaseException:
            self._rollback(n_ext, n_sc, n_out)
            raise
        self.node = node
        self.view.node = <void*>node
        self.calls.append(call)
        self.view.n_calls += 1
        self.view.pending = 1
        if node.writes_ext:
            self.mutates_ext = True
        return res

    cdef bint _shares_written(self, node, tuple call):
        """Whether an external input the call writes shares storage with another of its
        tensor arguments (``a[1:].add_(a[:-1])``): the call then runs eagerly, which raises
        eager's error where eager does, at the call (a region would have run it eagerly at
        its flush anyway: ``ext_overlap``)."""
        chk = node.overlap_args
        if chk is None:
            chk = node.overlap_args = _overlap_args(call)
        if not chk:
            return False
        ext = self.ext
        return _overlap([ext[j] for j in <tuple>chk[0]], <tuple>chk[1])

    cdef _rollback(self, Py_ssize_t n_ext, Py_ssize_t n_sc, Py_ssize_t n_out):
        """Forget the external inputs, scalars and outputs a call that is not recorded
        added."""
        for x in self.ext[n_ext:]:
            self.ext_ids.pop(id(x), None)
        del self.ext[n_ext:]
        del self.scalars[n_sc:]
        for t in self.outs[n_out:]:
            self.out_ids.pop(id(t), None)
            self.out_bases.discard(_data_ptr(t))
        del self.outs[n_out:]
        del self.out_meta[n_out:]
        self.view.n_ext = n_ext
        self.view.n_out = n_out
        if not self.calls:
            self.device = None

    cdef _alloc(self, tuple meta):
        cdef Py_ssize_t p, e, i = len(self.outs)
        r = None
        if self.ahead is not None and i < len(self.ahead) and self.ahead_meta[i] is meta:
            r = self.ahead[i]  # allocated when the region's kernel was launched ahead
            self.ahead[i] = None
        if r is None:
            if self.device is None or self.device is _CPU:
                if _cpu_pool and <Py_ssize_t>meta[3] >= _MIN_BLOCK:  # a reused block: no page faults
                    r = _pool_empty_strided(meta[0], meta[1], meta[2], meta[3])
                elif _fast_empty != NULL:
                    r = _fast_empty(meta[0], meta[1], meta[2], None)
                else:
                    r = _empty_strided(meta[0], meta[1], dtype=meta[2])
            else:
                if (meta[2] is _f16 or meta[2] is _bf16) and not _cuda_half:
                    raise Deferred("dtype")
                if _fast_empty != NULL:
                    r = _fast_empty(meta[0], meta[1], meta[2], self.device)
                else:
                    r = _empty_strided(meta[0], meta[1], dtype=meta[2], device=self.device)
        self.out_ids[id(r)] = i
        self.outs.append(r)
        self.out_meta.append(meta)
        p = _data_ptr(r)
        self.out_bases.add(p)
        if i < ACCEL_VIEW_MAX:
            self.view.out[i] = <void*><size_t>r._cdata
            self.view.out_base[i] = p
        self.view.n_out = i + 1
        if p < self.view.lo:
            self.view.lo = p
        e = p + <Py_ssize_t>meta[3]
        if e > self.view.hi:
            self.view.hi = e
        return r


cdef class WorkerReplay:
    """What the dispatch filter calls instead of :meth:`RegionCore._replay` on an autograd
    engine thread (``worker``: accel.interceptor's ``_Worker``, which owns ``region`` and
    ``lock``): the same arguments and result, under the lock, once the worker has queued
    its final callback for the backward pass.

    Raises:
        Deferred: outside a backward pass, or the region is being flushed; the call then
            takes the mode's path.
    """
    cdef object worker, lock
    cdef RegionCore region

    def __init__(self, worker, RegionCore region, lock):
        self.worker, self.region, self.lock = worker, region, lock

    def __call__(self, node, tuple call, tuple new_ext, tuple scalars, device):
        cdef RegionCore region = self.region
        worker = self.worker
        self.lock.acquire()
        try:
            if region.view.busy or (not worker.queued and not worker.queue_final_callback()):
                raise Deferred("not in a backward pass")
            return region._replay(node, call, new_ext, scalars, device)
        finally:
            self.lock.release()
