"""Tests of the ``accel`` command line (accel.cli.main)."""
import os
import sys
import types

import pytest

import accel
from accel.cli import main
from accel.store import Store

META = {"readable": "add(f32[4], f32[4])", "source": "int main(){}", "compile_time_s": 0.1}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(d))
    return d


@pytest.fixture
def filled(cache_dir):
    s = Store()
    s.put("abcd" + "0" * 60, b"x" * 2048, META)
    s.put("abce" + "1" * 60, b"y" * 10, {"readable": "mul(f32[2])"})
    s.put_negative("ffff" + "2" * 60, "gcc failed", {"readable": "broken_op"})
    s.record("hits", 5)
    s.record("compiles", 2)
    s.touch()  # what the process's exit does: the counts are written
    return s


@pytest.mark.parametrize("argv", [[], ["cache"], ["cache", "info"], ["cache", "list"], ["cache", "inspect"],
                                  ["cache", "clear"], ["run"], ["demo"]])
def test_help_everywhere(argv, capsys):
    assert main([*argv, "--help"]) == 0
    assert "usage: accel" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["cache"], ["cache", "bogus"], ["cache", "inspect"], ["run"]])
def test_usage_errors(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_info_empty(cache_dir, capsys):
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir) in out and "entries:" in out and "bytes)" in out and "compile failures:" in out


def test_info_filled(filled, capsys):
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    lines = dict(line.split(":", 1) for line in out.splitlines())
    assert lines["entries"].strip() == "3" and lines["hits"].strip() == "5"
    assert lines["compiles"].strip() == "2" and lines["size limit"].strip().endswith(f"({2**30} bytes)")


def test_list(filled, capsys):
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "abcd000000000000 " in out and "add(f32[4], f32[4])" in out and "0.10 s" in out
    assert "2.0 KiB" in out and "[negative] broken_op" in out and "mul(f32[2])" in out
    assert "0" * 60 not in out  # keys are shortened


def test_list_into_a_closed_pipe(filled, cache_dir):
    """`accel cache list | head -1` style: the reader is gone before accel writes; accel
    stops quietly (exit 1, no traceback), as git and pip do."""
    import subprocess

    r, w = os.pipe()
    os.close(r)  # the reader is gone: any write fails with EPIPE
    p = subprocess.run([sys.executable, "-m", "accel", "cache", "list"], stdout=w,
                       stderr=subprocess.PIPE, text=True, timeout=120,
                       env={**os.environ, "ACCEL_CACHE_DIR": str(cache_dir)})
    os.close(w)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "Broken" not in p.stderr, p.stderr


def test_list_empty(cache_dir, capsys):
    assert main(["cache", "list"]) == 0
    assert "empty" in capsys.readouterr().out


def test_inspect_prefix(filled, capsys):
    assert main(["cache", "inspect", "abcd"]) == 0
    out = capsys.readouterr().out
    meta, source = out.split("----- generated source -----")
    assert '"readable": "add(f32[4], f32[4])"' in meta and '"checksum_ok": true' in meta
    assert '"source"' not in meta and source.strip() == "int main(){}"


def test_inspect_unknown_and_ambiguous(filled, capsys):
    assert main(["cache", "inspect", "9999"]) == 1
    assert "no kernel store entry" in capsys.readouterr().err
    assert main(["cache", "inspect", "abc"]) == 1
    assert "ambiguous" in capsys.readouterr().err


def test_clear(filled, capsys):
    assert main(["cache", "clear"]) == 2
    assert main(["cache", "clear", "abcd", "--all"]) == 2
    assert main(["cache", "clear", "nope"]) == 1
    assert main(["cache", "clear", "abc"]) == 1  # ambiguous: nothing removed
    assert len(Store().entries()) == 3
    capsys.readouterr()
    assert main(["cache", "clear", "abcd", "ffff"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert Store().find("") == ["abce" + "1" * 60]
    assert main(["cache", "clear", "--all"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert Store().entries() == [] and Store().stats()["hits"] == 0


def test_unusable_store(cache_dir, capsys):
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o777)
    assert main(["cache", "info"]) == 1
    err = capsys.readouterr().err
    assert str(cache_dir) in err and "other users can write" in err


def test_invalid_env(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("ACCEL_LOG", "loud")
    assert main(["cache", "info"]) == 2
    assert "ACCEL_LOG" in capsys.readouterr().err


@pytest.fixture
def fake_interceptor(monkeypatch):
    calls = []
    fake = types.ModuleType("accel.interceptor")
    fake.enable = lambda: calls.append("enable")
    fake.disable = lambda: calls.append("disable")
    monkeypatch.setitem(sys.modules, "accel.interceptor", fake)
    return calls


SCRIPT = """
import sys, helper
with open(sys.argv[1], "w") as f:
    f.write(repr(sys.argv) + " " + helper.NAME + " " + __name__)
if "--fail" in sys.argv:
    sys.exit(3)
"""


def _script(tmp_path):
    (tmp_path / "helper.py").write_text("NAME = 'helper'\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    return str(tmp_path / "script.py")


def test_run(tmp_path, cache_dir, fake_interceptor):
    script, out = _script(tmp_path), tmp_path / "out.txt"
    argv0, path0 = sys.argv[:], sys.path[:]
    assert main(["run", script, str(out), "--foo", "-x"]) == 0
    assert out.read_text() == repr([script, str(out), "--foo", "-x"]) + " helper __main__"
    assert fake_interceptor == ["enable", "disable"]
    assert sys.argv == argv0 and sys.path == path0


def test_run_propagates_exit_code(tmp_path, cache_dir, fake_interceptor):
    assert main(["run", _script(tmp_path), str(tmp_path / "out.txt"), "--fail"]) == 3
    assert fake_interceptor == ["enable", "disable"]


def test_run_real_interceptor(tmp_path, cache_dir):
    pytest.importorskip("accel.interceptor")
    out = tmp_path / "out.txt"
    assert main(["run", _script(tmp_path), str(out), "--foo"]) == 0
    assert "'--foo'" in out.read_text()


def test_run_missing_script(tmp_path, capsys, fake_interceptor):
    assert main(["run", str(tmp_path / "nope.py")]) == 1
    assert "no such file" in capsys.readouterr().err and fake_interceptor == []


def test_demo(monkeypatch):
    seen = []
    fake = types.ModuleType("accel.demo")
    fake.main = lambda args: seen.append(args) or 7
    monkeypatch.setitem(sys.modules, "accel.demo", fake)
    assert main(["demo", "--size", "3"]) == 7 and seen == [["--size", "3"]]


def test_demo_end_to_end(fresh_store, capsys):
    """The real demo on a tiny GPT-2: PASS (loss and every gradient match eager); a second
    run in this process compiles nothing."""
    pytest.importorskip("transformers")
    from accel import demo

    args = ["--steps", "1", "--layers", "1", "--embd", "32", "--heads", "2", "--seq", "16",
            "--batch", "2"]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "PASS: loss" in out and "gradients match eager" in out
    accel.reset_stats()
    assert demo.main(args) == 0
    assert accel.stats()["compiles"] == 0 and accel.stats()["eager_replays"] == 0
