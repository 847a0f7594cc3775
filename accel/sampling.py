"""Step sampling: intercept a program's steps only where intercepting pays.

accel's interception costs the host work at every aten call; it pays where the kernels it
fuses save more than that. In a program bound by the host -- a small model's training step
on a GPU, or on a CPU -- it does not: the small- and idle-region rules of
``accel.interceptor`` run most regions eagerly, and the step still pays for the
interception itself (the demo's GPT-2 step ran at 0.87-0.92x of eager's speed on the H100,
a host-bound CPU proxy of it at 0.70-0.72x). So each thread measures its steps with and
without interception and keeps the faster, as an autotuner keeps the faster of two kernels.

A *step* is the interval between two calls of ``torch.autograd.backward`` (which
``Tensor.backward`` calls) on a thread where accel is enabled: a training step. On a thread
that has made no such call, an outermost ``accel.eager()`` (or ``accel.enable()``) begins
a step instead: a with-block per inference call. A step's time is the time accel was
enabled on the thread during it: the host's wall clock on a CPU; on a GPU (once CUDA is
initialized) the device's, between CUDA events recorded on the current stream where each
stretch of it begins and ends, so that the device's work counts whether the host waits for
it inside the step or outside.

The :class:`Sampler` of a thread, step by step:

- *warm*: intercepting; once :data:`QUIET_STEPS` steps in a row were *quiet* (no kernel
  compiled, loaded from the store or failed, no call seen for the first time: the store and
  the small- and idle-region rules have settled), a trial begins;
- *trial*: the steps of :data:`TRIAL` (intercepting, then not, then again, then not), each
  timed. An unintercepted step slower than :data:`ABORT` times the intercepted steps'
  median so far ends the trial at once (interception clearly pays: a trial then costs the
  program one slow step). A step that is not quiet ends it too, back to *warm*. At the
  end, interception is turned off where the unintercepted steps' median is below
  ``1 - MARGIN`` times the intercepted steps'. A verdict that reverses the last decision
  (or a first *off*) is confirmed first, by a second trial at once: on a busy machine one
  trial's steps can meet a burst of other work (a compiler the program started, say) that
  favours either side, and a wrong verdict would hold for :data:`HOLD_MIN` steps (in a
  ``bench_cpu.py`` run the demo's CPU step ran unintercepted after one such trial, at 105.6
  ms, eager's speed, where the next run's intercepted steps took 92.3; on an H200, whose
  host's step times are noisy, one-trial verdicts to intercept again left the demo's step
  intercepted for 45 of 80 steps, at 0.89x of eager's speed against 0.99x). An ABORT is
  clear and is not confirmed. A program that changed (below) has its next *off* verdict
  confirmed again;
- *hold*: the decision stands for a number of steps, :data:`HOLD_MIN` at first, doubled
  each time a trial confirms it, up to :data:`HOLD_MAX`; then a new trial. A step that is
  not quiet ends the hold, back to *warm*: the program changed (another model's steps, new
  shapes), and what the trial measured may not hold for it.

Turning interception off for a step flushes the pending region, takes accel's dispatch mode
off the thread's mode stack and the dispatch filter's key out of its key set: the step runs
as plain eager PyTorch (accel's Python hooks, which flush an empty region, stay). It is
done only where accel's mode is the innermost mode and the thread's only accel mode (one
enable deep); turning it back on, only where no mode was pushed meanwhile. Otherwise the
thread keeps its current state and the sampler starts again.

``ACCEL_STEP_SAMPLING``: ``all`` (the default) holds trials in CPU and GPU programs (on an
H200 the demo's step went from 0.82-0.90x of eager's speed to 0.97-0.99x); ``cpu`` only
while the process has not initialized CUDA, its steps timed by the host's clock; ``off``:
every step intercepted. A step in which a CUDA graph was captured is not
timed (a timing event would break the capture): the trial starts again. A clock that
raises stops sampling on the thread, with one warning.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, List, Optional

log = logging.getLogger("accel")

__all__ = ["Sampler", "QUIET_STEPS", "TRIAL", "MARGIN", "ABORT", "HOLD_MIN", "HOLD_MAX"]

#: quiet steps in a row before a trial
QUIET_STEPS = 4
#: whether each step of a trial intercepts (an unintercepted step right after intercepted
#: ones and the other way round, so that a drifting machine load hits both alike)
TRIAL = (True, True, True, False, False, False, True, True, False, False)
#: how much faster (a fraction) unintercepted steps must be for interception to be turned off
MARGIN = 0.05
#: an unintercepted trial step this many times the intercepted steps' median ends the trial
ABORT = 1.25
#: steps a decision holds before the next trial: at first, and at most (doubling between)
HOLD_MIN, HOLD_MAX = 32, 4096

_WARM, _TRIAL, _HOLD = "warm", "trial", "hold"


class _CpuClock:
    """The host's wall clock: stretches of time, summed per step (seconds)."""

    def __init__(self):
        self.t0 = None
        self.total = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.t0 is not None:
            self.total += time.perf_counter() - self.t0
            self.t0 = None

    def take(self):
        """End the step: its seconds (the clock goes on if it was running)."""
        running = self.t0 is not None
        self.stop()
        total, self.total = self.total, 0.0
        if running:
            self.start()
        return lambda: total


class _CudaClock:
    """The GPU's clock: a CUDA event recorded on the current stream where a stretch begins
    and ends; a step's seconds are known once its events have completed (never waited for:
    the sampler reads them a step or more later)."""

    def __init__(self):
        import torch

        self.torch = torch
        self.spare: List = []
        self.open = None
        self.pairs: List = []
        self.untimed = False  # a stretch of the step could not be timed

    def _event(self):
        if self.spare:
            return self.spare.pop()
        return self.torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.torch.cuda.is_current_stream_capturing():
            self.untimed = True  # (recording a timing event would break the capture)
            return
        ev = self._event()
        ev.record()
        self.open = ev

    def stop(self) -> None:
        if self.open is not None:
            if self.torch.cuda.is_current_stream_capturing():
                self.untimed, self.open = True, None
                return
            ev = self._event()
            ev.record()
            self.pairs.append((self.open, ev))
            self.open = None

    def take(self):
        running = self.open is not None
        self.stop()
        pairs, self.pairs = self.pairs, []
        untimed, self.untimed = self.untimed, False
        if running:
            self.start()

        def read():
            if untimed:
                return float("nan")
            if not all(b.query() for _, b in pairs):
                return None
            s = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
            for a, b in pairs:
                self.spare += (a, b)
            return s

        return read


def _cuda_clock_wanted() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


class Sampler:
    """One thread's step sampling (see the module's docstring).

    ``quiet`` returns a value that changes whenever a step is not quiet (a fingerprint of
    the process's counters); ``clock``, when given, makes the timer for a step (tests give
    a fake one).
    """

    def __init__(self, quiet: Callable[[], tuple],
                 clock: Optional[Callable[[], object]] = None):
        self._quiet = quiet
        self._make_clock = clock
        self.clock = None
        self.intercept = True  # whether the current step intercepts
        self.state = _WARM
        self.quiet_steps = 0
        self.hold = HOLD_MIN
        self.left = 0  # steps left in a hold
        self.last_off = None  # the decision the hold keeps (None before any trial)
        self.pos = 0  # trial steps begun
        self.pending: List = []  # (intercepted, read) of trial steps not yet read
        self.times = {True: [], False: []}
        self.fp = quiet()
        self.running = False
        self.trials = 0
        self.cuda = False  # trials where CUDA is initialized (steps timed on the GPU)
        self.broken = None  # why sampling stopped on this thread (an error), if it did
        self.confirming = False  # the trial confirms the one before's reversing verdict

    # -- the step's clock: accel enabled on the thread (start) or not (stop) -------------
    def start(self) -> None:
        self.running = True
        if self.clock is not None:
            self.clock.start()

    def stop(self) -> None:
        self.running = False
        if self.clock is not None:
            self.clock.stop()

    def _new_clock(self, timed: bool) -> None:
        if not timed:
            self.clock = None
            return
        if self._make_clock is not None:
            self.clock = self._make_clock()
        else:
            self.clock = _CudaClock() if _cuda_clock_wanted() else _CpuClock()
        if self.running:
            self.clock.start()

    # -- a step boundary -------------------------------------------------------------
    def boundary(self) -> bool:
        """End the current step and begin the next: returns whether it intercepts."""
        fp = self._quiet()
        quiet, self.fp = fp == self.fp, fp
        if self.broken is not None:
            return self._next(True)
        if self.state == _WARM:
            self.quiet_steps = self.quiet_steps + 1 if quiet else 0
            if self.quiet_steps >= QUIET_STEPS and (self.cuda or not _cuda_clock_wanted()):
                self._begin_trial()
            return self._next(self.intercept)
        if not quiet and (self.state == _HOLD or self.intercept):
            # the program changed (a new workload, say): what a trial measured, or is
            # measuring, no longer holds
            return self._rewarm("a step compiled or met a new call")
        if self.state == _HOLD:
            self.left -= 1
            if self.left <= 0:
                self._begin_trial()
            return self._next(self.intercept)
        # a trial step ended: TRIAL[pos - 1], or a step past the trial's end
        if self.pos <= len(TRIAL):
            self.pending.append((self.intercept, self.clock.take()))
        verdict = self._read()
        if verdict is not None:
            return verdict
        if self.pos < len(TRIAL):
            self.pos += 1
            return self._next(TRIAL[self.pos - 1])
        self.pos = len(TRIAL) + 1
        if self.pending:  # a GPU's last events are not done: one more step as the last
            return self._next(self.intercept)
        return self._decide()

    def _next(self, intercept: bool) -> bool:
        timed = self.state == _TRIAL
        if self.clock is None or not timed:
            self._new_clock(timed)
        self.intercept = intercept
        return intercept

    def _begin_trial(self) -> None:
        self.state = _TRIAL
        self.pos = 1
        self.pending = []
        self.times = {True: [], False: []}
        self.trials += 1
        self.intercept = TRIAL[0]
        self._new_clock(True)

    def _read(self) -> Optional[bool]:
        """Read the trial steps' times that are known, in order; a verdict where one ends
        the trial (an unintercepted step clearly slower)."""
        while self.pending:
            on, read = self.pending[0]
            t = read()
            if t is None:
                break
            if t != t:  # NaN: the step could not be timed (a CUDA graph was captured in it)
                return self._end_trial(None, "a step could not be timed")
            self.pending.pop(0)
            self.times[on].append(t)
            ons = self.times[True]
            if not on and ons and t > ABORT * statistics.median(ons):
                return self._end_trial(False, f"a step without it took {t * 1e3:.2f} ms "
                                              f"against {statistics.median(ons) * 1e3:.2f}",
                                       clear=True)
        return None

    def _decide(self) -> bool:
        on, off = statistics.median(self.times[True]), statistics.median(self.times[False])
        turn_off = off < (1.0 - MARGIN) * on
        return self._end_trial(turn_off, f"steps took {on * 1e3:.2f} ms with it, "
                                         f"{off * 1e3:.2f} ms without")

    def _rewarm(self, why: str) -> bool:
        """Back to the warm-up, intercepting."""
        self.pending, self.confirming, self.last_off = [], False, None
        self.state, self.quiet_steps = _WARM, 0
        log.debug("accel: step sampling starts again (%s)", why)
        return self._next(True)

    def _end_trial(self, turn_off: Optional[bool], why: str, clear: bool = False) -> bool:
        """End the trial with its verdict (``None``: start again); a verdict that reverses
        the last decision (or a first *off*) is confirmed by a second trial first, unless
        it is ``clear`` (an unintercepted step past :data:`ABORT`)."""
        if turn_off is None:
            return self._rewarm(why)
        reverses = self.last_off is not True if turn_off else self.last_off is True
        if reverses and not clear and not self.confirming:
            log.debug("accel: step sampling: a second trial to confirm turning interception "
                      "%s (%s)", "off" if turn_off else "on", why)
            self.confirming = True
            self._begin_trial()
            return self._next(self.intercept)
        self.confirming = False
        self.pending = []
        self.hold = min(2 * self.hold, HOLD_MAX) if turn_off == self.last_off else HOLD_MIN
        self.last_off = turn_off
        self.state, self.left = _HOLD, self.hold
        log.debug("accel: interception %s for the next %d steps of this thread (%s)",
                  "off" if turn_off else "on", self.hold, why)
        return self._next(not turn_off)

    def give_up(self, why: str) -> None:
        """Stop sampling on this thread (an error of its clock, say): intercept every step."""
        self.broken = why
        self.state, self.pending, self.intercept, self.confirming = _WARM, [], True, False
        self.clock = None

    def restart(self) -> None:
        """The thread could not take the state the sampler asked for: start again, keeping
        whatever state the thread is in (the caller sets :attr:`intercept`)."""
        self.state, self.quiet_steps, self.pending, self.confirming = _WARM, 0, [], False
        self._new_clock(False)
