"""The CUDA backend: streams, devices, no host synchronization, fallbacks. The OpInfo and
hypothesis suites (test_opinfo*.py, test_chains.py) also run on "cuda". Every test here
skips cleanly on a machine without a GPU; tests/gpu.sh runs them on one."""
import contextlib
import math
import os
import re
import shutil
import sys

import pytest
import torch

import accel
from accel.codegen.cuda import CudaRenderer

aten = torch.ops.aten
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
F = torch.nn.functional


def _x(*shape, device="cuda", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the other test modules' helpers)


def _lowered(*args):
    """The loop IR of recorded calls (tests/test_pipeline.py's helper: trace, passes, lower)."""
    from test_pipeline import _lowered as lowered

    return lowered(*args)


def _run(fn, *args):
    accel.reset_stats()
    with accel.eager():
        out = fn(*args)
    return out, accel.stats()


WORKLOADS = {
    "chain": lambda x: torch.sin(x) * torch.exp(-x * x) + 0.5 * torch.tanh(x),
    "softmax": lambda x: torch.softmax(x * 0.125, -1),
    "layer_norm": lambda x: F.layer_norm(x + 1, [x.shape[-1]]),
    "rms": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "column_sum": lambda x: (x * 2).sum(0),
    "full_sum": lambda x: x.sum(),
    "argmax": lambda x: (x + 1).argmax(1),
    "var_mean": lambda x: torch.var_mean(x * 3, 1),
    "column_var": lambda x: torch.var(x * 3, 0),
    "column_sums_split": lambda x: (x * 2).sum(0) + (x * x).sum(0),
    "column_max": lambda x: (x + 1).max(0),  # values and indices; rows split among blocks
    # float -> int64/int32 -> float (the CPU backend's trunc_to and trapping math; CUDA's cast)
    "conversions": lambda x: (x * 3).long() * 2 + (x * 7).int().float(),
    # groups of 2 channels: block loops over (channel, position), vectors along positions
    "group_norm": lambda x: F.silu(F.group_norm(x.reshape(x.shape[0] // 4, 4, -1), 2)),
    # over the rows: column mode, one pass of running (max, sum) pairs (accel::SoftmaxState)
    "column_softmax": lambda x: torch.softmax(x * 2, 0),
    # a boolean result: past GRID_MIN values (grid mode), partials of bool read back
    "full_any": lambda x: (x > 3).amax(),
}


@cuda
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_kernels_run_on_the_gpu_and_match_eager(name):
    x = _x(64, 300)
    expected = WORKLOADS[name](x)
    actual, st = _run(WORKLOADS[name], x)
    torch.testing.assert_close(actual, expected)
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_results_of_kernels_launched_ahead_match_eager(name, device, monkeypatch):
    """Each workload, called again and again with new inputs of one shape: from the third
    call its kernel is launched ahead (on the CPU too, under ``ACCEL_LAUNCH_AHEAD=all``),
    and every result is eager's."""
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD", "all")
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", "0")  # small tensors too
    fn = WORKLOADS[name]
    accel.reset_stats()
    # a shape per workload: workloads whose first calls agree (x + 1) would otherwise share
    # the first call's prediction, mispredict for one another and back off
    shape = (48, 352 + list(WORKLOADS).index(name))
    x = _x(*shape, device=device)
    for seed in range(5):
        x.copy_(_x(*shape, device=device, seed=seed))  # the same input tensor, new values
        with accel.eager():
            actual = fn(x)
        torch.testing.assert_close(actual, fn(x))
    st = accel.stats()
    assert st["speculative_hits"] >= 2 and st["speculative_misses"] == 0, st


#: shapes that take each kernel mode: elementwise with 16-byte vectors (innermost size a
#: multiple of 4) and without; column sums in whole warps (column mode) and not; full
#: reductions past GRID_MIN (grid mode) and below; long rows (block-strided) and short.
def _ln_grads(x, loss_sum=False):
    """A layer norm's gradients (its weight and bias gradients are column sums with per-row
    operands); ``loss_sum``: of ``y.sum()``, whose gradient is one value expanded."""
    xr = x.detach().requires_grad_()
    w = torch.linspace(0.5, 1.5, x.shape[1], device=x.device, dtype=x.dtype).requires_grad_()
    b = torch.zeros(x.shape[1], device=x.device, dtype=x.dtype, requires_grad=True)
    y = F.layer_norm(xr, [x.shape[1]], w, b)
    if loss_sum:
        y.sum().backward()
    else:
        y.backward(torch.cos(x))
    return torch.cat([xr.grad.flatten(), w.grad, b.grad])


MODES = [
    ("vector_chain", WORKLOADS["chain"], (256, 1024)),
    ("odd_chain", WORKLOADS["chain"], (33, 37)),
    ("column_sum_warps", WORKLOADS["column_sum"], (2048, 256)),
    ("column_var", lambda x: torch.var(x * 3, 0), (1000, 96)),
    ("column_amax", lambda x: (x - 1).amax(0), (3000, 64)),
    ("column_sum_split", WORKLOADS["column_sum"], (4096, 256)),
    ("column_sums_split", WORKLOADS["column_sums_split"], (8192, 96)),
    ("column_amax_split", lambda x: (x - 1).amax(0), (8000, 64)),
    ("layer_norm_grads", _ln_grads, (4096, 256)),
    ("layer_norm_grads_of_sum", lambda x: _ln_grads(x, True), (4096, 256)),
    ("grid_sum", WORKLOADS["full_sum"], (1024, 1000)),
    ("grid_mean_sqrt", lambda x: (x * x).mean().sqrt(), (512, 512)),
    ("grid_sum_unaligned", lambda x: (x.flatten()[1:-3] * 2).sum(), (512, 512)),  # (its scalar variant)
    ("grid_amax", lambda x: x.abs().amax(), (300, 1000)),
    ("grid_any", lambda x: (x.abs() > 4).amax().to(x.dtype), (300, 1000)),
    ("grid_all", lambda x: (x.abs() < 4).amin().to(x.dtype), (300, 1000)),
    ("long_softmax", WORKLOADS["softmax"], (8, 40000)),
    ("column_softmax", WORKLOADS["column_softmax"], (1000, 96)),
    ("column_log_softmax_split", lambda x: torch.log_softmax(x, 0), (8192, 64)),
    ("layer_norm_4096", WORKLOADS["layer_norm"], (64, 4096)),
    # few long rows, each split among blocks (CudaRenderer._row_split): a batch norm's
    # channel sums, its Welford statistics, a long row's arg and maximum
    ("row_split_channel_sums", lambda x: torch.stack([(x * 2).sum((0, 2)), (x * x).sum((0, 2))]), (64, 8, 4096)),
    ("row_split_var_mean", lambda x: torch.cat(torch.var_mean(x, (0, 2))), (64, 8, 4096)),
    ("row_split_argmax", lambda x: (x * 2).argmax(-1).to(x.dtype), (4, 262144)),
    ("row_split_amax", lambda x: (x - 1).amax(-1), (4, 262144)),
]


@cuda
@pytest.mark.parametrize("name,fn,shape", MODES, ids=[m[0] for m in MODES])
def test_every_kernel_mode_is_correct(name, fn, shape):
    """Against the float64 result rounded to float32: accel's sums accumulate in float64,
    eager's CUDA column and full sums in float32, whose own error over thousands of
    values near cancellation exceeds float32's default tolerance."""
    x = _x(*shape)
    expected = fn(x.double()).float()
    actual, st = _run(fn, x)
    torch.testing.assert_close(actual, expected)
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
    again, _ = _run(fn, x)  # grid mode's ticket counter is reset for the next launch
    torch.testing.assert_close(again, expected)


def _with_special_values(x, dim):
    """``x`` (2-d) with special values along its reduced dim ``dim``, in lines 0-7 of the
    other: all -inf, -inf in the first half only, one +inf, two +inf, a NaN, -inf and +inf
    together, values near float32's largest, -inf in the second half only."""
    t = x.movedim(dim, -1)  # a view: the writes land in x
    n = t.shape[-1]
    h = n // 2
    t[0] = -math.inf
    t[1, :h] = -math.inf
    t[2, 7] = math.inf
    t[3, [5, n - 3]] = math.inf
    t[4, n - 1] = math.nan
    t[5, 3], t[5, 9] = -math.inf, math.inf
    t[6] = t[6] * 1e37
    t[7, h:] = -math.inf
    return x


def _check_against_float64(fns, x) -> None:
    """Each of ``fns`` on ``x`` under accel, in a kernel: within float32's tolerance of the
    float64 result, NaN exactly where eager's float32 result is NaN."""
    for fn in fns:
        actual, st = _run(fn, x)
        torch.testing.assert_close(actual, fn(x.double()).float(), equal_nan=True)
        assert torch.equal(actual.isnan(), fn(x).isnan())
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


@cuda
@pytest.mark.parametrize("rows", [1000, 8192], ids=["one_block", "rows_split"])
def test_column_softmax_special_values(rows):
    """Softmax and log-softmax over the rows of [rows, 128] (column mode: a running max and
    sum a thread, merged across threads and, for 8192 rows, across blocks): columns all
    -inf, -inf in the first half of the rows only (a block's partial without a finite
    value), one +inf, two +inf, a NaN, -inf and +inf together, and very large values.
    Against the float64 result rounded to float32, special values alike (eager's float32
    sums over 8192 rows are themselves up to 3e-5 off it); NaN where eager's is NaN."""
    x = _with_special_values(_x(rows, 128, seed=3) * 4, 0)
    _check_against_float64([lambda t: torch.softmax(t, 0), lambda t: torch.log_softmax(t, 0)], x)


@cuda
@pytest.mark.parametrize("cols", [4096, 40000])
def test_row_softmax_special_values(cols):
    """Softmax, log-softmax and logsumexp over rows of 4096 values (a row kernel; with
    ``y.t()`` added to the softmax, its statistics alone in one) and of 40000 (block loops: a
    running max and sum a thread, merged across the block): rows all -inf, -inf in the
    first half only, one +inf, two +inf, a NaN, -inf and +inf together, very large values.
    Against the float64 result rounded to float32; NaN where eager's is NaN."""
    x = _with_special_values(_x(64, cols, seed=4) * 4, 1)
    y = _x(cols, 64, seed=5)
    _check_against_float64([lambda t: torch.softmax(t, -1), lambda t: torch.log_softmax(t, -1),
                            lambda t: torch.logsumexp(t, -1), lambda t: torch.softmax(t, -1) + y.t().to(t.dtype)], x)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["t_add", "t_add_run16", "softmax_t_add"])
def test_transposing_tiles_match_eager(case, dtype):
    """Nests that read an input across the rows they write run in shared-memory tiles, the
    elements' other loads read into registers before the tile's barrier: ``x.t() + y`` over
    sizes that are not multiples of the tile (tiles of 32 x 32, edge tiles), a transposed
    run of 16 values (tiles of 16 x 64: a warp reads two runs, the threads take the tile's
    values in turn), and a softmax's output plus ``y.t()`` (its per-row values once a tile
    in shared memory, ``x`` read ahead): every result as eager's."""
    if case == "t_add":
        fn, a, b = (lambda p, q: p.t() + q), _x(1000, 600, seed=1), _x(600, 1000, seed=2)
    elif case == "t_add_run16":
        fn, a, b = (lambda p, q: p.t() * 0.5 + q), _x(4100, 64, seed=3)[:, :16], _x(16, 4100, seed=4)
    else:
        fn, a, b = (lambda p, q: p.softmax(-1) + q.t()), _x(333, 1000, seed=5), _x(1000, 333, seed=6)
    a, b = a.to(dtype), b.to(dtype)
    actual, st = _run(fn, a, b)
    torch.testing.assert_close(actual, fn(a, b))
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


@cuda
@pytest.mark.parametrize("groups", [8, 32])
def test_channels_last_group_norm_matches_eager(groups):
    """A channels-last GroupNorm written contiguous (torch 2.11's CUDA group norm): its
    output's tiles take a position's 128 channels as one run, whatever the group's
    channels (16 or 4)."""
    x = _x(4, 128, 16, 16, seed=5).contiguous(memory_format=torch.channels_last)
    w, b = _x(128, seed=6) + 1, _x(128, seed=8)
    fn = lambda t: F.group_norm(t, groups, w, b)
    actual, st = _run(fn, x)
    torch.testing.assert_close(actual, fn(x))
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


@cuda
@pytest.mark.parametrize("dtype,offset", [(torch.float32, 1e6), (torch.float64, 1e9)])
@pytest.mark.parametrize("name,fn,shape", [
    ("row_layer_norm", lambda x: torch.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)[1:], (64, 4096)),
    ("row_var", lambda x: torch.var_mean(x, 1), (64, 1000)),
    ("column_var", lambda x: torch.var(x * 1, 0), (4096, 64)),
    ("thread_var", lambda x: torch.var(x.t() * 1, 1), (300, 16)),
], ids=lambda v: v if isinstance(v, str) else None)
def test_variance_far_from_zero(name, fn, shape, dtype, offset):
    """Values whose mean is far larger than their spread: a sum of squares minus the
    squared sum cancels to noise; every kernel mode's moments (shifted sums) match the
    float64 result. (LayerNorm's mean and rstd: its output, x - mean in the input's
    precision, is as far off the float64 result in eager.)"""
    x = (_x(*shape, seed=7).to(dtype) + offset)
    expected = fn(x.double())
    actual, st = _run(fn, x)
    torch.testing.assert_close(actual, tuple(e.to(dtype) for e in expected) if isinstance(expected, tuple)
                               else expected.to(dtype))
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


@cuda
@pytest.mark.parametrize("shape", [(16, 24576), (8, 40000), (4, 65536)], ids=str)
@pytest.mark.parametrize("name,dtype", [  # a GPU's 16-bit group norm runs eagerly (ops.RUNS_EAGERLY)
    (n, d) for n in ("softmax", "layer_norm", "rms", "group_norm")
    for d in (torch.float32, torch.bfloat16, torch.float16) if n != "group_norm" or d == torch.float32],
    ids=lambda v: str(v)[6:] if isinstance(v, torch.dtype) else v)
def test_long_rows_match_eager(name, shape, dtype):
    """Rows a thread keeps up to 32 values of in registers (24576 float32 values on 1024
    threads), and longer rows and group norm's groups, which block loops read twice in
    16-byte vectors (4 float32 or 8 16-bit values a thread at a time): every result as
    eager's, aligned (the vector variant) and one element off (the scalar one)."""
    fn = WORKLOADS[name]
    base = _x(shape[0] * shape[1] + 8).to(dtype)
    for x in (base[: shape[0] * shape[1]].view(shape), base[1: shape[0] * shape[1] + 1].view(shape)):
        actual, st = _run(fn, x)
        torch.testing.assert_close(actual, fn(x))
        assert st["kernel_runs"] == 1 and st["eager_replays"] == 0, st


@cuda
@pytest.mark.parametrize("name", ["chain", "softmax", "layer_norm", "rms"])
def test_misaligned_operands_take_the_scalar_kernel(name):
    """A view starting 4 bytes into its storage is not 16-byte aligned: the same kernel
    (same key) chooses its scalar variant at launch (elementwise and row kernels)."""
    base = _x(4097 * 64)
    aligned, shifted = base[: 4096 * 64].view(64, 4096), base[1: 4096 * 64 + 1].view(64, 4096)
    fn = WORKLOADS[name]
    for x in (aligned, shifted, aligned):
        actual, st = _run(fn, x)
        torch.testing.assert_close(actual, fn(x))
        assert st["kernel_runs"] == 1, st


@cuda
def test_no_host_synchronization():
    """Deferring and launching never waits for the GPU (torch raises on a synchronizing
    call in sync-debug mode "error")."""
    x = _x(128, 256)
    _run(WORKLOADS["softmax"], x)  # compile (and probe) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with accel.eager():
            y = torch.softmax(x * 0.125, -1) + 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(y, torch.softmax(x * 0.125, -1) + 1)


@cuda
def test_launches_on_the_current_stream():
    x = _x(256, 512)
    _run(WORKLOADS["chain"], x)  # compiled
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y, st = _run(WORKLOADS["chain"], x)
    s.synchronize()
    assert st["kernel_runs"] == 1
    torch.testing.assert_close(y, WORKLOADS["chain"](x))


def _rms_w(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


@cuda
def test_kernel_is_launched_ahead_without_host_synchronization(monkeypatch):
    """By default (ACCEL_LAUNCH_AHEAD=cuda) a region seen twice ending alike has its kernel
    launched at its first call, and the flush keeps that result; never waiting for the GPU."""
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", "0")  # small tensors too
    x, w = _x(96, 320), _x(320, seed=1)
    accel.reset_stats()
    for _ in range(3):
        with accel.eager():
            y = _rms_w(x, w)
        torch.testing.assert_close(y, _rms_w(x, w))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with accel.eager():
            y = _rms_w(x, w)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(y, _rms_w(x, w))
    st = accel.stats()
    assert st["speculative_hits"] >= 2 and st["speculative_misses"] == 0, st


@cuda
def test_launch_ahead_on_another_stream_than_the_flush(monkeypatch):
    """The current stream changes between the launch ahead and the flush: the region runs
    again on the new stream, ordered after the launch ahead."""
    monkeypatch.setenv("ACCEL_LAUNCH_AHEAD_MIN_MB", "0")  # small tensors too
    x, w = _x(96, 336), _x(336, seed=1)
    for _ in range(3):
        with accel.eager():
            _rms_w(x, w)
    accel.reset_stats()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with accel.eager():
        sq = x * x  # launched ahead on the default stream
        with torch.cuda.stream(s):
            y = x * torch.rsqrt(sq.mean(-1, keepdim=True) + 1e-6) * w
            del sq
            accel.flush()  # on s
    s.synchronize()
    torch.testing.assert_close(y, _rms_w(x, w))
    st = accel.stats()
    assert st["speculative_launches"] == 1 and st["speculative_misses"] == 1, st


def _late(n=256):
    """A [n, n] matrix of n's that a matmul fills after ~30 ms of other work on the current
    stream: read early, on another stream, it still holds -1."""
    a = torch.full((n, n), -1.0, device="cuda")
    m = torch.ones(n, n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    torch.mm(m, m, out=a)
    return a, m


@cuda
def test_a_side_stream_does_not_take_the_pending_region():
    """A region pending on the default stream when the program enters another stream's
    context is launched on the default stream (eager launched it there): entering the
    context flushes it. Launched on the side stream, it would read its input early."""
    s = torch.cuda.Stream()
    for _ in range(3):
        with accel.eager():
            a, m = _late()
            y = (a * 3 + 1) * 0.5 - 0.5  # pending: 384
            with torch.cuda.stream(s):
                torch.mm(m, m)  # not fused: a flush here would be on s
            w = y.sum(1)
        torch.cuda.synchronize()
        torch.testing.assert_close(w, torch.full((256,), 256 * 384.0, device="cuda"))


@cuda
def test_an_event_recorded_after_a_pending_region_covers_it():
    """Event.record (and Stream.wait_stream, which records one) flushes first: another
    stream waiting on the event sees the region's results."""
    s = torch.cuda.Stream()
    for wait in ("event", "stream"):
        with accel.eager():
            a, m = _late()
            y = (a * 3 + 1) * 0.5 - 0.5  # pending: 384
            if wait == "event":
                ev = torch.cuda.Event()
                ev.record()
                s.wait_event(ev)
            else:
                s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                z = torch.mm(y, m)
            torch.cuda.current_stream().wait_stream(s)
        torch.testing.assert_close(z, torch.full((256, 256), 256 * 384.0, device="cuda"))


@cuda
@pytest.mark.parametrize("warm_up", [True, False])
def test_cuda_graph_capture_and_replay(warm_up):
    """Regions recorded while a CUDA graph is captured are flushed into it at capture_end
    (their kernels built and loaded during the capture where the warm-up did not); a copy
    into the graph's static input is flushed before each replay."""
    def f(t):
        return (t.sin() * 2).exp() + t.mean(-1, keepdim=True)

    x = _x(512, 1024, seed=3)
    g = torch.cuda.CUDAGraph()
    with accel.eager():
        if warm_up:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    f(x)
            torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = f(x)
    for seed in (4, 5, 6):
        new = _x(512, 1024, seed=seed)
        with accel.eager():
            x.copy_(new * 1.0)  # pending until the replay
            g.replay()
            got = y * 1.0
        torch.testing.assert_close(got, f(new))


@cuda
def test_make_graphed_callables():
    """torch.cuda.make_graphed_callables under accel: forward and backward captured and
    replayed, matching eager's outputs and gradients."""
    def run(accelerated):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 256)).cuda()
        out = []
        with accel.eager() if accelerated else contextlib.nullcontext():
            gm = torch.cuda.make_graphed_callables(model, (torch.randn(64, 256, device="cuda",
                                                                       requires_grad=True),))
            for seed in range(3):
                xi = _x(64, 256, seed=seed).requires_grad_()
                o = gm(xi)
                (o * o).sum().backward()
                out.append((o.detach().clone(), xi.grad.clone()))
        return out, [p.grad.clone() for p in model.parameters()]

    torch.testing.assert_close(run(True), run(False))


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two GPUs")


@two_gpus
def test_second_gpu_and_device_guard():
    """A region runs on its tensors' GPU whatever the current device is (each GPU loads
    its own module), and launching leaves the current device as it was."""
    for dev, current in (("cuda:1", 0), ("cuda:0", 1), ("cuda:1", 1)):
        x = _x(64, 128, device=dev)
        with torch.cuda.device(current):
            y, st = _run(WORKLOADS["softmax"], x)
            assert torch.cuda.current_device() == current
        assert y.device == x.device and st["kernel_runs"] == 1
        torch.testing.assert_close(y, WORKLOADS["softmax"](x))


def _block(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                               torch.nn.Linear(128, 64), torch.nn.SiLU()).to(device)


def _sgd_steps(model, forward, xs, ctx):
    """SGD with momentum on ``forward(x)``'s mean square, a step for each input of ``xs``,
    each under ``ctx()``; the losses and parameters, on the CPU."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in xs:
        with ctx():
            loss = forward(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.detach())  # nothing read back between the steps
    return torch.stack(losses).cpu(), [p.detach().cpu() for p in model.parameters()]


def _trains_as_eager(make, forward, xs):
    """``make()`` trained eagerly and under accel (``forward(model, x)``) give the same
    losses and parameters; accel ran kernels."""
    me, ma = make(), make()
    want = _sgd_steps(me, lambda x: forward(me, x), xs, contextlib.nullcontext)
    accel.reset_stats()
    got = _sgd_steps(ma, lambda x: forward(ma, x), xs, accel.eager)
    st = accel.stats()
    assert st["kernel_runs"] >= 1, st
    torch.testing.assert_close(got, want)


@two_gpus
def test_training_on_the_second_gpu_matches_eager():
    """A model on cuda:1 while the current device is cuda:0: its forward's regions on the
    calling thread, its backward's on autograd's device thread of GPU 1."""
    xs = [_x(32, 64, device="cuda:1", seed=k) for k in range(3)]
    _trains_as_eager(lambda: _block("cuda:1"), lambda m, x: m(x), xs)
    assert torch.cuda.current_device() == 0


@two_gpus
def test_a_model_split_across_two_gpus_trains_as_eager():
    """Pipeline-style model parallelism: the first layers on cuda:0, the rest on cuda:1,
    activations moved between them. The backward runs on both GPUs' device threads, each
    recording into a region of its own and flushing it at the pass's end."""
    def make():
        m = _block("cpu")
        m[:3].to("cuda:0")
        m[3:].to("cuda:1")
        return m

    xs = [_x(32, 64, device="cuda:0", seed=k) for k in range(3)]
    _trains_as_eager(make, lambda m, x: m[3:](m[:3](x).to("cuda:1")), xs)


@two_gpus
@pytest.mark.parametrize("one_block", [False, True], ids=["a-block-a-step", "one-block"])
def test_data_parallel_on_two_gpus_matches_eager(one_block):
    """``nn.DataParallel`` (replicas on both GPUs, run in threads of its own) trains as
    eager under accel. Its backward reduces the replicas' parameter gradients on one GPU's
    device thread (``comm.reduce_add_coalesced``, reading memory in C++) while the other
    GPU's device thread may still hold its share pending; in one block, the optimizer's
    deferred updates are what the next step's replication reads."""
    xs = [_x(32, 64, device="cuda:0", seed=k) for k in range(3)]

    def forward(m, x):
        return torch.nn.DataParallel(m, device_ids=[0, 1])(x)

    if not one_block:
        _trains_as_eager(lambda: _block("cuda:0"), forward, xs)
        return

    me, ma = _block("cuda:0"), _block("cuda:0")
    want = _sgd_steps(me, lambda x: forward(me, x), xs, contextlib.nullcontext)
    with accel.eager():
        got = _sgd_steps(ma, lambda x: forward(ma, x), xs, contextlib.nullcontext)
    torch.testing.assert_close(got, want)


@two_gpus
def test_values_moved_between_gpus_match_eager():
    """Regions on either side of copies between GPUs (``.to``: eager, one region ends and
    another starts on the other GPU), and a call that mixes GPUs raises eager's error."""
    def fn(x0):
        a = torch.sin(x0) * 2 + 1
        b = a.to("cuda:1") * 3 - x0.to("cuda:1").exp()
        c = (b * b).sum(1).to("cuda:0") * a.mean(1)
        return a, b, c

    x0 = _x(64, 300, device="cuda:0")
    got, st = _run(fn, x0)
    assert [t.device.index for t in got] == [0, 1, 0]
    assert st["kernel_runs"] >= 2, st
    torch.testing.assert_close(got, fn(x0))
    x1 = _x(64, 300, device="cuda:1")
    with pytest.raises(RuntimeError) as eager_error:
        torch.sin(x0) + x1
    with pytest.raises(RuntimeError) as accel_error:
        with accel.eager():
            y = torch.sin(x0) * 2
            (y + x1).sum().item()
    assert str(accel_error.value).splitlines()[0] == str(eager_error.value).splitlines()[0]


@two_gpus
def test_a_region_on_the_second_gpu_launches_on_that_gpus_current_stream():
    """The current stream of the region's GPU, not of the current device: a side stream of
    cuda:1, current there, while the current device is cuda:0. Its input is written on
    that stream after a 50 ms sleep; launched on any other stream, the kernel would read it
    before it is written."""
    s = torch.cuda.Stream(device="cuda:1")
    for _ in range(3):
        with torch.cuda.stream(s):
            with torch.cuda.device(1):
                a = torch.full((256, 256), -1.0, device="cuda:1")
                m = torch.ones(256, 256, device="cuda:1")
                s.synchronize()
                torch.cuda._sleep(50_000_000)
                torch.mm(m, m, out=a)  # on s: 256s, late
            with torch.cuda.device(0):
                assert torch.cuda.current_stream(1) == s
                with accel.eager():
                    y = (a * 3 + 1) * 0.5 - 0.5
                    w = y.sum(1)
        s.synchronize()
        torch.testing.assert_close(w, torch.full((256,), 256 * 384.0, device="cuda:1"))


class _GpuAndCpuOutputs(torch.autograd.Function):
    """Outputs on the GPU and on the CPU: its backward runs on the GPU's device thread,
    one of its inputs a CPU gradient that the calling thread computed."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x.cpu() * 3

    @staticmethod
    def backward(ctx, g_gpu, g_cpu):
        return g_gpu * 2 + g_cpu.cuda() * 3


@cuda
def test_a_cpu_gradient_read_on_the_device_thread_is_filled():
    """A backward pass with CPU and CUDA nodes: the CPU gradient of ``_GpuAndCpuOutputs``
    (a fusible chain's, on the calling thread) is read on autograd's device thread as soon
    as it is computed. Deferred there, it was read unfilled: gradients off by 3.0, or
    9e25, at every step."""
    def run(ctx):
        x = torch.linspace(-2, 2, 256 * 256, device="cuda").view(256, 256).requires_grad_()
        with ctx():
            a, b = _GpuAndCpuOutputs.apply(x)
            loss = a.sin().sum() + (b.cos() * 2 + 1).sum() * 0.5
            loss.backward()
        return x.grad

    want = run(contextlib.nullcontext)
    for _ in range(3):
        torch.testing.assert_close(run(accel.eager), want)


@cuda
def test_cpu_and_gpu_tensors_do_not_share_a_region():
    a, b = _x(16, 16), _x(16, 16, device="cpu")
    with accel.eager():
        y = a * 2
        z = b * 2  # another device: the region flushes, a new one starts
    torch.testing.assert_close(y, a * 2)
    torch.testing.assert_close(z, b * 2)


@cuda
def test_missing_nvcc_falls_back(fresh_store, monkeypatch):
    monkeypatch.setenv("ACCEL_NVCC", "/nonexistent/nvcc")
    x = _x(32, 64, seed=3)
    y, st = _run(WORKLOADS["chain"], x)
    torch.testing.assert_close(y, WORKLOADS["chain"](x))
    assert st["kernel_runs"] == 0


def test_cuda_source_renders_without_a_gpu():
    """The CUDA backend is plain code generation: it renders here too (golden-style)."""
    x = torch.empty(64, 100)
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x],
                  [((64, 100), (100, 1), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert 'extern "C" __global__ void __launch_bounds__(1024) accel_region_t_k0(' in src
    assert "block_reduce" in src
    # a row of 100 takes one warp (about 4 values a thread), four rows a block, each warp
    # with scratch and a barrier of its own (no block-wide barrier: the warps of a block may
    # take different numbers of rows)
    [launch] = r.launches
    assert (launch["kernel"], launch["grid"], launch["block"]) == ("accel_region_t_k0", [16, 1, 1], [32, 4, 1])
    assert "blockIdx.x * 4 + threadIdx.y" in src and "smem_rows[threadIdx.y]" in src
    assert "__syncwarp();" in src and "__syncthreads" not in src


@pytest.mark.parametrize("shape, grid", [((64, 8, 4096), [8, 32, 1]), ((64, 1024, 64), [1024, 1, 1]),
                                         ((2, 8, 1024), [8, 1, 1])], ids=str)
def test_few_long_rows_are_split_among_blocks(shape, grid, tmp_path):
    """A batch norm's channel sums over [N, C, H * W]: with few channels and long rows,
    each row's values are split among blocks (blockIdx.y, 32 of them here, so that about
    528 blocks run), whose partials the row's last block combines (a ticket a row); many
    rows, or rows too short for each thread to take 32 values a block, keep a block a
    row. The module compiles for Hopper."""
    x = torch.empty(shape)
    ir = _lowered([(aten.sum.dim_IntList, (("x", 0), ("c", [0, 2])), {}, 1)], [x],
                  [((shape[1],), (1,), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    [launch] = r.launches
    split = grid[1] > 1
    assert launch["grid"] == grid and (launch["block"] == [256, 1, 1] or not split)
    assert ("accel::col_ticket(accel_region_t_k0_rcount" in src) == split
    assert (f"__device__ double accel_region_t_k0_rpart0[{grid[0] * grid[1]}];" in src) == split
    assert ("blockIdx.y * 256 + threadIdx.x" in src) == split
    if split:
        _nvcc(src, tmp_path / "m.cubin")


@pytest.mark.parametrize("shape", [(), (3,), (64, 128), (7, 5)])
def test_cuda_elementwise_variants_render(shape):
    """Elementwise nests of every rank render (0-d included); where the innermost size is a
    multiple of 4, a 16-byte-vector variant is chosen at launch by pointer alignment."""
    x = torch.empty(shape)
    stride = x.stride()
    ir = _lowered([(aten.mul.Tensor, (("x", 0), ("x", 0)), {}, 1), (aten.tanh.default, (("o", 0),), {}, 1)],
                  [x], [(shape, stride, torch.float32)] * 2, (1,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    vector = bool(shape) and x.numel() % 4 == 0  # contiguous: one loop of numel
    assert ("accel_region_t_k0v(" in src) == vector
    [launch] = r.launches
    assert ("vector" in launch) == vector
    if vector:  # the input and the live output, 4 elements a thread, 2 vectors in flight
        assert launch["vector"] == {"kernel": "accel_region_t_k0v", "buffers": [0, 1],
                                    "grid": [-(-x.numel() // 2048), 1, 1], "block": [256, 1, 1]}


def _rotate_half(x):
    return torch.cat((-x[..., 64:], x[..., :64]), -1)


@pytest.mark.parametrize("name, program, vectors, scalar", [
    # neighbours of a computed value: the load at offset 1 stays scalar beside the aligned one
    ("slices", lambda x: (lambda y: y[..., 1:-3] + y[..., :-4])(x * 2), 2, 1),
    # transformers' rotary embedding: a store per piece of the cat, each a vector
    ("rope", lambda x: x * 0.5 + _rotate_half(x) * 0.25, 6, 0),
    ("stack_rows", lambda x: torch.stack([x.exp(), x.sin()]), 3, 0),
    # a stack along the last dim: its values interleaved, the lanes' values fill vectors
    # that the warp writes in order from shared memory (one store, in a loop)
    ("stack_last", lambda x: torch.stack([x.exp(), x.sin(), x * 2], -1), 2, 0),
    ("stack_halves", lambda x: torch.stack([x[..., :64], x[..., 64:] * 2], -1), 3, 0)])
def test_cuda_vector_variants_of_offsets_and_pieces(monkeypatch, fresh_store, name, program, vectors, scalar):
    """Loads and stores at a constant offset (a slice, a cat's piece) move 16 bytes at a time
    where the offset is a multiple of 4 elements, and one element at a time where it is not
    (a vector at an odd offset would fault: misaligned address); a nest storing several
    pieces of one output stores each as a vector, and values interleaved along the last
    dim (a stack there) fill whole vectors (``VectorLoads._interleaved``)."""
    import accel.lowering as lowering

    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    x = torch.randn(8, 512, 128)
    with accel.eager():
        got = program(x)
    torch.testing.assert_close(got, program(x))
    [ir] = irs
    r = CudaRenderer()
    src = r.render(ir, "k")
    [launch] = r.launches
    assert "vector" in launch, src
    body = src[src.index("k_k0v("):]
    moves = re.findall(r"reinterpret_cast<(?:const )?accel::vec_t<float, 4>\*>\(b\d+ \+ ([^;]*)\)", body)
    assert len(moves) == vectors and not any(m.endswith("+ 1") for m in moves), moves
    assert len(re.findall(r"= b\d+\[[^\]]*\+ 1\];", body)) == scalar, body
    assert ("__syncwarp();" in body) == (name in ("stack_last", "stack_halves"))


@pytest.mark.parametrize("rows", [3000, 4_200_000])
def test_cuda_index_divisions_take_32_bits_while_they_fit(rows):
    """A nest's loop variables from its flat index (``x + b``, a row of 1023 broadcast) are
    divided in 32 bits where the nest has fewer than 2**31 iterations, and beyond that in 32
    bits only while the index itself fits (a branch; 64 bits past 2**32)."""
    x, b = torch.empty(rows, 1023, device="meta"), torch.empty(1023, device="meta")
    ir = _lowered([(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)], [x, b],
                  [((rows, 1023), (1023, 1), torch.float32)], (0,))
    src = CudaRenderer().render(ir, "k")
    assert re.search(r"const uint32_t (u\d+) = \(uint32_t\)\(f\d+\);", src)
    assert re.search(r"i1 = u\d+ % 1023u;", src)
    assert ("< 4294967296LL" in src) == (rows > 3000) and ("% 1023;" in src) == (rows > 3000)


@pytest.mark.parametrize("rows,stride,ix", [(3000, 1023, "int"), (1_100_000, 1023, "int64_t"),
                                            (4, 1 << 29, "int64_t")])
def test_cuda_kernels_index_in_32_bits_where_every_index_fits(rows, stride, ix):
    """A kernel's loop variables and flat indices (``x + b``, a row of 1023 broadcast) are
    32-bit ints (Triton's int32 indexing) where its flat index and every element offset it
    reads or writes stay below 2**30: not past 2**30 elements (1.1e9), nor for 4 rows
    2**29 elements apart."""
    x, b = torch.empty_strided((rows, 1023), (stride, 1), device="meta"), torch.empty(1023, device="meta")
    ir = _lowered([(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)], [x, b],
                  [((rows, 1023), (1023, 1), torch.float32)], (0,))
    src = CudaRenderer().render(ir, "k")
    assert re.search(rf"for \({ix} tile\d+ = blockIdx.x;", src), src
    assert re.search(rf"const {ix} i1 = u\d+ % 1023u;", src), src


@cuda
def test_indices_past_2_to_the_32_on_the_gpu():
    """4.3e9 elements (uint8): the flat index passes 2**32, its divisions take 64 bits there."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 100, (4_200_000, 1023), dtype=torch.uint8, device="cuda", generator=g)
    b = torch.randint(0, 100, (1023,), dtype=torch.uint8, device="cuda", generator=g)
    with accel.eager():
        y = x * 2 + b
    assert torch.equal(y, x * 2 + b)


@pytest.mark.parametrize("shape,vector", [((64, 4096), True), ((64, 100), True), ((64, 102), False)])
def test_cuda_row_kernels_have_a_vector_variant(shape, vector):
    """A softmax row whose length is a multiple of 4 gets a variant moving 4 neighbouring
    elements a thread at a time (each thread's values in registers, loaded once)."""
    x = torch.empty(shape)
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x],
                  [(shape, x.stride(), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert ("vector" in r.launches[0]) == vector
    if vector:
        assert r.launches[0]["vector"]["buffers"] == [0, 1]
        kv = src[src.index("accel_region_t_k0v("):]
        assert kv.count("reinterpret_cast<const accel::vec_t<float, 4>*>(b0") == 1  # one pass reads
        assert "b0[" not in kv


def _nvcc(src, path, *flags):
    """Compile CUDA module ``src`` as accel does (its flags and headers) for ``sm_90a``, from
    ``path``.cu into ``path`` (a cubin, or what ``flags`` ask for: ``-ptx``); returns the
    finished process (ptxas's reports on stderr)."""
    import subprocess

    from accel.build import INCLUDE_DIR, NVCCFLAGS

    path.with_suffix(".cu").write_text(src)
    return subprocess.run(["nvcc", *NVCCFLAGS, "-arch", "sm_90a", *flags, "-I", INCLUDE_DIR,
                           str(path.with_suffix(".cu")), "-o", str(path)],
                          check=True, capture_output=True, text=True, timeout=300)


def _vector_kernel_accesses(src, tmp_path):
    """The global loads and stores (PTX instructions) of the vector variant of kernel 0 of
    module ``src`` (named ``accel_region_t``), compiled by nvcc for ``sm_90a``."""
    _nvcc(src, tmp_path / "m.ptx", "-ptx")
    ptx = (tmp_path / "m.ptx").read_text()
    ptx_v = ptx[ptx.index(".entry accel_region_t_k0v"):]
    return [ln.split()[0] for ln in ptx_v.splitlines() if "ld.global" in ln or "st.global" in ln]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_vectors_are_16_bytes(dtype, tmp_path):
    """Vector variants move 16 bytes a thread at a time: 4 float32 or 8 16-bit floats, each
    vector loaded and stored whole (one vector access in nvcc's PTX), in elementwise and in
    row kernels (a row kernel reads each vector once, at its first lane, into a register)."""
    ctype = {torch.float32: "float", torch.bfloat16: "accel::bf16", torch.float16: "accel::f16"}[dtype]
    width = 4 if dtype == torch.float32 else 8
    x = torch.empty(64, 4096, dtype=dtype)
    meta = [((64, 4096), (4096, 1), dtype)]
    sm = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x], meta, (0,))
    pw = _lowered([(aten.mul.Tensor, (("x", 0), ("x", 0)), {}, 1)], [x], meta, (0,))
    for k, (ir, vectors) in enumerate(((sm, 4096 // width), (pw, 64 * 4096 // width))):
        r = CudaRenderer()
        src = r.render(ir, "accel_region_t")
        launch = r.launches[0]
        assert launch["vector"]["buffers"] == [0, 1]
        kv = src[src.index("accel_region_t_k0v("):]
        assert f"accel::vec_t<{ctype}, {width}>" in kv
        if k == 0:  # a row of 4096 on 512 threads (float32) or 256 (16-bit), 2 vectors each
            assert launch["vector"]["block"][0] * 2 == vectors
            assert kv.count("accel::load_once(") == 1 and "b0[" not in kv
        else:
            assert launch["vector"]["grid"] == [-(-vectors // (256 * 2)), 1, 1]
        if shutil.which("nvcc") is None:
            continue
        accesses = _vector_kernel_accesses(src, tmp_path)
        assert accesses and all(".v4." in a for a in accesses), accesses
        if k == 0:  # one load and one store per vector of the thread's row share
            assert len(accesses) == 4, accesses


def test_cuda_rows_with_moments_take_more_values_a_thread():
    """A softmax row of 4096 runs on 512 threads (8 values each); a layer norm row of 4096,
    whose block reduction merges mean and variance, on 256 (16 values each); rows of 16-bit
    floats take twice as many values a thread (the same bytes)."""
    x, w = torch.empty(64, 4096), torch.empty(4096)
    meta = [((64, 4096), (4096, 1), torch.float32)]
    sm = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x], meta, (0,))
    ln = _lowered([(aten.native_layer_norm.default, (("x", 0), ("c", [4096]), ("x", 1), ("x", 1), ("c", 1e-5)), {}, 3)],
                  [x, w], meta + [((64, 1), (1, 1), torch.float32)] * 2, (0,))
    xh = x.to(torch.bfloat16)
    smh = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [xh],
                   [((64, 4096), (4096, 1), torch.bfloat16)], (0,))
    for ir, threads in ((sm, 512), (ln, 256), (smh, 256)):
        r = CudaRenderer()
        src = r.render(ir, "accel_region_t")
        assert r.launches[0]["block"] == [threads, 1, 1]
        assert "float c" in src and f"[{4096 // threads}];" in src  # the row in registers


@pytest.mark.parametrize("n,dtype,residual,threads", [
    (24576, torch.bfloat16, False, 512), (24576, torch.bfloat16, True, 512),
    (32768, torch.float32, False, 512), (24576, torch.float32, True, 1024),
    (65536, torch.float32, False, 1024), (16384, torch.float32, False, 1024)], ids=str)
def test_cuda_long_layer_norm_rows_take_half_blocks_where_two_fit_in_l2(n, dtype, residual, threads):
    """A layer norm row longer than 16 values a thread of 1024 runs on blocks of 512 threads
    (block loops, two rows in flight a multiprocessor) where its inputs hold at most 128 KiB
    a row; a row reading more (a residual add at float32) keeps 1024 threads, as do rows of
    up to 16 values a thread."""
    x, w = torch.empty(8, n, dtype=dtype), torch.empty(n, dtype=dtype)
    meta = [((8, n), (n, 1), dtype)]
    calls = [(aten.native_layer_norm.default, (("x", 0), ("c", [n]), ("x", 1), ("x", 1), ("c", 1e-5)), {}, 3)]
    inputs = [x, w]
    if residual:
        calls = [(aten.add.Tensor, (("x", 0), ("x", 2)), {}, 1),
                 (aten.native_layer_norm.default, (("o", 0), ("c", [n]), ("x", 1), ("x", 1), ("c", 1e-5)), {}, 3)]
        inputs, meta = [x, w, torch.empty_like(x)], meta * 2
    ir = _lowered(calls, inputs, meta + [((8, 1), (1, 1), torch.float32)] * 2, (len(meta) - 1,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert r.launches[0]["block"] == [threads, 1, 1], r.launches
    if threads == 512:
        assert "q += 512)" in src  # block loops of 16-byte vectors
    kv = src[src.index("accel_region_t_k0v("):]
    if "for (int q" in kv:  # block loops: each row input read again takes L2 hints, not the weight
        reads = 2 if residual else 1
        assert kv.count("accel::load_once<accel::L2_KEEP>(") == reads
        assert kv.count("accel::load_once<accel::L2_LAST>(") == reads
        assert kv.count("accel::load_once(rv") == 1  # the weight, read by every row


@pytest.mark.parametrize("n,dtype,narrow", [
    (32768, torch.float32, True), (32768, torch.bfloat16, True), (32768, torch.float64, False),
    (4096, torch.float32, False), (65536, torch.float32, True), (131072, torch.float32, False)], ids=str)
def test_cuda_block_loop_moments_sum_float32_per_thread(n, dtype, narrow):
    """A layer norm row in block loops (too long for registers) sums each thread's share of
    float32 or 16-bit values shifted in float32 and merges the threads in float64
    (``accel::widen``), as eager's float32 sums; float64 values keep float64 sums, and so do
    rows kept in registers ([*, 4096]) and shares over 64 values ([*, 131072]: 128 a thread
    of 1024)."""
    x, w = torch.empty(8, n, dtype=dtype), torch.empty(n, dtype=dtype)
    calls = [(aten.native_layer_norm.default, (("x", 0), ("c", [n]), ("x", 1), ("x", 1), ("c", 1e-5)), {}, 3)]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ir = _lowered(calls, [x, w], [((8, n), (n, 1), dtype)] + [((8, 1), (1, 1), acc)] * 2, (0,))
    src = CudaRenderer().render(ir, "accel_region_t")
    assert ("accel::ShiftedMoments<float>" in src) == narrow
    assert ("accel::block_moments(accel::widen<double>(" in src) == narrow
    assert ("accel::ShiftedMoments<double>" in src) != narrow


def test_cuda_long_row_hints_leave_a_weight_every_row_reads_alone():
    """A layer norm backward over rows too long for registers reads dy and x in both of its
    row loops (L2 kept between them, evicted first after the last) and the weight in both
    too, which every row reads: the weight keeps the normal L2 priority."""
    n = 65536
    dy, x, w, m = torch.empty(8, n), torch.empty(8, n), torch.empty(n), torch.empty(8, 1)
    calls = [(aten.native_layer_norm_backward.default, (("x", 0), ("x", 1), ("c", [n]), ("x", 2), ("x", 3),
                                                        ("x", 4), ("c", None), ("c", [True, False, False])), {}, 3)]
    ir = _lowered(calls, [dy, x, m, m, w], [((8, n), (n, 1), torch.float32), ((n,), (1,), torch.float32),
                                            ((n,), (1,), torch.float32)], (0,))
    src = CudaRenderer().render(ir, "accel_region_t")
    kv = src[src.index("accel_region_t_k0v("):]
    for b in (0, 1):  # dy, x: kept in the reduction's loop, evicted first in the last
        rows = [ln for ln in kv.splitlines() if f"*>(b{b} + {n} * i0" in ln]
        assert len(rows) == 2 and "<accel::L2_KEEP>" in rows[0] and "<accel::L2_LAST>" in rows[1]
    weight = [ln for ln in kv.splitlines() if "*>(b4 + " in ln]
    assert len(weight) == 2 and all("accel::load_once(rv" in ln for ln in weight)


@pytest.mark.parametrize("n,dtype,kept", [(24576, torch.float32, 24), (32768, torch.float32, 32),
                                           (65536, torch.float32, None), (65536, torch.bfloat16, None)],
                         ids=str)
def test_cuda_long_rows_keep_32_values_a_thread_then_loop_over_vectors(n, dtype, kept, tmp_path):
    """A float32 softmax row of up to 32 values a thread of 1024 stays in registers; a
    longer row runs in block loops that read it twice (its statistics in one pass, then
    the output), whose vector variant moves 16 bytes
    a thread at a time (one vector load per pass, one vector store: nvcc's PTX)."""
    x = torch.empty(8, n, dtype=dtype)
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x],
                  [((8, n), (n, 1), dtype)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    [launch] = r.launches
    assert launch["block"] == [1024, 1, 1] and "vector" in launch
    kv = src[src.index("accel_region_t_k0v("):]
    width = 16 // dtype.itemsize
    if kept:
        assert f"[{kept}];" in src and "for (int q" not in src
        return
    # the statistics (a running max and sum), then the output
    assert kv.count(f"for (int q = threadIdx.x; q < {n // width}; q += 1024)") == 2
    # the row stays in L2 between the passes and leaves it after the last (Triton's hints)
    assert kv.count("accel::load_once<accel::L2_KEEP>(") == 1 and kv.count("accel::load_once<accel::L2_LAST>(") == 1
    assert "accel::load_once(" not in kv
    if shutil.which("nvcc") is None:
        return
    accesses = _vector_kernel_accesses(src, tmp_path)
    assert accesses and all(".v4." in a for a in accesses), accesses


def test_cuda_residual_layer_norm_row_keeps_its_sum_once_in_registers(tmp_path):
    """Residual add + layer norm over rows of 32768 float32 values: a row kernel of 1024
    threads keeps each thread's 32 values of ``x + r`` in registers (one array, not x and r
    apart), its last loop loads neither again, and its lanes' indices are 64-bit (with an
    unsigned ``threadIdx.x * 4``, which may wrap, nvcc computed and kept each lane's address:
    ptxas spilled 140 bytes a thread of the vector kernel; with nvcc here, fewer than 64)."""
    import re

    n = 32768
    x, r, w = torch.empty(8, n), torch.empty(8, n), torch.empty(n)
    calls = [(aten.add.Tensor, (("x", 0), ("x", 2)), {}, 1),
             (aten.native_layer_norm.default, (("o", 0), ("c", [n]), ("x", 1), ("x", 3), ("c", 1e-5)), {}, 3)]
    meta = [((8, n), (n, 1), torch.float32)] * 2 + [((8, 1), (1, 1), torch.float32)] * 2
    rend = CudaRenderer()
    src = rend.render(_lowered(calls, [x, w, r, w], meta, (1,)), "accel_region_t")
    assert rend.launches[0]["block"] == [1024, 1, 1] and "for (int q" not in src
    for kernel in (src[:src.index("accel_region_t_k0v(")], src[src.index("accel_region_t_k0v("):]):
        assert len(re.findall(r"float c\d+\[32\];", kernel)) == 1, kernel
        last = kernel[kernel.rindex("accel::rsqrt"):]
        assert "b0[" not in last and "b2[" not in last and "(b0 +" not in last and "(b2 +" not in last
    assert "((int)threadIdx.x + (j >> 2) * 1024) * 4" in src
    if shutil.which("nvcc") is None:
        return
    proc = _nvcc(src, tmp_path / "m.cubin", "-Xptxas", "-v")
    info = proc.stderr[proc.stderr.index("accel_region_t_k0v"):]
    assert int(re.search(r"(\d+) bytes spill stores", info).group(1)) < 64, info


def test_cuda_reduction_modes_render():
    """Column sums in whole warps split over rows of threads (and, with few tiles of long
    columns, over blocks); long full reductions run over many blocks with a ticket counter
    (rendered here without a GPU)."""
    x = torch.empty(512, 256)
    ir = _lowered([(aten.sum.dim_IntList, (("x", 0), ("c", [0]), ("c", False)), {}, 1)], [x],
                  [((256,), (1,), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert "accel::col_reduce" in src and r.launches[0]["block"] == [32, 32, 1]
    assert "col_ticket" not in src and r.launches[0]["grid"] == [8, 1, 1]
    x = torch.empty(8192, 4096)  # few tiles, long columns: the rows split among blocks
    ir = _lowered([(aten.sum.dim_IntList, (("x", 0), ("c", [0]), ("c", False)), {}, 1)], [x],
                  [((4096,), (1,), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert r.launches[0]["grid"] == [128, 2, 1] and r.launches[0]["block"] == [32, 32, 1]
    assert "if (!accel::col_ticket(accel_region_t_k0_count, tile" in src
    # a layer norm's weight gradient, sum over rows of dy * (x - mean[row]) * rstd[row]:
    # the per-row loads are one address for a warp; column mode still reads coalesced
    x, dy, row = torch.empty(4096, 256), torch.empty(4096, 256), torch.empty(4096, 1)
    calls = [(aten.sub.Tensor, (("x", 0), ("x", 2)), {}, 1),
             (aten.mul.Tensor, (("o", 0), ("x", 2)), {}, 1),
             (aten.mul.Tensor, (("x", 1), ("o", 1)), {}, 1),
             (aten.sum.dim_IntList, (("o", 2), ("c", (0,))), {}, 1)]
    meta = [((4096, 256), (256, 1), torch.float32)] * 3 + [((256,), (1,), torch.float32)]
    r = CudaRenderer()
    src = r.render(_lowered(calls, [x, dy, row], meta, (3,)), "accel_region_t")
    assert r.launches[0]["block"] == [32, 32, 1] and r.launches[0]["grid"] == [8, 8, 1], r.launches
    # an argmax over the rows: column tiles too, (value, index) pairs combined by value, then
    # the smaller index (a thread walked each column down 8192 rows before: 25x eager's time)
    x = torch.empty(8192, 4096)
    ir = _lowered([(aten.argmax.default, (("x", 0), ("c", 0)), {}, 1)], [x], [((4096,), (1,), torch.int64)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert r.launches[0]["grid"] == [128, 2, 1] and r.launches[0]["block"] == [32, 32, 1], r.launches
    assert "accel::col_reduce(accel::ArgPair<float>{" in src and "accel::ArgCombine<true>()" in src
    assert "if (!accel::col_ticket(accel_region_t_k0_count, tile" in src
    x = torch.empty(4096, 256)
    ir = _lowered([(aten.sum.default, (("x", 0),), {}, 1)], [x], [((), (), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    assert "accel::grid_reduce" in src and "__device__ unsigned int accel_region_t_k0_count = 0;" in src
    # its vector variant: a 16-byte vector of the input a thread at a time, GRID_UNROLL
    # vectors in flight (the H100 summed 64M float32 values at 1.9 TB/s a value at a time)
    vector = r.launches[0]["vector"]
    assert vector["buffers"] == [0] and vector["grid"] == r.launches[0]["grid"], r.launches
    assert src.count("#pragma unroll 4\n") == 2 and "const int r" in src and " = q * 4 + j;" in src
    # a softmax over the rows: its statistics in one pass over the column (a running max
    # and sum a thread, merged), not a max loop then a sum-of-exp loop; rows split among
    # blocks as a single reduction's are
    x = torch.empty(8192, 4096)
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", 0), ("c", False)), {}, 1)], [x],
                  [((8192, 4096), (4096, 1), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_t")
    stats = src[:src.index("accel_region_t_k1")]
    assert r.launches[0]["grid"] == [128, 2, 1] and r.launches[0]["block"] == [32, 32, 1], r.launches
    assert re.search(r"accel::SoftmaxState<float> (a\d+)\{-INFINITY, 0\};(.|\n)*\1\.add\(t\d+\);", stats), stats
    assert stats.count("for (int r") == 1 and "accel::exp" not in stats
    assert "accel::col_combine(accel_region_t_k0_part0, accel::MergeSoftmax()" in stats


def _kernel_source(src: str, k: int) -> str:
    """The scalar variant of kernel ``k`` of a rendered module."""
    start = src.index(f"accel_region_t_k{k}(")
    return src[start:src.index("\n}\n", start)]


def test_cuda_softmax_statistics_read_a_row_once():
    """Rows too long for registers (65536 float32 values) run block loops: the softmax's
    statistics as one running (max, sum) a thread, merged across the block
    (``accel::SoftmaxState``), then the output's loop, two reads of the row, not three.
    Statistics alone, written for a later nest (a softmax whose output adds ``y.t()``, a
    logsumexp): a row kernel whose maximum's loop keeps its loads in registers for the
    sum of exponentials, one read, where block loops read the row twice; with nothing
    after them, a thread keeps as many values as its registers hold (rendered here
    without a GPU)."""
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", -1), ("c", False)), {}, 1)],
                  [torch.empty(16, 65536)], [((16, 65536), (65536, 1), torch.float32)], (0,))
    k0 = _kernel_source(CudaRenderer().render(ir, "accel_region_t"), 0)
    assert re.search(r"accel::SoftmaxState<float> (a\d+)\{-INFINITY, 0\};(.|\n)*"
                     r"\1 = accel::block_reduce\(\1, accel::MergeSoftmax\(\), smem\);", k0), k0
    assert k0.count("b0[") == 2 and "accel::Max()" not in k0
    x, y = torch.empty(64, 4096), torch.empty(4096, 64)
    calls = [(aten._softmax.default, (("x", 0), ("c", -1), ("c", False)), {}, 1),
             (aten.t.default, (("x", 1),), {}, 1), (aten.add.Tensor, (("o", 0), ("o", 1)), {}, 1)]
    meta = [((64, 4096), (4096, 1), torch.float32), ((64, 4096), (1, 64), torch.float32),
            ((64, 4096), (4096, 1), torch.float32)]
    lse = ([(aten.logsumexp.default, (("x", 0), ("c", [1]), ("c", False)), {}, 1)], [torch.empty(64, 4096)],
           [((64,), (1,), torch.float32)], (0,))
    for ir in (_lowered(calls, [x, y], meta, (2,)), _lowered(*lse)):
        r = CudaRenderer()
        k0 = _kernel_source(r.render(ir, "accel_region_t"), 0)
        assert k0.count("b0[") == 1 and re.search(r"const float t\d+ = c\d+\[j\];", k0), k0
        # as many values a thread as registers hold: 32 of 4096 on 128 threads
        assert "for (int j = 0; j < 32; ++j)" in k0 and r.launches[0]["block"] == [128, 1, 1]


_BUILDS = [(n, torch.float32) for n in sorted(WORKLOADS)] + [
    (n, dt) for dt in (torch.bfloat16, torch.float16)
    for n in ("chain", "softmax", "layer_norm", "column_sum", "full_sum", "argmax")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("name,dtype", _BUILDS, ids=[f"{n}-{str(d)[6:]}" for n, d in _BUILDS])
def test_every_kernel_mode_builds_a_cubin_with_its_planned_kernels(name, dtype, fresh_store, monkeypatch,
                                                                   tmp_path):
    """Each workload's module compiles with accel's nvcc flags (for Hopper: no GPU needed)
    and its cubin holds every kernel the launch plan names, in float32 and, for some, the
    16-bit floats (their 4-element vector variants included). The loop IR is the one the
    CPU pipeline lowers for the same calls."""
    from accel.codegen.cpp import CppRenderer

    modules = []
    cpu_render = CppRenderer.render

    def render(self, ir, kname):
        r = CudaRenderer()
        modules.append((r.render(ir, kname), r.launches))
        return cpu_render(self, ir, kname)

    monkeypatch.setattr(CppRenderer, "render", render)
    shapes = {"full_sum": (1 << 17,), "full_any": (1 << 17,), "column_sums_split": (4096, 64),  # grid mode; split
              "column_max": (4096, 64)}
    x = _x(*shapes.get(name, (256, 512)), device="cpu").to(dtype)
    _run(WORKLOADS[name], x)
    assert modules
    for k, (src, launches) in enumerate(modules):
        _nvcc(src, tmp_path / f"m{k}.cubin")
        image = (tmp_path / f"m{k}.cubin").read_bytes()
        names = [l["kernel"] for l in launches] + [l["vector"]["kernel"] for l in launches if "vector" in l]
        assert names and all(n.encode() + b"\0" in image for n in names)
    if name == "group_norm":  # its block loops move vectors
        assert any("vector" in l for _, launches in modules for l in launches)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_a_rebuilt_group_norm_output_builds_a_cubin(fresh_store, monkeypatch, tmp_path):
    """A GroupNorm -> SiLU training step with ``ACCEL_REMAT=on``: the backward's region
    rebuilds the norm's output (``accel.group_norm_apply``) and sums it over the spatial
    positions along a reduction loop split into the merge's digits. Its CUDA module (the
    loop IR the CPU pipeline lowers) compiles with accel's nvcc flags for Hopper, every
    planned kernel in the cubin; the rebuilt output is not among the forward's outputs."""
    from accel.codegen.cpp import CppRenderer
    from test_generic import _forget_kernels

    monkeypatch.setenv("ACCEL_REMAT", "on")
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "0")  # (static IR, which CudaRenderer renders)
    # the trie keeps the kernels of earlier tests in this process (a GPU run's worker had
    # built the backward's region, a kernel its fresh store does not hold: not lowered here)
    _forget_kernels()
    modules = []
    cpu_render = CppRenderer.render

    def render(self, ir, kname):
        r = CudaRenderer()
        modules.append((r.render(ir, kname), r.launches))
        return cpu_render(self, ir, kname)

    monkeypatch.setattr(CppRenderer, "render", render)
    p = torch.randn(4, 8, 16, 16, requires_grad=True)
    norm = torch.nn.GroupNorm(4, 8)
    accel.reset_stats()
    with accel.eager():
        y = torch.nn.functional.silu(norm(p * 2))
        grads = torch.autograd.grad((y * y).sum(), [p, norm.weight])  # (held: computed)
    # (a string: pytest shortens a dict's repr, and where the kernels came from -- compiles,
    # store, memory or generic hits, launched ahead -- is what a GPU worker's failure needs)
    assert accel.stats()["recomputed_saves"] == 2 and len(modules) == 2, f"{len(modules)} modules; {accel.stats()}"
    y = torch.nn.functional.silu(norm(p * 2))
    for got, ref in zip(grads, torch.autograd.grad((y * y).sum(), [p, norm.weight])):
        torch.testing.assert_close(got, ref)
    for k, (src, launches) in enumerate(modules):
        _nvcc(src, tmp_path / f"m{k}.cubin")
        image = (tmp_path / f"m{k}.cubin").read_bytes()
        names = [l["kernel"] for l in launches] + [l["vector"]["kernel"] for l in launches if "vector" in l]
        assert names and all(n.encode() + b"\0" in image for n in names)


@pytest.mark.parametrize("pure", [False, True], ids=["cython", "python"])
def test_cuda_kernel_without_a_driver_raises_load_error(pure):
    """No libcuda.so.1 (this CI machine): loading a CUDA module raises LoadError (the runtime
    then warns once and runs the region eagerly)."""
    import ctypes

    from accel import _core_py
    from accel.region import native

    core = _core_py if pure else native
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(core.LoadError, match="CUDA driver not found"):
            core.CudaKernel(b"", [])
    else:
        pytest.skip("this machine has a CUDA driver")


@cuda
@pytest.mark.parametrize("pure", [False, True], ids=["cython", "python"])
def test_bad_cubin_fails_at_launch_and_the_region_runs_eagerly(pure, fresh_store, monkeypatch, caplog):
    """A module the driver rejects: launch returns its CUresult (named by
    cuda_error_string), the region runs eagerly with one warning naming it, results match."""
    from accel import _core_py, interceptor, runtime
    from accel.region import native

    monkeypatch.setattr(interceptor, "_warned", set())  # the warning is once per process
    core = _core_py if pure else native
    k = core.CudaKernel(b"not a cubin", [{"kernel": "k", "grid": [1, 1, 1], "block": [32, 1, 1]}])
    status = k.launch([0], [], torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())
    assert status != 0 and core.cuda_error_string(status)
    monkeypatch.setattr(runtime, "native", core)
    monkeypatch.setattr(core, "CudaKernel", lambda image, launches: k)
    x = _x(64, 128 if pure else 96, seed=5)  # its own trie node: a kernel failure is remembered there
    y, st = _run(WORKLOADS["chain"], x)
    torch.testing.assert_close(y, WORKLOADS["chain"](x))
    assert st["kernel_runs"] == 0 and st["eager_replays"] == 1
    assert "failed to launch (" + core.cuda_error_string(status) in caplog.text


@cuda
def test_a_region_with_a_factory_builds_in_the_background(fresh_store, monkeypatch):
    """``torch.where(c, x, 0.5)`` records ``scalar_tensor(0.5, device=cuda:0)`` between
    the region's other calls. Built in the background (``ACCEL_ASYNC_COMPILE``), the
    region's snapshot held meta tensors for its inputs, the trace failed ("Tensor on device
    cuda:0 is not on the expected device meta") and the region ran eagerly from then on
    (the GPU programs of nine transformers architectures had such regions). It now builds,
    and its kernel runs."""
    monkeypatch.setenv("ACCEL_ASYNC_COMPILE", "1")
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    x = _x(64, 48, seed=11)

    def fn(x):
        return torch.where(x.sin() > 0, x * 2, 0.5).exp() + 1

    for _ in range(2):
        y, st = _run(fn, x)
        torch.testing.assert_close(y, fn(x))
        assert accel.wait_for_compiles(timeout=600) == 0
    assert st["compile_failures"] == 0 and st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


def test_cuda_block_loops_reduce_a_few_values_in_every_thread(fresh_store, monkeypatch, tmp_path):
    """A block loops kernel's reduction over a few values (at most ``ALONE_MAX``: a group
    norm backward's per-group sums over groups of 2 channels, beside its loop over the
    group's 2048 values) is reduced by each thread alone, a plain loop, not across the
    block (``CudaRenderer._alone``: the block reductions' barriers cost more than the
    loads), and is no thread loop that keeps the kernel from its vector variant. Rendered
    without a GPU (built with nvcc where it is installed); eager's
    gradients on the CPU."""
    import accel.lowering as lowering

    from test_generic import _forget_kernels

    # static IR, which CudaRenderer renders: no shape-generic kernel of an earlier test's
    # group norm of other outer lengths (a GPU run's worker had built one: not lowered here)
    monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "0")
    _forget_kernels()
    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 32, 32, generator=g)  # (3 samples: shapes no other test traces)
    w, y = torch.randn(8, generator=g), torch.randn(3, 8, 32, 32, generator=g)

    def program(x, w, y):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad((F.group_norm(x, 4, w) * y).sum(), [x, w])

    # against float64 rounded to float32: the weight's gradient sums 3072 values, and eager's
    # float32 sums are off it by more than float32's tolerance for some inputs
    want = [t.float() for t in program(x.double(), w.double(), y.double())]
    accel.reset_stats()
    with accel.eager():
        got = program(x, w, y)
    torch.testing.assert_close(got, want)
    kernels = []
    for ir in irs:
        src = CudaRenderer().render(ir, "accel_region_t")
        kernels += ['extern "C"' + k for k in src.split('extern "C"')[1:]]
        if shutil.which("nvcc"):
            _nvcc(src, tmp_path / f"m{len(kernels)}.cubin")
    alone = [k for k in kernels if re.search(r"for \(int (r\d+) = 0; \1 < 2; \1 \+= 1\)", k)]
    assert alone, f"{len(irs)} lowered; {accel.stats()}; kernels: {kernels}"
    assert all("for (int f" in k and "block_reduce" not in k for k in alone), alone
    # no thread loop over 2 values: the block loops move the rows' values as 16-byte vectors
    assert any("v(" in k.split("\n")[0] and "accel::vec_t<float, 4>" in k for k in alone), alone


def test_cuda_vector_variant_of_an_elementwise_nest_with_per_group_stores(fresh_store, monkeypatch, tmp_path):
    """A group norm's output nest also stores its mean and rstd outputs, one value a
    group (no stride along the loop over the group's values): that loop still takes
    16-byte vectors, those stores scalar, by the lane at the loop's 0 alone
    (``VectorLoads._broadcast_store``; on the H100 the nest of ``cat_groupnorm_train``
    moved 768 MB in 287 us without its vector variant). Rendered without a GPU (built with
    nvcc where it is installed)."""
    import accel.lowering as lowering

    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    x = torch.randn(3, 8, 12, 12, requires_grad=True)  # (shapes no other test traces)
    w, b = torch.randn(8), torch.randn(8)

    def program():  # (the norm's output nest apart from its statistics' nest)
        y = F.silu(F.group_norm(x * 2, 4, w, b)) + x
        return y, (y * y).sum()

    want = program()
    with accel.eager():
        got = program()
    torch.testing.assert_close(got, want)
    found = []
    for ir in irs:
        r = CudaRenderer()
        src = r.render(ir, "accel_region_t")
        if shutil.which("nvcc"):
            _nvcc(src, tmp_path / f"m{len(found)}.cubin")
        for k, launch in enumerate(r.launches):
            text = src.split(f"accel_region_t_k{k}v(")[1].split('extern "C"')[0] if "vector" in launch else ""
            if re.search(r"if \(i\d+ == 0 && i\d+ == 0\) b\d+\[", text):  # a per-group store, one lane's
                found.append(text)
    assert found and all("*reinterpret_cast<accel::vec_t<float, 4>*>(b" in t for t in found), found
