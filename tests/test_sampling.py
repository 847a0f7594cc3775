"""Step sampling (accel/sampling.py): a thread's steps timed with and without interception,
and the slower way turned off.

The sampler's decisions are tested with scripted step times; the interceptor's side with a
clock that makes every step without interception faster (or slower), so that what a
program runs does not depend on this machine's speed. Every program's results are compared
with eager's at every step, across the switches.
"""
import contextlib
import copy
import re

import pytest
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import accel
from accel import dispatch, interceptor, runtime, sampling
from devices import DEVICES  # tests/devices.py
from plugin_runs import run_under  # tests/plugin_runs.py

TRIAL_END = sampling.QUIET_STEPS + len(sampling.TRIAL)  # steps to the first trial's verdict
OFF_END = TRIAL_END + len(sampling.TRIAL)  # to interception turned off: a second trial confirms


class _Scripted:
    """A clock whose step takes ``times[intercepted]`` seconds, read ``lag`` takes later."""

    def __init__(self, sampler, times, lag=0):
        self.sampler, self.times, self.lag, self.reads = sampler, times, lag, []

    def start(self):
        pass

    def stop(self):
        pass

    def take(self):
        t = self.times[self.sampler.intercept]
        due = len(self.reads) + self.lag  # readable after ``lag`` more reads of any step

        def read():
            self.reads.append(t)
            return t if len(self.reads) > due else None

        return read


def _sampler(times, lag=0, quiet=None):
    fp = [0]
    s = sampling.Sampler(quiet or (lambda: fp[0]),
                         clock=lambda: _Scripted(s, times, lag))
    return s, fp


def _run(s, steps):
    """The state of each of ``steps`` steps after the current one."""
    return [s.boundary() for _ in range(steps)]


def test_interception_turned_off_where_steps_run_faster_without_it():
    s, _ = _sampler({True: 10.0, False: 5.0})
    states = _run(s, OFF_END + 3)
    assert states[:sampling.QUIET_STEPS - 1] == [True] * (sampling.QUIET_STEPS - 1)
    assert tuple(states[sampling.QUIET_STEPS - 1:TRIAL_END - 1]) == sampling.TRIAL
    assert tuple(states[TRIAL_END - 1:OFF_END - 1]) == sampling.TRIAL  # the confirming trial
    assert states[OFF_END - 1:] == [False] * 4  # decided: off, held
    assert s.left == sampling.HOLD_MIN - 3 and s.trials == 2


def test_an_off_verdict_the_second_trial_does_not_confirm_keeps_interception_on():
    """A first trial whose unintercepted steps met a quiet machine, and intercepted ones a
    busy one, says off; the confirming trial, on a machine alike for both, does not."""
    times = {True: 10.0, False: 5.0}
    s, _ = _sampler(times)
    states = _run(s, TRIAL_END)
    assert s.state == "trial" and s.confirming
    times[False] = 10.0
    states = _run(s, len(sampling.TRIAL) + 2)
    assert s.state == "hold" and s.intercept and all(states[len(sampling.TRIAL) - 1:])
    assert s.trials == 2 and not s.confirming


def _held_off(times):
    """A sampler that turned interception off, at its first hold's end (the next step
    begins a trial)."""
    s, _ = _sampler(times)
    _run(s, OFF_END - 1 + sampling.HOLD_MIN)
    assert s.state == "hold" and not s.intercept and s.left == 1
    return s


@pytest.mark.parametrize("second", ["on", "off"])
def test_an_on_verdict_after_off_is_confirmed_by_a_second_trial(second):
    """A trial during an *off* hold whose unintercepted steps read not faster (within the
    margin: not an ABORT) turns interception on only where a second trial agrees; where
    that one reads them faster again, interception stays off, its hold doubled (on a GPU
    host's noisy step times one-trial verdicts turned it on again and again)."""
    times = {True: 10.0, False: 5.0}
    s = _held_off(times)
    times[False] = 10.2
    _run(s, 1 + len(sampling.TRIAL))  # the trial: it says on
    assert s.state == "trial" and s.confirming
    if second == "off":
        times[False] = 5.0
    states = _run(s, len(sampling.TRIAL) + 2)
    assert s.state == "hold" and not s.confirming
    if second == "on":
        assert s.intercept and all(states[len(sampling.TRIAL) - 1:]) and s.hold == sampling.HOLD_MIN
    else:
        assert not s.intercept and not any(states[len(sampling.TRIAL) - 1:])
        assert s.hold == 2 * sampling.HOLD_MIN


def test_an_abort_during_an_off_hold_turns_interception_on_at_once():
    """An unintercepted trial step past ABORT is clear: no second trial."""
    times = {True: 10.0, False: 5.0}
    s = _held_off(times)
    times[False] = 20.0
    states = _run(s, 1 + sampling.TRIAL.index(False) + 2)
    assert s.state == "hold" and s.intercept and not s.confirming and states[-1]


def test_a_clearly_slower_step_without_interception_ends_the_trial_at_once():
    s, _ = _sampler({True: 5.0, False: 10.0})
    states = _run(s, TRIAL_END + 2)
    first_off = sampling.QUIET_STEPS - 1 + sampling.TRIAL.index(False)
    assert states[first_off] is False
    assert all(states[first_off + 1:])  # one step without interception, then on again
    assert s.left == sampling.HOLD_MIN - (len(states) - first_off - 2)


@pytest.mark.parametrize("off_time", [9.9, 10.0, 10.4])
def test_within_the_margin_interception_stays_on(off_time):
    s, _ = _sampler({True: 10.0, False: off_time})
    states = _run(s, TRIAL_END + 5)
    assert all(states[TRIAL_END - 1:])


def test_a_hold_doubles_while_trials_agree_and_resets_when_they_disagree():
    times = {True: 10.0, False: 5.0}
    s, _ = _sampler(times)
    holds = []
    for _ in range(3):
        while s.state != "hold":
            s.boundary()
        holds.append((s.hold, s.intercept))
        while s.state == "hold":
            s.boundary()
    assert holds == [(sampling.HOLD_MIN, False), (2 * sampling.HOLD_MIN, False),
                     (4 * sampling.HOLD_MIN, False)]
    times[False] = 20.0  # the program changed: interception pays now
    while s.state != "hold":
        s.boundary()
    assert (s.hold, s.intercept) == (sampling.HOLD_MIN, True)


def test_a_step_that_compiles_starts_the_warm_up_again():
    s, fp = _sampler({True: 10.0, False: 5.0})
    _run(s, sampling.QUIET_STEPS + 1)  # in the trial, intercepting
    assert s.state == "trial" and s.intercept
    fp[0] += 1  # a kernel compiled during this step
    assert s.boundary() is True and s.state == "warm"
    states = _run(s, OFF_END + 1)
    assert states[-1] is False  # a whole warm-up and two trials later


def test_a_step_that_compiles_during_a_hold_starts_the_warm_up_again():
    s, fp = _sampler({True: 10.0, False: 5.0})
    while s.state != "hold":
        s.boundary()
    assert not s.intercept
    _run(s, 2)
    fp[0] += 1  # the program changed (another workload's steps, say): a kernel compiled
    assert s.boundary() is True and s.state == "warm"
    states = _run(s, OFF_END + 1)
    assert states[-1] is False  # a whole warm-up and two trials later


def test_readings_that_come_late_delay_the_decision_but_keep_it():
    s, _ = _sampler({True: 10.0, False: 5.0}, lag=2)
    states = _run(s, OFF_END + 8)
    assert tuple(states[sampling.QUIET_STEPS - 1:TRIAL_END - 1]) == sampling.TRIAL
    assert states[TRIAL_END - 1:TRIAL_END + 1] == [False, False]  # the last state, held
    assert not any(states[-6:])  # the trial's last state, then the decision's
    assert s.state == "hold" and not s.intercept and s.trials == 2
    assert s.left > sampling.HOLD_MIN - 6  # decided once the last step's time was read


def test_a_step_that_could_not_be_timed_starts_the_warm_up_again():
    s, _ = _sampler({True: 10.0, False: float("nan")})  # (a CUDA graph captured in it)
    states = _run(s, 3 * TRIAL_END)
    first_off = sampling.QUIET_STEPS - 1 + sampling.TRIAL.index(False)
    assert states[first_off] is False
    assert all(states[first_off + 1:first_off + 1 + sampling.QUIET_STEPS])
    assert s.trials >= 2 and s.state != "hold"  # never decided


def test_gpu_steps_are_sampled_only_where_asked(monkeypatch):
    monkeypatch.setattr(sampling, "_cuda_clock_wanted", lambda: True)  # CUDA initialized
    s, _ = _sampler({True: 10.0, False: 5.0})
    assert all(_run(s, 3 * TRIAL_END)) and s.state == "warm"  # ACCEL_STEP_SAMPLING=cpu
    s.cuda = True  # =all (the default)
    assert not _run(s, OFF_END)[-1] and s.state == "hold"


# -- the interceptor's side ---------------------------------------------------------------
class _Faster:
    """The interceptor's clock for these tests: steps without interception take
    ``off`` seconds, with it 1."""

    def __init__(self, off):
        self.off = off

    def __call__(self):
        s = interceptor._state.sampler
        return _Scripted(s, {True: 1.0, False: self.off})


@pytest.fixture
def sampled(monkeypatch):
    """``make(off)``: step sampling on for this thread, with steps without interception
    taking ``off`` seconds against 1 with it; the thread's sampling state is reset after."""
    monkeypatch.setenv("ACCEL_STEP_SAMPLING", "all")
    st = interceptor._state
    assert st.depth == 0

    def make(off=0.5):
        clock = None if off is None else _Faster(off)  # None: the real clock
        st.sampler = sampling.Sampler(interceptor._quiet_fingerprint, clock=clock)
        st.backward_steps = False
        return st.sampler

    yield make
    st.sampler, st.backward_steps, st.suspended = None, False, False
    assert st.depth == 0 and torch._C._len_torch_dispatch_stack() == 0


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).to(device)


def _step(m, x):
    m.zero_grad(set_to_none=True)
    target = torch.arange(4, device=x.device).repeat(4)
    loss = torch.nn.functional.cross_entropy(torch.tanh(m(x)) * 2, target)
    loss.backward()
    return loss.detach()


def _assert_same(ma, me, la, le):
    torch.testing.assert_close(la, le)
    for (n, pe), pa in zip(me.named_parameters(), ma.parameters()):
        torch.testing.assert_close(pa.grad, pe.grad, msg=n)


def _side_by_side(steps, block=accel.eager, device="cpu"):
    """Train two copies of :func:`_model` for ``steps`` steps, eagerly and each step inside
    ``block()``, asserting the loss and gradients are eager's at every step. Returns per
    step (accel's mode on the stack inside the block, whether accel flushed a region or
    its dispatch filter saw a call)."""
    me = _model(device)
    ma = copy.deepcopy(me)
    x = torch.randn(16, 16, device=device)
    runtime.reset_stats()
    seen = []
    for _ in range(steps):
        le = _step(me, x)
        before = (accel.stats()["flushes"], dispatch.counts() if dispatch.active() else None)
        with block():
            on = torch._C._len_torch_dispatch_stack() == 1
            la = _step(ma, x)
        after = (accel.stats()["flushes"], dispatch.counts() if dispatch.active() else None)
        seen.append((on, after != before))
        _assert_same(ma, me, la, le)
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_training_steps_run_without_interception_once_that_is_faster(sampled, device):
    sampled(off=0.5)
    # (room for one more warm-up: where accel.remat recomputes the model's GELU output,
    # which the LayerNorm saves (ACCEL_REMAT=on; under auto, not at this size), the first trial step whose
    # interception resumes at its backward records the backward of an eager forward, a path
    # met for the first time: a step that is not quiet, and the sampler starts again)
    seen = _side_by_side(OFF_END + TRIAL_END + 12, device=device)
    # a step that began without interception ran no region and passed no call to the filter
    assert all(not moved for on, moved in seen[-8:]) and not any(on for on, _ in seen[-8:])
    assert any(on and moved for on, moved in seen[:sampling.QUIET_STEPS])
    assert accel.stats()["bypassed_steps"] >= 8


@pytest.mark.parametrize("device", DEVICES)
def test_steps_stay_intercepted_where_interception_pays(sampled, device):
    sampled(off=2.0)
    seen = _side_by_side(TRIAL_END + 8, device=device)
    assert accel.stats()["bypassed_steps"] == 1  # the trial's one step without it
    assert seen[-1][0]


def test_one_enable_around_the_loop_switches_at_backward_calls(sampled):
    """As under ACCEL_EAGER=1: steps end at backward calls, inside one enable; the mode
    leaves and rejoins the stack there, and the region pending at the call is flushed."""
    sampled(off=0.5)
    me = _model()
    ma = copy.deepcopy(me)
    x = torch.randn(16, 16)
    le = _step(me, x)  # no optimizer: every step's loss and gradients are these
    depths = []
    accel.enable()
    try:
        for _ in range(OFF_END + 6):
            ma.zero_grad(set_to_none=True)
            pending = torch.tanh(ma(x)) * 2  # recorded: pending at the backward call
            la = torch.nn.functional.cross_entropy(pending, torch.arange(4).repeat(4))
            la.backward()
            depths.append(torch._C._len_torch_dispatch_stack())
            _assert_same(ma, me, la.detach(), le)
    finally:
        accel.disable()
    assert depths[0] == 1 and depths[-1] == 0
    assert 1 in depths[sampling.QUIET_STEPS:]  # the trial's intercepted steps came back


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _AccelUnderAMode:
    def __enter__(self):
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(accel.eager())
        self.stack.enter_context(_Counting())

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def test_a_mode_above_accels_keeps_interception_on(sampled):
    sampled(off=0.5)
    _side_by_side(TRIAL_END + 4, _AccelUnderAMode)
    assert accel.stats()["bypassed_steps"] == 0


def _trained_to_off():
    """A model and input trained under accel (a with-block a step) until step sampling
    turned interception off (the ``sampled`` fixture's clock makes that faster)."""
    m = _model()
    x = torch.randn(16, 16)
    for _ in range(OFF_END + 2):
        with accel.eager():
            _step(m, x)
    return m, x


def test_a_nested_enable_in_a_step_without_interception_intercepts(sampled):
    sampled(off=0.5)
    m, x = _trained_to_off()
    y = torch.randn(64, 64)
    with accel.eager():
        assert torch._C._len_torch_dispatch_stack() == 0  # this step: no interception
        runs = accel.stats()["kernel_runs"]
        with accel.eager():
            assert torch._C._len_torch_dispatch_stack() == 1
            z = torch.sin(y) * 2 + 1
        assert accel.stats()["kernel_runs"] == runs + 1
        assert torch._C._len_torch_dispatch_stack() == 0
        w = torch.cos(z) + 1  # eager again, after the nested block
        assert accel.stats()["kernel_runs"] == runs + 1
    torch.testing.assert_close(w, torch.cos(torch.sin(y) * 2 + 1) + 1)


def test_an_exception_in_a_step_without_interception_leaves_the_thread_clean(sampled):
    sampled(off=0.5)
    m, x = _trained_to_off()
    with pytest.raises(RuntimeError, match="shape"):
        with accel.eager():
            assert torch._C._len_torch_dispatch_stack() == 0
            m(torch.randn(3, 5))
    assert not accel.is_enabled() and interceptor._state.depth == 0
    assert not interceptor._state.suspended


class _SwitchingAtEveryBoundary(sampling.Sampler):
    """Interception off and on at every step boundary, without trials (as
    tests/sample_everything.py's); counts the boundaries."""

    def boundary(self) -> bool:
        self.fp = self._quiet()
        self.steps = getattr(self, "steps", 0) + 1
        self.intercept = self.steps % 2 == 0
        return self.intercept


def test_a_backward_pass_begun_inside_another_is_not_a_step_boundary(sampled):
    """A reentrant checkpoint's backward calls ``torch.autograd.backward`` inside the outer
    pass: not a step boundary. (A switch there took accel's mode off the dispatch mode
    stack inside a node, where the engine put back the modes its pass began with: the exit
    of ``accel.eager()`` then popped an empty stack, "trying to pop from empty mode stack".)
    Switching at every boundary, the blocks exit cleanly, with eager's gradients, and a
    step counts the outer backward call and the block only."""
    sampled()
    st = interceptor._state
    st.sampler = _SwitchingAtEveryBoundary(interceptor._quiet_fingerprint)
    model = _model()
    x = torch.randn(16, 16, requires_grad=True)

    def step(m):
        m.zero_grad(set_to_none=True)
        x.grad = None
        out = torch.utils.checkpoint.checkpoint(m, x * 2, use_reentrant=True)
        (out.tanh() * 3).sum().backward()
        return [p.grad for p in m.parameters()] + [x.grad]

    want = step(model)
    for k in range(4):
        with accel.eager():
            got = step(model)
        torch.testing.assert_close(got, want)
        assert st.depth == 0 and torch._C._len_torch_dispatch_stack() == 0
    assert st.sampler.steps <= 2 * 4, st.sampler.steps


def test_inference_blocks_are_steps_too(sampled):
    sampled(off=0.5)
    y = torch.randn(32, 32)
    runtime.reset_stats()
    outs = []
    for _ in range(OFF_END + 4):
        with accel.eager():
            outs.append(torch.softmax(torch.sin(y) * 2, -1))
    want = torch.softmax(torch.sin(y) * 2, -1)
    for o in outs:
        torch.testing.assert_close(o, want)
    assert accel.stats()["bypassed_steps"] >= 4


class _Broken:
    def start(self):
        raise RuntimeError("the clock broke")

    stop = start


def test_a_clock_that_raises_stops_sampling_and_the_program_goes_on(sampled):
    s = sampled()
    s._make_clock = _Broken
    seen = _side_by_side(TRIAL_END + 4)
    assert all(on for on, _ in seen)
    assert s.broken and "the clock broke" in s.broken
    assert accel.stats()["bypassed_steps"] == 0


def test_blocks_without_backward_after_training_are_sampled_afresh(sampled):
    """Training decided interception off; an evaluation loop of blocks that call no
    backward must not inherit that state for good: its blocks are the steps again."""
    sampled(off=0.5)
    m, x = _trained_to_off()
    with accel.eager():
        assert torch._C._len_torch_dispatch_stack() == 0  # training: off
        _step(m, x)
    interceptor._state.sampler._make_clock = _Faster(2.0)  # evaluation: interception pays
    y = torch.randn(32, 32)
    on = []
    for _ in range(TRIAL_END + 4):
        with accel.eager():
            on.append(torch._C._len_torch_dispatch_stack() == 1)
            z = torch.softmax(torch.sin(y) * 2, -1)
        torch.testing.assert_close(z, torch.softmax(torch.sin(y) * 2, -1))
    assert on[0] is False  # the block right after training's last step: its state
    assert all(on[1:sampling.QUIET_STEPS + 1]) and sum(not o for o in on[1:]) == 1


def test_sampling_off_always_intercepts(sampled, monkeypatch):
    sampled(off=0.01)
    monkeypatch.setenv("ACCEL_STEP_SAMPLING", "off")
    m = _model()
    x = torch.randn(16, 16)
    runtime.reset_stats()
    for _ in range(TRIAL_END + 4):
        with accel.eager():
            assert torch._C._len_torch_dispatch_stack() == 1
            _step(m, x)
    assert accel.stats()["bypassed_steps"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_steps_timed_by_the_real_clock_match_eager(sampled):
    s = sampled(off=None)  # CUDA events: whichever way the trials go, results are eager's
    _side_by_side(TRIAL_END + 20, device="cuda")
    assert s.trials >= 1 and s.broken is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_cuda_clock_reads_a_step_once_its_work_is_done():
    clock = sampling._CudaClock()
    clock.start()
    torch.cuda._sleep(50_000_000)  # tens of ms of GPU time, the host not waiting
    read = clock.take()
    first = read()
    torch.cuda.synchronize()
    t = read()
    clock.stop()
    assert first is None or first > 0.001
    assert t is not None and t > 0.001


@pytest.mark.suite
def test_programs_switching_interception_at_every_step_match_eager():
    """tests/test_programs.py (LSTM and GRU, every optimizer, checkpointing, DDP, hooks,
    torch.func, ...) with step sampling switching interception off and on without trials,
    at every backward call and outermost block (tests/sample_everything.py): each program's
    results still equal eager's. Not the four transformers architectures (about 40 s of the
    run on the dev VM): models trained step by step as llama's and the convnet's are, whose
    switches are the same."""
    out = run_under("sample_everything", ["test_programs.py"], "-k",
                    "not cuda and not transformers_architectures")
    off = re.search(r"sample_everything: (\d+) steps without interception", out)
    assert off and int(off.group(1)) >= 10, out[-3000:]
