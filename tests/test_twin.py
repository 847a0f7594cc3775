"""The pure-Python twin of the Cython core runs the tests of memory shared outside the
dispatcher too; the interceptor suite runs on it in tests/test_allocator.py, every output
pooled (the twin's outputs otherwise come from ``torch.empty_strided``, as the pool's
fresh blocks do)."""
import os
import subprocess
import sys

import pytest

from plugin_runs import run_under  # tests/plugin_runs.py


@pytest.mark.suite
def test_shared_memory_suite_on_pure_python_core():
    """The shared-memory suite on the region core's pure-Python twin (accel/_core_py.py),
    but for the tests of codegen alone (``codegen``-marked: the same kernels, whatever core
    runs them)."""
    run_under(None, ["test_shared.py"], "-m", "not codegen", ACCEL_PURE_PYTHON="1")


def test_twin_is_selected_by_env():
    code = "import accel.region as r; print(type(r.Region.__mro__[1]).__module__, r.RegionCore.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ACCEL_PURE_PYTHON="1"), timeout=120)
    assert "accel._core_py" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "ACCEL_PURE_PYTHON"},
                         timeout=120)
    assert "accel._core" in out.stdout and "_core_py" not in out.stdout, out.stderr
