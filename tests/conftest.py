import os
import tempfile

import pytest

# One store for the whole test session (unless a test points ACCEL_CACHE_DIR elsewhere).
os.environ.setdefault("ACCEL_CACHE_DIR", os.path.join(tempfile.mkdtemp(prefix="accel-test-"), "store"))


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    """A new, empty on-disk store for one test."""
    import accel.runtime

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "store"))
    accel.runtime.set_store(None)
    yield tmp_path / "store"
    accel.runtime.set_store(None)
