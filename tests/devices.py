"""The devices a test runs on, as a ``pytest.mark.parametrize`` list: the CPU, and CUDA,
which skips cleanly on a machine without a GPU (tests/gpu.sh runs the CUDA cases on one);
``SECOND_GPU``, "cuda:1", skips where there are fewer than two."""
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
SECOND_GPU = pytest.param("cuda:1", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="fewer than two GPUs"))
