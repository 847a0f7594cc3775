"""Regions that write an input in place and read it at other elements: eager, accel and
torch.compile side by side (median ms per call, interleaved, results checked).

    python bench/inplace_regions.py [cpu|cuda] [--runs N]

Each call first copies the workload's inputs afresh from a fixed copy (eagerly, outside
accel; the same copy in every backend's time), then runs:

- ``router``: ``w.div_(w.sum(-1, keepdim=True))`` (mixture-of-experts routers);
- ``scores``: ``s.div_(8.0)`` then ``s.softmax(-1)`` (MPT's and Falcon's attention);
- ``pooled``: ``h.add_(r)`` then ``relu(h).mean(0)`` (a residual block before a pooler).

Shapes: [8192, 1024] float32 on the CPU, [16384, 4096] on a GPU. Until the forty-eighth
round these regions ran eagerly under accel (the lowering refused the write); now the
write runs in a kernel nest of its own after the reads (``accel.lowering.lower``).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KERNELS_HEAD, compare_kernels, device_workloads_args, run_as, table  # noqa: E402



def router(w):
    w.div_(w.sum(-1, keepdim=True))
    return w


def scores(s):
    s.div_(8.0)
    return s.softmax(-1)


def pooled(h, r):
    h.add_(r)
    return torch.relu(h).mean(0)


WORKLOADS = {"router": (router, 1), "scores": (scores, 1), "pooled": (pooled, 2)}


def main() -> None:
    dev, shape, sync, runs, wanted = device_workloads_args(__doc__)
    rows = []
    for name, (fn, n_in) in WORKLOADS.items():
        if not wanted(name):
            continue
        g = torch.Generator().manual_seed(0)
        base = [(torch.rand(*shape, generator=g) + 0.1).to(dev) for _ in range(n_in)]
        bufs = {k: [b.clone() for b in base] for k in ("eager", "accel", "compile")}
        compiled = torch.compile(fn)

        def call(kind, f):
            def run():
                for b, src in zip(bufs[kind], base):
                    b.copy_(src)
                return run_as(kind, f, bufs[kind], sync), bufs[kind][0]  # and the input written in place
            return run

        rows.append(compare_kernels(f"{name} {list(shape)}", call("eager", fn), call("accel", fn),
                                    call("compile", compiled), runs))
    print(table(KERNELS_HEAD, rows))


if __name__ == "__main__":
    main()
