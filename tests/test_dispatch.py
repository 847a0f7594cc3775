"""The dispatch filter (accel/dispatch.py, include/accel/dispatch_filter.cpp): which calls it
runs past the interceptor's dispatch mode, and that every other path stays the mode's."""
import contextlib
import copy
import ctypes
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accel
from accel import dispatch, eager_regions, interceptor
from accel.interceptor import AccelMode, _state

close = torch.testing.assert_close

pytestmark = pytest.mark.usefixtures("needs_dispatch_filter")


@pytest.fixture
def seen(monkeypatch):
    """The aten calls that reach accel's ``__torch_dispatch__`` (a list, appended to)."""
    calls = []
    original = AccelMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(AccelMode, "__torch_dispatch__", counting)
    return calls


def test_the_filters_key_hashes_every_file_it_includes():
    """Every accel file the filter's source includes, directly or through another, is hashed
    into its store key (``dispatch.HEADERS``): an edited one builds a new filter rather than
    loading the stored one (``gemm.h`` was missing)."""
    hashed = {os.path.basename(h) for h in dispatch.HEADERS}
    todo, seen = [dispatch.SOURCE], set()
    while todo:
        with open(todo.pop()) as f:
            for name in re.findall(r'#include "accel/([^"]+)"', f.read()):
                if name not in seen:
                    seen.add(name)
                    todo.append(os.path.join(os.path.dirname(dispatch.SOURCE), name))
    assert seen and seen <= hashed, seen - hashed


def test_plain_calls_skip_the_mode(seen):
    a, b = torch.randn(16, 8), torch.randn(8, 4)
    table, idx = torch.randn(10, 3), torch.tensor([1, 2])
    with accel.eager():
        fast0 = dispatch.counts()[0]
        y = a @ b
        e = torch.embedding(table, idx)
        fast1 = dispatch.counts()[0]
    assert fast1 - fast0 == 2
    assert torch.ops.aten.mm.default not in seen
    assert torch.ops.aten.embedding.default not in seen
    close(y, a @ b)
    assert e.shape == (2, 3)


def test_a_pending_region_is_flushed_before_a_plain_call(seen):
    x, w = torch.randn(32, 16), torch.randn(16, 8)
    with accel.eager():
        y = torch.sin(x) * 2
        assert len(_state.region.calls) == 2
        fast0 = dispatch.counts()[0]
        z = y @ w  # reads y: the filter flushes the region first, then runs it past the mode
        assert len(_state.region.calls) == 0
        assert dispatch.counts()[0] == fast0 + 1
    assert torch.ops.aten.mm.default not in seen
    close(z, (torch.sin(x) * 2) @ w)


def test_an_error_in_the_filters_flush_propagates(monkeypatch):
    """A flush that fails inside the filter raises the flush's own Python exception at the
    call, as it does on the mode's path."""
    def fail(region):
        raise ValueError("accel test: this flush fails")

    x = torch.randn(8, 8)
    with accel.eager():
        y = torch.sin(x)
        monkeypatch.setattr(interceptor, "execute", fail)
        with pytest.raises(ValueError, match="this flush fails"):
            y @ x
        monkeypatch.undo()
        z = torch.cos(x) @ x
    close(z, torch.cos(x) @ x)


def _recorded():
    return dispatch.counts()[2]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_repeated_calls_are_recorded_by_the_filter(device, seen):
    """A call recorded before from the same trie node is recorded again by the filter, in
    C++, without reaching the mode; runtime scalars (positional, keyword, wrapped Python
    numbers), constants the key holds by value, defaults and argument wiring as the
    interceptor keys them. Every result is eager's."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    i = torch.arange(-6, 6, dtype=torch.int64, device=device)

    def program(x, y, s, k, e, same, alpha):
        u = torch.sin(x) * s  # a runtime scalar
        v = torch.pow(u, e)  # an exponent: a constant, keyed by value
        w = torch.add(v, y, alpha=alpha) if alpha is not None else torch.add(v, y)
        p = x * x if same else x * y  # one input twice, or two
        q = (i + k) * 3  # int: 0 is a constant, others runtime scalars
        return (w + p).sum(-1), torch.nn.functional.gelu(w, approximate="tanh"), q

    cases = [(0.5, 3, 2.0, True, None), (0.5, 3, 2.0, True, None), (-1.5, 0, 3.0, False, 2),
             (2.0, -4, 2.0, True, 2), (0.25, 3, 3.0, False, None), (2.0, 5, 2.0, False, 0.5),
             (-1.0, 0, 3.0, True, 2)]
    want = [program(a, b, *c) for c in cases]
    got = []
    with accel.eager():
        for c in cases:
            got.append(program(a, b, *c))
            accel.flush()
    for g, w, c in zip(got, want, cases):
        close(g, w, msg=str(c))
    seen.clear()
    with accel.eager():
        r0 = _recorded()
        again = program(a, b, *cases[0])
    assert _recorded() - r0 >= 8  # every deferred call
    assert not any(f in dispatch_ops() for f in seen), seen
    close(again, want[0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_first_call_recorded_by_the_filter_launches_ahead(device, seen, monkeypatch):
    """A region's first call recorded by the filter launches the region's kernel ahead as
    the mode's path would (``ACCEL_LAUNCH_AHEAD=all`` for the CPU): the mode sees none of
    the calls, the kernels launched ahead are kept, and results are eager's, also when the
    region then ends otherwise than predicted."""
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD", "all")
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", "0")  # small tensors too
    x = torch.randn(64, 32, device=device)

    def f(x, more):
        y = torch.softmax(x * 0.125, -1)
        return y * 2.0 if more else y

    with accel.eager():
        for more in (True, False, False, False, False):  # learnt by the filter, then predicted
            y = f(x, more)  # alive at the flush, as below (the liveness mask is predicted too)
            accel.flush()
        seen.clear()
        s0 = accel.stats()
        got = []
        for more in (False, False, True, False):
            got.append(f(x, more))
            accel.flush()
        s1 = accel.stats()
    assert not any(f in dispatch_ops() for f in seen), seen
    for g, more in zip(got, (False, False, True, False)):
        close(g, torch.softmax(x * 0.125, -1) * (2.0 if more else 1.0))
    assert s1["speculative_launches"] - s0["speculative_launches"] >= 3
    assert s1["speculative_hits"] - s0["speculative_hits"] >= 2
    assert s1["speculative_misses"] - s0["speculative_misses"] >= 1


def dispatch_ops():
    from accel.ops import fusible_ops

    return fusible_ops()


def test_the_filter_records_only_what_the_mode_would(seen):
    """Where the interceptor would not defer a call (an input that is a view of a pending
    output, a tensor subclass, a dtype it does not take), the filter's recording leaves it
    to the mode, whose results are eager's."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = torch.randn(6, 6)
    xi = torch.randint(-3, 3, (6, 6), dtype=torch.int16)
    for _ in range(2):
        with accel.eager():
            y = torch.exp(x)
            z = y.diagonal() * 2  # reads a view of a pending output the region cannot: flush
            c = torch.abs(xi) + 1  # int16: eager
            t = TwoTensor(torch.sin(x), torch.cos(x)) + 1
        close(z, torch.exp(x).diagonal() * 2)
        assert c.dtype == torch.int16 and torch.equal(c, torch.abs(xi) + 1)
        assert isinstance(t, TwoTensor)
        close(t.a, torch.sin(x) + 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_calls_reading_views_of_pending_outputs_are_recorded_by_the_filter(device, seen):
    """A call reading a slice, a chunk or a transpose of a pending output (at an offset:
    accel.ops.pending_view) is keyed by the view's offset, sizes and strides and, from its
    second step, recorded in C++ without reaching the mode; one reading a diagonal (which
    the region cannot read through) reaches the mode every time, which flushes first.
    Every result is eager's."""
    x = torch.randn(16, 24, device=device)

    def program(x):
        y = x * 2 + 1
        d = y[:, 1:] - y[:, :-1]  # views at offsets 1 and 0
        a, b = y.chunk(2, -1)
        t = torch.sin(y.t()[3:]) * a.sum(-1)  # a transposed slice; a chunk
        return d, torch.exp(b) * 2, t

    def steps(n):
        out = []
        for _ in range(n):
            with accel.eager():
                out.append(program(x))
        return out

    steps(2)
    seen.clear()
    got = steps(2)
    assert not any(f in dispatch_ops() for f in seen), seen
    for g in got:
        for a, b in zip(g, program(x)):
            close(a, b)
    with accel.eager():
        y = x * 2
        z = y.diagonal() + 1
    assert torch.ops.aten.add.Tensor in seen
    close(z, (x * 2).diagonal() + 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_cat_and_stack_calls_are_recorded_by_the_filter(device, seen):
    """A ``cat`` or ``stack`` the mode records as ``accel.cat`` (of pending values, of
    inputs, of chunks of either; a rotary embedding's ``rotate_half``; one input twice) is
    keyed by ``accel.cat``'s arguments in C++ (stack's unsqueezed views among them) and,
    from its second step, recorded there without reaching the mode; gradients flow through
    it. A ``cat`` the mode does not take (one tensor) reaches it every time. Every result
    is eager's."""
    x = torch.randn(6, 8, device=device, requires_grad=True)
    c = torch.randn(6, 8, device=device)

    def program(x):
        y = x * 2 + 1
        x1, x2 = y.chunk(2, -1)
        r = y * c + torch.cat([-x2, x1], -1) * 3  # rotate_half
        s = torch.stack([c, y, c], -1) + 1  # an input twice, a pending value between
        t = torch.cat([y, c], 0).sin()
        return r, s, t, torch.stack([x, c], 0) * 2

    def steps(n):
        out = []
        for _ in range(n):
            with accel.eager():
                res = program(x)
                (g,) = torch.autograd.grad(sum(o.sum() for o in res), x)
            out.append((*res, g))
        return out

    steps(2)
    seen.clear()
    got = steps(2)
    assert torch.ops.aten.cat.default not in seen and torch.ops.aten.stack.default not in seen, seen
    want = program(x)
    want = (*want, torch.autograd.grad(sum(o.sum() for o in want), x)[0])
    for g in got:
        for a, b in zip(g, want):
            close(a, b)
    seen.clear()
    with accel.eager():
        z = torch.cat([x * 2], 0) + 1
    assert torch.ops.aten.cat.default in seen
    close(z, x * 2 + 1)


def test_views_of_pending_outputs_stay_views(seen):
    x = torch.randn(8, 6)
    with accel.eager():
        y = torch.exp(x) + 1
        v = y.t()[1:]  # views pass by while the region is pending, not flushing it
        assert len(_state.region.calls) == 2
        z = v * 3
    assert torch.ops.aten.t.default not in seen
    close(v, (torch.exp(x) + 1).t()[1:])
    close(z, (torch.exp(x) + 1).t()[1:] * 3)


def test_composite_ops_still_decompose_into_deferred_calls():
    x, r = torch.randn(16, 32), torch.randn(16, 32)
    ln = torch.nn.LayerNorm(32)
    with accel.eager():
        y = ln(x + r)  # layer_norm (CompositeImplicitAutograd) -> native_layer_norm, deferred
        names = [str(c[0]) for c in _state.region.calls]
    assert "aten.native_layer_norm.default" in names, names
    close(y, ln(x + r))


class Log(TorchDispatchMode):
    """Records every aten call it sees."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_a_mode_above_accel_sees_every_call():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with accel.eager():
        with Log() as log:
            y = (a @ b).t()
    assert torch.ops.aten.mm.default in log.calls
    assert torch.ops.aten.t.default in log.calls
    close(y, (a @ b).t())


def test_fake_tensor_mode_inside_accel():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with accel.eager():
        with FakeTensorMode():
            e = torch.empty(3, 4)
            y = e @ torch.ones(4, 2)
    assert isinstance(e, FakeTensor) and isinstance(y, FakeTensor)
    assert y.shape == (3, 2)


def test_tensor_subclass_arguments_reach_their_dispatch():
    from torch.testing._internal.two_tensor import TwoTensor

    a = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))
    b = torch.randn(4, 4)
    with accel.eager():
        y = a @ b
    assert isinstance(y, TwoTensor)
    close(y.a, a.a @ b)
    close(y.b, a.b @ b)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_run_eagerly():
    """A nested tensor's layout is strided, but it has no sizes: the filter's key must not
    ask for them (it raised out of the program), and the call runs eagerly."""
    parts = [torch.randn(3, 4), torch.randn(5, 4)]
    nt = torch.nested.nested_tensor(parts)
    for _ in range(2):
        with accel.eager():
            y = (nt * 2).relu() + 1
            z = torch.exp(parts[0]) * 2  # and a region after it, as usual
        for got, p in zip(y.unbind(), parts):
            close(got, (p * 2).relu() + 1)
        close(z, torch.exp(parts[0]) * 2)


def test_the_hottest_ops_have_unboxed_kernels(seen):
    """Views, factories, matmuls, composite and deferrable ops have their own kernels on the
    filter's key (an op outside the list keeps the boxed fallback); they run past the mode,
    pass calls on to it and record as the fallback does."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert dispatch.unboxed() > 50
    for name in ("aten::view", "aten::mm", "aten::reshape", "aten::mul.Tensor"):
        assert has(name, "TESTING_ONLY_GenericMode"), name
    assert not has("aten::sin", "TESTING_ONLY_GenericMode")
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    with accel.eager():
        for _ in range(3):
            past0, on0, rec0, _ = dispatch.counts()
            y = (torch.sin(x) * 2).view(16, 8).t() @ w[:16]  # mul recorded, view past the mode
            past1, on1, rec1, _ = dispatch.counts()
    assert past1 - past0 == 4  # view, t, slice, mm
    assert rec1 - rec0 == 2  # sin (the fallback) and mul (unboxed), recorded in C++ in the third step
    assert torch.ops.aten.view.default not in seen
    close(y, (torch.sin(x) * 2).view(16, 8).t() @ w[:16])


def test_with_nothing_deferrable_every_call_runs_past_the_mode(seen):
    """dispatch.set_deferrable([]) (what bench/step_phases.py --nothing-deferred measures):
    the filter runs fusible calls past the mode, eagerly, recording nothing; given
    fusible_ops() again it records them again."""
    from accel.ops import fusible_ops

    x, w = torch.randn(8, 16), torch.randn(16, 4)
    dispatch.set_deferrable([])
    try:
        with accel.eager():
            past0, _, rec0, _ = dispatch.counts()
            y = (torch.sin(x) * 2) @ w
            past1, _, rec1, _ = dispatch.counts()
            assert not _state.region.calls
    finally:
        dispatch.set_deferrable(fusible_ops())
    assert past1 - past0 == 3 and rec1 == rec0  # sin (boxed), mul (unboxed), mm
    assert torch.ops.aten.sin.default not in seen and torch.ops.aten.mul.Tensor not in seen
    close(y, (torch.sin(x) * 2) @ w)
    with accel.eager():
        z = torch.sin(x) * 2
        assert len(_state.region.calls) == 2
    close(z, torch.sin(x) * 2)


def test_subclass_tensors_in_lists_and_optionals_reach_their_dispatch():
    """A tensor subclass inside a list (``cat``, ``index.Tensor``'s indices) or an optional
    argument (``layer_norm``'s weight) of an op with an unboxed kernel: its own dispatch."""
    from torch.testing._internal.two_tensor import TwoTensor

    a = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))
    b = torch.randn(4, 4)
    i = TwoTensor(torch.tensor([0, 2]), torch.tensor([1, 3]))
    g = TwoTensor(torch.ones(4), torch.full((4,), 2.0))
    with accel.eager():
        c = torch.cat([b, a])
        d = b[i]
        e = torch.nn.functional.layer_norm(b, (4,), g)
    assert isinstance(c, TwoTensor) and isinstance(d, TwoTensor) and isinstance(e, TwoTensor)
    close(c.b, torch.cat([b, a.b]))
    close(d.b, b[i.b])
    close(e.b, torch.nn.functional.layer_norm(b, (4,), g.b))


def test_functorch_transforms_inside_accel():
    """vmap and grad (functorch's mode keys sit below the filter's): eager's results."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 8), torch.randn(8, 3)

    def f(v):
        return (torch.sin(v) @ w).tanh().sum()

    def run():
        return (torch.vmap(lambda v: torch.sin(v) @ w)(x), torch.func.grad(f)(x[0]),
                torch.func.vmap(torch.func.grad(f))(x))

    want = run()
    with accel.eager():
        fast0 = dispatch.counts()[0]
        got = run()
        assert dispatch.counts()[0] > fast0
    close(got, want)


def test_calls_made_above_autograd_reach_the_mode():
    """Where more than autograd's generated kernel runs between the filter and the
    recording of a deferred call, or that kernel computes from the call's output, the calls
    made there reach the mode (the Python key stays): an op that decomposes above autograd
    (``var_mean.dim``), autocast casting a pending output, forward-mode AD computing a
    tangent from a pending output, step after step (once the filter records them): eager's
    results."""
    import torch.autograd.forward_ad as fwAD

    x, tangent = torch.randn(16, 48), torch.randn(16, 48)

    def run():
        out = [torch.var_mean(x * 3, 1)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.append(torch.prod((x * 0.5).bfloat16() + 1, 1))  # prod: autocast's float32 list
        with fwAD.dual_level():
            y = torch.tanh(fwAD.make_dual(x, tangent) * 0.5).mul(2)  # tanh's tangent reads tanh
            out.extend(t.clone() for t in fwAD.unpack_dual(y))
        return out

    want = run()
    with accel.eager():
        for _ in range(4):
            close(run(), want)


def test_calls_inside_a_passed_call_run_eagerly():
    """An op the filter passes runs with the mode's keys excluded, as inside the mode's
    ``__torch_dispatch__``: what its kernel computes is not deferred (here the kernel reads
    the memory of an intermediate directly, which a deferred output would leave unwritten)."""
    lib = torch.library.Library("accel_test_dispatch", "DEF")
    lib.define("plus_one_sum(Tensor x) -> Tensor")

    def plus_one_sum(x):
        y = x + 1  # deferred, were the mode to see it
        raw = (ctypes.c_float * y.numel()).from_address(torch._C.TensorBase.data_ptr(y))
        return torch.tensor(float(sum(raw)))

    lib.impl("plus_one_sum", plus_one_sum, "CPU")
    x = torch.arange(6, dtype=torch.float32)
    with accel.eager():
        fast0 = dispatch.counts()[0]
        s = torch.ops.accel_test_dispatch.plus_one_sum(x)
        assert dispatch.counts()[0] > fast0
    assert s.item() == 21.0


def test_the_key_is_only_included_inside_accel():
    x = torch.randn(4, 4)
    with accel.eager():
        with accel.eager():
            pass
        before = dispatch.counts()
        x @ x  # still filtered after the inner context's exit
        assert dispatch.counts()[0] == before[0] + 1
    after = dispatch.counts()
    x @ x
    assert dispatch.counts() == after


def test_the_filter_loaded_in_the_flush_leaving_the_last_block(monkeypatch):
    """The filter's background build can be found done at any flush, the one that leaving
    the outermost ``accel.eager()`` makes included: the filter is then turned on for a
    thread whose mode is already off its stack. That raised IndexError out of the with
    statement (in a user's first process, once the build had finished; found by the
    explore profile of tests/test_chains.py). The block exits, its results are eager's, and
    the key is off outside it."""
    x = torch.randn(64)
    with accel.eager():
        y = x.sin() * 2  # pending when the block exits
        # as if this thread had not seen the filter yet, its build still in flight
        dispatch.set_included(False)
        _state.filtered = False
        _state.region.set_replay(False, 0)
        monkeypatch.setattr(dispatch, "building", True)
    close(y, x.sin() * 2)
    assert not _state.filtered
    after = dispatch.counts()
    x @ x
    assert dispatch.counts() == after


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_training_step_gradients_match(device, seen):
    """Forward and backward (on CUDA, on autograd's device thread, which inherits the
    filter's key and binds its own region) give eager's gradients, step after step, and
    most calls never reach the mode (on CPU, where backward runs on the calling thread);
    the filter records calls on both threads (the pure-Python core: gradients only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).to(device)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16, device=device)
    with Log() as log:  # the step's aten calls, counted
        twin(x).square().mean().backward()
    twin.zero_grad(set_to_none=True)
    for step in range(3):  # the first teaches the filter the step's calls; it records them after
        seen.clear()
        model.zero_grad(set_to_none=True)
        r0, main0 = dispatch.recorded(), dispatch.counts()[2]
        with accel.eager():
            model(x).square().mean().backward()
        recorded, on_main = dispatch.recorded() - r0, dispatch.counts()[2] - main0
        twin.zero_grad(set_to_none=True)
        twin(x).square().mean().backward()
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            close(p.grad, q.grad, msg=f"step {step}: {n}")
    from accel.region import native

    if native.__name__.endswith("_core_py"):  # the twin's regions have no view to record into
        return
    assert on_main > 0
    if device == "cuda":  # backward's calls, on autograd's device thread
        assert recorded > on_main
    if device == "cpu":
        assert len(seen) < len(log.calls) / 4, (len(seen), len(log.calls))


def test_nll_loss_with_a_region_pending_reaches_the_mode(seen):
    """``nll_loss_forward`` is no deferrable op, but the mode must see it while a region is
    pending (``accel.ops.MODE_OPS``: it reads a pending log-softmax without flushing it,
    ``accel.interceptor._nll_of_log_softmax``): the filter sends it there, where it would
    have flushed the region and run it past the mode. The loss is eager's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 50, generator=g)
    t = torch.randint(0, 50, (16,), generator=g)
    with torch.no_grad():
        for _ in range(3):
            with accel.eager():
                loss = torch.nn.functional.cross_entropy(x, t)
            close(loss, torch.nn.functional.cross_entropy(x, t))
    assert seen.count(torch.ops.aten.nll_loss_forward.default) == 3, seen


def _run(code, env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=e, timeout=300)


CHECK = """
import torch, accel
from accel import dispatch
x = torch.randn(32, 32)
with accel.eager():
    y = torch.sin(x) @ x
    z = torch.relu(y) + 1
torch.testing.assert_close(z, torch.relu(torch.sin(x) @ x) + 1)
print("loaded", dispatch.wait(60), "off", dispatch.off_reason())
"""


def test_turned_off_by_the_environment(tmp_path):
    r = _run(CHECK, {"ACCEL_DISPATCH_FILTER": "0", "ACCEL_CACHE_DIR": str(tmp_path / "s")})
    assert r.returncode == 0, r.stderr
    assert "loaded False off ACCEL_DISPATCH_FILTER=0" in r.stdout


def test_cross_entropy_on_the_modes_path_alone(tmp_path):
    """With the filter off, the mode alone runs ``F.cross_entropy``'s ``nll_loss`` of a
    pending log-softmax as eager's on the logits plus deferred row statistics, as with it."""
    code = """
    import torch, accel
    from accel import interceptor
    fused = []
    original = interceptor._nll_of_log_softmax
    interceptor._nll_of_log_softmax = lambda *a: fused.append(original(*a)) or fused[-1]
    x, t = torch.randn(32, 300), torch.randint(0, 300, (32,))
    with torch.no_grad():
        with accel.eager():
            loss = torch.nn.functional.cross_entropy(x, t, reduction="sum")
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(x, t, reduction="sum"))
    print("fused", [f is not None for f in fused])
    """
    r = _run(code, {"ACCEL_DISPATCH_FILTER": "0", "ACCEL_CACHE_DIR": str(tmp_path / "s")})
    assert r.returncode == 0, r.stderr
    assert "fused [True]" in r.stdout, r.stdout


def test_a_failed_build_leaves_the_mode_path(tmp_path):
    """A compiler that fails: one warning, a negative entry, every result right."""
    r = _run(CHECK, {"ACCEL_CXX": "false", "ACCEL_CACHE_DIR": str(tmp_path / "s")})
    assert r.returncode == 0, r.stderr
    assert "loaded False" in r.stdout
    assert r.stderr.count("no dispatch filter") == 1, r.stderr


def test_a_build_that_times_out_is_tried_again_by_the_next_process(tmp_path):
    """The filter's build runs at the lowest priority, so a busy machine can keep it past
    its timeout (5 times ``ACCEL_COMPILE_TIMEOUT``): that process keeps the mode's path (one warning, every
    result right) and stores nothing, so the next process builds it again (here its
    compiler fails at once: a negative entry, which a third process reads)."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\ncase \"$*\" in *accel_dispatch_filter*)\n  echo run >> {calls}\n"
                   f"  [ -e {tmp_path / 'fast'} ] || sleep 30;;\nesac\nexit 1\n")
    cxx.chmod(0o755)
    env = {"ACCEL_CXX": str(cxx), "ACCEL_CACHE_DIR": str(tmp_path / "s"), "ACCEL_COMPILE_TIMEOUT": "1"}
    r = _run(CHECK, env)
    assert r.returncode == 0, r.stderr
    assert "loaded False" in r.stdout and r.stderr.count("no dispatch filter") == 1, r.stderr
    assert "timed out" in r.stderr
    (tmp_path / "fast").touch()
    for _ in range(2):
        r = _run(CHECK, env)
        assert r.returncode == 0, r.stderr
        assert "loaded False" in r.stdout and r.stderr.count("no dispatch filter (BuildError") == 1
    assert calls.read_text().count("run") == 2


def test_a_compile_that_times_out_is_killed_with_its_children(tmp_path, monkeypatch):
    """The timeout kills the compiler's whole process group: g++'s cc1plus (here the
    script's ``sleep``) outlived a killed g++, and on a loaded machine such orphans, 1.4
    GB each while they built the filter, piled up until memory ran out."""
    from accel import build

    pid_file = tmp_path / "child"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("ACCEL_COMPILE_TIMEOUT", "1")
    with pytest.raises(build.BuildTimeout):
        build._run(str(cxx), "", "a.cpp", "a.so", lambda src, lib: [str(cxx), src])
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")


def test_a_program_that_ends_first_leaves_the_build_running(tmp_path):
    """A fresh store: the program ends while the filter's build still runs (a compiler that
    waits here for a file when it builds the filter, and then fails), without waiting for
    it; the build goes on apart and stores its outcome (a negative entry), which the next
    process reads instead of building again."""
    calls, go = tmp_path / "calls", tmp_path / "go"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\ncase \"$*\" in *accel_dispatch_filter*)\n  echo run >> {calls}\n"
                   f"  while [ ! -e {go} ]; do sleep 0.05; done;;\nesac\nexit 1\n")  # regions: eager
    cxx.chmod(0o755)
    env = {"ACCEL_CXX": str(cxx), "ACCEL_CACHE_DIR": str(tmp_path / "s"),
           "ACCEL_COMPILE_TIMEOUT": "600"}  # longer than _run waits for the program
    first = CHECK.replace('print("loaded", dispatch.wait(60)', 'print("loaded", dispatch.loaded()')
    try:
        r = _run(first, env)
        assert r.returncode == 0, r.stderr
        assert "loaded False off None" in r.stdout and "no dispatch filter" not in r.stderr
        deadline = time.monotonic() + 120
        while not calls.exists():  # the build process, left running, reaches the compiler
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        go.touch()
    r = _run(CHECK, env)  # waits for the build (under the store's lock), then reads its entry
    assert r.returncode == 0, r.stderr
    assert "loaded False" in r.stdout and r.stderr.count("no dispatch filter") == 1, r.stderr
    assert calls.read_text().count("run") == 1


def _autogroups() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1" and os.path.exists("/proc/self/autogroup")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling classes")
def test_the_build_process_runs_at_the_lowest_priority(tmp_path):
    """The filter's build process, and the compiler it runs, take only CPU time the program
    leaves idle: SCHED_IDLE, and where Linux groups processes by session (autogroups) the
    build's own session at nice 19, which otherwise competes with the program's session
    as an equal whatever the build's own priority (the compiler here reports both, then
    fails: a negative entry, as any failed build)."""
    seen = tmp_path / "seen"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\ncase \"$*\" in *accel_dispatch_filter*)\n"
                   f"  grep '^policy' /proc/$$/sched >> {seen}\n"
                   f"  cat /proc/$$/autogroup >> {seen} 2>/dev/null;;\nesac\nexit 1\n")
    cxx.chmod(0o755)
    r = _run(CHECK, {"ACCEL_CXX": str(cxx), "ACCEL_CACHE_DIR": str(tmp_path / "s")})
    assert r.returncode == 0, r.stderr
    assert "loaded False" in r.stdout and r.stderr.count("no dispatch filter") == 1, r.stderr
    text = seen.read_text()
    assert re.search(r"^policy\s*:\s*5$", text, re.M), text  # SCHED_IDLE
    if _autogroups():
        assert re.search(r"^/autogroup-\d+ nice 19$", text, re.M), text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling classes")
def test_lowering_priority_leaves_the_callers_session_alone():
    """Called in a process that does not lead its own session, the priority change is
    that process's alone: its session's autogroup (the program's, a shell's) keeps its
    nice value."""
    code = """
    import os
    from accel.dispatch import _lower_priority
    before = open("/proc/self/autogroup").read() if os.path.exists("/proc/self/autogroup") else ""
    _lower_priority()
    after = open("/proc/self/autogroup").read() if os.path.exists("/proc/self/autogroup") else ""
    print(os.sched_getscheduler(0) == os.SCHED_IDLE, before == after, os.getsid(0) == os.getpid())
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "False"], r.stdout


def test_an_in_memory_store_builds_it_on_a_thread(tmp_path):
    """An unusable cache directory (a file): the store is in memory, which no other
    process can fill, so the filter is built on one of accel's build threads instead of
    a process of its own (here its compiler fails: one warning, every result right)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    r = _run(CHECK, {"ACCEL_CXX": "false", "ACCEL_CACHE_DIR": str(not_a_dir)})
    assert r.returncode == 0, r.stderr
    assert "in-memory store" in r.stderr and "loaded False" in r.stdout
    # the compiler's own failure, as the build thread met it (a process of its own would
    # have had no store to put it in)
    assert r.stderr.count("no dispatch filter (BuildError: false failed") == 1, r.stderr


def test_a_new_process_loads_it_from_the_store():
    """The session's store holds the filter (conftest waited for it): a new process loads
    it at its first enable, with no build and no wait."""
    code = CHECK.replace('print("loaded"', 'assert dispatch.active()\nprint("loaded"')
    r = _run(code, {})
    assert r.returncode == 0 and "loaded True" in r.stdout, r.stderr


_PREFETCHED = """
import torch, accel
from accel import dispatch, runtime
from accel.store import Store
thread = dispatch._prefetch
print("thread", thread is not None)
thread.join()
pre = dispatch._prefetched
print("found", pre[0].location == Store.settings()[0] and pre[2] is not None and not pre[2].negative)
"""
# the keys the first enable looks up in the store (the filter's: looked up again)
_COUNT_GETS = """
gets = []
get = Store.get
Store.get = lambda self, key, *a, **k: gets.append(key) or get(self, key, *a, **k)
"""
_LOOKED_UP = ('print("filter looked up again", dispatch.store_key() in gets)\n'
              'print("adopted", runtime.get_store() is pre[0])\n')


def test_import_finds_the_filter_in_the_background():
    """``import accel`` (torch imported first) opens the session's store and finds the
    filter in it on a thread of its own; the first enable makes that store the process's
    and only registers the filter."""
    r = _run(_PREFETCHED + _COUNT_GETS + CHECK.replace("import torch, accel\n", "") + _LOOKED_UP, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["thread True", "found True"], r.stdout
    assert "loaded True" in r.stdout and "filter looked up again False" in r.stdout, r.stdout
    assert "adopted True" in r.stdout, r.stdout


_FALLBACKS = """
def fallbacks():
    table = torch._C._dispatch_dump_table("aten::sin").splitlines()
    return sorted(l.split(":")[0] for l in table if "backend fallback" in l and "accel" in l)
"""


def test_import_registers_the_fallbacks_in_the_background():
    """The import's thread also registers the filter's two boxed fallbacks (most of the
    registration's time): before the first enable they are in the dispatcher's tables, the
    library not yet loaded; the first enable loads it, and results are right."""
    code = ("import torch\n" + _FALLBACKS + "print('before', fallbacks())\n" + _PREFETCHED
            + "print('after', fallbacks(), dispatch._lib is None)\n"
            + CHECK.replace("import torch, accel\n", ""))
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "before []" in r.stdout, r.stdout
    assert "after ['Fake', 'TESTING_ONLY_GenericMode'] True" in r.stdout, r.stdout
    assert "loaded True" in r.stdout, r.stdout


def test_calls_while_the_fallbacks_are_registered_are_right():
    """The program's calls go on while the import's thread registers the fallbacks (it
    writes only their keys' entries of the dispatch tables, keys no call carries before an
    enable): every result meanwhile is eager's, bit for bit, and so is every result under
    accel after it. (A fork meanwhile waits for the registration to end:
    test_a_fork_during_the_prefetch_loads_the_filter_in_the_child forks then.)"""
    code = """
import torch
x = torch.randn(64, 64)
def program():
    return [torch.sin(x) @ x, torch.relu(x) + 1, x.sum(0), torch.cat([x, x]).view(-1)[:7], x.t().contiguous()]
want = program()
import accel
from accel import dispatch
thread, n, during = dispatch._prefetch, 0, 0
while n < 200 or thread.is_alive():
    during += thread.is_alive()
    for a, b in zip(program(), want):
        assert torch.equal(a, b)
    n += 1
with accel.eager():
    got = [program() for _ in range(3)]
for g in got:
    for a, b in zip(g, want):
        torch.testing.assert_close(a, b)
print("ok", dispatch.wait(60), "during", during > 0)
"""
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "ok True during" in r.stdout, (r.stdout, r.stderr)  # (during: True here)


def test_a_store_set_up_after_the_import_is_the_one_used():
    """A program that changes the store's settings after ``import accel`` (here its size
    limit) gets a store opened with them: the prefetched one is left, and the first enable
    looks the filter up in its own."""
    code = (_PREFETCHED + "import os\nos.environ['ACCEL_CACHE_SIZE_MB'] = '4321'\n" + _COUNT_GETS
            + CHECK.replace("import torch, accel\n", "") + _LOOKED_UP
            + "print('limit', runtime.get_store().size_limit_bytes >> 20)\n")
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "loaded True" in r.stdout and "filter looked up again True" in r.stdout, r.stdout
    assert "adopted False" in r.stdout and "limit 4321" in r.stdout, r.stdout


def test_a_new_store_after_the_import_gets_the_prefetched_filter(tmp_path):
    """A program that names a fresh store after ``import accel`` (as bench_cpu.py does for
    its cold start): the library whose fallbacks the import's thread registered is the
    one loaded (another could not register them), at once and without a build, and it
    is put into the new store for the program's next processes."""
    where = tmp_path / "fresh"
    code = (_PREFETCHED + f"import os\nos.environ['ACCEL_CACHE_DIR'] = {str(where)!r}\n"
            + CHECK.replace("import torch, accel\n", "")
            + "print('building', dispatch.building, 'stored', Store().get(dispatch.store_key()) is not None)\n")
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "loaded True off None" in r.stdout, (r.stdout, r.stderr)
    assert "building False stored True" in r.stdout, r.stdout
    assert "dispatch filter" not in r.stderr, r.stderr


def test_the_store_is_adopted_only_where_the_environment_names_it(fresh_store, tmp_path,
                                                                  monkeypatch):
    from accel import runtime
    from accel.store import Store

    assert not runtime.adopt_store(Store(str(tmp_path / "other")))  # another directory
    ahead = Store()  # as the import's prefetch opens it
    monkeypatch.setenv("ACCEL_CACHE_SIZE_MB", "77")
    assert not runtime.adopt_store(ahead)  # the size limit changed since
    monkeypatch.setenv("ACCEL_CACHE_SIZE_MB", "bad")
    assert not runtime.adopt_store(ahead)  # invalid: left to get_store to report
    monkeypatch.delenv("ACCEL_CACHE_SIZE_MB")
    assert runtime.adopt_store(ahead) and runtime.get_store() is ahead
    assert not runtime.adopt_store(Store())  # one is open already


@pytest.mark.parametrize("env", [{"ACCEL_DISPATCH_FILTER": "0"}, {"ACCEL_DISABLE": "1"},
                                 {"ACCEL_DISPATCH_FILTER": "maybe"}])
def test_no_prefetch_where_the_filter_is_off_or_the_setting_invalid(env):
    """Nothing starts at import where the filter is not to be used, or where a setting it
    reads is invalid (which the first enable reports, naming the variable)."""
    code = ("import torch, accel\nfrom accel import dispatch\nprint(dispatch._prefetch)\n"
            "try:\n    accel.enable()\nexcept accel.ConfigError as e:\n    print(e)\n")
    r = _run(code, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("None\n"), r.stdout
    if env.get("ACCEL_DISPATCH_FILTER") == "maybe":
        assert "ACCEL_DISPATCH_FILTER" in r.stdout, r.stdout


def test_import_creates_no_store(tmp_path):
    """Where the store does not exist yet, the import leaves it to the first enable to
    create."""
    where = tmp_path / "s"
    code = ("import os, torch, accel\nfrom accel import dispatch\n"
            "print(dispatch._prefetch, os.path.exists(os.environ['ACCEL_CACHE_DIR']))\n")
    r = _run(code, {"ACCEL_CACHE_DIR": str(where), "ACCEL_CXX": "false"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "False"] and not where.exists(), r.stdout


def test_a_broken_store_at_import_is_reported_by_the_first_enable(tmp_path):
    """A store whose index is not a database: the import says nothing; the first enable
    warns once (as without the prefetch) and every result is right."""
    where = tmp_path / "s"
    (where / "index").mkdir(parents=True, mode=0o700)
    where.chmod(0o700)
    (where / "index" / "cache.db").write_bytes(b"not a database" * 100)
    code = ("import sys, torch, accel\nfrom accel import dispatch\nprint(dispatch._prefetch is not None)\n"
            "dispatch._prefetch.join()\nsys.stderr.write('imported\\n')\nsys.stderr.flush()\n"
            + CHECK.replace("import torch, accel\n", ""))
    r = _run(code, {"ACCEL_CACHE_DIR": str(where), "ACCEL_CXX": "false"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True\n") and "loaded False" in r.stdout, r.stdout
    before, after = r.stderr.split("imported\n")
    assert "accel" not in before and after.count("in-memory store") == 1, r.stderr


_FORK = """
import os, torch, accel
from accel import dispatch
pid = os.fork()
x = torch.randn(32, 32)
with accel.eager():
    z = torch.relu(torch.sin(x) @ x) + 1
try:
    torch.testing.assert_close(z, torch.relu(torch.sin(x) @ x) + 1)
    ok = dispatch.wait(60)
except AssertionError:
    ok = False
if pid == 0:
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("parent", ok, "child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_fork_during_the_prefetch_loads_the_filter_in_the_child():
    """A process forked while the import's thread may still be at work (a DataLoader
    worker, say): the child has no such thread, finds the filter itself where the
    parent's thread had not, and its results are right; so are the parent's (the child
    answers through its exit status: the two share one stdout)."""
    r = _run(_FORK, {})
    assert r.returncode == 0, r.stderr
    assert "parent True child 0" in r.stdout, (r.stdout, r.stderr)


def test_a_failed_recording_takes_the_modes_path():
    """Where the region does not take a call the filter records (here: the recording
    raises), the call takes the mode's path, whose result is eager's; an interrupt
    (KeyboardInterrupt) is raised at the call, as on the mode's path."""
    x = torch.randn(8)

    def program():
        return (torch.sin(x) + 1) * 2

    def failing(*args):
        raise RuntimeError("accel test: this recording fails")

    def interrupted(*args):
        raise KeyboardInterrupt

    with accel.eager():
        for _ in range(2):  # the filter learns the program's calls
            program()
            accel.flush()
        r0 = _recorded()
        try:
            _state.region.set_replay(True, 256, failing)
            y = program()
            accel.flush()
            assert _recorded() == r0
            _state.region.set_replay(True, 256, interrupted)
            with pytest.raises(KeyboardInterrupt):
                program()
        finally:
            interceptor._set_replay(_state, _state.modes[-1])
    close(y, program())


def _helpers():
    """The filter's C++ helpers (include/accel/core_helpers.h) as Python callables,
    and their addresses."""
    lib = dispatch._lib
    addrs = [ctypes.cast(f, ctypes.c_void_p).value
             for f in (lib.accel_empty_strided, lib.accel_liveness, lib.accel_ext_overlap,
                       lib.accel_reuse_blocks)]
    obj = ctypes.py_object
    return (ctypes.PYFUNCTYPE(obj, obj, obj, obj, obj)(addrs[0]), ctypes.PYFUNCTYPE(obj, obj)(addrs[1]),
            addrs)


def test_the_filters_overlap_check_agrees_with_the_twin():
    """``accel_ext_overlap`` (the native core's check, before running a region that writes
    an external input, that the input shares no memory with another) answers as the
    pure-Python twin's ``ext_overlap`` does, and raises on bad arguments."""
    from accel import _core_py

    *_, addrs = _helpers()
    obj = ctypes.py_object
    overlap = ctypes.PYFUNCTYPE(obj, obj, obj)(addrs[2])
    base, other = torch.zeros(4, 8), torch.zeros(8)
    cases = [([base[0], base[1], other], (0,)),  # rows of one storage: shared
             ([base[0], base[1], other], (2,)),  # written alone in its storage
             ([base, base.t()], ()),  # shared, but only read
             ([other, other[2:4]], (1,)),  # a slice inside the written input's storage
             ([torch.empty(0), other], (0,)),  # an empty storage shares nothing
             ([other], (0,))]
    answers = [overlap(ext, written) for ext, written in cases]
    assert answers == [_core_py.ext_overlap(ext, written) for ext, written in cases]
    assert answers == [True, False, False, True, False, False]
    with pytest.raises(TypeError):
        overlap([base, 1.0], (0,))
    with pytest.raises(IndexError):
        overlap([base], (1,))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_saved_outputs_skip_the_mode_and_pack_hooks_read_their_values(device, seen):
    """Autograd saving a recorded call's output (a shallow copy, which with a dispatch mode
    on the stack would be an ``aten::detach`` call into it) does not reach the mode; with
    saved-tensor hooks set, a pack hook that reads the pending output reaches it (the
    region is flushed first) and reads eager's values."""
    x = torch.randn(8, 16, device=device, requires_grad=True)

    def step():
        return torch.tanh(x * 0.5).mul(2).sum()  # tanh's output is saved for backward

    with accel.eager():
        for _ in range(10):  # the first steps teach the filter the calls; it records them after
            seen.clear()
            r0 = dispatch.counts()[2]
            loss = step()
            recorded, forward_calls = dispatch.counts()[2] - r0, list(seen)
            loss.backward()
            if recorded:
                break
    assert recorded >= 2
    assert torch.ops.aten.detach.default not in forward_calls, forward_calls

    def packed(enable):
        copies = []

        def pack(t):
            copies.append(t.detach().clone())  # reads t, or defers a call that does
            return t

        with enable(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
        return copies, loss.detach()

    got, want = packed(accel.eager), packed(contextlib.nullcontext)
    assert len(got[0]) == len(want[0]) >= 1
    close(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_the_filters_liveness_agrees_with_the_core(device, monkeypatch):
    """Which pending outputs a flush must write, as the core computes it with the filter's
    ``accel_liveness`` (used once the filter is loaded) and without: outputs dead, held by
    Python, saved by autograd, viewed; small ones and, on the CPU, output pool blocks
    (held by the pool's storage object alone, or viewed too)."""
    from accel.region import native

    if native.__name__.endswith("_core_py"):
        pytest.skip("the pure-Python core does without the helpers")
    _, liveness, addrs = _helpers()
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")  # pooled outputs too (read at each enable)
    x = torch.randn(512, 1024, device=device)  # 2 MiB: pool-sized on the CPU
    xg = x.clone().requires_grad_()
    try:
        with accel.eager():
            held = []
            for n in (8, 512):
                torch.exp(x[:n] * 1.5)  # dead
                held.append(torch.exp(x[:n] * 2.5))  # held by Python
                held.append(torch.exp(xg[:n] * 3.5).sum())  # exp's result saved by autograd
                held.append(torch.exp(x[:n] * 4.5)[1:])  # viewed
            region = _state.region
            assert len(region.outs) >= 16
            native.set_helpers(addrs[0], 0)
            expected = region.liveness()
            native.set_helpers(*addrs)
            assert region.liveness() == expected
            assert expected.count(True) >= 8 and expected.count(False) >= 4, expected
            fast = liveness(region.outs)
            assert all(f is None or f == e for f, e in zip(fast, expected))
    finally:
        native.set_helpers(*addrs)


@pytest.mark.parametrize("core", ["native", "twin"])
def test_device_empty_strided_matches_torch(core):
    """The cores' ``device_empty_strided`` (outputs allocated for a kernel launched ahead on
    a GPU) gives what ``torch.empty_strided`` gives, through the filter's allocator once it
    is loaded, and raises torch's errors."""
    from accel import _core_py
    from accel.region import native

    assert dispatch.wait(120)
    if core == "native" and native.__name__.endswith("_core_py"):
        pytest.skip("the native core is not built")
    mod = native if core == "native" else _core_py
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = mod.device_empty_strided((3, 5), (1, 3), dtype, device)
            want = torch.empty_strided((3, 5), (1, 3), dtype=dtype, device=device)
            assert (t.shape, t.stride(), t.dtype, t.device) == (want.shape, want.stride(), dtype, want.device)
    with pytest.raises(RuntimeError):  # torch's out-of-memory error
        mod.device_empty_strided((1 << 62,), (1,), torch.uint8, devices[-1])


def test_the_filters_allocator_matches_torch_and_raises_torchs_errors():
    """``accel_empty_strided`` (the native core's output allocation once the filter is
    loaded) gives what ``torch.empty_strided`` gives, and raises as it does."""
    empty_strided, _, _ = _helpers()
    devices = [None] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.float16, torch.int64, torch.bool):
            want = torch.empty_strided((3, 5), (1, 3), dtype=dtype, device=device)
            got = empty_strided((3, 5), (1, 3), dtype, device)
            assert (got.shape, got.stride(), got.dtype, got.device) == (
                want.shape, want.stride(), dtype, want.device)
    with pytest.raises(TypeError):
        empty_strided([3], (1,), torch.float32, None)
    with pytest.raises(ValueError):
        empty_strided((3,), (), torch.float32, None)
    with pytest.raises(RuntimeError):
        empty_strided((-1,), (1,), torch.float32, None)
    with pytest.raises(RuntimeError):  # torch's out-of-memory error
        empty_strided((1 << 62,), (1,), torch.uint8, None)


@pytest.mark.parametrize("core", ["native", "twin"])
def test_filter_include_sets_the_threads_key_and_returns_the_old_state(core):
    """The cores' ``filter_include`` (what ``dispatch.set_included`` calls at every enable
    and disable) includes the filter's key in the calling thread's key set, or not, and
    returns whether it was included, as the library's ``accel_filter_include`` does."""
    from accel import _core_py
    from accel.region import native

    assert dispatch.wait(120)
    if core == "native":
        if native.__name__.endswith("_core_py"):
            pytest.skip("the native core is not built")
        mod = native
    else:
        mod = _core_py
        mod.set_include_fn(ctypes.cast(dispatch._lib.accel_filter_include, ctypes.c_void_p).value)
    lib = dispatch._lib  # the library's own function, the oracle: it returns the old state

    def included():
        on = lib.accel_filter_include(1)
        lib.accel_filter_include(on)
        return bool(on)

    was = included()
    try:
        assert mod.filter_include(True) == was
        assert included()
        assert mod.filter_include(False) is True
        assert not included()
        assert mod.filter_include(False) is False
    finally:
        lib.accel_filter_include(int(was))
    mod.set_include_fn(0)
    try:
        with pytest.raises(RuntimeError, match="not loaded"):
            mod.filter_include(True)
    finally:
        mod.set_include_fn(ctypes.cast(dispatch._lib.accel_filter_include, ctypes.c_void_p).value)


def test_an_engine_thread_records_through_its_worker(backward_case, monkeypatch):
    """On a thread that did not enable accel (as autograd's CUDA device thread, which
    inherits the filter's key and the mode), the filter records a backward pass's calls
    into that thread's region through its worker (``WorkerReplay``: the lock, the final
    callback) once it has seen them; calls outside a backward pass run eagerly; gradients
    are eager's and nothing is left pending, step after step. (That thread calls
    ``backward`` itself, whose hook holds the calling thread's calls eager where CUDA is in
    use, as in a GPU suite's process: a CPU pass here.)"""
    from accel.region import native

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert dispatch.wait(120)
    x, w, f, want = backward_case
    mode = AccelMode()  # owned by this thread
    steps, errors = [], []

    def engine_thread():
        try:
            dispatch.set_included(True)
            for _ in range(4):
                x.grad = w.grad = None
                r0 = dispatch.counts()[2]
                with mode:
                    y = f(x, w).square().sum()
                    y.backward()
                steps.append((dispatch.counts()[2] - r0, x.grad.clone(), w.grad.clone(),
                               len(_state.region.calls)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            dispatch.set_included(False)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert not errors, errors
    for recorded, gx, gw, left in steps:
        close(gx, want[0])
        close(gw, want[1])
        assert left == 0
    if not native.__name__.endswith("_core_py"):  # the twin's regions have no view to record into
        assert steps[-1][0] > 0, [s[0] for s in steps]


# -- small regions: their first call runs eagerly (accel.eager_regions.SMALL_REGION_CALLS) ----
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="no CUDA device"))


@contextlib.contextmanager
def _path(path):
    """Inside accel.eager(): the calls take the dispatch filter's path (as usual) or, with
    its key left out, every call the mode's."""
    if path == "mode":
        dispatch.set_included(False)
    try:
        yield
    finally:
        if path == "mode":
            dispatch.set_included(True)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("path", ["filter", "mode"])
def test_a_small_regions_first_call_runs_eagerly(device, path, monkeypatch):
    """The first flush of a region of a few calls on tiny tensors runs them eagerly, and
    builds no kernel; the call it began with runs eagerly from then on (on the filter's
    path and on the mode's alike): the next call begins the next region, which is small in
    turn. Every result is eager's."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "0")  # the small-region rule alone
    torch.manual_seed(0)
    cols = {"filter": 9, "mode": 10}[path]  # trie nodes of their own (the trie is the process's)
    x, w = torch.randn(4, cols, device=device), torch.randn(cols, 3, device=device)
    accel.reset_stats()
    runs = []
    for i in range(4):
        before = accel.stats()["kernel_runs"]
        with accel.eager(), _path(path):
            y = torch.sin(x) * (i + 1)  # a region of two calls, flushed by the matmul
            z = y @ w
        runs.append(accel.stats()["kernel_runs"] - before)
        close(y, torch.sin(x) * (i + 1))
        close(z, (torch.sin(x) * (i + 1)) @ w)
    # 1: [sin, mul] flushed eagerly, sin then runs eagerly; 2: [mul] alike; 3, 4: eager
    assert runs == [0, 0, 0, 0]
    assert accel.stats()["small_region_calls"] == 2 + 2 + 2 + 2
    assert accel.stats()["compiles"] == 0 and accel.stats()["eager_replays"] == 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_small_regions_of_a_new_stride_each_step_build_nothing(device, fresh_store, monkeypatch):
    """A generation's pattern: a small region over a slice of a growing cache, whose stride
    (so its key) is new at every step. Each is a first flush, run eagerly: no kernel is
    built (each used to be, 64 of a 48-token generation's 79 builds, each run once)."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "0")  # the small-region rule alone
    torch.manual_seed(0)
    cache = torch.randn(2, 1, device=device)
    accel.reset_stats()
    for step in range(12):
        want = (cache[:, -1:] + 1.0) * 0.5
        with accel.eager():
            got = (cache[:, -1:] + 1.0) * 0.5
        close(got, want, rtol=0, atol=0)
        cache = torch.cat([cache, want], dim=1)  # [2, L]: the slice's stride is L
    s = accel.stats()
    assert s["compiles"] == 0 and s["kernel_runs"] == 0 and s["eager_replays"] == 0
    assert s["small_region_calls"] == 2 * 12


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_call_marked_small_before_the_filter_saw_it_runs_past_the_mode(device, seen,
                                                                       monkeypatch):
    """A region whose first call was marked small while the filter did not see the thread's
    calls (its key left out here; in a program, before its build was loaded): the filter
    learns that call's edge when the mode first runs it eagerly, and runs it past the mode
    from then on (it used to pass it to the mode at every step: the GPU demo's step at the
    filter-less path's speed in a process that built the filter)."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "0")  # the small-region rule alone
    torch.manual_seed(0)
    x, w = torch.randn(4, 14, device=device), torch.randn(14, 3, device=device)  # own nodes
    for path in ("mode", "mode", "filter", "filter", "filter"):
        seen.clear()
        with accel.eager(), _path(path):
            y = torch.cos(x) * 3.0  # a small region: cos is marked at its first flush
            z = y @ w
        close(z, (torch.cos(x) * 3.0) @ w)
        cos_at_mode = seen.count(torch.ops.aten.cos.default)
    # the first filter step: cos reaches the mode, which runs it eagerly; the edge is learnt
    assert cos_at_mode == 0 and seen.count(torch.ops.aten.mm.default) == 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_small_regions_need_small_tensors_and_few_calls(device, monkeypatch):
    """A region over the byte limit, or of more calls than the limit, keeps its kernel."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "0")  # the small-region rule alone
    torch.manual_seed(0)
    big = torch.randn(eager_regions.SMALL_REGION_BYTES[device] // 4, device=device)
    tiny = torch.randn(4, 11, device=device)
    programs = {
        "big": lambda s: (torch.sin(big) * s).sum(0, keepdim=True),
        "long": lambda s: torch.cos(torch.sin(tiny) * s).exp().tanh(),
    }
    for name, program in programs.items():
        accel.reset_stats()
        for i in range(3):
            want = program(i + 1.0)
            ones = torch.ones(want.shape[-1], 1, device=device)
            with accel.eager():
                got = program(i + 1.0) @ ones  # the matmul flushes the region
            close(got, want @ ones, msg=name)
        assert accel.stats()["kernel_runs"] == 3, name
        assert accel.stats()["small_region_calls"] == 0, name


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("path", ["filter", "mode"])
def test_small_regions_off_fuses_them_again(device, path, monkeypatch):
    """With ACCEL_EAGER_SMALL_REGIONS=0 every region runs its kernel, those whose first
    call was marked small before included (on the filter's path and the mode's)."""
    torch.manual_seed(0)
    cols = {"filter": 12, "mode": 13}[path]  # trie nodes of their own
    x, w = torch.randn(4, cols, device=device), torch.randn(cols, 2, device=device)

    def program(s):
        return (torch.sin(x) + s) @ w  # a region of two calls, flushed by the matmul

    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "0")  # the small-region rule alone
    for on, want_runs in (("1", [0, 0, 0]), ("0", [1, 1, 1])):
        monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", on)
        runs = []
        for i in range(3):
            before = accel.stats()["kernel_runs"]
            with accel.eager(), _path(path):
                y = program(i + 1.0)
            runs.append(accel.stats()["kernel_runs"] - before)
            close(y, program(i + 1.0))
        assert runs == want_runs, on


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_small_regions_train_as_eager_does(device, monkeypatch, train_as_eager):
    """A small model's training steps with small regions running eagerly (on an engine
    thread too, on a GPU): the loss and every gradient are eager's at every step."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(approximate="tanh"),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 5)).to(device)
    x, t = torch.randn(6, 12, device=device), torch.randint(0, 5, (6,), device=device)
    accel.reset_stats()
    train_as_eager(base, x, t, 4)
    assert accel.stats()["small_region_calls"] > 0


@pytest.mark.parametrize("op", ["mul_", "div_", "pow_", "sin_"])
def test_autograd_clones_a_pending_self_through_the_mode(op):
    """With grad mode on, autograd's kernel of an in-place op clones ``self`` for the
    backward, a call of its own below the filter: a pending ``self`` must reach the mode
    there (a GRU cell's ``(h - n).mul_(z)``: the clone read it unfilled)."""
    def step(x, w):
        h = (x * 2.0).add(1.0)  # pending when the in-place op clones it (positive: pow_)
        z = w.sigmoid() + 0.5
        h = getattr(h, op)(z) if op != "sin_" else h.sin_()
        (h * z).sum().backward()
        return x.grad, w.grad

    def leaves():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(16, 8, generator=g).abs().requires_grad_(),
                torch.randn(16, 8, generator=g).requires_grad_())

    want = step(*leaves())
    with accel.eager():
        for _ in range(3):  # learnt, then recorded by the filter
            close(step(*leaves()), want)


def test_wrapped_numbers_without_data_are_left_to_the_interceptor(monkeypatch):
    """A call's key reads a wrapped number's value; forward AD's tangent of one is a zero
    tensor with no data, and a torch.func transform's wrapper of one has no storage: such
    calls (``dual * 2``, ``vmap(jacfwd(...))``) are the interceptor's, not read (the key
    of a small region's first call raised "its data is not allocated yet")."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import jacfwd, vmap

    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(64, 33, generator=g), torch.randn(64, 33, generator=g)

    def program():
        with fwAD.dual_level():
            y = fwAD.make_dual(x, t).sin() * 2
            primal, tangent = fwAD.unpack_dual(y)
            primal, tangent = primal.clone(), tangent.clone()
        return primal, tangent, vmap(jacfwd(lambda z: z.exp() * 2))(x[:3, :4])

    want = program()
    with accel.eager():
        for _ in range(3):  # small regions decided, then their first calls keyed here
            close(program(), want)
