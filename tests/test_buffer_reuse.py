"""Where regions' large CPU outputs live (accel/allocator.py's ``configure``, accel/_core.pyx's
``reuse_blocks``): the output pool where malloc maps each large block afresh; elsewhere the
heap, with each live output moved at the flush onto the block of the region's earliest dead
intermediate of its size (buffer reuse). Moved or not, every result is eager's."""
import ctypes
import os
import subprocess
import sys

import pytest
import torch

import accel
from accel import allocator, dispatch
from accel.region import native

close = torch.testing.assert_close
ROWS = 512  # [512, 1024] float32: 2 MiB, above allocator.MIN_BLOCK
_ptr = torch._C.TensorBase.data_ptr  # the raw address: Tensor.data_ptr would flush first

needs_helper = pytest.mark.skipif(native.__name__.endswith("_core_py"),
                                  reason="buffer reuse needs the native core")


@pytest.fixture
def no_pool(monkeypatch):
    """The pool off (as ACCEL_CPU_POOL=auto chooses where the heap reuses freed memory),
    the dispatch filter loaded (its C++ helper moves the blocks)."""
    monkeypatch.setenv("ACCEL_CPU_POOL", "off")
    with accel.eager():
        torch.ones(4).neg()
    if not dispatch.wait(180):
        pytest.skip(f"dispatch filter not loaded: {dispatch.off_reason()}")


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(ROWS, 1024)


@needs_helper
def test_live_output_takes_the_earliest_dead_intermediates_block(x, no_pool):
    before = accel.stats()["kernel_runs"]
    with accel.eager():
        a = x * 2
        first = _ptr(a)
        b = a.sin()
        del a
        c = b + 1
        del b
        own = _ptr(c)
    assert accel.stats()["kernel_runs"] == before + 1
    assert own != first and _ptr(c) == first
    close(c, (x * 2).sin() + 1)


@needs_helper
def test_views_taken_before_the_flush_follow_the_moved_block(x, no_pool):
    with accel.eager():
        a = x * 3
        first = _ptr(a)
        c = a.cos()
        del a
        v = c[1:]
        w = c.t()
    assert _ptr(c) == first and _ptr(v) == first + 1024 * 4 and _ptr(w) == first
    want = (x * 3).cos()
    close(c, want)
    close(v, want[1:])
    close(w, want.t())


@needs_helper
def test_outputs_saved_by_autograd_are_moved_intact(x, no_pool):
    """exp saves its result for the backward: the saved tensor shares the moved block, and
    its version counter is unchanged (the backward checks it)."""
    xg = x.clone().requires_grad_()
    with accel.eager():
        a = xg * 0.5
        first = _ptr(a)
        y = torch.exp(a)
        del a
        loss = y.sum()
    assert _ptr(y) == first and y._version == 0
    loss.backward()
    close(xg.grad, 0.5 * torch.exp(x * 0.5))


@needs_helper
def test_no_move_onto_a_block_of_another_size(x, no_pool):
    with accel.eager():
        a = x[:ROWS // 2] * 2  # dead, half the live output's size
        del a
        c = x * 3
        own = _ptr(c)
    assert _ptr(c) == own
    close(c, x * 3)


@needs_helper
def test_pool_on_moves_nothing(x, monkeypatch):
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")
    with accel.eager():
        torch.ones(4).neg()
    assert dispatch.wait(180)
    with accel.eager():
        a = x * 2
        b = a.sin()
        del a
        own = _ptr(b)
    assert _ptr(b) == own
    close(b, (x * 2).sin())


@needs_helper
def test_the_helper_takes_only_unshared_dead_blocks_of_one_size():
    """``accel_reuse_blocks`` called directly: a dead output whose storage something else
    holds is not a donor; one output moves onto the earliest dead block of its size; bad
    arguments raise."""
    assert dispatch.wait(180)
    obj = ctypes.py_object
    reuse = ctypes.PYFUNCTYPE(obj, obj, obj, ctypes.c_ssize_t)(
        ctypes.cast(dispatch._lib.accel_reuse_blocks, ctypes.c_void_p).value)
    dead_held, dead1, dead2, live = (torch.empty(1 << 18) for _ in range(4))
    view = dead_held[1:]
    p = [_ptr(t) for t in (dead_held, dead1, dead2, live)]
    outs = [dead_held, dead1, dead2, live]
    assert reuse(outs, (3,), 1 << 20) == 1
    assert _ptr(live) == p[1] and _ptr(dead1) == p[3]  # the earliest unshared donor
    assert _ptr(dead_held) == p[0] and _ptr(view) == p[0] + 4 and _ptr(dead2) == p[2]
    assert reuse(outs, (3,), 2 << 20) == 0  # under the size threshold
    assert reuse([torch.empty(1 << 19), live], (1,), 1 << 20) == 0  # other sizes
    with pytest.raises(TypeError):
        reuse([1, live], (1,), 1)
    with pytest.raises(IndexError):
        reuse(outs, (4,), 1)


def test_without_the_filter_results_are_the_same(x, monkeypatch):
    """No dispatch filter (no helper), or the pure-Python core: nothing moves, nothing
    differs."""
    monkeypatch.setenv("ACCEL_CPU_POOL", "off")
    code = ("import torch, accel\n"
            "x = torch.randn(512, 1024)\n"
            "with accel.eager():\n"
            "    a = x * 2\n    b = a.sin()\n    del a\n"
            "torch.testing.assert_close(b, (x * 2).sin())\n"
            "print('ok')\n")
    for extra in ({"ACCEL_DISPATCH_FILTER": "0"}, {"ACCEL_PURE_PYTHON": "1"}):
        p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **extra},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


_PROBE = ("from accel import allocator\n"
          "print(allocator.maps_large_blocks(), allocator.configure(1024, 'auto'),"
          " allocator.configure(1024, 'on'), allocator.configure(1024, 'off'),"
          " allocator.configure(0, 'on'))\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("tuning, want", [
    ({}, "True True True False False"),  # glibc's defaults: each 64 MiB block mmapped afresh
    ({"MALLOC_MMAP_THRESHOLD_": str(1 << 30)}, "False False True False False"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "False False True False False"),
])
def test_auto_uses_the_pool_only_where_malloc_maps_large_blocks(tuning, want):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    p = subprocess.run([sys.executable, "-c", _PROBE], env={**env, **tuning},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    if p.stdout.split()[0] == "None":
        pytest.skip("no mallinfo2 (glibc < 2.33)")
    assert p.stdout.strip() == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("imports, env, want", [
    ("import torch, accel", {}, "False"),  # tuned at import: torch came first
    ("import torch, accel", {"ACCEL_MALLOC_TUNING": "0"}, "True"),
    ("import torch, accel", {"ACCEL_DISABLE": "1"}, "True"),
    ("import torch, accel", {"ACCEL_MALLOC_TUNING": "maybe"}, "True"),  # the enable reports it
    ("import accel, torch", {}, "True"),  # the CLI's order: tuned at the first enable
])
def test_import_tunes_malloc_where_torch_came_first(imports, env, want):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "ACCEL_MALLOC_TUNING"))}
    code = imports + "\nfrom accel import allocator\nprint(allocator.maps_large_blocks())\n"
    p = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    if p.stdout.strip() == "None":
        pytest.skip("no mallinfo2 (glibc < 2.33)")
    assert p.stdout.strip() == want


def test_accels_own_malloc_tuning_turns_the_pool_off(x, monkeypatch):
    """ACCEL_MALLOC_TUNING (on by default) keeps large blocks in the heap: from the first
    enable on, auto chooses the heap."""
    monkeypatch.setenv("ACCEL_CPU_POOL", "auto")
    monkeypatch.setenv("ACCEL_MALLOC_TUNING", "1")
    with accel.eager():
        y = torch.sin(x) * 2
    close(y, torch.sin(x) * 2)
    if allocator.maps_large_blocks() is None:
        pytest.skip("no mallinfo2 (glibc < 2.33)")
    assert allocator.maps_large_blocks() is False
    assert allocator.pool_stats()["capacity_bytes"] == 0


def test_an_invalid_pool_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCEL_CPU_POOL", "sometimes")
    with pytest.raises(accel.ConfigError, match="ACCEL_CPU_POOL=.*auto, on, off"):
        with accel.eager():
            pass
