"""Pure-Python twin of :mod:`accel._core` (msgpack's ``fallback.py`` pattern): the same
classes and functions, selected with ``ACCEL_PURE_PYTHON=1`` or when the extension is not
built. It keeps the native hot path honest and debuggable; tests run both.
"""
from __future__ import annotations

import ctypes
import sys

import torch

from .allocator import empty_strided
from .ops import DTYPES, HALF, NOT_DEFERRABLE, SCALAR, TENSOR, Deferred, OpSpec, float_key, overlap_args, pending_view

_data_ptr = torch._C.TensorBase.data_ptr
_CPU = torch.device("cpu")
_untyped_storage = torch._C.TensorBase.untyped_storage
_storage_use_count = torch._C._storage_Use_Count
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_cuda_half = True
_small_regions = True


def set_helpers(empty_strided: int, liveness: int, overlap: int = 0, reuse: int = 0) -> None:
    """The native core's use of the dispatch filter's C++ helpers (see accel/_core.pyx);
    the twin does without them."""


def set_cpu_pool(on: bool) -> None:
    """See accel/_core.pyx. The twin always asks :func:`accel.allocator.empty_strided`,
    which uses the pool only where :func:`accel.allocator.configure` turned it on."""


def reuse_blocks(outs: list, live_idx: tuple) -> None:
    """The native core's buffer reuse at a flush (see accel/_core.pyx) needs the dispatch
    filter's C++ helper; the twin does without it."""


def device_empty_strided(shape: tuple, stride: tuple, dtype, device):
    """The twin of the native core's: ``torch.empty_strided`` on a GPU ``device``."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


SHARED_MAX = 64  # as the native core's table (include/accel/region_view.h)
_shared_lookup = None  # where storages are shared outside the dispatcher: is one of them?


def shared_table_address() -> int:
    """The twin keeps no table for the dispatch filter (0), which records nothing here."""
    return 0


def set_shared(storages, lookup) -> None:
    """The twin of the native core's: where ``storages`` (StorageImpl addresses; None: too
    many to list) is not empty, ``lookup(address)`` says whether an external input's
    storage is shared outside the dispatcher; such a call is not deferred."""
    global _shared_lookup
    _shared_lookup = lookup if storages is None or storages else None


_include = None  # the dispatch filter's accel_filter_include (ctypes), once loaded


def set_include_fn(address: int) -> None:
    """The twin of the native core's: ``accel_filter_include`` by ``address`` (0: none)."""
    global _include
    _include = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(address) if address else None


def filter_include(on: bool) -> bool:
    """Include the dispatch filter's key in the calling thread's key set (or not); returns
    whether it was included.

    Raises:
        RuntimeError: :func:`set_include_fn` has not been given the function.
    """
    if _include is None:
        raise RuntimeError("accel: the dispatch filter is not loaded")
    return _include(1 if on else 0) != 0


def ext_overlap(ext: list, written: tuple) -> bool:
    """Whether an external input at an index in ``written`` shares memory with another of
    ``ext`` (a list of tensors): their storages' byte ranges intersect (external inputs
    that are only read may share it: ``x`` and ``x.t()``)."""
    spans = []
    for t in ext:
        s = _untyped_storage(t)
        spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    for j in written:
        b = spans[j]
        for i, a in enumerate(spans):
            if i != j and a[0] < b[1] and b[0] < a[1]:
                return True
    return False


def set_small_regions(on: bool) -> None:
    """See accel/_core.pyx."""
    global _small_regions
    _small_regions = bool(on)


def set_cuda_half(on: bool) -> None:
    """Whether regions on CUDA devices take float16/bfloat16 tensors (``ACCEL_CUDA_HALF``,
    set at each enable); off, such calls run eagerly."""
    global _cuda_half
    _cuda_half = bool(on)


_CONST_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device,
                torch.memory_format, torch.layout, tuple)


class RegionCore:
    """The recording half of a region (see :class:`accel.region.Region`)."""

    # the region's view for the dispatch filter (include/accel/region_view.h), made at the
    # first clear: byte 0 is 1 while calls are recorded; byte 1 (replay) stays 0, so the
    # filter reads nothing else and never records into this region itself
    _view = None

    def pending_address(self):
        """The address of the region's view, whose first byte is 1 while the region has
        recorded calls."""
        return ctypes.addressof(self._view)

    def set_replay(self, on, cap, fn=None, on_first=None):
        """The native core's switch for the filter's recording (this core has none)."""

    def clear(self, root):
        if self._view is None:
            self._view = (ctypes.c_uint8 * 16)()
        self._view[0] = 0
        self.node = root
        self.ext = []
        self.ext_ids = {}
        self.outs = []
        self.out_ids = {}
        self.out_bases = set()
        self.out_meta = []
        self.scalars = []
        self.calls = []
        self.lo = sys.maxsize
        self.hi = 0
        self.mutates_ext = False
        self.device = None
        self.ahead = None  # outputs allocated ahead (speculation), by index
        self.ahead_meta = None
        self.first = self.speculation = None  # launching ahead (see accel/_core.pyx)
        self.first_n_ext = 0

    def run_cached(self, stats, compiled_type, ahead_min, nodes_pending):
        """The native core's flush of a region whose kernel is in memory (see
        accel/_core.pyx); the twin leaves every flush to accel.runtime.execute."""
        return False

    def __len__(self):
        return len(self.calls)

    def liveness(self):
        """Which pending outputs are still observable (a tuple of bools): held by Python,
        by another TensorImpl (autograd's saved values, views) or sharing storage with one."""
        live = []
        for t in self.outs:  # references: self.outs, t, getrefcount's argument
            live.append(sys.getrefcount(t) > 3 or t._use_count() > 1
                        or _storage_use_count(_untyped_storage(t)._cdata) > 2)
        return tuple(live)

    def _tensor_sig(self, t):
        if type(t) not in _TENSOR_TYPES or t.layout != torch.strided or not (t.is_cpu or t.is_cuda):
            raise Deferred("tensor kind")
        d = _CPU if t.is_cpu else t.device
        if self.device is None:
            self.device = d
        elif d != self.device:
            raise Deferred("device")  # a region runs on one device
        i = self.out_ids.get(id(t))
        if i is not None and self.outs[i] is t:
            return ("o", i), ("o", i)
        if t.dtype not in DTYPES or (t.dtype in HALF and not _cuda_half and d is not _CPU):
            raise Deferred("dtype")
        if self.outs:
            p = _data_ptr(t)
            if self.lo <= p < self.hi and self._aliases_pending(t, p):
                w = pending_view(t, self.outs, p - t.storage_offset() * t.element_size())
                if w is None:
                    raise Deferred("alias")  # a view of a pending output: flush, then retry
                return w, w
        if _shared_lookup is not None and _shared_lookup(_untyped_storage(t)._cdata):
            raise Deferred("shared memory")
        j = self.ext_ids.get(id(t))
        if j is None or self.ext[j] is not t:
            j = len(self.ext)
            self.ext.append(t)
            self.ext_ids[id(t)] = j
        return ("x", j, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), d), ("x", j)

    def _aliases_pending(self, t, p):
        # the start of t's storage is a pending output's (every view shares its storage)
        return p - t.storage_offset() * t.element_size() in self.out_bases

    def _arg(self, kind, v, key, tmpl):
        tv = type(v)
        if kind == TENSOR and tv in _TENSOR_TYPES:
            k, w = self._tensor_sig(v)
            key.append(k)
            tmpl.append(w)
        elif (kind == TENSOR or kind == SCALAR) and v and v == v and (
                (tv is float and self._float_ok) or (tv is int and self._int_ok)):
            # nonzero numbers are runtime arguments; their sign is part of the key
            key.append(("f" if tv is float else "i") + ("-" if v < 0 else "+"))
            tmpl.append(("s", len(self.scalars)))
            self.scalars.append(v)
        else:
            if isinstance(v, list):
                v = tuple(v)
            elif tv not in (bool, int, float, str, type(None), torch.dtype, torch.device,
                            torch.memory_format, torch.layout, tuple):
                raise Deferred("argument type")
            if tv is torch.device:  # a factory's device: the region's
                if self.device is None:
                    self.device = v
                elif v != self.device:
                    raise Deferred("device")
            if tv is float and v != v:
                v = "nan"  # NaN != NaN would break dict lookups
            # with its type: 0 == 0.0 == False as dict keys; and -0.0 apart from 0.0
            key.append((tv, float_key(v) if tv is float else v) if tv in (int, float, bool) else v)
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
            if node.eager_first is True and _small_regions:  # (accel.interceptor)
                raise Deferred("small region")
        except Deferred:
            self._rollback(n_ext, n_sc, len(self.outs))
            raise
        n_out = len(self.outs)
        try:
            call = (func, tuple(targs), tkw, node.n_new)
            if node.writes_ext:  # a written input sharing storage with another argument: eager
                if node.overlap_args is None:
                    node.overlap_args = overlap_args(call)
                chk = node.overlap_args
                if chk and ext_overlap([self.ext[j] for j in chk[0]], chk[1]):
                    raise Deferred("written input shares storage")
            if node.ret is not None:
                res = self._resolve(node.ret)
            elif not node.multi:
                res = self._alloc(node.outs[0])
            else:
                res = tuple(None if m is None else self._alloc(m) for m in node.outs)
        except BaseException:  # out of memory, say: the call is not recorded
            self._rollback(n_ext, n_sc, n_out)
            raise
        self.node = node
        self.calls.append(call)
        self._view[0] = 1
        if node.writes_ext:
            self.mutates_ext = True
        return res

    def _alloc(self, meta):
        shape, stride, dtype, nbytes = meta
        i = len(self.outs)
        t = None
        if self.ahead is not None and i < len(self.ahead) and self.ahead_meta[i] is meta:
            t, self.ahead[i] = self.ahead[i], None  # allocated when the kernel was launched ahead
        if t is None:
            if dtype in HALF and not _cuda_half and self.device is not None and self.device is not _CPU:
                raise Deferred("dtype")
            t = empty_strided(shape, stride, dtype, nbytes, self.device)
        self.out_ids[id(t)] = i
        self.outs.append(t)
        self.out_meta.append(meta)
        p = _data_ptr(t)
        self.out_bases.add(p)
        if p < self.lo:
            self.lo = p
        if p + nbytes > self.hi:
            self.hi = p + nbytes
        return t

    def _rollback(self, n_ext, n_sc, n_out):
        """Forget the external inputs, scalars and outputs a call that is not recorded
        added."""
        for t in self.ext[n_ext:]:
            self.ext_ids.pop(id(t), None)
        del self.ext[n_ext:]
        del self.scalars[n_sc:]
        for t in self.outs[n_out:]:
            self.out_ids.pop(id(t), None)
            self.out_bases.discard(_data_ptr(t))
        del self.outs[n_out:]
        del self.out_meta[n_out:]
        if not self.calls:
            self.device = None



class LoadError(OSError):
    """A kernel library could not be opened or lacks its entry point."""


_libs = []


def load(path: str, symbol: str) -> int:
    """dlopen ``path`` and return the address of ``symbol``, keeping it loaded."""
    try:
        lib = ctypes.CDLL(path)
        fn = getattr(lib, symbol)
    except (OSError, AttributeError) as e:
        raise LoadError(str(e)) from e
    _libs.append(lib)
    return ctypes.cast(fn, ctypes.c_void_p).value


class _Scalar(ctypes.Union):
    _fields_ = [("f", ctypes.c_double), ("i", ctypes.c_int64)]


_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Scalar))


def launch(fn: int, ptrs: list, scalars: list) -> int:
    """Call kernel ``fn`` with buffer addresses and runtime scalars; return its status."""
    return _KERNEL(fn)(*_args(ptrs, scalars))


def kernel_ptrs(ext: list, outs: list, live_idx: tuple, scratch: list) -> list:
    """A kernel's buffer addresses: the external inputs, the outputs it writes, scratch."""
    return ([_data_ptr(t) for t in ext] + [_data_ptr(outs[i]) for i in live_idx]
            + [_data_ptr(t) for t in scratch])


def _args(ptrs: list, scalars: list):
    bufs = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
    sc = (_Scalar * max(1, len(scalars)))()
    for i, v in enumerate(scalars):
        if type(v) is float:
            sc[i].f = v
        else:
            sc[i].i = v
    return bufs, sc


# -- CUDA: a region's cubin through the driver API ---------------------------------------------
_MAX_DEVICES = 64
_driver = None


def _cuda():
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise LoadError(f"CUDA driver not found: {e}") from e
        vp = ctypes.c_void_p
        for name, args in (("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
                           ("cuCtxGetCurrent", [ctypes.POINTER(vp)]), ("cuCtxSetCurrent", [vp]),
                           ("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p]),
                           ("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p]),
                           ("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp, ctypes.POINTER(vp), vp]),
                           ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
                           ("cuInit", [ctypes.c_uint])):
            try:
                f = getattr(lib, name)
            except AttributeError as e:
                raise LoadError(f"libcuda.so.1 lacks {name}") from e
            f.argtypes, f.restype = args, ctypes.c_int
        r = lib.cuInit(0)
        if r != 0:
            raise LoadError(f"cuInit failed ({r})")
        _driver = lib
    return _driver


def cuda_error_string(status: int) -> str:
    """The CUDA driver's name for error code ``status``, or the number."""
    s = ctypes.c_char_p()
    if _driver is not None and _driver.cuGetErrorString(status, ctypes.byref(s)) == 0 and s.value:
        return s.value.decode(errors="replace")
    return f"CUDA error {status}"


class CudaKernel:
    """A region's CUDA module: cubin ``image`` and launch plan ``launches`` (see
    :meth:`accel.codegen.cuda.CudaRenderer.render`), loaded per device at its first launch.

    Raises:
        LoadError: no CUDA driver (``libcuda.so.1``).
    """

    def __init__(self, image: bytes, launches: list):
        self.drv = _cuda()
        self.image = bytes(image)
        self.launches = launches
        self.devices = {}  # device -> (context, [(scalar kernel, vector kernel or None)])

    def _load(self, device):
        d, vp = self.drv, ctypes.c_void_p
        dev, ctx, prev, mod = ctypes.c_int(), vp(), vp(), vp()
        r = d.cuDeviceGet(ctypes.byref(dev), device) or d.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        if r:
            return r
        d.cuCtxGetCurrent(ctypes.byref(prev))
        d.cuCtxSetCurrent(ctx)
        try:
            r = d.cuModuleLoadData(ctypes.byref(mod), self.image)
            funcs = []
            for l in self.launches:
                pair = []
                for k in (l, l.get("vector")):
                    f = vp()
                    if k is not None and not r:
                        r = d.cuModuleGetFunction(ctypes.byref(f), mod, k["kernel"].encode())
                    pair.append(f if k is not None else None)
                funcs.append(pair)
        finally:
            d.cuCtxSetCurrent(prev)
        if not r:
            self.devices[device] = (ctx, funcs)
        return r

    def launch(self, ptrs: list, scalars: list, stream: int, device: int) -> int:
        """Launch the plan's kernels in order on ``stream`` of GPU ``device``; return 0 or
        the first CUresult that failed."""
        if not 0 <= device < _MAX_DEVICES:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        if device not in self.devices:
            r = self._load(device)
            if r:
                return r
        d, (ctx, funcs) = self.drv, self.devices[device]
        bufs, sc = _args(ptrs, scalars)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(bufs), ctypes.addressof(sc))
        prev = ctypes.c_void_p()
        d.cuCtxGetCurrent(ctypes.byref(prev))
        if prev.value != ctx.value:
            d.cuCtxSetCurrent(ctx)
        try:
            for l, (f, fv) in zip(self.launches, funcs):
                v = l.get("vector")
                if v is not None and not any(ptrs[b] & 15 for b in v["buffers"]):
                    l, f = v, fv
                r = d.cuLaunchKernel(f, *l["grid"], *l["block"], 0, stream, params, None)
                if r:
                    return r
            return 0
        finally:
            if prev.value != ctx.value:
                d.cuCtxSetCurrent(prev)


class WorkerReplay:
    """What the dispatch filter calls instead of ``RegionCore._replay`` on an autograd
    engine thread (see accel/_core.pyx): under ``lock``, once ``worker`` queued its final
    callback.

    Raises:
        Deferred: outside a backward pass, or the region is being flushed.
    """

    def __init__(self, worker, region, lock):
        self.worker, self.region, self.lock = worker, region, lock

    def __call__(self, node, call, new_ext, scalars, device):
        with self.lock:
            if self.region.busy or (not self.worker.queued and not self.worker.queue_final_callback()):
                raise Deferred("not in a backward pass")
            return self.region._replay(node, call, new_ext, scalars, device)
