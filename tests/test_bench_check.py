"""The benchmarks' correctness verdict (bench/_common.py ``check``): against eager, then
against a float64 oracle where eager's own result is off it; and bench/flush_parts.py, which
launches a region's kernel by hand."""
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import _common  # noqa: E402

EXACT = (torch.tensor(1.0, dtype=torch.float64), {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)})
EAGER = (torch.tensor(1.0), {"w": torch.tensor([1.001, 2.0])})  # 1e-3 off float64


def _result(w0):
    return (torch.tensor(1.0), {"w": torch.tensor([w0, 2.0])})


def test_close_to_eager_is_yes():
    assert _common.check("w", "accel", _result(1.001), EAGER, exact=EXACT) == "yes"


def test_float64_oracle_decides_where_eager_is_off_it():
    assert _common.check("w", "accel", _result(1.0), EAGER, exact=EXACT) == "yes (float64 oracle)"


def test_as_near_float64_as_eager():
    assert _common.check("w", "accel", _result(0.9995), EAGER, exact=EXACT) == "yes (as near float64 as eager)"


def test_farther_than_eager_names_the_tensor_and_both_distances(capsys):
    verdict = _common.check("w", "accel", _result(1.002), EAGER, detail=True, exact=EXACT)
    assert verdict == "MISMATCH (farther from float64 than eager: [1]['w'] 2.00e-03 against eager's 1.00e-03)"
    assert "farther from float64 than eager: [1]['w']" in capsys.readouterr().err
    assert _common.check("w", "accel", _result(1.002), EAGER, exact=EXACT) == "MISMATCH"


def test_nan_where_eager_has_nan_is_yes():
    """``digamma(x * 4)`` of a randn ``x`` meets a pole (a negative integer: NaN) once in 8M
    values; every backend's NaN there had made the verdict MISMATCH."""
    nan = torch.tensor([float("nan"), 1.0])
    assert _common.check("w", "accel", nan.clone(), nan) == "yes"
    assert _common.check("w", "accel", torch.tensor([0.0, 1.0]), nan) == "MISMATCH"


def test_no_oracle_reports_the_assert_close_detail():
    verdict = _common.check("w", "accel", _result(1.002), EAGER, detail=True)
    assert verdict.startswith("MISMATCH ([1]['w'], abs 1.0e-03")


def test_flush_parts_runs_on_the_cpu():
    """flush_parts.py launches a region's kernel by hand. While it gathered the kernel's
    runtime scalars itself, a shape-generic kernel (its loop lengths after the scalars)
    read past them: a segmentation fault. Its table must come out whole."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    out = subprocess.run([sys.executable, os.path.join(bench, "flush_parts.py"), "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "µs |" not in line]
    assert len(rows) == 11, out.stdout
    assert "| launch (runs the kernel) |" in out.stdout and "| record 5 calls, flush |" in out.stdout
