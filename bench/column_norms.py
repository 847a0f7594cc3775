"""Normalizations over the rows of [N, C] (column statistics): eager, accel and
torch.compile side by side (median ms per call, interleaved, results checked).

    python bench/column_norms.py [cpu|cuda] [--runs N]

Workloads, on [8192, 1024] float32 on the CPU and [16384, 4096] on a GPU:

- ``standardize``: ``(x - x.mean(0)) / x.std(0)`` (feature standardization);
- ``shares``: ``x / x.sum(0, keepdim=True)``;
- ``softmax0``: ``x.softmax(0)``;
- ``batchnorm1d``: ``torch.nn.BatchNorm1d`` in training mode, forward (each backend its
  own module: the running statistics are updated in place);
- ``colmean``: ``x.mean(0)`` alone (the column reduction these read).

Before the forty-ninth round accel ran the column statistics and the output in one loop
nest walking each column down its rows (3-20x slower than eager on the CPU); now the
statistics run in a nest of their own (on the CPU vectors of a block's columns over the
rows; Welford moments as shifted sums; on a GPU column tiles with the rows split among
blocks) and the output in one along the rows (``accel.lowering._transposing``).
"""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KERNELS_HEAD, compare_kernels, device_workloads_args, run_as, table  # noqa: E402



def standardize(x):
    return (x - x.mean(0)) / x.std(0)


def shares(x):
    return x / x.sum(0, keepdim=True)


def softmax0(x):
    return x.softmax(0)


def colmean(x):
    return x.mean(0)


def main() -> None:
    dev, shape, sync, runs, wanted = device_workloads_args(__doc__)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(*shape, generator=g) * 4 + 1).to(dev)
    bn = torch.nn.BatchNorm1d(shape[1]).to(dev)
    workloads = {"standardize": [standardize] * 3, "shares": [shares] * 3, "softmax0": [softmax0] * 3,
                 "batchnorm1d": [copy.deepcopy(bn) for _ in range(3)], "colmean": [colmean] * 3}
    rows = []
    for name, (fe, fa, fc) in workloads.items():
        if not wanted(name):
            continue
        compiled = torch.compile(fc)

        def call(kind, f):
            return lambda: run_as(kind, f, (x,), sync)

        rows.append(compare_kernels(f"{name} {list(shape)}", call("eager", fe), call("accel", fa),
                                    call("compile", compiled), runs))
    print(table(KERNELS_HEAD, rows))


if __name__ == "__main__":
    main()
