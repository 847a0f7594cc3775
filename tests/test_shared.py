"""Memory shared outside torch's dispatcher (accel/shared.py): NumPy arrays, DLPack,
buffers and shared memory see every write in program order, and every write made through
them is seen, as in eager; no region reads or writes such memory."""
import multiprocessing

import numpy as np
import pytest
import torch

import accel
from accel import allocator, dispatch, shared
from accel.interceptor import _state
from accel.region import native

close = torch.testing.assert_close


def _on_both(fn):
    """fn() eagerly, then under accel; the two results (NumPy arrays or tensors)."""
    want = fn()
    with accel.eager():
        got = fn()
    return got, want


def _views_taken_before_writes(export):
    def program():
        a = torch.zeros(1000)
        n = export(a)  # before the writes: NumPy sees them as they are made
        seen = []
        for _ in range(3):
            a.add_(1.0)
            a.mul_(2.0)
            seen.append(np.array(n, copy=True))
        b = a * 3.0
        a.copy_(b + 1.0)
        seen.append(np.array(n, copy=True))
        return np.stack(seen)

    return program


EXPORTS = {
    "Tensor.numpy": lambda a: a.numpy(),
    "np.asarray": np.asarray,
    "np.from_dlpack": np.from_dlpack,
}


@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_numpy_arrays_taken_before_writes_see_them(export):
    got, want = _on_both(_views_taken_before_writes(EXPORTS[export]))
    np.testing.assert_array_equal(got, want)


IMPORTS = {
    "torch.from_numpy": torch.from_numpy,
    "torch.as_tensor": torch.as_tensor,
    "torch.asarray": torch.asarray,
    "torch.from_dlpack": torch.from_dlpack,
    "torch.frombuffer": lambda a: torch.frombuffer(memoryview(a).cast("B"), dtype=torch.float32),
}


@pytest.mark.parametrize("imp", sorted(IMPORTS))
def test_numpy_writes_after_a_deferred_read_are_not_seen_by_it(imp):
    def program():
        arr = np.zeros(1000, dtype=np.float32)
        t = IMPORTS[imp](arr)
        outs = []
        for i in range(3):
            arr[:] = i + 1
            y = (t * 2.0 + 1.0).sin()  # reads t now, as eager does
            arr[:] = -5.0  # before any flush
            outs.append(y)
        return torch.stack(outs)

    got, want = _on_both(program)
    close(got, want)


def test_inplace_writes_through_from_numpy_are_seen_by_numpy():
    def program():
        arr = np.ones(1000, dtype=np.float32)
        t = torch.from_numpy(arr)
        sums = []
        for _ in range(3):
            t.mul_(3.0)
            t.add_(1.0)
            sums.append(arr.sum())
        return np.array(sums)

    got, want = _on_both(program)
    np.testing.assert_array_equal(got, want)


@pytest.mark.usefixtures("needs_dispatch_filter")
@pytest.mark.skipif(native.shared_table_address() == 0,
                    reason="the pure-Python core: the dispatch filter records nothing")
def test_the_dispatch_filter_leaves_shared_inputs_to_the_interceptor():
    """Calls the filter learnt on ordinary tensors, then made on one over a NumPy array
    with the same key: the filter must not record them."""
    arrs = [np.full(4096, float(i), dtype=np.float32) for i in range(6)]
    with accel.eager():
        recorded = dispatch.recorded()
        outs = []
        for i, a in enumerate(arrs):
            t = torch.from_numpy(a) if i >= 3 else torch.full((4096,), float(i))
            outs.append(((t * 2.0) + 1.0).sin())
            a[:] = -7.0  # the NumPy array changes before the region flushes
            outs[-1].tolist()  # a flush: each region begins at the trie's root
        recorded = dispatch.recorded() - recorded
        got = torch.stack(outs)
    assert recorded > 0  # the filter recorded the calls it learnt
    close(got, torch.stack([torch.full((4096,), float(i)).mul(2).add(1).sin() for i in range(6)]))


def test_more_shared_storages_than_the_table_holds():
    held = [torch.zeros(8) for _ in range(100)]
    for t in held:
        t.numpy()
    got, want = _on_both(_views_taken_before_writes(EXPORTS["Tensor.numpy"]))
    np.testing.assert_array_equal(got, want)
    assert all(shared.is_shared(t) for t in held)


def test_exports_before_the_first_enable_are_known():
    """accel's hooks are installed when it is imported, not at the first enable."""
    a = torch.zeros(10)
    a.numpy()
    assert shared.is_shared(a)
    assert shared.is_shared(torch.from_numpy(np.zeros(3))[1:])  # views share the storage
    assert not shared.is_shared(torch.as_tensor([1.0, 2.0]))  # a copy
    assert not shared.is_shared(torch.as_tensor(torch.zeros(3)))  # torch's own tensor


def test_dead_storages_and_reused_pool_blocks_are_forgotten(monkeypatch):
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")  # auto: off here, where accel tunes malloc
    shared.clear()
    keep = torch.zeros(4)
    keep.numpy()
    for _ in range(3 * native.SHARED_MAX):
        torch.zeros(4).numpy()  # dead at once: dropped as registrations accumulate
    assert len(shared._refs) <= native.SHARED_MAX and shared.is_shared(keep)
    # a pooled CPU output (at least allocator.MIN_BLOCK bytes), exported, then dropped: the
    # pool hands its block out again, which nothing else holds any more (the pool emptied
    # first: an earlier test's free block of that size could be handed out instead)
    allocator.empty_cache()
    x = torch.randn(allocator.MIN_BLOCK // 4)
    with accel.eager():
        y = (x * 2.0).exp()
    y.numpy()
    y_storage = torch._C.TensorBase.untyped_storage(y)._cdata
    assert y_storage in shared._refs
    del y
    with accel.eager():
        z = (x * 2.0).exp()
        assert torch._C.TensorBase.untyped_storage(z)._cdata == y_storage  # the same block
    assert not shared.is_shared(z)
    shared.clear()


def _child(a, go, done, q):
    go.wait()
    q.put(float(a.sum()))
    done.set()


def test_shared_memory_written_before_an_event_is_seen_by_another_process():
    ctx = multiprocessing.get_context("spawn")
    a = torch.zeros(1000).share_memory_()
    go, done, q = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_child, args=(a, go, done, q))
    p.start()
    try:
        with accel.eager():
            a.add_(5.0)
            a.mul_(2.0)
            assert not _state.region.calls  # nothing deferred over shared memory
            go.set()
            got = q.get(timeout=120)
    finally:
        p.join(timeout=120)
    assert got == 10000.0
