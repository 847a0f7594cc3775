"""The interceptor: enablement, deferral, liveness, and every way of reading a pending
tensor's data (each must flush first)."""
import copy
import io
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import accel
from accel.interceptor import _state
from devices import DEVICES

close = torch.testing.assert_close


def chain(x):
    return torch.sin(x) * torch.exp(-x * x) + 0.5 * torch.tanh(x)


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(64, 33)


def pending():
    return len(_state.region.calls)


def test_eager_defers_and_fills_on_exit(x):
    accel.reset_stats()
    with accel.eager():
        y = chain(x)
        assert pending() > 0
    assert pending() == 0
    close(y, chain(x))
    assert accel.stats()["kernel_runs"] >= 1


def test_nesting_and_exception_safety(x):
    with pytest.raises(ZeroDivisionError):
        with accel.eager():
            with accel.eager():
                y = x * 2
            1 / 0
    assert not accel.is_enabled()
    close(y, x * 2)


def test_eager_is_a_decorator_too(x):
    """``accel.eager()`` decorates a function as it wraps a block (``contextlib``'s
    ContextDecorator): enabled inside each call, flushed and off after it, exceptions pass."""
    @accel.eager()
    def f(t):
        assert accel.is_enabled()
        return chain(t)

    @accel.eager()
    def g():
        raise KeyError("boom")

    for _ in range(2):
        y = f(x)
        assert not accel.is_enabled() and pending() == 0
        close(y, chain(x))
    with pytest.raises(KeyError):
        g()
    assert not accel.is_enabled()


def test_enable_disable(x):
    accel.enable()
    try:
        assert accel.is_enabled()
        y = x + 1
    finally:
        accel.disable()
    assert not accel.is_enabled()
    close(y, x + 1)
    with pytest.raises(RuntimeError):
        accel.disable()


def test_other_threads_not_intercepted(x):
    out = {}
    with accel.eager():
        t = threading.Thread(target=lambda: out.setdefault("y", chain(x)))
        t.start()
        t.join()
        assert pending() == 0
    close(out["y"], chain(x))


@pytest.mark.parametrize("how", ["event", "queue", "thread", "executor", "future"])
def test_tensors_handed_to_another_thread_are_filled(x, how):
    """A tensor computed under accel and handed to another thread, which reads it while
    the computing thread waits: the other thread's reads do not pass through this
    thread's mode, and read its memory (they read zeros or garbage). Handing over through
    an Event, a Queue, a thread's arguments, an executor's task or a future's result
    flushes the region first; the computing thread then waits, its region not flushed by
    any call of its own."""
    import concurrent.futures
    import queue

    seen = {}
    want = chain(x).sum()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with accel.eager():
            y = chain(x)
            assert pending() > 0
            if how == "event":
                box, ready, done = {"y": y}, threading.Event(), threading.Event()

                def read():
                    ready.wait()
                    seen["sum"] = box["y"].sum()
                    done.set()

                t = threading.Thread(target=read)
                t.start()
                ready.set()
                done.wait(60)
            elif how == "queue":
                q, done = queue.Queue(), threading.Event()
                t = threading.Thread(target=lambda: (seen.setdefault("sum", q.get().sum()), done.set()))
                t.start()
                y = chain(x)  # recorded after the thread's start
                q.put(y)
                done.wait(60)
            elif how == "thread":
                t = threading.Thread(target=lambda v: seen.setdefault("sum", v.sum()), args=(y,))
                t.start()
                t.join()
            elif how == "executor":
                seen["sum"] = pool.submit(torch.sum, y).result()
            else:  # a result handed back from another thread's future to this one
                fut = concurrent.futures.Future()
                other = pool.submit(lambda: fut.result().sum())
                fut.set_result(y)
                seen["sum"] = other.result()
            assert pending() == 0
    close(seen["sum"], want)

def test_a_forked_child_builds_kernels_of_its_own(fresh_store):
    """A child forked after the parent built a kernel (a DataLoader worker, say) builds
    the kernels it misses: the parent's build threads are not in the child, whose first
    build waited for them forever before."""
    import multiprocessing

    torch.manual_seed(0)
    x = torch.randn(256, 512)
    with accel.eager():
        chain(x).sum().item()  # built by the parent's build threads
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        torch.set_num_threads(1)  # as a DataLoader worker does: GNU OpenMP's threads do not fork
        accel.reset_stats()
        with accel.eager():
            got = (torch.cos(x) * 3 + x.exp()).sum(0)  # a region the parent never built
        q.put((got.tolist(), accel.stats()["compiles"]))

    p = ctx.Process(target=child)
    p.start()
    try:
        got, compiles = q.get(timeout=300)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    close(torch.tensor(got), (torch.cos(x) * 3 + x.exp()).sum(0))
    assert compiles == 1


def test_accel_disable_env(x, monkeypatch):
    monkeypatch.setenv("ACCEL_DISABLE", "1")
    with accel.eager():
        y = x * 3
        assert pending() == 0
    close(y, x * 3)


def test_invalid_env_names_variable(monkeypatch):
    monkeypatch.setenv("ACCEL_MAX_REGION", "lots")
    with pytest.raises(accel.ConfigError, match="ACCEL_MAX_REGION"):
        with accel.eager():
            pass
    monkeypatch.delenv("ACCEL_MAX_REGION")
    monkeypatch.setenv("ACCEL_DISABLE", "maybe")
    with pytest.raises(accel.ConfigError, match="ACCEL_DISABLE.*allowed values"):
        accel.enable()


# -- escape hatches: every read flushes first ---------------------------------------------
READS = {
    "item": lambda t: t[0, 0].item(),
    "numpy": lambda t: t.numpy().copy(),
    "tolist": lambda t: t.tolist(),
    "__array__": lambda t: np.asarray(t).copy(),
    "data_ptr": lambda t: np.ctypeslib.as_array(
        (__import__("ctypes").c_float * t.numel()).from_address(t.data_ptr())).copy(),
    "dlpack": lambda t: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    "__dlpack__": lambda t: np.from_dlpack(t).copy(),
    "pickle": lambda t: pickle.loads(pickle.dumps(t)),
    "torch.save": lambda t: torch.load(_save(t)),
    "repr": lambda t: repr(t),
    "str": lambda t: str(t),
    "format": lambda t: f"{t[0, 0]:.4f}",
    "untyped_storage": lambda t: torch.frombuffer(bytes(t.untyped_storage()), dtype=t.dtype),
    "device_copy": lambda t: t.to("meta"),
    "bool": lambda t: bool(t[0, 0] > -10),
}


def _save(t):
    f = io.BytesIO()
    torch.save(t, f)
    f.seek(0)
    return f


@pytest.mark.parametrize("how", sorted(READS))
def test_read_flushes(x, how):
    ref = chain(x)
    with accel.eager():
        y = chain(x)
        assert pending() > 0
        got = READS[how](y)
        assert pending() == 0, f"{how} did not flush"
        expect = READS[how](ref)
    if isinstance(got, torch.Tensor) and got.device.type != "meta":
        close(got.reshape(expect.shape), expect)
    elif isinstance(got, np.ndarray):
        np.testing.assert_allclose(got.reshape(expect.shape), expect, rtol=1.3e-6, atol=1e-5)
    elif isinstance(got, float):
        assert got == pytest.approx(expect, rel=1.3e-6, abs=1e-5)
    elif how == "tolist":
        close(torch.tensor(got), torch.tensor(expect))
    elif how in ("repr", "str"):
        assert got.split("(")[0] == expect.split("(")[0] and len(got) == len(expect)


def test_stream_and_graph_entry_points_flush(x):
    """The host's ways of ordering GPU work (streams, events, CUDA graphs, synchronizing)
    flush the pending region first (tests/test_cuda.py runs them on a GPU); here, the one
    that runs without a GPU (``set_stream(None)`` is a no-op) and the wrapping of the rest."""
    from accel.hooks import _STREAM_HOOKS

    with accel.eager():
        y = chain(x)
        assert pending() > 0
        torch.cuda.set_stream(None)
        assert pending() == 0
    close(y, chain(x))
    for owner, name in _STREAM_HOOKS:
        if owner is not None:
            assert getattr(owner, name).__wrapped__, f"{owner.__name__}.{name} is not hooked"


#: Ways to give a tensor's Python object other contents outside the dispatcher: ``x`` an
#: input of the pending region, ``y`` its pending output, ``u`` another tensor.
REPLACE_CONTENTS = {
    "input.data": lambda x, y, u: setattr(x, "data", u),
    "input.data of another dtype": lambda x, y, u: setattr(x, "data", u.double()),
    "input.data pending": lambda x, y, u: setattr(x, "data", x.data.clamp(-0.1, 0.1)),
    "output.data": lambda x, y, u: setattr(y, "data", u),
    "swap_tensors input": lambda x, y, u: torch.utils.swap_tensors(x, u),
    "swap_tensors output": lambda x, y, u: torch.utils.swap_tensors(y, u),
}


@pytest.mark.parametrize("how", list(REPLACE_CONTENTS))
def test_replacing_a_pending_tensors_contents_flushes_first(x, how):
    """``t.data = u`` and ``torch.utils.swap_tensors`` (``nn.Module.to``, ``half()``,
    ``cuda()``) change what a tensor's Python object holds, which the pending region reads
    or writes through that object: each flushes first, the region's values are the ones
    eager computed from the contents it saw (unflushed: ``chain(x)`` read ``u``'s memory,
    or wrote its result into ``u``)."""
    def program(x, u):
        y = chain(x)
        REPLACE_CONTENTS[how](x, y, u)
        return y * 1, x * 1, u * 1

    want = program(x.clone(), -x.flip(0))
    x, u = x.clone(), -x.flip(0)
    with accel.eager():
        got = program(x, u)
    close(got, want)


def test_module_to_after_a_forward_whose_result_is_unread():
    """``nn.Module.double()`` between a forward and the read of its result: the forward's
    values are the float32 parameters' (unflushed, the kernel read float64 memory as
    float32: 0.0 instead of 5.12)."""
    m = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    for p in m.parameters():
        torch.nn.init.constant_(p, 0.02)
    x = torch.randn(16, 32)

    def program(m):
        a = (m(x) * 2).sum(0)
        m.double()
        return a, m(x.double().sin())

    want = program(copy.deepcopy(m))
    with accel.eager():
        got = program(m)
    close(got, want)


class _OnAGpu(torch.Tensor):
    """A tensor that says it is on a GPU (no data: nothing runs on it)."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, device=torch.device("cuda"))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_ctc_loss_takes_cpu_lengths_as_lists_under_the_mode(monkeypatch):
    """Under a dispatch mode, ``ctc_loss.Tensor``'s composite takes its path for tensor
    subclasses, whose CUDA kernel refused CPU lengths that eager accepts ("Expected all
    tensors to be on the same device": ``F.ctc_loss`` on a GPU under accel raised). The hook
    passes them as lists, as eager's path does, only under a mode and only for CPU
    integer lengths with log-probabilities elsewhere, and not where cuDNN takes the call
    (eager passes the tensors there). The GPU case runs in ``test_programs.py``."""
    from accel.hooks import _ctc_lengths_as_lists

    assert torch.ctc_loss.__wrapped__
    seen, cudnn = [], []
    monkeypatch.setattr(torch, "_use_cudnn_ctc_loss", lambda *args: cudnn.append(args[-1]) or len(cudnn) > 1)
    ctc = _ctc_lengths_as_lists(lambda lp, t, il, tl, *a, **k: seen.append((il, tl, a, k)))
    gpu, lengths = _OnAGpu((12, 2, 6)), torch.tensor([12, 10])
    with accel.eager():
        ctc(gpu, None, lengths, torch.tensor([3, 3]), 3, reduction=1)
        ctc(gpu, None, lengths, lengths, blank=2)  # cuDNN's call: as given
        ctc(torch.zeros(12, 2, 6), None, lengths, lengths)  # all on the CPU: as given
        ctc(gpu, None, lengths.float(), lengths)  # not integers: eager's error, as given
    ctc(gpu, None, lengths, lengths)  # no mode: as given
    assert cudnn == [3, 2]  # (the blank index passed on)
    assert seen[0] == ([12, 10], [3, 3], (3,), {"reduction": 1})
    assert all(type(s[0]) is torch.Tensor for s in seen[1:])


def test_views_of_pending_outputs(x):
    with accel.eager():
        y = chain(x)
        v = y[::2, 1:].t()  # a view of a pending output, taken without flushing
        z = v * 2 + 1
        w = y.data + 1  # .data bypasses the dispatcher
        d = y.detach()
        del y
        e = d * 3
    ref = chain(x)
    close(z, ref[::2, 1:].t() * 2 + 1)
    close(w, ref + 1)
    close(e, ref * 3)


def test_inplace_and_out(x):
    a, b = x.clone(), x.clone()
    o1 = torch.empty_like(x)
    o2 = torch.empty_like(x)
    with accel.eager():
        a.mul_(2).add_(1, alpha=0.5)
        y = a.exp()
        y.sub_(a)
        torch.add(a, y, out=o1)
        a.clamp_(min=0.25)
    b.mul_(2).add_(1, alpha=0.5)
    ry = b.exp()
    ry.sub_(b)
    torch.add(b, ry, out=o2)
    b.clamp_(min=0.25)
    close(a, b)
    close(y, ry)
    close(o1, o2)


def test_inplace_on_views_of_one_storage(x):
    a, b = x.clone(), x.clone()
    with accel.eager():
        a[:, :10].mul_(a[:, 10:20]).add_(1.5)
        a[:, 20:30].sub_(a.t()[:10].t() * 2)
    b[:, :10].mul_(b[:, 10:20]).add_(1.5)
    b[:, 20:30].sub_(b.t()[:10].t() * 2)
    close(a, b)


def test_inplace_write_beside_overlapping_reads_runs_a_kernel(x):
    """Inputs that are only read may share storage (``x`` and ``x.t()``): a region that
    writes another input still runs its kernel; one writing into an input that shares
    storage with another input is replayed eagerly (either way: eager's result)."""
    s = torch.randn(33, 33)
    for target in ("other", "shared"):
        a, b = s.clone(), s.clone()
        out_a, out_b = torch.zeros(33, 33), torch.zeros(33, 33)
        accel.reset_stats()
        with accel.eager():
            dst = out_a if target == "other" else a
            dst.add_(a * 2 + a.t())
        (out_b if target == "other" else b).add_(b * 2 + b.t())
        close(out_a, out_b)
        close(a, b)
        st = accel.stats()
        assert (st["kernel_runs"], st["eager_replays"]) == ((1, 0) if target == "other" else (0, 1)), st


def test_failed_output_allocation_runs_the_call_eagerly(x):
    """A call whose output cannot be allocated (4 PiB here: more than a 64-bit process's
    address space, so it fails whatever the kernel's overcommit policy; 4 TiB was handed
    out, and then filled, on a machine with ``vm.overcommit_memory=1``) is not recorded:
    it runs eagerly, which raises eager's own error, and the pending region stays whole."""
    big = torch.ones(1).expand(1 << 25, 1 << 25)
    with pytest.raises(RuntimeError) as eager_error:
        big * 2
    with accel.eager():
        y = x * 2
        with pytest.raises(type(eager_error.value)):
            big * 2
        z = y + 1
    close(z, x * 2 + 1)
    close(y, x * 2)


def test_inplace_partial_overlap_raises_like_eager(x):
    with pytest.raises(RuntimeError, match="single memory location"):
        x.clone()[1:].add_(x[:-1])  # fine in eager: different storages
        a = x.clone()
        a[1:].add_(a[:-1])
    with pytest.raises(RuntimeError, match="single memory location"):
        with accel.eager():
            a = x.clone()
            a[1:].add_(a[:-1])


def test_binary_cross_entropy_of_an_input_out_of_range_raises_at_the_call():
    """Eager's CPU ``binary_cross_entropy`` raises on an input outside [0, 1] (NaN too); a
    kernel would return NaN, so on the CPU the op runs eagerly under accel: the same error
    at the call, every time, and the program's other results and an in-range loss (and its
    gradient, whose backward region stays fusible) as eager's."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(64, 32, generator=g)
    t = (torch.rand(64, 32, generator=g) > 0.5).float()
    F = torch.nn.functional
    with accel.eager():
        for bad in (p + 1, p - 1, p.masked_fill(p > 0.9, float("nan"))):
            h = torch.sigmoid(p) * 2
            for _ in range(2):
                with pytest.raises(RuntimeError, match="between 0 and 1"):
                    F.binary_cross_entropy(bad, t)
        q = torch.sigmoid(p * 3).requires_grad_()
        loss = F.binary_cross_entropy(q, t)
        loss.backward()
    close(h, torch.sigmoid(p) * 2)
    q0 = torch.sigmoid(p * 3).requires_grad_()
    want = F.binary_cross_entropy(q0, t)
    want.backward()
    close(loss, want)
    close(q.grad, q0.grad)


def test_inplace_partial_overlap_raises_at_the_call(x):
    """An in-place call whose written input shares storage with another of its arguments
    raises eager's error at the call, not at a later flush (it once joined the region,
    whose flush raised): a program that catches it goes on, every result right. One that
    shares storage without overlapping runs, as in eager."""
    with accel.eager():
        a = x.clone()
        b = torch.sin(x)
        for _ in range(3):  # the call's trie node known, and through the dispatch filter
            with pytest.raises(RuntimeError, match="single memory location"):
                a[1:].add_(a[:-1])
        c = b * 2
        d = x.clone()
        d[:, :16].add_(d[:, 16:32])
    close(a, x)  # eager refuses before writing
    close(c, torch.sin(x) * 2)
    e = x.clone()
    e[:, :16].add_(e[:, 16:32])
    close(d, e)


def test_dead_outputs_are_not_written(x, fresh_store):
    from accel.runtime import get_store

    with accel.eager():
        y = torch.sin(x)
        z = y.cos()
        del y
    close(z, torch.cos(torch.sin(x)))
    store = get_store()
    metas = [store.inspect(e["key"]) for e in store.entries() if not e["negative"]]
    assert any(m["meta"]["live_idx"] == [1] if "meta" in m else m.get("live_idx") == [1] for m in metas)


def test_autograd_inside_and_outside(x):
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    with accel.eager():
        y = a.exp() * torch.sigmoid(a)  # exp saves its output: filling must not bump it
        loss = (y * y.tanh()).sum()
        loss.backward()
        assert pending() == 0 or True
    yb = b.exp() * torch.sigmoid(b)
    (yb * yb.tanh()).sum().backward()
    close(a.grad, b.grad)
    c = x.clone().requires_grad_()
    with accel.eager():
        yc = c.exp() * torch.sigmoid(c)
        lc = (yc * yc.tanh()).sum()
    lc.backward()  # outside the context
    close(c.grad, b.grad)


def test_scalar_change_compiles_once(x, fresh_store):
    accel.reset_stats()
    for i in range(5):
        alpha = 0.1 * (i + 1)
        with accel.eager():
            y = x.add(x, alpha=alpha) * alpha - (1 + i)
        close(y, x.add(x, alpha=alpha) * alpha - (1 + i))
    assert accel.stats()["compiles"] == 1
    assert accel.stats()["kernel_runs"] == 5


def _recompile_limit(monkeypatch, limit):
    """``ACCEL_RECOMPILE_LIMIT=limit``, with no signature counted yet in this process."""
    from accel import runtime

    monkeypatch.setenv("ACCEL_RECOMPILE_LIMIT", limit)
    monkeypatch.setattr(runtime, "_SHAPES_BUILT", {})
    monkeypatch.setattr(runtime, "_LIMITED", set())


def _shapes_program(n):
    """A region (a chain no other test runs) at a shape of its own for each ``n``."""
    x = torch.linspace(-2, 2, 3 * n, dtype=torch.float64).view(3, n)
    return lambda: ((x * 3).cos() * 0.5 + x).sum(1), x


@pytest.mark.parametrize("limit", ["2", "0"])
def test_a_region_past_the_recompile_limit_runs_eagerly_at_new_shapes(limit, fresh_store, monkeypatch, caplog):
    """``ACCEL_RECOMPILE_LIMIT`` (L): a region whose new shapes keep coming after the step
    of its first build (each outermost ``accel.eager()`` block a step) has kernels built for
    L of them; later new shapes run eagerly, with eager's values, the shapes built still
    running their kernels; one warning. 0: every shape is built."""
    _recompile_limit(monkeypatch, limit)
    accel.reset_stats()
    for n in [5, 6, 7, 8, 9, 5, 6, 9]:
        program, x = _shapes_program(n + 10 * int(limit == "0"))  # (shapes of each case's own)
        with accel.eager():
            got = program()
        close(got, program())
    s = accel.stats()
    if limit == "0":
        assert (s["compiles"], s["kernel_runs"], s["eager_replays"]) == (5, 8, 0)
        assert "ACCEL_RECOMPILE_LIMIT" not in caplog.text
    else:  # built: 5 (its first step), 6 and 7 (two new shapes after it)
        assert (s["compiles"], s["kernel_runs"], s["eager_replays"]) == (3, 5, 3)
        assert caplog.text.count("ACCEL_RECOMPILE_LIMIT=2") == 1


def test_shapes_met_in_a_regions_first_step_count_against_four_times_the_limit(fresh_store, monkeypatch):
    """In one step (a static program's first, which meets all its shapes: a ResNet-50's
    batch norm + ReLU regions take 11) a region has kernels built for up to 4 L shapes;
    past them, eager."""
    _recompile_limit(monkeypatch, "1")
    accel.reset_stats()
    with accel.eager():
        for n in range(30, 36):
            program, x = _shapes_program(n)
            got = program()
            close(got, program())  # (a read: the region flushed)
    s = accel.stats()
    assert (s["compiles"], s["kernel_runs"], s["eager_replays"]) == (4, 4, 2)


@pytest.mark.parametrize("new_shape", [False, True], ids=["static", "a new shape"])
def test_shapes_refused_in_the_first_step_are_built_when_the_next_meets_only_them(new_shape, fresh_store,
                                                                                 monkeypatch):
    """A static program can meet more than 4 L shapes of one region signature in its first
    step (DenseNet-121's batch norm + ReLU: 58 widths; 218 of its regions ran eagerly in
    every step). The shapes refused there are built in a later step that meets no new shape
    of the signature, and run their kernels from then on. A later step that meets a new
    shape first (a program whose shapes keep changing) leaves them eager, as before."""
    _recompile_limit(monkeypatch, "1")
    ns = range(50, 56) if new_shape else range(40, 46)  # (shapes of each case's own)

    def step(extra=()):
        accel.reset_stats()
        with accel.eager():  # a step
            for n in [*extra, *ns]:
                program, x = _shapes_program(n)
                close(program(), program())  # (a read: the region flushed)
        s = accel.stats()
        return s["compiles"], s["kernel_runs"], s["eager_replays"]

    assert step() == (4, 4, 2)
    if new_shape:
        assert step([56]) == (0, 4, 3)
        assert step() == (0, 4, 2)
    else:
        assert step() == (2, 6, 0)
        assert step() == (0, 6, 0)


def test_unsupported_op_runs_eagerly(x):
    w = torch.randn(33, 7)
    with accel.eager():
        y = torch.relu(x @ w) * 2 + torch.cumsum(x, 0)[:, :7]
    close(y, torch.relu(x @ w) * 2 + torch.cumsum(x, 0)[:, :7])


@pytest.mark.parametrize("device", DEVICES)
def test_pointwise_ops_tagged_late_run_as_kernels(device):
    """The activations torch tags ``pointwise`` only from 2.13 on (``accel.ops.
    POINTWISE_UNTAGGED``: torch 2.11 lacks the tag, so they ran eagerly there) are deferred
    and fused on every torch."""
    import torch.nn.functional as F
    from accel.ops import POINTWISE_UNTAGGED, fusible_ops

    assert POINTWISE_UNTAGGED <= {op._schema.name[6:] for op in fusible_ops()}
    x = torch.randn(64, 33, device=device) * 3

    def fn(x):
        a = F.leaky_relu(x, 0.2) + F.leaky_relu(x * 2, 0.3, inplace=True)
        b = F.elu(x * 1, inplace=True) + F.celu(x * 1, inplace=True) + F.selu(x * 1, inplace=True)
        return a + b + F.hardtanh(x * 1, inplace=True) + F.hardsigmoid(x * 1, inplace=True)

    accel.reset_stats()
    with accel.eager():
        y = fn(x)
    s = accel.stats()
    assert s["kernel_runs"] == 1 and s["eager_replays"] == 0, s
    close(y, fn(x))


@pytest.mark.parametrize("device", DEVICES)
def test_negative_zero_constants_are_not_zero(device):
    """-0.0 and 0.0 are equal as Python values (and dict keys) but not as results: ``x +
    0.0`` of -0.0 is 0.0, ``clamp``'s bounds and ``copysign`` pass their sign on. Each
    constant gives eager's bits, in any order, also once the dispatch filter records the
    calls (its number classes and checks; the region key, CSE and the lowering's
    expressions each took one zero for the other)."""
    from accel import dispatch

    dispatch.wait(300)
    one = torch.ones(20, device=device)
    xs = [torch.tensor([True, False] * 10, device=device),
          torch.tensor([0.0, -0.0, 1.0, -1.0] * 5, device=device)]
    zeros = [(-0.0, 0.0), (0.0, -0.0), (0.0, 0.0), (-0.0, -0.0)]

    def fn(x, lo, hi):
        return [torch.copysign(one, torch.clamp(x, lo, hi)), torch.copysign(one, x.float() + lo),
                torch.copysign(one, (x.float() * 2 + lo) + (x.float() * 2 + hi))]

    for _ in range(3):  # the mode records the calls first, then the filter
        for x in xs:
            for lo, hi in zeros:
                want = fn(x, lo, hi)
                with accel.eager():
                    got = fn(x, lo, hi)
                for g, w in zip(got, want):
                    assert torch.equal(g, w), (x, lo, hi, g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_clamp_and_relu_give_eagers_sign_of_zero(device):
    """Where ``x`` equals a bound up to the sign of zero: on a GPU eager's clamps are
    ``fminf(fmaxf(x, lo), hi)`` (-0.0 below 0.0) with numbers and tensors as bounds, in place
    too; on the CPU its clamps keep ``x`` (numbers as bounds; with tensors eager's own
    vectorized and scalar loops differ) and ``relu(-0.0)`` is -0.0 (torch's decomposition:
    0.0); ``fmax``/``fmin`` of two zeros is the first on the CPU (libm's: the second) and
    IEEE's on a GPU. Each result has eager's bits."""
    x = torch.tensor([0.0, -0.0, 1.0, -1.0], device=device).repeat(1024)
    b = torch.tensor([0.0, -0.0, -0.0, 0.0], device=device).repeat_interleave(4).repeat(256)
    cases = [lambda: torch.relu(x * 1), lambda: (x * 1).relu_(), lambda: torch.fmax(x * 1, b),
             lambda: torch.fmin(x * 1, b)]
    for lo in (0.0, -0.0):
        cases += [lambda lo=lo: torch.clamp_min(x * 1, lo), lambda lo=lo: torch.clamp_max(x * 1, lo),
                  lambda lo=lo: (x * 1).clamp_min_(lo), lambda lo=lo: (x * 1).clamp_max_(lo)]
        for hi in (0.0, -0.0):
            cases += [lambda lo=lo, hi=hi: torch.clamp(x * 1, lo, hi),
                      lambda lo=lo, hi=hi: (x * 1).clamp_(min=lo, max=hi)]
    if device == "cuda":
        cases += [lambda: torch.clamp(x * 1, b, -b), lambda: torch.clamp_min(x * 1, b),
                  lambda: torch.clamp_max(x * 1, b), lambda: (x * 1).clamp_(b, b)]
    for fn in cases:
        want = fn()
        accel.reset_stats()
        with accel.eager():
            got = fn()
        st = accel.stats()
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), (got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_float_int_float_round_trip_keeps_zero_positive(device):
    """A float in (-1, 0) converted to an integer and back is 0.0, as eager gives it: gcc
    12 folds ``(float)(int64_t)x`` into ``trunc(x)`` (-0.0 there) under
    ``-fno-trapping-math``, in the scalar loops of strided inputs and vector tails; a CPU
    kernel with both conversions is compiled with trapping math."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(4099, generator=g) - 1, (torch.rand(67, 129, generator=g) - 1).t()]

    def fn(x):
        return [torch.atan2(x.long(), x), torch.copysign(torch.ones(()), x.int().float() * 1),
                1 / (x.long().to(x.dtype) + 2 * x) - x.long()]

    for x in xs:
        x = x.to(device)
        want = fn(x)
        with accel.eager():
            for _ in range(2):
                accel.reset_stats()
                got = fn(x)
        st = accel.stats()
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        for a, e in zip(got, want):
            assert torch.equal(a, e) and torch.equal(a.signbit(), e.signbit()), (a, e)

def test_half_dtypes_stay_correct(x):
    for dt in (torch.float16, torch.bfloat16):
        h = x.to(dt)
        with accel.eager():
            y = torch.sin(h) * 2 + h.float().exp().to(dt)
        close(y, torch.sin(h) * 2 + h.float().exp().to(dt))


def test_missing_compiler_falls_back(x, fresh_store, monkeypatch, caplog):
    monkeypatch.setenv("ACCEL_CXX", "/nonexistent/g++")
    with accel.eager():
        y = chain(x) * 3.5
    close(y, chain(x) * 3.5)
    assert "eagerly" in caplog.text


@pytest.mark.parametrize("device", DEVICES)
def test_inference_tensors_written_in_place_compile(device, fresh_store, caplog):
    """A region that writes an inference tensor in place inside ``torch.inference_mode``,
    flushed after the block, is traced as the program ran it (in inference mode): its
    kernel runs, with eager's result, and no warning (it ran eagerly before: "Inplace
    update to inference tensor outside InferenceMode")."""
    x = torch.randn(64, 64, device=device)
    with torch.inference_mode():
        a = x * 2
    e = x * 2 + 1
    want = e.sin() * 3
    accel.reset_stats()
    with accel.eager():
        with torch.inference_mode():
            a.add_(1)
            b = a.sin() * 3
        got = b.sum()
    st = accel.stats()
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
    assert "eagerly" not in caplog.text
    close(got, want.sum())
    assert torch.equal(a, e)


def _router(p, m):  # a mixture-of-experts router: top-k weights renormalized in place
    w, i = p.softmax(-1).topk(4, -1)
    w.div_(w.sum(-1, keepdim=True))
    return w * 2, i


def _scores(p, m):  # MPT's and Falcon's attention: scores scaled in place, then a softmax
    s = p @ p.t()
    s.div_(8.0)
    return s.softmax(-1), s


def _pooled(p, m):  # a residual added in place, then pooled
    h = p @ m
    h.add_(p)
    return torch.relu(h).mean(0), h


def _chained(p, m):  # two inputs written in place, one from the other's column sums
    a, b = p[0] @ m, p @ m
    a.add_(b.sum(0))
    b.mul_(a)
    return a, b


def _int_centered(p, m):  # integers: bit-exact
    c = (p * 100).to(torch.int64).cumsum(-1)
    c.sub_(c.amax(-1, keepdim=True))
    return c, c.sum(0)


def _column_normalized(p, m):  # the column sums go to memory before the write
    h = p @ m
    h.div_(h.sum(0, keepdim=True) + 100)
    return (h,)


def _transposed_sums(p, m):  # row i divided by column i's sum: other rows' elements
    h = m @ m
    h.div_(h.sum(0).unsqueeze(1) + 100)
    return (h,)


def _shallower(p, m):  # the row sums are old values; z's sums a reduction at each element
    h, z = p @ m, (p @ m).unsqueeze(-1).expand(-1, -1, 3).contiguous()
    s = h.sum(-1, keepdim=True) + 100
    h.add_(z.sum(-1)).div_(s)
    return (h,)


@pytest.mark.parametrize("fn", [_router, _scores, _pooled, _chained, _int_centered, _column_normalized,
                                _transposed_sums, _shallower],
                         ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_writes_read_at_other_elements_run_kernels(device, fn, fresh_store, caplog):
    """A region that writes an input in place and reads it at other elements (inside a
    reduction, or in a kernel nest after the write) runs its kernel, with eager's results:
    the write shares the nest of reductions that read only its own row (a row's sum, then
    the row's writes), or runs in a nest of its own, before the reads of its new values or
    after those of its old ones, the reductions its new values take over the input moved to
    memory before it (``accel.lowering.lower``: a column's sums, a reduction computed again
    at each element of a deeper one). These regions ran eagerly before (found in a sweep of
    transformers architectures, the forty-seventh round)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(48, 80, generator=g).to(device)
    m = torch.randn(80, 80, generator=g).to(device) / 9
    want = fn(p, m)
    accel.reset_stats()
    for _ in range(2):  # compiled, then the stored kernel
        with accel.eager():
            got = fn(p, m)
        for a, b in zip(got, want):
            if a.dtype.is_floating_point:
                close(a, b)
            else:
                assert torch.equal(a, b)
    st = accel.stats()
    assert st["kernel_runs"] >= 2 and st["eager_replays"] == 0, st
    assert "eagerly" not in caplog.text


def _standardized(x):
    return (x - x.mean(0)) / x.std(0)


def _column_softmax(x):
    return x.softmax(0)


def _column_shares(x):
    return x / x.sum(0, keepdim=True)


def _standardized_odd_rows(x):  # 999 rows: 249 steps of 4 rows, then 3 rows one by one
    return _standardized(x[:999])


def _batch_norm_1d(x):
    x = x.detach().requires_grad_()
    w = torch.linspace(0.5, 1.5, x.shape[1], dtype=x.dtype, device=x.device, requires_grad=True)
    y = torch.nn.functional.batch_norm(x, None, None, w, None, training=True)
    (y * y.detach().flip(0)).sum().backward()
    return y, x.grad, w.grad


def _batch_norm_2d_channels_last(x):  # the statistics: column ones of [N * H * W, C]
    x = x.reshape(10, 100, 8, 12).permute(0, 2, 3, 1).detach().requires_grad_()  # channels-last
    w = torch.linspace(0.5, 1.5, x.shape[1], dtype=x.dtype, device=x.device, requires_grad=True)
    y = torch.nn.functional.batch_norm(x, None, None, w, None, training=True)
    (y * y.detach().flip(0)).sum().backward()
    return y, x.grad, w.grad


def _group_norm_channels_last(x):  # 8 groups of 12 contiguous channels, 100 positions each
    x = x.reshape(10, 10, 10, 96).permute(0, 3, 1, 2).detach().requires_grad_()  # channels-last
    w = torch.linspace(0.5, 1.5, x.shape[1], dtype=x.dtype, device=x.device, requires_grad=True)
    y = torch.nn.functional.group_norm(x, 8, w)
    # (+ y * y: without it a weight gradient entry summed 1000 products to 5e-3, and
    # float32's normalized values alone put it 1.1e-5 from float64's, eager's 2.6e-4)
    (y * y.detach().flip(0) + y * y).sum().backward()
    return y, x.grad, w.grad


@pytest.mark.parametrize("fn", [_standardized, _standardized_odd_rows, _column_softmax, _column_shares,
                                _batch_norm_1d, _batch_norm_2d_channels_last, _group_norm_channels_last],
                         ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("device", DEVICES)
def test_column_normalizations_run_kernels_with_eagers_results(device, fn, fresh_store):
    """Normalizations over the rows of [N, C] (feature standardization, a softmax over dim
    0, column shares, BatchNorm1d in training, forward and backward): the column
    statistics run in a nest of their own (on the CPU vectors of a block's columns
    accumulated over the rows; Welford moments as shifted sums), the outputs in one along
    the rows. They walked each column down its rows before (3-20x slower than eager on
    the CPU). A channels-last batch norm's output nests loop in its memory order (N, H, W,
    then C innermost: 0.25x of eager's speed on the CPU before, in [N, C, H, W] order).
    A channels-last group norm's statistics loop the positions outside each group's
    channels (reduction variables in memory order; 0.24x of eager's speed before).
    Checked against the same computation in float64: eager's float32 sums of a
    thousand rows are further from it than ``assert_close`` allows float32 (the weight's
    gradient: 6.9e-5 against accel's 1.6e-5)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1000, 96, generator=g) * 4 + 1).to(device)
    want = fn(x.double())
    accel.reset_stats()
    for _ in range(2):
        with accel.eager():
            got = fn(x)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            close(a, b.float())
    st = accel.stats()
    assert st["kernel_runs"] >= 2 and st["eager_replays"] == 0, st


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
@pytest.mark.parametrize("device", DEVICES)
def test_column_arg_reductions_match_eager_bit_for_bit(device, dtype, fresh_store):
    """argmax, argmin, max and min over the rows of [N, C] (on the CPU a vector of a block's
    columns, each keeping its value and index, one row a step: 0.73x of eager's speed
    before, walking each column down its rows; on a GPU column tiles, the rows split
    among threads and blocks, combined by value then index: 25x slower than eager before,
    a thread walking each column): the first of equal values wins, a NaN beats any number,
    -inf columns give index 0, as eager's."""
    g = torch.Generator().manual_seed(0)
    # many ties; on a GPU whole tiles of 32 columns, the rows split among 3 blocks a tile
    x = torch.randint(0, 4, (2000, 96), generator=g).to(dtype)
    if dtype.is_floating_point:
        x[5, 3] = x[17, 3] = float("nan")
        x[:, 9] = float("-inf")
        x[40, 10] = float("inf")
    x = x.to(device)
    fns = [lambda t: t.argmax(0), lambda t: t.argmin(0), lambda t: t.max(0), lambda t: t.min(0),
           lambda t: (t * 2).argmax(0, keepdim=True), lambda t: t.reshape(20, 100, 96).argmin(1)]
    accel.reset_stats()
    for fn in fns:
        want = fn(x)
        with accel.eager():
            got = fn(x)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()), (a, b)
            if a.dtype.is_floating_point:
                assert torch.equal(a.isnan(), b.isnan())
    st = accel.stats()
    assert st["kernel_runs"] >= len(fns) and st["eager_replays"] == 0, st


def test_ops_without_a_lowering_run_eagerly_their_neighbours_fused(fresh_store, caplog):
    """``i0``, ``igamma``, ``igammac``, ``frexp`` (prims without a lowering) and ``lcm`` (an
    integer division) are not taken into regions (accel.ops._DENY): before, each call's
    region failed its build ("no lowering for prims.bessel_i0"), ran eagerly and warned.
    Now they run eagerly, the calls around them fused, eager's results bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1 << 18, generator=g) * 3 + 0.1, torch.rand(1 << 18, generator=g) + 0.5
    a, b = torch.randint(-50, 50, (1 << 18,), generator=g), torch.randint(-30, 30, (1 << 18,), generator=g)
    fns = [lambda: torch.i0(x * 2) + 1, lambda: (x * 2).i0_() + 1, lambda: torch.igamma(x * 2, y) + 1,
           lambda: torch.igammac(x * 2, y) * 3, lambda: torch.frexp(x * 2)[0] + torch.frexp(x * 2)[1],
           lambda: torch.lcm(a * 2, b) + 1]
    accel.reset_stats()
    with caplog.at_level(logging.WARNING, logger="accel"):
        for fn in fns:
            want = fn()
            with accel.eager():
                got = fn()
            assert got.dtype == want.dtype and torch.equal(got, want)
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= len(fns), st
    assert not [r for r in caplog.records if "runs eagerly" in r.getMessage()]


@pytest.mark.codegen
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_reductions_over_a_few_values_a_row_match_eager(dtype, fresh_store):
    """Sums, products, maxima, minima, argmax, argmin (ties: the first) and Welford moments
    over 2 to 16 values a result (the sum of squares of [N, 3] points, a logsumexp over 5
    classes, mvlgamma's sum of 3 lgammas, var_mean of [N, 3]): the CPU kernel
    vectorizes across the results, each result's values unrolled (accel.codegen.cpp
    SMALL_ROWS), with strides gcc does not group (5, 6, 7, 12, negative: a flipped row)
    loaded as single values: eager's results (integers bit for bit), NaN and infinities
    where it has them, over rows of contiguous, transposed and flipped inputs, rows over two
    dims and two dependent reductions a row."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for k in (2, 3, 4, 5, 6, 7, 8, 12, 16):
        x = (torch.randn(2003, k, generator=g) * 3).to(dtype)
        if dtype.is_floating_point:
            x[7, k - 1], x[9, 0], x[11] = float("nan"), float("inf"), -float("inf")
        cases += [(lambda t: (t * 2).sum(-1), x), (lambda t: (t * 2).amax(-1), x),
                  (lambda t: (t - 1).amin(-1, keepdim=True), x), (lambda t: (t.flip(-1) * 2).sum(-1) + t.flip(-1).amax(-1), x),
                  (lambda t: (t * 2).mT.sum(0), x.mT.contiguous().mT), (lambda t: (t.clamp(-2, 2) + 1).prod(-1), x),
                  (lambda t: (t * 2).argmax(-1), x), (lambda t: t.clamp(-1, 1).argmin(-1), x),  # ties
                  (lambda t: t.flip(-1).clamp(-1, 1).argmax(-1, keepdim=True), x)]
        if dtype.is_floating_point:  # Welford moments: eager's update, one value at a time
            cases += [(lambda t: torch.stack(torch.var_mean(t * 2, -1)), x),
                      (lambda t: torch.stack(torch.var_mean(t + 1e6, -1, correction=0)), x)]
    y = (torch.randn(1001, 3, 5, generator=g) * 3).to(dtype)
    cases += [(lambda t: (t * 2).sum((1, 2)), y), (lambda t: (t - 1).flatten(1).argmax(-1), y)]
    if dtype.is_floating_point:
        cases.append((lambda t: torch.stack(torch.var_mean(t, (1, 2))), y))
        cases += [(lambda t: torch.logsumexp(t * 2, -1), y[:, 0]), (lambda t: torch.linalg.vector_norm(t, dim=-1), y),
                  (lambda t: torch.mvlgamma(t.abs() * 3 + 2, 3), y), (lambda t: (t - t.amax(-1, keepdim=True)).exp().sum(-1), y)]
    accel.reset_stats()
    for fn, x in cases:
        want = fn(x)
        with accel.eager():
            got = fn(x)
        if dtype.is_floating_point:
            torch.testing.assert_close(got, want, equal_nan=True)
            assert torch.equal(got.isinf(), want.isinf())
        else:
            assert torch.equal(got, want)
    st = accel.stats()
    assert st["kernel_runs"] >= len(cases) and st["eager_replays"] == 0, st


@pytest.mark.codegen
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_kernels_over_a_few_values_a_row_match_eager(dtype, fresh_store, monkeypatch):
    """Softmax, log-softmax, LayerNorm (with and without an affine), RMSNorm, a softmax
    whose row is also an output, over rows of 2 to 16 values (and 17: the usual row
    kernel): the CPU kernel vectorizes across the rows, each row's reductions and its loop
    unrolled (accel.codegen.cpp.CppRenderer._small_row_nest): eager's results, NaN and
    infinities where it has them, over contiguous, transposed and batched ([B, R, k])
    inputs."""
    from accel.codegen.cpp import CppRenderer

    taken = []
    real = CppRenderer._small_row_nest
    monkeypatch.setattr(CppRenderer, "_small_row_nest", lambda self, j, nest: taken.append(
        real(self, j, nest)) or taken[-1])
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    cases = []
    for k in (2, 3, 5, 8, 10, 16, 17):
        x = (torch.randn(2003, k, generator=g) * 3).to(dtype)
        x[7, k - 1], x[9, 0], x[11], x[13, 1] = float("nan"), float("inf"), -float("inf"), float("inf")
        w, b = torch.randn(k, generator=g).to(dtype), torch.randn(k, generator=g).to(dtype)
        cases += [(lambda t: (t * 2).softmax(-1), x), (lambda t: (t - 1).log_softmax(-1), x),
                  (lambda t: F.layer_norm(t, t.shape[-1:]), x),
                  (lambda t, w=w, b=b: F.layer_norm(t * 2, t.shape[-1:], w.to(t.dtype), b.to(t.dtype)), x),
                  (lambda t, w=w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(t.dtype), x),
                  (lambda t: torch.stack([t * 3, (t * 3).softmax(-1)]), x),
                  (lambda t: (t * 2).softmax(-1), x.mT.contiguous().mT),
                  (lambda t: (t + 1).log_softmax(-1), (torch.randn(4, 999, k, generator=g) * 3).to(dtype))]
    accel.reset_stats()
    for fn, x in cases:
        want = fn(x)
        with accel.eager():
            got = fn(x)
        try:
            torch.testing.assert_close(got, want, equal_nan=True)
        except AssertionError:  # where eager's float32 is off (a LayerNorm of [-4.6619, -4.6502]
            # over its two values: eager's -0.878788, 0.878860, float64's -0.878838, 0.878838),
            # accel's values outside the tolerance no farther from float64's result than
            # eager's farthest (the benchmarks' verdict, bench/_common.py check)
            rtol, atol = {torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}[dtype]  # (the defaults)
            off = ~torch.isclose(got, want, rtol, atol, equal_nan=True)
            exact = fn(x.double())
            eager_off = (want.double() - exact).abs().nan_to_num(0.0, 0.0, 0.0).max()
            assert (got.double() - exact).abs()[off].max() <= eager_off
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())
    st = accel.stats()
    assert st["kernel_runs"] >= len(cases) and st["eager_replays"] == 0, st
    assert any(taken), "no row kernel took the small-row form"


def _split_rows_programs(x, f):
    """Column reductions of ``x`` ([N, C], C >= 256): plain, Welford, two dependent groups
    (softmax over dim 0), a variance over two reduction loops (a strided slice); the
    product of factors ``f`` near 1 (factors rounded to float32 beforehand: a thousand
    roundings of the factors alone are further from float64's product than
    ``assert_close`` allows float32)."""
    z = x.reshape(200, 5, -1)[:, 1:]  # rows over two loops: 200 (split) and 4
    return [x.sum(0), x.mean(0, keepdim=True), x.amax(0), x.amin(0), f.prod(0), x.var(0),
            x.std(0, correction=0), *torch.var_mean(x * 2, 0), x.softmax(0), x.log_softmax(0),
            x.logsumexp(0), x.norm(dim=0), z.var((0, 1)), z.sum((0, 1)), x.abs().mean(0) - x.mean(0)]


@pytest.mark.codegen
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_column_reductions_with_rows_split_among_threads_match_eager(threads, fresh_store, monkeypatch):
    """Column reductions over 300 columns whose rows the CPU kernel splits among the
    threads (each thread's partials merged in thread order; 1000 rows: 333 or 334 a
    thread with 3, rows left over after 4 a step), on 1, 2 and 3 OpenMP threads: floats
    against the same computation in float64; argmax, argmin, max and min with ties, NaN,
    -inf and inf columns, integer sums and any / all bit for bit against eager."""
    import accel.codegen.columns as columns

    monkeypatch.setattr(columns, "machine_threads", lambda: 2)  # split on any machine
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(1000, 300, generator=g) * 4 - 1
        f = x * 0.01 + 1
        want = _split_rows_programs(x.double(), f.double())
        ties = torch.randint(0, 4, (1000, 300), generator=g).float()
        ties[5, 3] = ties[700, 3] = ties[900, 4] = float("nan")
        ties[:, 9] = float("-inf")
        ties[999, 10] = float("inf")
        ints = torch.randint(-2**40, 2**40, (1000, 300), generator=g)
        exact = [lambda: ties.argmax(0), lambda: ties.argmin(0), lambda: ties.max(0), lambda: ties.min(0),
                 lambda: (ties.argmax(0), ties.argmin(0), ties.amax(0), ties.amin(0)),
                 lambda: ints.sum(0), lambda: ints.amax(0), lambda: (ints > 2**39).any(0),
                 lambda: (ints > -2**40 + 2**30).all(0)]
        accel.reset_stats()
        with accel.eager():
            got = _split_rows_programs(x, f)
        for a, b in zip(got, want):
            close(a, b.float())
        for fn in exact:
            e = fn()
            with accel.eager():
                a = fn()
            for u, v in zip(a if isinstance(a, tuple) else (a,), e if isinstance(e, tuple) else (e,)):
                assert u.dtype == v.dtype and torch.equal(u.nan_to_num(), v.nan_to_num()), (u, v)
                assert not u.dtype.is_floating_point or torch.equal(u.isnan(), v.isnan())
        st = accel.stats()
        assert st["kernel_runs"] >= 1 + len(exact) and st["eager_replays"] == 0, st
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_float32_sums_in_lanes_match_float64(threads, fresh_store):
    """float32 sums along a contiguous loop: four runs of 8 values a step (16 where the values
    cost more than a few additions: exponentials, sigmoids) added pairwise in float32, then
    widened into float64 lanes (``CppRenderer._lanes_sum``), each thread's lanes its own
    for a whole-tensor sum, the last values of a row one at a time (1000 and 1003 are not
    multiples of 32 or 64): row sums and means with a prologue, a row sum of float16
    values, whole-tensor sums, and sums over loops around the contiguous one, on 1, 2 and
    3 OpenMP threads, against float64."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 1000, generator=g) * 3
        y = torch.randn(1 << 16, generator=g) + 0.25
        z = torch.randn(3, 1003, generator=g)
        h = (torch.randn(32, 1000, generator=g) * 5).half()
        fns = [lambda t: t.sum(-1), lambda t: (t * 2 + 1).mean(-1, keepdim=True),
               lambda t: t.sum(), lambda t: (t * t).sum(), lambda t: (t * 0.25).exp().sum(-1),
               lambda t: torch.sigmoid(t).sum()]
        accel.reset_stats()
        for t in (x, y, z):
            for fn in fns:
                with accel.eager():
                    got = fn(t)
                close(got, fn(t.double()).float())
        with accel.eager():
            got = h.sum(-1)
        close(got, h.double().sum(-1).half())
        # lanes shared by the loops around the contiguous one: channel sums over the batch
        # and the positions, and the whole sum of a slice (its loops split by the gap; the
        # threads share the batch's loop, and each sums its rows' last values)
        b = torch.randn(12, 6, 1003, generator=g)  # (a slice of half: 36108 values, on threads)
        for fn in (lambda t: t.sum((0, 2)), lambda t: (t * 0.5).exp().sum((0, 2)),
                   lambda t: t[:, :3].sum(), lambda t: torch.sigmoid(t[:, 1:4]).sum()):
            with accel.eager():
                got = fn(b)
            close(got, fn(b.double()).float())
        st = accel.stats()
        assert st["kernel_runs"] >= 23 and st["eager_replays"] == 0 and st["compile_failures"] == 0, st
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_of_a_channels_last_tensor_takes_the_first_in_logical_order(device, fresh_store):
    """Reductions loop their variables in memory order, but an argmax's loop order is its
    tie-break: over every dim of a channels-last tensor, eager returns the first maximum
    in row-major (logical) order, not the first in memory."""
    x = torch.zeros(2, 3, 4, 5)
    x[0, 2, 0, 0] = x[0, 0, 0, 1] = 1  # the first in memory, the first row-major
    x = x.contiguous(memory_format=torch.channels_last).to(device)
    accel.reset_stats()
    with accel.eager():
        got = [(x * 1).argmax(), (x * 1).argmin(), (x + 0).reshape(2, 3, 20).argmax(2)]
    want = [(x * 1).argmax(), (x * 1).argmin(), (x + 0).reshape(2, 3, 20).argmax(2)]
    assert got[0].item() == 1 and all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert accel.stats()["eager_replays"] == 0


def test_eager_replay_keeps_the_shapes_eager_gives(fresh_store, monkeypatch):
    """A region replayed eagerly (its kernel could not be built) whose op's kernel returns
    another shape than the op's meta function (eval-mode batch norm's saved statistics:
    [0] from the CPU kernel, [C] from meta) runs as eager does instead of raising."""
    def broken(*a, **k):
        raise RuntimeError("injected codegen failure")

    monkeypatch.setattr("accel.codegen.cpp.CppRenderer.render", broken)
    x, rm, rv = torch.randn(3, 2, 4), torch.randn(2), torch.rand(2) + 0.5
    w, b = torch.randn(2), torch.randn(2)
    want = torch.ops.aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)
    accel.reset_stats()
    with accel.eager():
        got = torch.ops.aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)
        y = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=False) * 2
    assert accel.stats()["eager_replays"] >= 1
    assert [t.shape for t in got] == [t.shape for t in want]
    for g, e in zip(got, want):
        close(g, e)
    close(y, torch.nn.functional.batch_norm(x, rm, rv, w, b, training=False) * 2)




@pytest.mark.parametrize("first,second", [(0, 0.0), (0.0, 0), (False, 0), (0, False)],
                         ids=["int-float", "float-int", "bool-int", "int-bool"])
def test_constants_equal_in_value_but_not_in_type_key_apart(first, second):
    """A zero scalar is a constant of the region's key (nonzero ones are runtime arguments),
    and 0 == 0.0 == False as dict keys: ``x + 0.0`` after ``x + 0`` took the int one's trie
    node and returned int64 (found by tests/test_chains.py's explore profile). Likewise a
    value-specialized exponent, ``pow(x, 1)`` against ``pow(x, 1.0)``."""
    x = torch.arange(-10, 11).reshape(3, 7)
    for s in (first, second, first, second):
        with accel.eager():
            a = x + s
            b = (a * 2).clamp_(min=1) + a
            p = x.pow(1 if type(s) is not float else 1.0) * 3
        e = x + s
        assert a.dtype == e.dtype, (s, a.dtype, e.dtype)
        close(b, (e * 2).clamp_(min=1) + e)
        close(p, x.pow(1 if type(s) is not float else 1.0) * 3)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eval_batch_norm_kernel_returns_eagers_empty_statistics(dtype):
    """Eval-mode batch norm run as a kernel returns the saved statistics eager's CPU kernel
    returns: empty, of shape [0] and eager's dtype (the meta function's are [C]: the region
    returned [C] uninitialized elements), and its output as eager's."""
    g = torch.Generator().manual_seed(0)
    x, rm = torch.randn(4, 3, 5, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)
    rv = torch.rand(3, generator=g).to(dtype) + 0.5
    w, b = torch.randn(3).to(dtype), torch.randn(3).to(dtype)
    for op, args in ((torch.ops.aten._native_batch_norm_legit_no_training, (0.1, 1e-5)),
                     (torch.ops.aten.native_batch_norm, (False, 0.1, 1e-5))):
        want = op(x * 2, w, b, rm, rv, *args)
        accel.reset_stats()
        with accel.eager():
            got = op(x * 2, w, b, rm, rv, *args)
        assert accel.stats()["kernel_runs"] == 1, accel.stats()
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
        close(got[0], want[0])

@pytest.mark.parametrize("background", [False, True], ids=["at_flush", "background"])
def test_compile_failure_is_remembered(background, fresh_store, monkeypatch, caplog):
    """A failed build (at the flush, or in the background with ACCEL_ASYNC_COMPILE) leaves
    its region eager, remembered as a negative entry; nothing is raised in the program."""
    import accel.runtime as rt
    from accel import interceptor

    monkeypatch.setattr(interceptor, "_warned", set())  # the warning is once per process
    if background:
        monkeypatch.setenv("ACCEL_ASYNC_COMPILE", "1")

    def broken(*a, **k):
        raise RuntimeError("injected codegen failure")

    monkeypatch.setattr("accel.codegen.cpp.CppRenderer.render", broken)
    x = torch.randn(11, 7) if background else torch.randn(10, 3)  # a trie node each
    accel.reset_stats()
    for _ in range(3):
        with accel.eager():
            y = torch.atan(x) * 1.5
        close(y, torch.atan(x) * 1.5)
        accel.wait_for_compiles(timeout=600)
    assert accel.stats()["compile_failures"] == 1 and accel.stats()["kernel_runs"] == 0
    assert any(e["negative"] for e in rt.get_store().entries())
    assert "injected codegen failure" in caplog.text


def test_compiler_error_is_named_in_the_warning(fresh_store, monkeypatch, caplog):
    """A kernel the compiler rejects runs eagerly, and the one-line warning names the
    compiler's first error, not only that it failed (it once read ``g++ failed (1):``)."""
    from accel import interceptor

    monkeypatch.setattr(interceptor, "_warned", set())
    render = accel.codegen.cpp.CppRenderer.render

    def broken(self, ir, name):
        return render(self, ir, name).replace("return ACCEL_OK;", "return undeclared_status;", 1)

    monkeypatch.setattr("accel.codegen.cpp.CppRenderer.render", broken)
    x = torch.randn(12, 5)
    accel.reset_stats()
    with accel.eager():
        y = torch.atan(x) * 2.5
    close(y, torch.atan(x) * 2.5)
    assert accel.stats()["compile_failures"] == 1 and accel.stats()["kernel_runs"] == 0
    line = next(r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage())
    assert "error" in line and "undeclared_status" in line, line


def test_unwritable_cache_dir_falls_back(x, tmp_path, monkeypatch):
    import accel.runtime as rt

    bad = tmp_path / "file"
    bad.write_text("not a dir")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(bad))
    rt.set_store(None)
    try:
        with accel.eager():
            y = chain(x) + 7
        close(y, chain(x) + 7)
    finally:
        rt.set_store(None)


def _run(code, env=None, args=()):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)] if not args else
                          [sys.executable, *args], capture_output=True, text=True, env=e,
                          timeout=300)


SCRIPT = """
import sys, torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
x = torch.linspace(-2, 2, 1000)
y = torch.sin(x) * 2 + 1
assert 'accel' in sys.modules, 'accel not loaded'
assert any(type(m).__name__ == 'AccelMode' for m in _get_current_dispatch_mode_stack())
torch.testing.assert_close(y, torch.sin(torch.linspace(-2, 2, 1000)) * 2 + 1)
print('OK', sys.argv[1:])
"""


def test_accel_eager_env_var_unmodified_script(tmp_path):
    p = tmp_path / "s.py"
    p.write_text(SCRIPT)
    r = _run(None, {"ACCEL_EAGER": "1"}, args=(str(p), "--flag", "v"))
    assert r.returncode == 0, r.stderr
    assert "OK ['--flag', 'v']" in r.stdout


def test_accel_eager_env_var_invalid(tmp_path):
    p = tmp_path / "s.py"
    p.write_text("print('ran')")
    r = _run(None, {"ACCEL_EAGER": "1", "ACCEL_LOG": "loud"}, args=(str(p),))
    assert r.returncode == 2 and "ACCEL_LOG" in r.stderr and "ran" not in r.stdout


def test_accel_run_cli(tmp_path):
    p = tmp_path / "s.py"
    p.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "accel", "run", str(p), "--flag", "v"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "OK ['--flag', 'v']" in r.stdout


WARM = """
import json, sys, torch, accel
x = torch.linspace(-2, 2, 4096).reshape(64, 64)
with accel.eager():
    y = torch.softmax(x * 0.5, -1) + torch.layer_norm(x, [64])
torch.testing.assert_close(y, torch.softmax(x * 0.5, -1) + torch.layer_norm(x, [64]))
print(json.dumps({**accel.stats(), "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_new_process_with_warm_store_skips_meta_evaluation(fresh_store):
    """The trie's node metadata persists with the kernels: a second process finds every
    kernel and every call's output metadata in the store, so it compiles nothing and never
    evaluates a call on meta tensors (which would import torch._dynamo, about 1 s)."""
    import json

    from plugin_runs import seed_dispatch_filter  # tests/plugin_runs.py

    seed_dispatch_filter(fresh_store)  # not built again by the processes (100 s of a core)
    cold = json.loads(_run(WARM).stdout.strip().splitlines()[-1])
    warm = json.loads(_run(WARM).stdout.strip().splitlines()[-1])
    assert cold["compiles"] >= 1 and cold["dynamo"]
    assert warm["compiles"] == 0 and warm["store_hits"] >= 1 and warm["kernel_runs"] >= 1
    assert not warm["dynamo"], "a warm process evaluated a call on meta tensors"


def test_backward_on_an_engine_thread_is_fused_and_flushed(backward_case, monkeypatch):
    """CUDA backward runs on the autograd engine's device thread, which inherits the
    caller's mode. Here a thread that did not create the mode plays that part: the backward
    pass it runs is recorded into its own region and flushed by the engine's final
    callback before ``backward`` returns; its forward calls (outside a backward pass) run
    eagerly. (That thread calls ``backward`` itself, whose hook holds the calling thread's
    calls eager where CUDA is in use, as a GPU suite's process has it: a CPU pass here.)"""
    from accel.interceptor import AccelMode

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    x, w, f, want = backward_case
    mode = AccelMode()  # owned by this thread
    accel.reset_stats()
    seen = {}

    def worker():
        with mode:
            f(x, w).square().sum().backward()
        seen["calls_left"] = len(_state.region.calls)
        seen["stats"] = accel.stats()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["calls_left"] == 0
    assert seen["stats"]["kernel_runs"] >= 1, seen["stats"]
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(w.grad, want[1])


def _raising_backward(x, z):
    """A loss whose backward pass records ``z``'s gradient (3 everywhere, handed to
    ``z.grad``) and then raises: ``exp``'s saved result was modified in place."""
    b = x.sin().exp()
    loss = (b * 2).sum() + (z * 3).sum()
    b.mul_(1)
    return loss


def _on_engine_thread(mode, jobs):
    """Run ``jobs`` (functions) in turn on one other thread under ``mode`` (owned by this
    thread), as autograd's CUDA device thread runs every backward pass; each job's result
    or exception, handed back without Python's thread primitives (which accel's hooks
    flush on: the engine hands gradients back in C++), and the calls its worker held after
    it."""
    out = []

    def run():
        with mode:
            for job in jobs:
                try:
                    r = job()
                except RuntimeError as e:
                    r = e
                w = _state.worker
                out.append((r, len(w.region.calls) if w is not None else 0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_a_comm_function_runs_after_every_engine_threads_worker_is_flushed():
    """DataParallel's backward reduces, on one GPU's device thread and in C++, gradients
    another GPU's device thread computed (``torch.nn.parallel.comm.reduce_add_coalesced``):
    the comm functions run eagerly after every engine thread's worker is flushed. Here an
    engine thread is paused in the middle of its pass (in a tensor hook), its worker
    holding the gradients computed so far, while another thread calls a function wrapped
    as the comm functions are: that worker holds nothing by then, and the pass's
    gradients are still eager's."""
    from torch.autograd.graph import _engine_run_backward

    from accel.hooks import _COMM_HOOKS, _eagerly
    from accel.interceptor import _WORKERS, AccelMode

    assert all(hasattr(o, n) for o, n in _COMM_HOOKS)
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    mode = AccelMode()
    paused, resume = threading.Lock(), threading.Lock()  # plain locks: no hook flushes
    paused.acquire()
    resume.acquire()
    seen = {}

    def in_the_middle(g):
        seen["held"] = len(_state.worker.region.calls)
        paused.release()
        resume.acquire()

    def job():
        h = x * 2
        h.register_hook(in_the_middle)
        loss = (h.sin() * 3).exp().sum()
        return _engine_run_backward((loss,), (torch.ones(()),), False, False, (), True, True)

    out = []
    t = threading.Thread(target=lambda: out.extend(_on_engine_thread(mode, [job])))
    t.start()
    paused.acquire()
    _eagerly(lambda: seen.setdefault("during", [len(w.region.calls) for w in _WORKERS]),
             every_thread=True)()
    resume.release()
    t.join()
    assert seen["held"] > 0 and not any(seen["during"]), seen
    assert out[0][1] == 0
    ref = x.detach().clone().requires_grad_()
    ((ref * 2).sin() * 3).exp().sum().backward()
    close(x.grad, ref.grad)


@pytest.mark.parametrize("cuda_in_use", [False, True])
def test_with_cuda_in_use_the_calling_thread_defers_nothing_during_a_backward_pass(cuda_in_use, x,
                                                                                  monkeypatch):
    """A backward pass runs its CPU nodes on the calling thread and its CUDA nodes on
    autograd's device threads, which read a CPU node's result as soon as it returns; so
    with CUDA in use the calling thread's calls pass through eagerly during the pass
    (a custom function's backward copying a CPU gradient to the GPU read it unfilled:
    test_cuda.py's ``..._cpu_gradient_...``). Seen here by a tensor hook in the middle of
    the pass: nothing pending on this thread then. Without CUDA in use (a CPU program) the
    pass's calls are deferred as ever."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_in_use)
    seen = []
    w = x.clone().requires_grad_()
    with accel.eager():
        h = w * 2
        h.register_hook(lambda g: seen.append(pending()))
        h.sin().exp().sum().backward()
        assert pending() == 0 or not cuda_in_use
    ref = x.clone().requires_grad_()
    (ref * 2).sin().exp().sum().backward()
    close(w.grad, ref.grad)
    assert (seen[0] == 0) == cuda_in_use, seen


def test_a_backward_pass_that_raises_on_an_engine_thread_leaves_nothing_pending():
    """A backward pass that raises on an engine thread runs no final callback. The next
    pass on that thread queues its own (the worker knows the pass by its graph task id),
    so its gradients are filled; before, the first pass's callback counted as queued, and
    the second pass's gradients were handed back pending (the random programs' gradients
    on a GPU, after a program whose backward raised). The engine is called here without
    accel's entry points (``_engine_run_backward``), which flush on their own."""
    from torch.autograd.graph import _engine_run_backward

    from accel.interceptor import AccelMode

    torch.manual_seed(0)
    x, z, v = (torch.randn(64, 33, requires_grad=True) for _ in range(3))
    g = torch.randn(64, 33)
    mode = AccelMode()

    def failing():
        loss = _raising_backward(x, z)
        return _engine_run_backward((loss,), (torch.ones(()),), False, False, (), True, True)

    def clean():
        loss = (torch.tanh(v * g) * 3).sum()
        return _engine_run_backward((loss,), (torch.ones(()),), False, False, (), True, True)

    (err, _), (_, left) = _on_engine_thread(mode, [failing, clean])
    assert isinstance(err, RuntimeError) and "modified by an inplace operation" in str(err)
    assert left == 0
    want = (1 - torch.tanh(v.detach() * g) ** 2) * g * 3
    torch.testing.assert_close(v.grad, want)


def test_a_backward_pass_that_raises_leaves_its_gradients_filled():
    """``torch.autograd.backward`` (and ``torch.autograd.grad``) flush what a pass that
    raised recorded on an engine thread before the exception goes on: the gradient it
    accumulated into ``z.grad`` before raising is filled, as eager's is."""
    from accel.interceptor import AccelMode

    torch.manual_seed(0)
    x, z = (torch.randn(64, 33, requires_grad=True) for _ in range(2))
    mode = AccelMode()
    for entry in (lambda loss: torch.autograd.backward(loss),
                  lambda loss: torch.autograd.grad(loss, [x, z])):
        z.grad = None
        [(err, left)] = _on_engine_thread(mode, [lambda: entry(_raising_backward(x, z))])
        assert isinstance(err, RuntimeError) and "modified by an inplace operation" in str(err)
        assert left == 0
        if z.grad is not None:  # (autograd.grad accumulates into no leaf)
            torch.testing.assert_close(z.grad, torch.full((64, 33), 3.0))


def test_a_failed_flush_after_a_failed_backward_pass_keeps_the_passs_error(monkeypatch, caplog):
    """Where flushing the engine threads' calls after a backward pass that raised fails
    too, the program gets the pass's own exception, and accel logs the flush's."""
    from accel import interceptor

    def broken(self):
        raise ValueError("the flush failed")

    monkeypatch.setattr(interceptor._Worker, "final", broken)
    torch.manual_seed(0)
    x, z = (torch.randn(64, 33, requires_grad=True) for _ in range(2))
    with caplog.at_level("WARNING", logger="accel"):
        [(err, _)] = _on_engine_thread(interceptor.AccelMode(),
                                       [lambda: torch.autograd.backward(_raising_backward(x, z))])
    assert isinstance(err, RuntimeError) and "modified by an inplace operation" in str(err)
    assert "failed backward pass raised" in caplog.text


# -- background builds (ACCEL_ASYNC_COMPILE) ---------------------------------------------------
def test_async_compile_runs_eagerly_until_the_kernels_are_ready(fresh_store, monkeypatch):
    """Four new regions: the first call runs them eagerly while their kernels build on
    worker threads; once accel.wait_for_compiles() returns, the same calls run kernels."""
    monkeypatch.setenv("ACCEL_ASYNC_COMPILE", "1")
    xs = [torch.randn(17 + i, 5) for i in range(4)]

    fns = [lambda x: torch.sin(x) * 2.5 + torch.cos(x), lambda x: (x * x).sum(1)] * 2

    def step():
        return [f(x) for f, x in zip(fns, xs)]

    def run():
        out = []
        for f, x in zip(fns, xs):  # a region each
            with accel.eager():
                out.append(f(x))
        return out

    accel.reset_stats()
    close(run(), step())
    first = accel.stats()
    assert first["kernel_runs"] == 0 and first["eager_replays"] >= 4
    assert accel.wait_for_compiles(timeout=600) == 0
    assert accel.stats()["compiles"] >= 4
    accel.reset_stats()
    close(run(), step())
    assert accel.stats()["kernel_runs"] >= 4 and accel.stats()["eager_replays"] == 0


def test_a_background_build_traces_its_inputs_on_their_devices():
    """A background build traces a snapshot of its region, whose inputs stand in for the
    real ones without their memory: fake tensors on the inputs' devices. Meta tensors
    failed the trace of a GPU region holding a factory (``where(c, x, 0.5)``'s
    ``scalar_tensor`` on ``cuda:0``: "Tensor on device cuda:0 is not on the expected
    device meta"), and every such region of the GPU programs built in the background ran
    eagerly. Checked here with inputs that say they are on a GPU (fake tensors; no GPU
    needed)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from accel import runtime
    from accel.graph import trace_region

    aten, prims = torch.ops.aten, torch.ops.prims
    mode, gpu = FakeTensorMode(), torch.device("cuda", 0)
    on_gpu = lambda t: mode.fake_tensor_converter.from_meta_and_device(mode, t, gpu)  # noqa: E731
    ext = [on_gpu(torch.empty(4, 8, device="meta")), on_gpu(torch.empty(4, 8, dtype=torch.bool, device="meta"))]
    calls = [(aten.sin.default, (("x", 0),), {}, 1),
             (aten.scalar_tensor.default, (("c", 0.5),), {"dtype": ("c", torch.float32), "device": ("c", gpu)}, 1),
             (aten.where.self, (("x", 1), ("o", 0), ("o", 1)), {}, 1)]
    region = SimpleNamespace(calls=calls, ext=ext, outs=[None] * 3, out_meta=[], scalars=[], node=None,
                             device=gpu)
    snap = runtime._snapshot(region)
    assert [(t.device, t.shape, t.stride(), t.dtype) for t in snap.ext] == [
        (gpu, t.shape, t.stride(), t.dtype) for t in ext]
    gm = trace_region(snap.calls, snap.ext, 3, (2,), []).gm
    assert any(n.target is prims.where.default for n in gm.graph.nodes)


# -- launching ahead (ACCEL_LAUNCH_AHEAD; "all" runs the mechanism on the CPU too) ---------------
def rms(x, w, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _spec_stats():
    s = accel.stats()
    return s["speculative_launches"], s["speculative_hits"], s["speculative_misses"]


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD", "all")
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", "0")  # small tensors too
    accel.reset_stats()


def _warm(x, w, n=4):
    """Run rms under accel ``n`` times: the region's kernel is then launched ahead."""
    for _ in range(n):
        with accel.eager():
            y = rms(x, w)
        close(y, rms(x, w))


def test_launch_ahead_result_is_kept(ahead):
    x, w = torch.randn(48, 21), torch.randn(21)
    _warm(x, w, 6)
    launches, hits, misses = _spec_stats()
    assert launches >= 4 and hits == launches and misses == 0
    assert accel.stats()["kernel_runs"] == 6 and accel.stats()["eager_replays"] == 0
    w.mul_(3)  # between regions, an update of a predicted input (an optimizer step) is read
    with accel.eager():
        y = rms(x, w)
    close(y, rms(x, w))
    assert _spec_stats()[1] == hits + 1


def _other_scalar(x, w):
    return rms(x, w, eps=0.5)


def _intermediate_kept(x, w):  # rms's calls, one more output live
    sq = x * x
    return x * torch.rsqrt(sq.mean(-1, keepdim=True) + 1e-6) * w, sq


def _longer(x, w):
    return rms(x, w) + 1


_OTHER = {}


def _other_weight(x, w):  # a different tensor of the same shape where w was
    return rms(x, _OTHER.setdefault(w.shape[0], torch.randn(w.shape[0])))


def _weight_changed_midway(x, w):
    s = x * x  # the first call, where the kernel is launched ahead with w's old values
    w.index_fill_(0, torch.tensor([0, 3]), 7.0)  # not deferred: flushes, then writes w
    return x * torch.rsqrt(s.mean(-1, keepdim=True) + 1e-6) * w


_VARIANTS = [_other_scalar, _intermediate_kept, _longer, _other_weight, _weight_changed_midway]


@pytest.mark.parametrize("variant", _VARIANTS)
def test_launch_ahead_mispredicted_runs_again(ahead, variant):
    """The region after a launch ahead ends otherwise than predicted: the result is the
    eager one (the region is run again, after the launch), and the miss is counted."""
    torch.manual_seed(1)
    n = 8 + _VARIANTS.index(variant)  # a shape (so a trie path) of its own
    x, w = torch.randn(40, n), torch.randn(n)
    _warm(x, w)
    launches, hits, misses = _spec_stats()
    assert launches >= 2 and misses == 0
    w_eager = w.clone()
    want = variant(x, w_eager)
    with accel.eager():
        got = variant(x, w)
    close(got, want)
    close(w, w_eager)
    assert _spec_stats()[0] == launches + 1 and _spec_stats()[2] == 1


def test_launch_ahead_needs_the_predicted_inputs_unchanged(ahead):
    """No launch ahead where a predicted input is gone or its storage changed."""
    x, w = torch.randn(40, 23), torch.randn(23)
    _warm(x, w)
    launches = _spec_stats()[0]
    w.set_(torch.randn(23))  # same shape, another storage
    _warm(x, w, 1)
    w = torch.randn(23)  # the predicted tensor is freed
    _warm(x, w, 1)
    assert _spec_stats()[0] == launches and _spec_stats()[2] == 0


def test_launch_ahead_backs_off_after_misses(ahead):
    """A prediction that keeps failing (the scalar alternates) stops being launched."""
    x, w = torch.randn(40, 24), torch.randn(24)
    for i in range(60):
        eps = 1e-6 if i % 2 else 1e-3
        with accel.eager():
            y = rms(x, w, eps)
        close(y, rms(x, w, eps))
    launches, hits, misses = _spec_stats()
    assert misses <= 3, _spec_stats()


def test_launch_ahead_regions_sharing_their_first_call(ahead):
    """Two regions that begin with the same call, in turn: each flush mispredicts the
    other's end at first; results stay eager's and the prediction backs off."""
    x = torch.randn(40, 27)
    fns = [lambda x: (x + 1).sin(), lambda x: (x + 1).cos() * 2]
    for i in range(40):
        f = fns[(i // 3) % 2]  # three of one, then three of the other
        with accel.eager():
            y = f(x)
        close(y, f(x))
    assert _spec_stats()[2] <= 4, _spec_stats()


def test_launch_ahead_failing_changes_nothing(ahead, monkeypatch):
    """A launch ahead that fails before launching (here: allocating its outputs) leaves the
    region to its flush."""
    x, w = torch.randn(40, 26), torch.randn(26)
    _warm(x, w)
    launches = _spec_stats()[0]

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("no memory (test)")

    monkeypatch.setattr(accel.allocator, "empty_strided", no_memory)  # the launch's outputs
    _warm(x, w, 2)
    assert _spec_stats()[0] == launches and accel.stats()["eager_replays"] == 0


@pytest.mark.parametrize("min_mb, launched", [(1, False), (0, True)])
def test_launch_ahead_only_kernels_moving_enough_memory(ahead, monkeypatch, min_mb, launched):
    """``ACCEL_LAUNCH_AHEAD_MIN_MB``: a region whose inputs and outputs span less than it
    (here about 8 KiB) is never launched ahead; results are eager's either way."""
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", str(min_mb))
    x, w = torch.randn(40, 26), torch.randn(26)
    _warm(x, w)
    assert (_spec_stats()[0] > 0) == launched
    assert accel.stats()["eager_replays"] == 0


def test_a_region_with_its_kernel_in_memory_skips_the_runtime(monkeypatch):
    """Flushing a region whose kernel is in memory runs in the native core
    (``RegionCore.run_cached``) without the runtime's ``execute``, counted alike, also where
    it writes an external input or needs scratch buffers; a first run, a written input
    sharing storage with another input of the region (replayed eagerly), or a prediction to
    keep for launching ahead takes ``execute``. Results are eager's either way."""
    from accel import interceptor, runtime
    from accel.region import native

    calls = []
    monkeypatch.setattr(interceptor, "execute", lambda region: (calls.append(1), runtime.execute(region)))
    native_core = not native.__name__.endswith("_core_py")
    x, w = torch.randn(40, 29), torch.randn(29)  # a shape of its own: no kernel in memory yet
    for n in range(4):
        calls.clear()
        accel.reset_stats()
        with accel.eager():
            y = rms(x, w)
        close(y, rms(x, w))
        st = accel.stats()
        assert st["kernel_runs"] == st["flushes"] == 1 and st["eager_replays"] == 0, st
        assert len(calls) == (1 if n == 0 or not native_core else 0)
    a = torch.randn(40, 29)
    ref = a.clone().mul_(2).add_(1)
    for n in range(3):
        calls.clear()
        b = a.clone()
        with accel.eager():
            b.mul_(2).add_(1)  # writes b, an input of the region
        close(b, ref)
        assert len(calls) == (1 if n == 0 or not native_core else 0)
    a = torch.randn(2, 29)
    ref = a.clone()
    ref[0].mul_(2)
    ref_c = ref[1] + 1
    for n in range(3):
        calls.clear()
        accel.reset_stats()
        b = a.clone()
        with accel.eager():
            b[0].mul_(2)
            c = b[1] + 1  # b[1] shares the written b[0]'s storage: replayed eagerly
        close(b, ref)
        close(c, ref_c)
        assert len(calls) == 1 and accel.stats()["eager_replays"] == 1
    ref = a.clone()
    ref[0].mul_(2).add_(ref[1])
    for n in range(3):
        accel.reset_stats()
        b = a.clone()
        with accel.eager():
            # the add_ writes b[0] and reads b[1], which shares its storage: it runs
            # eagerly (eager's check of partial overlaps is at the call), the mul_ before
            # it through its kernel
            b[0].mul_(2).add_(b[1])
        close(b, ref)
        st = accel.stats()
        assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st
    x2 = torch.randn(40, 31)
    for n in range(3):
        calls.clear()
        with accel.eager():
            y = ((x2 - x2.mean(0)) ** 2).sum(1)  # the column means go to a scratch buffer
        close(y, ((x2 - x2.mean(0)) ** 2).sum(1))
        assert len(calls) == (1 if n == 0 or not native_core else 0)
    from accel.region import ROOT
    assert any(k.scratch for k in _kernels_under(ROOT) if isinstance(k, runtime.CompiledRegion))
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD", "all")
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", "0")
    for n in range(3):
        calls.clear()
        with accel.eager():
            y = rms(x, w)
        close(y, rms(x, w))
        assert len(calls) == 1  # the prediction is kept by execute


def _kernels_under(node):
    """Every kernel held by ``node`` and the trie nodes under it."""
    todo, out = [node], []
    while todo:
        n = todo.pop()
        out.extend(n.kernels.values())
        todo.extend(n.children.values())
    return out


def test_launch_ahead_off(monkeypatch):
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD", "off")
    accel.reset_stats()
    x, w = torch.randn(40, 25), torch.randn(25)
    _warm(x, w)
    assert _spec_stats() == (0, 0, 0)


def test_sum_of_an_expanded_value_matches_eager():
    for v, shape, dtype in [(0.1, (1000, 48), torch.float32), (3, (77, 5), torch.int64),
                            (float("inf"), (9, 4), torch.float32), (2.5, (0, 4), torch.float64)]:
        x = torch.tensor(v, dtype=dtype).expand(*shape)
        with accel.eager():
            y = (x + 0).sum(0) if shape[0] else x.sum(0)
        close(y, x.sum(0))


def test_factories_do_not_flush(x):
    """Tensors made from sizes and constants (or another tensor's metadata) read no data:
    the pending region goes on past them."""
    accel.reset_stats()
    with accel.eager():
        a = x * 2
        z = torch.zeros_like(a) + a.new_full((64, 33), 0.5) + torch.ones(64, 33)
        e = a.new_empty_strided((3,), (1,))
        r = torch.arange(33.0)
        y = torch.sin(a) + z + r
        assert pending() > 3 and e.shape == (3,)
    assert accel.stats()["flushes"] == 1
    close(y, torch.sin(x * 2) + 1.5 + torch.arange(33.0))


def _script_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * y + 1).sum(1) - y.exp().mean()


class _ScriptModule(torch.nn.Module):
    def forward(self, y):
        return (y * 2).sigmoid()


def test_torchscript_runs_eagerly_its_pending_inputs_flushed_first(x):
    """TorchScript's graph executor runs fused groups of ops as kernels of its own (NNC on
    GPUs), which read their inputs' memory directly: a scripted function, a scripted
    module's method and a traced one run with the pending region flushed and their calls
    passed through eagerly (on a GPU, a deferred input read unfilled gave wrong results:
    test_programs.py's TorchScript program). On the CPU NNC needs an LLVM build of torch,
    so here the test sees the mechanism: nothing is pending inside or after the call."""
    import warnings

    with warnings.catch_warnings():  # TorchScript is deprecated from torch 2.13 on
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = [torch.jit.script(_script_fn), torch.jit.script(_ScriptModule()),
                    torch.jit.trace(_ScriptModule(), x)]
    seen = []
    for fn in scripted:
        args = (x, x * 0.5) if fn is scripted[0] else (x * 0.5,)
        want = fn(*args)
        with accel.eager():
            y = x * 0.5  # pending
            assert pending() == 1
            got = fn(*(x, y) if fn is scripted[0] else (y,))
            seen.append(pending())
            z = got + 1  # deferred again after the call
            seen.append(pending())
        close(got, want)
        close(z, want + 1)
    assert seen == [0, 1] * 3, seen


def test_compiled_function_inside_is_not_traced_into_accel(x):
    """A torch.compile'd function called under accel: TorchDynamo must not trace accel's
    dispatch (without a skip it converted 77 frames of it here); the results are eager's,
    and accel's mode is the plain class (marked for dynamo on its code object, no wrapper
    run at every call)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from accel.interceptor import _DYNAMO_SKIPS, AccelMode

    @torch.compile(backend="eager")
    def f(t):
        return torch.sin(t) * 2 + t.cos()

    torch._dynamo.reset()
    counters.clear()
    with accel.eager():
        y = f(x)
        z = y + 1
        assert type(_state.modes[-1]) is AccelMode or not _DYNAMO_SKIPS
    close(z, torch.sin(x) * 2 + x.cos() + 1)
    assert counters["frames"]["total"] <= 1, dict(counters["frames"])


class _CountingMode(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor methods it sees, by name."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _power_iterations(w, u, v):
    """spectral_norm's power method (F.normalize with ``out=``), then a read of the result."""
    with torch.no_grad():
        for _ in range(3):
            u = torch.nn.functional.normalize(torch.mv(w, v), dim=0, eps=1e-12, out=u)
            v = torch.nn.functional.normalize(torch.mv(w.t(), u), dim=0, eps=1e-12, out=v)
    return u, v, (u.sin() * 2).tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_torch_function_modes_see_the_programs_calls_alone(device):
    """A torch function mode on the stack (``torch.set_default_device``, a user's mode)
    sees the program's calls as in eager, and none of accel's own: accel's tensor methods
    reached it by their public names, which are accel's flushing hooks (a region flushed
    while being recorded or flushed: wrong values, a crash), and a CPU output accel
    allocated took the default device."""
    g = torch.Generator().manual_seed(0)
    w, u, v = torch.randn(8, 16, generator=g), torch.randn(8, generator=g), torch.randn(16, generator=g)
    want = _power_iterations(w, u.clone(), v.clone())
    eager_mode = _CountingMode()
    with eager_mode:
        _power_iterations(w, u.clone(), v.clone())
    accel_mode = _CountingMode()
    with accel.eager(), accel_mode:
        got = _power_iterations(w, u.clone(), v.clone())
    assert accel_mode.seen == eager_mode.seen
    close(got, want)
    torch.set_default_device(device)  # CPU tensors still, made explicitly
    try:
        with accel.eager():
            got = _power_iterations(w, u.clone(), v.clone())
            y = torch.sigmoid(w) * 3.0 + 1.0
            assert y.device.type == "cpu"
    finally:
        torch.set_default_device(None)
    close(got, want)
    close(y, torch.sigmoid(w) * 3.0 + 1.0)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the names of the aten calls that reach it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._opname)
        return func(*args, **(kwargs or {}))


def test_modes_below_accel_see_the_programs_calls(x):
    """A dispatch mode entered before accel's is below it, and saw accel's allocations of
    unfilled outputs instead of the program's calls: make_fx traced a graph of
    ``empty_strided`` calls that returned garbage (so did ``torch.func.linearize``), and
    ``torch.export`` failed in the flush. With such a mode below, calls run eagerly under
    accel: the mode sees eager's calls, every result right; a region pending from before
    is flushed first."""
    from torch.fx.experimental.proxy_tensor import make_fx

    c = x[0].cos()

    def f(t):
        return torch.sin(t * 2 + 1) * c

    t = torch.randn(33)
    with accel.eager():
        pending_before = torch.tanh(x) * 3  # flushed at the first call under the tracer
        gm = make_fx(f)(t)
        _, jvp = torch.func.linearize(torch.sin, t)
        tangent = jvp(torch.ones(33))
    ops = {n.target._opname for n in gm.graph.nodes if n.op == "call_function"}
    assert {"sin", "mul", "add"} <= ops and "empty_strided" not in ops, gm.code
    close(gm(t), f(t))
    close(tangent, torch.cos(t))
    close(pending_before, torch.tanh(x) * 3)

    class M(torch.nn.Module):
        def forward(self, t):
            return (t * 2 + 1).sin() * c

    with accel.eager():
        ep = torch.export.export(M(), (t,))
    close(ep.module()(t), M()(t))
    log = _OpLog()
    with log, accel.eager():
        y = chain(x)
    eager_log = _OpLog()
    with eager_log:
        want = chain(x)
    assert log.ops == eager_log.ops
    close(y, want)


def test_out_resized_warns_at_the_call():
    """An ``out=`` tensor of another shape is resized, with eager's deprecation warning,
    at the call (deferred, it warned from the region's flush, as a C++ warning the
    program's filters never saw); under ``simplefilter("error")`` it raises there."""
    import warnings

    a = torch.randn(10)
    for _ in range(2):  # the call's trie node new, then known
        out = torch.empty(3)
        with accel.eager():
            with pytest.warns(UserWarning, match="was resized") as got:
                torch.sin(a * 2, out=out)
            y = out + 1
        assert len(got) == 1 and got[0].filename == __file__
        close(y, torch.sin(a * 2) + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = torch.empty(3)
            with accel.eager():
                with pytest.raises(UserWarning, match="was resized"):
                    torch.sin(a * 2, out=out)


@pytest.mark.parametrize("device", DEVICES)
def test_column_sum_over_rows_statistics_runs_as_a_kernel(device, fresh_store):
    """A sum over a batch of values that use each row's sum (a LayerNorm backward's input
    gradient plus the residual's, summed over the batch, in the demo's GPT-2 step): the
    rows' sums go to memory first, and the batch sum, which reads them across the batch
    (a stride of 128 a step, contiguous along the rows), then goes to a nest of its own.
    The rule that sends such a reduction there kept rejecting that nest too (recursing
    until Python's limit: the region ran eagerly)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(8, 128, 256, generator=g) + 0.5).to(device)
    z = torch.rand(8, 128, 256, generator=g).to(device)

    def f():
        s = x.sum(-1, keepdim=True)
        return (z + x * s).sum(0), s

    accel.reset_stats()
    with accel.eager():
        got = f()
    for a, b in zip(got, f()):
        close(a, b)
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= 1, st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reductions_with_epilogues_reading_across_rows_match_eager(device, dtype, fresh_store):
    """A reduction whose epilogue reads another tensor across the rows it writes: the
    reductions go to memory first and the epilogue's nest is tiled
    (``accel.lowering._reads_across_rows``): a softmax, a centering and a full sum with a
    transposed addend, and a channels-last group norm written contiguous (as torch 2.11's
    CUDA group norm returns it), its groups of 12 channels tiles of 8 and a tail (against
    float64's: eager's channels-last group norm on the CPU is itself 2e-5 off)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(70, 150, generator=g) * 3).to(dtype).to(device)
    y = torch.randn(150, 70, generator=g).to(dtype).to(device)
    img = (torch.rand(2, 96, 9, 10, generator=g) + 0.5).to(dtype).to(device)
    img = img.contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(96, generator=g).to(dtype).to(device), torch.rand(96, generator=g).to(dtype).to(device)
    fns = [lambda: x.softmax(-1) + y.t(), lambda: x - x.mean(-1, keepdim=True) + y.t(),
           lambda: x.sum() * y.t()]
    accel.reset_stats()
    for fn in fns:
        want = fn()
        with accel.eager():
            got = fn()
        close(got, want)
    with accel.eager():
        got = torch.nn.functional.group_norm(img, 8, w, b).contiguous()
    want = torch.nn.functional.group_norm(img.double(), 8, w.double(), b.double()).contiguous()
    close(got, want.to(dtype))
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= 4, st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.float16])
def test_transposed_reads_match_eager(device, dtype):
    """Regions reading a tensor across the rows they write (tiled nests on the CPU, float32's
    tiles of 64 transposed through AVX registers, tiles through shared memory on a GPU;
    tails of tiles: 37, 53, 140 and 150 are not multiples of 8, 32 or 64): ``x.t() + y``,
    ``x.t().contiguous()``, a batch of transposes, a softmax, log-softmax and sum over a
    transposed tensor's rows, and the outer loop's values kept per tile
    (``x.t() * y.sum(-1, keepdim=True)``)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(53, 37, generator=g) * 4).to(dtype).to(device)
    y = (torch.randn(37, 53, generator=g) * 4).to(dtype).to(device)
    xb = (torch.randn(3, 53, 37, generator=g) * 4).to(dtype).to(device)
    xl = (torch.randn(150, 140, generator=g) * 4).to(dtype).to(device)  # whole 64 x 64 tiles, and tails
    yl = (torch.randn(140, 150, generator=g) * 4).to(dtype).to(device)
    fns = [lambda: x.t() + y, lambda: x.t().contiguous() * 1, lambda: x.t() * y.sum(-1, keepdim=True),
           lambda: (x.t() - y).sum(-1), lambda: xb.transpose(1, 2) * 2 + y, lambda: xl.t() - yl,
           lambda: xl.t().contiguous() * 1]
    if dtype.is_floating_point and dtype != torch.float16:
        # (not float16: its log-softmax is at times an ulp from eager's, both within the
        # tolerance of float64's rounded to float16, and the epilogue's rounding can double it)
        fns += [lambda: x.t().softmax(-1), lambda: (x.t() * 0.5).log_softmax(-1) + y]
    for fn in fns:
        want = fn()
        with accel.eager():
            got = fn()
        assert got.stride() == want.stride()
        if dtype.is_floating_point:
            close(got, want)
        else:
            assert torch.equal(got, want)


def _spy_on(monkeypatch, name):
    """A list to which each call of ``accel.interceptor.<name>`` appends whether it returned
    a result (took the call) rather than None."""
    from accel import interceptor

    done = []
    original = getattr(interceptor, name)

    def spy(*a):
        out = original(*a)
        done.append(out is not None)
        return out

    monkeypatch.setattr(interceptor, name, spy)
    return done


@pytest.fixture
def fused_nll(monkeypatch):
    """Which ``nll_loss_forward`` calls the interceptor ran as eager's on the logits plus
    deferred row statistics (``accel.interceptor._nll_of_log_softmax``): a list of bools."""
    return _spy_on(monkeypatch, "_nll_of_log_softmax")


@pytest.fixture
def fused_nll_backward(monkeypatch):
    """Which ``nll_loss_backward`` calls the interceptor deferred as
    ``accel.nll_loss_backward`` (``accel.interceptor._nll_loss_backward``): a list of bools."""
    return _spy_on(monkeypatch, "_nll_loss_backward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_backward_never_writes_the_nll_gradient(device, dtype, reduction, fused_nll_backward):
    """Training ``F.cross_entropy``: autograd's ``NllLossBackward0`` defers its
    ``nll_loss_backward`` as one call (``accel.nll_loss_backward``: the rows' gradient at
    their targets, written without a scatter), so the log-softmax backward reading it
    fuses with it and the [N, C] gradient of the log-softmax is never written. Loss and
    logits' gradient as eager's, three steps (the dispatch filter learns no edge from the
    fused call), ignored targets (-100, and an ``ignore_index`` that is a class)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(48, 700, generator=g, dtype=torch.float64) * 3).to(device, dtype)
    t = torch.randint(0, 700, (48,), generator=g).to(device)
    t[[2, 7]] = -100
    t5 = t.clamp(min=0)
    t5[[9, 11]] = 5
    F = torch.nn.functional
    for tt, ii in ((t, -100), (t5, 5)):
        xe = x.clone().requires_grad_()
        want = F.cross_entropy(xe, tt, reduction=reduction, ignore_index=ii)
        (want.sum() if reduction == "none" else want).backward()
        xa = x.clone().requires_grad_()
        accel.reset_stats()
        for _ in range(3):
            xa.grad = None
            with accel.eager():
                got = F.cross_entropy(xa, tt, reduction=reduction, ignore_index=ii)
                (got.sum() if reduction == "none" else got).backward()
            close(got, want)
            close(xa.grad, xe.grad)
        assert accel.stats()["eager_replays"] == 0
    assert fused_nll_backward == [True] * 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss_backward_op_runs_eagers_kernel(device, dtype, reduction):
    """``accel.nll_loss_backward`` run eagerly (a region of it run eagerly: small, idle, a
    fallback) is eager's ``nll_loss_backward``, one kernel; its reference, the
    decomposition a kernel fuses, gives the same values. Bit-exact, ignored targets in."""
    from accel import library

    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, 13, (21,), generator=g)
    t[[1, 8]] = -100
    go = torch.randn(21 if reduction == 0 else (), generator=g, dtype=dtype).to(device)
    t, tot = t.to(device), torch.tensor(19.0, dtype=dtype, device=device)
    got = torch.ops.accel.nll_loss_backward(go, t, tot, 13, reduction, -100)
    want = torch.ops.aten.nll_loss_backward(go, torch.empty(21, 13, dtype=dtype, device=device), t,
                                            None, reduction, -100, tot)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(library.nll_loss_backward(go, t, tot, 13, reduction, -100), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_of_log_softmax_op_runs_eagers_kernels(device, dtype, reduction):
    """``accel.nll_of_log_softmax`` run eagerly is eager's ``log_softmax`` and
    ``nll_loss_forward``, bit for bit (two kernels, not its reference's dozen), its total
    weight the count of kept rows for every reduction; its reference, the decomposition a
    kernel fuses, is close to it and counts alike."""
    from accel import library

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(21, 13, generator=g, dtype=dtype) * 3).to(device)
    t = torch.randint(0, 13, (21,), generator=g)
    t[[1, 8]] = -100
    t = t.to(device)
    rows = torch.ops.aten.nll_loss_forward(x, t, None, 0, -100)[0]
    loss, total = torch.ops.accel.nll_of_log_softmax(x, rows, t, reduction, -100)
    F = torch.nn.functional
    want = F.nll_loss(F.log_softmax(x, 1), t, reduction=("none", "mean", "sum")[reduction])
    assert torch.equal(loss, want) and torch.equal(total, torch.tensor(19.0, dtype=dtype, device=device))
    ref_loss, ref_total = library.nll_of_log_softmax(x, rows, t, reduction, -100)
    close(ref_loss, want)
    assert torch.equal(ref_total, total)


def test_nll_loss_backward_elsewhere_runs_eagerly(fused_nll_backward):
    """``nll_loss_backward`` outside autograd's ``NllLossBackward0`` (called directly, where
    no forward checked the targets) runs as eager's, raising eager's error on a target out
    of range; with a class weight it runs eagerly too. Results as eager's."""
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(16, 30, generator=g).log_softmax(1)
    t = torch.randint(0, 30, (16,), generator=g)
    w = torch.rand(30, generator=g)
    go, tot = torch.tensor(1.0), torch.tensor(16.0)
    bwd = torch.ops.aten.nll_loss_backward.default
    bad = t.clone()
    bad[3] = 30
    with accel.eager():
        with pytest.raises((IndexError, RuntimeError)):
            bwd(go, logp, bad, None, 1, -100, tot)
        got = bwd(go, logp, t, None, 1, -100, tot) * 1
    close(got, bwd(go, logp, t, None, 1, -100, tot))
    x = torch.randn(16, 30, generator=g)
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    F = torch.nn.functional
    with accel.eager():
        F.cross_entropy(xa, t, weight=w).backward()
    F.cross_entropy(xe, t, weight=w).backward()
    close(xa.grad, xe.grad)
    assert fused_nll_backward == [False, False, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_without_grad_never_writes_log_softmax(device, dtype, reduction, fused_nll):
    """``F.cross_entropy`` under ``no_grad``: its ``nll_loss_forward`` of the pending
    ``log_softmax`` runs as eager's on the logits plus deferred row statistics, so the
    region's kernel reads the logits once and writes no [N, C] output (the log-softmax is
    dead at the flush). Results as eager's, ignored targets (the default -100, and an
    ``ignore_index`` of 3) and a row of very large logits included; float64 as the oracle."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 1000, generator=g, dtype=torch.float64) * 4).to(device, dtype)
    x[5] += 1e4  # a row whose logits cancel: (max - x[t]) + log(sum) as eager's
    t = torch.randint(0, 1000, (48,), generator=g).to(device)
    t[[2, 7]] = -100
    t3 = t.clamp(min=0)
    t3[[9, 11]] = 3
    F = torch.nn.functional
    accel.reset_stats()
    with torch.no_grad(), accel.eager():
        got = [F.cross_entropy(x, t, reduction=reduction),
               F.cross_entropy(x, t3, reduction=reduction, ignore_index=3)]
    assert fused_nll == [True, True]
    assert accel.stats()["eager_replays"] == 0
    for (tt, ii), y in zip(((t, -100), (t3, 3)), got):
        want = F.cross_entropy(x.double(), tt, reduction=reduction, ignore_index=ii)
        close(y, want.to(dtype))
        close(y, F.cross_entropy(x, tt, reduction=reduction, ignore_index=ii))


def test_cross_entropy_fusion_keeps_eagers_errors_and_gradients(fused_nll):
    """The fused ``nll_loss_forward`` raises eager's error on a target out of range (from
    eager's own call, on the logits), and label smoothing's loss (which reads the
    log-softmax again) is eager's. Calls it does not cover run as before, as eager's: a
    class weight, logits computed in the region, a log-softmax over dim 0 (``0 == False``:
    no dim taken for ``half_to_float``), and training, where autograd keeps the log-softmax
    for the backward (the loss and the logits' gradient as eager's)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 100, generator=g)
    t = torch.randint(0, 100, (32,), generator=g)
    w = torch.rand(100, generator=g)
    F = torch.nn.functional
    bad = t.clone()
    bad[4] = 100
    with torch.no_grad(), accel.eager():
        with pytest.raises(IndexError, match="out of bounds"):
            F.cross_entropy(x, bad)
        others = [F.cross_entropy(x, t, weight=w), F.cross_entropy(x * 2, t),
                  F.nll_loss(F.log_softmax(x, 0), t), F.cross_entropy(x, t, label_smoothing=0.1)]
    close(others[0], F.cross_entropy(x, t, weight=w))
    close(others[1], F.cross_entropy(x * 2, t))
    close(others[2], F.nll_loss(F.log_softmax(x, 0), t))  # over the other dim (0 == False)
    close(others[3], F.cross_entropy(x, t, label_smoothing=0.1))
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with accel.eager():
        loss = F.cross_entropy(xa, t)
        loss.backward()
    want = F.cross_entropy(xe, t)
    want.backward()
    close(loss, want)
    close(xa.grad, xe.grad)
    # not fused: the bad target (eager's call on the logits raised: the usual path raised
    # again), the weight, the logits computed in the region, a log-softmax over dim 0,
    # training; fused: label smoothing's
    assert fused_nll == [False, False, False, False, True, False]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_fusion_replayed_eagerly(reduction, fused_nll, fresh_store, monkeypatch):
    """Without a compiler the region holding the fused ``nll_loss_forward``
    (``accel.nll_of_log_softmax``, recorded as one call) runs eagerly, through that op's
    reference: the loss and its total weight as eager's, ignored targets included, and
    again at the next calls (the dispatch filter learns no edge from the fused call: an edge
    taken from it would replay the accel op's arguments as ``nll_loss_forward``'s)."""
    monkeypatch.setenv("ACCEL_CXX", "/nonexistent/g++")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 300, generator=g)
    t = torch.randint(0, 300, (40,), generator=g)
    t[[3, 8]] = -100
    red = {"none": 0, "mean": 1, "sum": 2}[reduction]
    want = torch.ops.aten.nll_loss_forward(torch.log_softmax(x, 1), t, None, red, -100)
    accel.reset_stats()
    with torch.no_grad():
        for _ in range(3):
            with accel.eager():
                got = torch.ops.aten.nll_loss_forward(torch.log_softmax(x, 1), t, None, red, -100)
            close(got[0], want[0])
            assert got[1].item() == want[1].item()
    assert fused_nll == [True] * 3
    assert accel.stats()["eager_replays"] >= 1 and accel.stats()["kernel_runs"] == 0
