"""Reductions over a few values a result (eighty-fourth round): eager, accel and
torch.compile side by side (median ms per call, interleaved, results checked).

    python bench/small_rows.py [cpu|cuda] [--runs N] [--only NAME,...]

Inputs: ``p`` float32 of [N, k] with N the device's workload's elements over 2 (4M on the
CPU: [8192, 1024] / 2; 32M on a GPU), k as the workload needs. Workloads:

- ``sumsq3``: ``(p * p).sum(-1)`` of [N, 3] (points' squared lengths); ``norm3``:
  ``torch.linalg.vector_norm(p, dim=-1)`` of [N, 3];
- ``sum4``: ``(p * 2).sum(-1)`` of [N, 4]; ``sum16``: the same of [N / 4, 16];
- ``amax2``: ``(p * 2).amax(-1)`` of [N, 2];
- ``logsumexp5``: ``torch.logsumexp(p * 2, -1)`` of [N, 5] (5 classes);
- ``sum_exp3``: ``torch.exp(p).sum(-1)`` of [N, 3];
- ``mvlgamma3``: ``torch.mvlgamma(p.abs() * 3 + 2, 3)`` of [N] (a sum of 3 lgammas a value);
- ``softmax8``: ``(p * 2).softmax(-1)`` of [N / 2, 8]; ``softmax3``, ``softmax5``,
  ``softmax16``: the same of [N, 3], [N, 5], [N / 4, 16];
- ``log_softmax10``: ``(p * 2).log_softmax(-1)`` of [N / 2, 10] (10 classes);
  ``cross_entropy10``: ``F.cross_entropy(p, target)`` of the same, a fixed target;
- ``layer_norm8``: ``F.layer_norm(p, (8,))`` of [N / 2, 8];
- ``argmax10``: ``(p * 2).argmax(-1)`` of [N / 2, 10] (a classifier's predictions);
- ``var_mean3``: ``torch.var_mean(p * 2, -1)`` of [N, 3] (Welford moments).

Until this round the CPU kernel of a reduction over k values a result ran a vectorized
loop over the k values inside a loop over the results: with k = 3, all but 3 lanes idle,
and a function without vector variants scalar. Now (``accel.codegen.cpp.SMALL_ROWS``) the
loop over the results is the vectorized one, each result's k values unrolled, and strides
gcc groups no loads of (5, 6, 7, 9-15) hidden from it as run-time values. Eighty-fifth
round: argmax, argmin and Welford moments too (they kept the old loop), and row kernels over
rows of a few values (softmax, log-softmax, LayerNorm: ``CppRenderer._small_row_nest``),
each row's reductions and its loop unrolled inside the loop over the rows.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KERNELS_HEAD, compare_on, device_workloads_args, table  # noqa: E402

WORKLOADS = {
    "sumsq3": (3, lambda p: (p * p).sum(-1)),
    "norm3": (3, lambda p: torch.linalg.vector_norm(p, dim=-1)),
    "sum4": (4, lambda p: (p * 2).sum(-1)),
    "sum16": (16, lambda p: (p * 2).sum(-1)),
    "amax2": (2, lambda p: (p * 2).amax(-1)),
    "logsumexp5": (5, lambda p: torch.logsumexp(p * 2, -1)),
    "sum_exp3": (3, lambda p: torch.exp(p).sum(-1)),
    "mvlgamma3": (1, lambda p: torch.mvlgamma(p.abs() * 3 + 2, 3)),
    "softmax8": (8, lambda p: (p * 2).softmax(-1)),
    "softmax3": (3, lambda p: (p * 2).softmax(-1)),
    "softmax5": (5, lambda p: (p * 2).softmax(-1)),
    "softmax16": (16, lambda p: (p * 2).softmax(-1)),
    "log_softmax10": (10, lambda p: (p * 2).log_softmax(-1)),
    "cross_entropy10": (10, lambda p: F.cross_entropy(p, _target(p))),
    "layer_norm8": (8, lambda p: F.layer_norm(p, (8,))),
    "argmax10": (10, lambda p: (p * 2).argmax(-1)),
    "var_mean3": (3, lambda p: torch.var_mean(p * 2, -1)),
}
_TARGETS = {}


def _target(p):
    """A fixed class index a row of ``p`` (made once per shape and device, outside the timing)."""
    key = (p.shape, p.device)
    if key not in _TARGETS:
        g = torch.Generator().manual_seed(1)
        _TARGETS[key] = torch.randint(0, p.shape[1], (p.shape[0],), generator=g).to(p.device)
    return _TARGETS[key]


def main() -> None:
    dev, shape, sync, runs, wanted = device_workloads_args(__doc__)
    n = shape[0] * shape[1] // 2
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (k, fn) in WORKLOADS.items():
        if not wanted(name):
            continue
        m = n // 4 if k == 16 else n // 2 if k in (8, 10) else n
        p = torch.randn(m, k, generator=g).to(dev)
        p = p.view(-1) if k == 1 else p
        if name == "cross_entropy10":
            _target(p)
        rows.append(compare_on(name, fn, p, sync, runs))
    print(table(KERNELS_HEAD, rows))


if __name__ == "__main__":
    main()
