"""The idle-region rule (accel.eager_regions.IDLE_FLUSHES): on a GPU, regions whose flushes
find the device idle run eagerly, decided call by call; a busy flush keeps them fused.

The rule's GPU probe (``eager_regions.device_idle``) is replaced by a scripted one on the
CPU, where it otherwise never applies; the last test uses a real GPU where there is one."""
import pytest
import torch

import accel
from accel import eager_regions

close = torch.testing.assert_close


@pytest.fixture
def rule(monkeypatch, fresh_store):
    """The rule on (the suite turns small regions, and so it, off), its probe scripted:
    ``rule(answers)`` makes the probe return each answer in turn, then the last one again,
    and returns the list of devices it was asked about. A fresh store: the tests count
    compiles."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "1")

    def script(answers):
        asked = []

        def probe(device):
            asked.append(device)
            return answers[min(len(asked), len(answers)) - 1]

        monkeypatch.setattr(eager_regions, "device_idle", probe)
        return asked

    return script


def _program(cols):
    """Five pointwise calls on a [64, cols] float32 tensor (over the small-region limit),
    flushed by a matmul (of positive terms: eager's rounding, not cancellation, decides its
    error); the region's scalar changes per iteration (a runtime argument)."""
    torch.manual_seed(cols)
    x, w = torch.randn(64, cols), torch.rand(cols, 3)

    def run(s):
        y = torch.tanh(torch.sin(x) * s + 1.0).exp()
        return y, y @ w

    return run


def _run(program, n):
    """``n`` iterations of ``program`` under accel, each result checked against eager's."""
    for i in range(n):
        want = program(i + 1.0)
        with accel.eager():
            got = program(i + 1.0)
        close(got, want)


def _counts():
    s = accel.stats()
    return s["compiles"], s["kernel_runs"], s["eager_replays"], s["small_region_calls"]


def test_idle_regions_run_eagerly_and_build_nothing(rule):
    """Every flush finds the device idle: each region is sampled IDLE_FLUSHES times, run
    eagerly meanwhile, then its first call runs eagerly and the rest starts the next
    region, sampled alike; no kernel is ever built and every result is eager's."""
    asked = rule([True])
    program = _program(513)
    accel.reset_stats()
    n, k = 24, eager_regions.IDLE_FLUSHES
    _run(program, n)
    compiles, runs, replays, eager_calls = _counts()
    assert (compiles, runs) == (0, 0)
    assert replays == len(asked) == 5 * k  # regions of 5, 4, 3, 2 and 1 calls, k flushes each
    # the region's j-th call runs eagerly after (j + 1) * k iterations
    assert eager_calls == sum(n - (j + 1) * k for j in range(5))


def test_a_busy_flush_keeps_the_region_fused(rule):
    """Two idle flushes, then a busy one: the region is built and runs its kernel from
    that flush on, and is never sampled again."""
    asked = rule([True, True, False, True])
    program = _program(514)
    accel.reset_stats()
    _run(program, 8)
    compiles, runs, replays, eager_calls = _counts()
    assert len(asked) == 3
    assert (compiles, runs, replays, eager_calls) == (1, 6, 2, 0)


@pytest.mark.parametrize("how", ["flag off", "too big"])
def test_regions_the_rule_leaves_alone(rule, monkeypatch, how):
    """With ACCEL_EAGER_IDLE_REGIONS=0, or a region of IDLE_REGION_BYTES or more, nothing
    is sampled and the region runs its kernel at every flush."""
    if how == "flag off":
        monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "0")
    else:
        monkeypatch.setattr(eager_regions, "IDLE_REGION_BYTES", 64 << 10)
    asked = rule([True])
    program = _program({"flag off": 515, "too big": 516}[how])
    accel.reset_stats()
    _run(program, 6)
    assert asked == []
    assert _counts() == (1, 6, 0, 0)


def test_idle_regions_train_as_eager_does(rule, train_as_eager):
    """A small model's training steps while every region is found idle: regions run
    eagerly while sampled, then call by call; the loss and every gradient are eager's at
    every step. The only kernels built are small regions' (at their first flush: the
    small-region rule's), and by the last step none runs."""
    rule([True])
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(24, 700), torch.nn.GELU(approximate="tanh"),
                               torch.nn.LayerNorm(700), torch.nn.Linear(700, 5))
    x, t = torch.randn(32, 24), torch.randint(0, 5, (32,))
    accel.reset_stats()
    steps, counts = 6 * eager_regions.IDLE_FLUSHES, []
    train_as_eager(base, x, t, steps, before=lambda step: counts.append(_counts()))
    compiles, runs, replays, eager_calls = _counts()
    assert runs == compiles and replays > 0 and eager_calls > 0
    assert _counts()[:3] == counts[-1][:3]  # the last step: nothing built, run or replayed


def test_the_probe(monkeypatch):
    """The GPU probe: None on a CPU, while a CUDA graph is captured (not queried), and where
    the stream's query raises (a CUDA error of earlier work, which the region's launch then
    reports); the query's answer otherwise."""
    assert eager_regions.device_idle(None) is None
    assert eager_regions.device_idle(torch.device("cpu")) is None

    class Stream:
        def __init__(self, answer):
            self.answer = answer

        def query(self):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    capturing = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    for answer, want in ((True, True), (False, False),
                         (RuntimeError("CUDA error: an illegal memory access"), None)):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None, a=answer: Stream(a))
        assert eager_regions.device_idle(torch.device("cuda", 0)) is want
    capturing = True  # a CUDA graph is being captured: a query would end the capture
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: 1 / 0)
    assert eager_regions.device_idle(torch.device("cuda", 0)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_idle_and_busy_regions_on_cuda(monkeypatch, fresh_store):
    """On a real GPU: a region that always begins with the GPU idle (synchronized before
    each call) ends up running eagerly, call by call (its last calls' regions are small
    ones, built once); one that begins while the GPU sleeps through a long kernel keeps its
    kernel. Every result is eager's."""
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "1")
    monkeypatch.setenv("ACCEL_EAGER_IDLE_REGIONS", "1")
    torch.manual_seed(0)
    n = 8 * eager_regions.IDLE_FLUSHES
    for busy, cols in ((False, 517), (True, 518)):
        x, w = torch.randn(64, cols, device="cuda"), torch.rand(cols, 3, device="cuda")
        accel.reset_stats()
        for i in range(n):
            if i == n - 1:
                last = _counts()
            want = torch.tanh(torch.sin(x) * (i + 1.0) + 1.0).exp() @ w
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(100_000_000)  # cycles: tens of ms on the stream
            with accel.eager():
                got = torch.tanh(torch.sin(x) * (i + 1.0) + 1.0).exp() @ w
            close(got, want)
        compiles, runs, replays, eager_calls = _counts()
        if busy:
            assert (compiles, runs, replays, eager_calls) == (1, n, 0, 0)
        else:
            assert replays > 0 and eager_calls > 0
            assert _counts()[:3] == last[:3]  # the last call: nothing built, run or replayed


def test_regions_run_eagerly_inside_torch_func_transforms(rule):
    """Regions run eagerly (here: sampled by the rule) inside ``torch.func.grad`` and
    ``vmap``: their calls run where the mode recorded them, below the transforms' layers
    (through them, ``grad`` refused the outputs' ``copy_``: "attempted to call in-place
    operation (aten::copy_) that would mutate a captured Tensor")."""
    from torch.func import grad, vmap

    rule([True])
    torch.manual_seed(0)
    x, w = torch.randn(64, 513), torch.randn(513)

    def f(w, x):
        return (torch.tanh(x * w) * 2.0 + 1.0).exp().sum()

    def program():
        return grad(f)(w, x), vmap(f, in_dims=(None, 0))(w, x)

    want = program()
    accel.reset_stats()
    with accel.eager():
        for _ in range(2):
            close(program(), want)
    assert accel.stats()["eager_replays"] > 0
