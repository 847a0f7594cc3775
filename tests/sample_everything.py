"""pytest plugin (``-p sample_everything``, with ``tests/`` on the path): step sampling on
(``ACCEL_STEP_SAMPLING=all``), with every thread's sampler switching without a trial: a step
without interception, one with it, over and over. Every backward call and every outermost
``accel.eager()`` block is a switch, so suites run under it take interception off and put
it back (a region pending, autograd's threads, optimizers, nested blocks, other modes) far
more often than timed trials would. tests/test_sampling.py runs suites under it."""
import os

os.environ["ACCEL_STEP_SAMPLING"] = "all"  # (before conftest's default)

from accel import interceptor, sampling  # noqa: E402


OFF = [0]  # steps begun without interception, every thread


class _Switching(sampling.Sampler):
    def boundary(self) -> bool:
        self.fp = self._quiet()
        self.steps = getattr(self, "steps", 0) + 1
        self.intercept = self.steps % 2 == 0
        OFF[0] += not self.intercept
        return self.intercept


def _sampler(st):
    if not isinstance(st.sampler, _Switching):
        st.sampler = _Switching(interceptor._quiet_fingerprint)
    return st.sampler


interceptor._sampler = _sampler


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"sample_everything: {OFF[0]} steps without interception")
