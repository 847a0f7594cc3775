import os
import tempfile

import pytest

# One store for the whole test session (unless a test points ACCEL_CACHE_DIR elsewhere).
os.environ.setdefault("ACCEL_CACHE_DIR", os.path.join(tempfile.mkdtemp(prefix="accel-test-"), "store"))
# Under pytest-xdist each worker gets a store of its own: tests read the store's counters
# (hits, compiles), which another worker's kernels would move.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["ACCEL_CACHE_DIR"] = os.path.join(
        os.environ["ACCEL_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture(scope="session", autouse=True)
def dispatch_filter():
    """Build (or load) the dispatch filter before the first test, so that every test runs
    with it, as a process does once the store has it (accel.dispatch)."""
    import accel.dispatch

    accel.dispatch.wait()
    yield


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
