"""The dispatch filter (accel/dispatch.py, include/accel/dispatch_filter.cpp): which calls it
runs past the interceptor's dispatch mode, and that every other path stays the mode's."""
import copy
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accel
from accel import dispatch
from accel.interceptor import AccelMode, _state

close = torch.testing.assert_close

pytestmark = pytest.mark.skipif(not dispatch.wait(), reason="dispatch filter not built here")


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


def test_plain_calls_skip_the_mode(seen):
    a, b = torch.randn(16, 8), torch.randn(8, 4)
    table, idx = torch.randn(10, 3), torch.tensor([1, 2])
    with accel.eager():
        fast0, _ = dispatch.counts()
        y = a @ b
        e = torch.embedding(table, idx)
        fast1, _ = dispatch.counts()
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
        z = y @ w  # reads y: the mode must flush the region first
        assert len(_state.region.calls) == 0
    assert torch.ops.aten.mm.default in seen
    close(z, (torch.sin(x) * 2) @ w)


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
        fast0, _ = dispatch.counts()
        got = run()
        assert dispatch.counts()[0] > fast0
    close(got, want)


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
        fast0, _ = dispatch.counts()
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_training_step_gradients_match(device, seen):
    """Forward and backward (on CUDA, on autograd's device thread, which inherits the
    filter's key and binds its own region) give eager's gradients, and most calls never
    reach the mode (on CPU, where backward runs on the calling thread)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).to(device)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16, device=device)
    with Log() as log:  # the step's aten calls, counted
        twin(x).square().mean().backward()
    twin.zero_grad(set_to_none=True)
    seen.clear()
    with accel.eager():
        model(x).square().mean().backward()
    twin(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        close(p.grad, q.grad, msg=n)
    if device == "cpu":
        assert len(seen) < len(log.calls) / 2, (len(seen), len(log.calls))


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


def test_a_failed_build_leaves_the_mode_path(tmp_path):
    """A compiler that fails: one warning, a negative entry, every result right."""
    r = _run(CHECK, {"ACCEL_CXX": "false", "ACCEL_CACHE_DIR": str(tmp_path / "s")})
    assert r.returncode == 0, r.stderr
    assert "loaded False" in r.stdout
    assert r.stderr.count("no dispatch filter") == 1, r.stderr


def test_a_new_process_loads_it_from_the_store():
    """The session's store holds the filter (conftest waited for it): a new process loads
    it at its first enable, with no build and no wait."""
    code = CHECK.replace('print("loaded"', 'assert dispatch.active()\nprint("loaded"')
    r = _run(code, {})
    assert r.returncode == 0 and "loaded True" in r.stdout, r.stderr
