"""The CUDA backend: streams, devices, no host synchronization, fallbacks. The OpInfo and
hypothesis suites (test_opinfo*.py, test_chains.py) also run on "cuda". Every test here
skips cleanly on a machine without a GPU; tests/gpu.sh runs them on one."""
import pytest
import torch

import accel
from accel.codegen.cuda import CudaRenderer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
F = torch.nn.functional


def _x(*shape, device="cuda", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


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
}


@cuda
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_kernels_run_on_the_gpu_and_match_eager(name):
    x = _x(64, 300)
    expected = WORKLOADS[name](x)
    actual, st = _run(WORKLOADS[name], x)
    torch.testing.assert_close(actual, expected)
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st


#: shapes that take each kernel mode: elementwise with 16-byte vectors (innermost size a
#: multiple of 4) and without; column sums in whole warps (column mode) and not; full
#: reductions past GRID_MIN (grid mode) and below; long rows (block-strided) and short.
MODES = [
    ("vector_chain", WORKLOADS["chain"], (256, 1024)),
    ("odd_chain", WORKLOADS["chain"], (33, 37)),
    ("column_sum_warps", WORKLOADS["column_sum"], (2048, 256)),
    ("column_var", lambda x: torch.var(x * 3, 0), (1000, 96)),
    ("column_amax", lambda x: (x - 1).amax(0), (3000, 64)),
    ("grid_sum", WORKLOADS["full_sum"], (1024, 1000)),
    ("grid_mean_sqrt", lambda x: (x * x).mean().sqrt(), (512, 512)),
    ("grid_amax", lambda x: x.abs().amax(), (300, 1000)),
    ("long_softmax", WORKLOADS["softmax"], (8, 40000)),
    ("layer_norm_4096", WORKLOADS["layer_norm"], (64, 4096)),
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


@cuda
def test_misaligned_operands_take_the_scalar_kernel():
    """A view starting 4 bytes into its storage is not 16-byte aligned: the same kernel
    (same key) chooses its scalar variant at launch."""
    base = _x(4097 * 64)
    aligned, shifted = base[: 4096 * 64].view(64, 4096), base[1: 4096 * 64 + 1].view(64, 4096)
    fn = WORKLOADS["chain"]
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


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_second_gpu_and_device_guard():
    x = _x(64, 128, device="cuda:1")
    with torch.cuda.device(0):  # the current device is not the tensors'
        y, st = _run(WORKLOADS["softmax"], x)
    assert y.device == x.device and st["kernel_runs"] == 1
    torch.testing.assert_close(y, WORKLOADS["softmax"](x))


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
    import sys
    import os

    sys.path.insert(0, os.path.dirname(__file__))
    from test_pipeline import _lowered

    aten = torch.ops.aten
    x = torch.empty(64, 100)
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x],
                  [((64, 100), (100, 1), torch.float32)], (0,))
    src = CudaRenderer().render(ir, "accel_region_t")
    assert "__global__" in src and "block_reduce" in src and "cudaGetLastError" in src
    assert 'extern "C" int accel_region_t(void* const* bufs' in src


@pytest.mark.parametrize("shape", [(), (3,), (64, 128), (7, 5)])
def test_cuda_elementwise_variants_render(shape):
    """Elementwise nests of every rank render (0-d included); where the innermost size is a
    multiple of 4, a 16-byte-vector variant is chosen at launch by pointer alignment."""
    import sys
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_pipeline import _lowered

    aten = torch.ops.aten
    x = torch.empty(shape)
    stride = x.stride()
    ir = _lowered([(aten.mul.Tensor, (("x", 0), ("x", 0)), {}, 1), (aten.tanh.default, (("o", 0),), {}, 1)],
                  [x], [(shape, stride, torch.float32)] * 2, (1,))
    src = CudaRenderer().render(ir, "accel_region_t")
    vector = bool(shape) and x.numel() % 4 == 0  # contiguous: one loop of numel
    assert ("accel_region_t_k0v<<<" in src) == vector
    assert ("& 15) == 0" in src) == vector


def test_cuda_reduction_modes_render():
    """Column sums in whole warps split over rows of threads; long full reductions run over
    many blocks with a ticket counter (rendered here without a GPU)."""
    import sys
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_pipeline import _lowered

    aten = torch.ops.aten
    x = torch.empty(512, 256)
    ir = _lowered([(aten.sum.dim_IntList, (("x", 0), ("c", [0]), ("c", False)), {}, 1)], [x],
                  [((256,), (1,), torch.float32)], (0,))
    src = CudaRenderer().render(ir, "accel_region_t")
    assert "accel::col_reduce" in src and "dim3(32, " in src
    ir = _lowered([(aten.sum.default, (("x", 0),), {}, 1)], [x], [((), (), torch.float32)], (0,))
    src = CudaRenderer().render(ir, "accel_region_t")
    assert "accel::grid_reduce" in src and "__device__ unsigned int accel_region_t_k0_count = 0;" in src
