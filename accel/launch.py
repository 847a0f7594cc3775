"""Launch: a compiled region's kernel run on its buffers, at the region's flush or ahead of it.

:func:`launch_kernel` runs a kernel (CPU: now; CUDA: on the current stream of the region's
GPU, the host not waiting). Launching ahead (``ACCEL_LAUNCH_AHEAD``): where the last flushes
of regions that began at a trie node all ended alike (a :class:`Prediction`, kept on that
node), the next such region's kernel is launched at its first call (:func:`speculate`), and
its flush keeps the result only if the region ended as predicted (:func:`confirmed`). The
flush itself is :func:`accel.runtime.execute`.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from . import allocator
from .region import Region, TrieNode, _data_ptr, _untyped_storage, native

if TYPE_CHECKING:
    from .runtime import CompiledRegion


class Prediction:
    """How the last regions that began at a trie node ended, kept on that node: the end
    node and liveness mask, their (CUDA) kernel, the external inputs the first call does not
    supply (weak references, with the shape, strides, offset, dtype, address and storage
    size they had), the runtime scalars and the outputs' metadata. ``count`` flushes in a
    row ended so; the kernel is launched ahead once ``count >= need`` (``need`` grows
    fourfold at each mispredicted launch). Only regions that write no external input are
    predicted; the first call's key fixes the device."""

    __slots__ = ("end", "live", "kern", "tail", "scalars", "metas", "count", "need")

    def __init__(self, end, live, kern, tail, scalars, metas, count, need):
        self.end, self.live, self.kern, self.tail = end, live, kern, tail
        self.scalars, self.metas = scalars, metas
        self.count, self.need = count, need


class Speculation:
    """A kernel launched ahead: the prediction, the inputs and scalars it was launched with
    (strong references until the flush), their version counters and addresses, and the
    CUDA stream (``None`` on CPU)."""

    __slots__ = ("pred", "ext", "versions", "ptrs", "scalars", "stream")

    def __init__(self, pred, ext, versions, ptrs, scalars, stream):
        self.pred, self.ext, self.versions, self.ptrs = pred, ext, versions, ptrs
        self.scalars, self.stream = scalars, stream


_MAX_NEED = 4096
_ahead_min = 64 << 20  # ACCEL_LAUNCH_AHEAD_MIN_MB, in bytes


def set_launch_ahead_min(mib: int) -> None:
    """Launch ahead only kernels whose inputs and outputs span at least ``mib`` MiB
    (``ACCEL_LAUNCH_AHEAD_MIN_MB``, read at each enable)."""
    global _ahead_min
    _ahead_min = mib << 20


def _ext_meta(t) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def speculate(region: Region, pred: Prediction) -> bool:
    """At ``region``'s first call, launch the kernel its prediction names, without waiting
    for the rest of its calls: on a GPU the kernel then runs while the host records them.
    The external inputs the first call does not supply are the prediction's (alive, and
    with the shape, strides, offset, address and storage they had); outputs past the first
    call's are allocated now and handed out by the calls that return them. The flush
    (:func:`accel.runtime.execute`) keeps the result only if the region ended as predicted with the very
    same inputs, unchanged (identity, version counter, address), scalars, liveness mask and
    stream; otherwise it runs the region again, in stream order after this launch. Returns
    whether it launched; does nothing where any of that cannot hold."""
    tail = []
    for ref, meta, ptr, nbytes in pred.tail:
        t = ref()
        if (t is None or _ext_meta(t) != meta or _data_ptr(t) != ptr
                or _untyped_storage(t).nbytes() < nbytes):
            return False
        tail.append(t)
    kern, metas, n_first, dev = pred.kern, pred.metas, len(region.outs), region.device
    ahead = [None] * len(metas)
    for i in kern.live_idx:
        if i >= n_first:
            m = metas[i]
            ahead[i] = (native.device_empty_strided(m[0], m[1], m[2], dev) if kern.cuda else
                        allocator.empty_strided(m[0], m[1], m[2], m[3], dev))
    ext = region.ext + tail
    scalars = region.scalars + pred.scalars[len(region.scalars):]
    ptrs = kernel_ptrs(kern, region, ext, region.outs + ahead[n_first:])
    status, stream = launch_kernel(kern, region, ptrs, scalars)
    if status != 0:  # the flush launches it again and reports the failure
        return False
    region.ahead, region.ahead_meta = ahead, metas
    region.speculation = Speculation(pred, ext, [t._version for t in ext], ptrs[:len(ext)],
                                     scalars, stream)
    return True


def confirmed(region: Region, sp: Speculation, node: TrieNode, live) -> bool:
    """True if the kernel launched ahead computed exactly what ``region`` asks for."""
    pred = sp.pred
    if node is not pred.end or live != pred.live or region.scalars != sp.scalars:
        return False
    if len(region.ext) != len(sp.ext):
        return False
    for a, b, v, p in zip(region.ext, sp.ext, sp.versions, sp.ptrs):
        if a is not b or a._version != v or _data_ptr(a) != p:
            return False
    return sp.stream is None or sp.stream == raw_stream(cuda_index(region))


def mispredicted(region: Region, sp: Speculation) -> None:
    """Back off from launching ahead at this prediction; on a GPU, order the region's real
    run after the launch ahead when the current stream changed since (both write its
    outputs)."""
    pred = sp.pred
    pred.count, pred.need = 0, min(pred.need * 4, _MAX_NEED)
    if sp.stream is not None:
        dev = cuda_index(region)
        if raw_stream(dev) != sp.stream:
            torch.cuda.current_stream(dev).wait_stream(torch.cuda.ExternalStream(sp.stream, device=dev))


def predict(region: Region, node: TrieNode, live, kern: CompiledRegion) -> None:
    """Remember on the region's first trie node how it ended (see :class:`Prediction`),
    where its kernel is big enough to launch ahead (``ACCEL_LAUNCH_AHEAD_MIN_MB``)."""
    first = region.first
    if kern.traffic < 0:  # the same for every region that runs it: its trie path is static
        kern.traffic = region.traffic(kern.live_idx)
    if kern.traffic < _ahead_min:
        first.predict = None
        return
    old = first.predict
    tail = [(weakref.ref(t), _ext_meta(t), _data_ptr(t), _untyped_storage(t).nbytes())
            for t in region.ext[region.first_n_ext:]]
    same = old is not None and old.end is node and old.live == live
    first.predict = Prediction(node, live, kern, tail, list(region.scalars), list(region.out_meta),
                               old.count + 1 if same else 1, old.need if old is not None else 2)


def kernel_ptrs(kern: CompiledRegion, region: Region, ext, outs) -> list:
    """The kernel's buffer addresses: the external inputs, the outputs it writes (of
    ``outs``, by index), then its scratch buffers."""
    return native.kernel_ptrs(ext, outs, kern.live_idx,
                              region.scratch_for(kern) if kern.scratch else _NO_SCRATCH)


_NO_SCRATCH: list = []


def launch_kernel(kern: CompiledRegion, region: Region, ptrs, scalars):
    """Run ``kern`` (CPU: now; CUDA: on the current stream of the region's GPU, the host not
    waiting); returns (status, CUDA stream or None)."""
    if kern.sizes:  # (a shape-generic kernel's loop lengths after the region's scalars)
        scalars = scalars + kern.sizes
    if not kern.cuda:
        return native.launch(kern.fn, ptrs, scalars), None
    dev = cuda_index(region)
    stream = raw_stream(dev)
    return kern.fn.launch(ptrs, scalars, stream, dev), stream


def cuda_index(region: Region) -> int:
    d = region.device
    return d.index if d.index is not None else torch.cuda.current_device()


def raw_stream(device: int) -> int:
    """The cudaStream_t of ``device``'s current stream, without building a Stream object
    (what Inductor's generated code calls: ``getraw_stream``)."""
    return torch._C._cuda_getCurrentRawStream(device)
