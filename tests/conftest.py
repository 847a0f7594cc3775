import os
import tempfile

import pytest

# One store for the whole test session (unless a test points ACCEL_CACHE_DIR elsewhere),
# shared by pytest-xdist's workers as by any processes: the kernels one builds, the other
# loads, and the dispatch filter is built once (its build takes the store's compile lock).
# Tests that count compiles or read the store's counters use stores of their own.
os.environ.setdefault("ACCEL_CACHE_DIR", os.path.join(tempfile.mkdtemp(prefix="accel-test-"), "store"))

# Small regions (accel.eager_regions.SMALL_REGION_CALLS): once seen, a region of a few calls on
# tiny tensors runs eagerly. The suite's tensors are tiny and what it tests is regions and
# their kernels, so it fuses every region; the small-region tests turn the default back on.
# The idle-region rule (on a GPU) shares the mechanism and is off with it (tests/test_idle.py).
os.environ.setdefault("ACCEL_EAGER_SMALL_REGIONS", "0")
# Step sampling (accel/sampling.py) times a thread's steps and may run some without
# interception: what a test's steps run would then depend on the machine's speed. The suite
# intercepts every step; tests/test_sampling.py turns it on, with a clock of its own.
os.environ.setdefault("ACCEL_STEP_SAMPLING", "off")
# The recompile limit (accel.runtime._may_build) runs a region eagerly at new shapes once it
# has had kernels built for a few: the suite runs thousands of shapes of its regions, each
# test a step or more, and what it tests is their kernels. Its own tests turn it on.
os.environ.setdefault("ACCEL_RECOMPILE_LIMIT", "0")


def pytest_collection_modifyitems(items):
    """The ``suite`` tests (test files run again in a pytest subprocess, minutes each) first:
    pytest-xdist hands its first tests out in turn, so the workers run them side by side
    from the start, rather than one worker ending the session alone on one of them."""
    items.sort(key=lambda item: item.get_closest_marker("suite") is None)


@pytest.fixture(scope="session", autouse=True)
def dispatch_filter():
    """Build (or load) the dispatch filter before the first test, so that every test runs
    with it, as a process does once the store has it (accel.dispatch)."""
    import accel.dispatch

    accel.dispatch.wait()
    yield


@pytest.fixture
def needs_dispatch_filter():
    """Skips a test that needs the dispatch filter where it could not be built (waited for
    in the test, not at import: collecting a module must not build it)."""
    import accel.dispatch

    if not accel.dispatch.wait():
        pytest.skip("dispatch filter not built here")


@pytest.fixture
def train_as_eager():
    """``run(base, x, target, steps, before=None)``: trains two copies of module ``base``
    side by side, one eagerly and one under ``accel.eager()`` (forward on ``x``, cross
    entropy of ``2 * tanh(out)`` against class indices ``target``, backward), ``steps``
    steps, calling ``before(step)`` first in each; asserts that the loss and every
    parameter gradient are eager's at every step."""
    import copy

    import torch

    import accel

    def run(base, x, target, steps, before=None):
        me, ma = copy.deepcopy(base), copy.deepcopy(base)
        for step in range(steps):
            if before is not None:
                before(step)
            me.zero_grad(set_to_none=True)
            ma.zero_grad(set_to_none=True)
            le = torch.nn.functional.cross_entropy(torch.tanh(me(x)) * 2, target)
            le.backward()
            with accel.eager():
                la = torch.nn.functional.cross_entropy(torch.tanh(ma(x)) * 2, target)
                la.backward()
            torch.testing.assert_close(la, le)
            for (n, pe), pa in zip(me.named_parameters(), ma.parameters()):
                torch.testing.assert_close(pa.grad, pe.grad, msg=n)

    return run


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    """A new, empty on-disk store for one test."""
    import accel.runtime

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "store"))
    accel.runtime.set_store(None)
    yield tmp_path / "store"
    accel.runtime.set_store(None)


# hypothesis profiles (tests/test_chains.py): "accel-ci" by default, derandomized so the
# suite is reproducible; `pytest --hypothesis-profile=accel-explore` hunts for more bugs.
try:
    from hypothesis import HealthCheck, settings as _hyp_settings
except ImportError:  # hypothesis-based tests skip themselves
    pass
else:
    _hyp_settings.register_profile(
        "accel-ci", max_examples=60, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    _hyp_settings.register_profile(
        "accel-explore", max_examples=1000, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    _hyp_settings.load_profile("accel-ci")


@pytest.fixture
def backward_case():
    """A small backward pass for the engine-thread tests: ``(x, w, f, want)`` where
    ``want`` holds eager's gradients of ``f(x, w).square().sum()`` for x and w (float64,
    [48, 24] and [24]); their ``.grad`` are reset."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(48, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        return torch.nn.functional.layer_norm(torch.tanh(x * w), (24,)).sin()

    f(x, w).square().sum().backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    return x, w, f, want
