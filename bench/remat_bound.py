"""Recomputing saved values instead of saving them, in the demo's GPT-2 step on the CPU:
eager autograd saves four of the tanh-GELU's intermediates (``x``, ``tanh(...)``,
``0.5 * x``, ``1 + tanh(...)``), so a forward kernel writes them and the backward kernel
reads them back, where torch.compile's partitioner saves ``x`` alone and recomputes the
rest in the backward (seed: ``min_cut_rematerialization_partition``). accel does the same
through autograd's saved-tensor hooks (``accel/remat.py``, ``ACCEL_REMAT``). Timed,
interleaved: eager; accel with ``ACCEL_REMAT=off`` (the values saved as eager saves them);
accel as shipped (``auto``: recomputed); accel with the model's GELU swapped for a
``torch.autograd.Function`` that saves ``x`` alone and recomputes in its backward (the
bound: no hooks, no recorded recomputation); and torch.compile. Every gradient of the
swapped model is checked against eager's first.

    python bench/remat_bound.py [--steps 40]

Prints median ms per step of each, their ratios, and the median of the paired differences
between accel with and without recomputation (consecutive steps: robust to a drifting
machine).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics

import _common  # puts this checkout's accel first on sys.path
_common.intercept_every_step()  # it times interception itself
import torch

from accel import demo, dispatch

_C = math.sqrt(2.0 / math.pi)


def _tanh_arg(x):
    return _C * (x + 0.044715 * torch.pow(x, 3.0))


class RecomputedGELU(torch.autograd.Function):
    """transformers' ``NewGELUActivation`` (tanh-GELU) saving its input alone."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(_tanh_arg(x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(_tanh_arg(x))
        dt = (1.0 - t * t) * _C * (1.0 + 3.0 * 0.044715 * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * dt)


class _GELU(torch.nn.Module):
    def forward(self, x):
        return RecomputedGELU.apply(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    base, ids, labels = _common.gpt2(torch.device("cpu"))
    dispatch.wait()
    me, ma, mr, mc = (copy.deepcopy(base) for _ in range(4))
    for block in mr.transformer.h:
        block.mlp.act = _GELU()
    compiled = torch.compile(lambda: demo.train_step(mc, ids, labels))

    step = _common.accel_fn(demo.train_step)

    def accel_with(mode, m):
        def run():
            os.environ["ACCEL_REMAT"] = mode  # read at the enable
            return step(m, ids, labels)
        return run

    ms_off = copy.deepcopy(base)
    fns = {"eager": lambda: demo.train_step(me, ids, labels),
           "accel, ACCEL_REMAT=off": accel_with("off", ms_off),
           "accel": accel_with("auto", ma),
           "accel, GELU recomputed": accel_with("off", mr), "torch.compile": compiled}
    demo.train_step(me, ids, labels)
    fns["accel, GELU recomputed"]()
    for (name, pe), pr in zip(me.named_parameters(), mr.parameters()):
        torch.testing.assert_close(pr.grad, pe.grad, msg=lambda m, n=name: f"{n}: {m}")
    for _ in range(5):
        for fn in fns.values():
            fn()
    ms, times = _common.interleaved_ms(fns, args.steps, samples=True)
    print(f"GPT-2 train step (accel demo), cpu, {torch.get_num_threads()} threads, medians of "
          f"{args.steps} interleaved steps (ms); the recomputing GELU's gradients match eager's\n")
    print("| variant | ms | eager / variant | torch.compile / variant |")
    print("|---|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.2f} | {ms['eager'] / v:.2f}x | {ms['torch.compile'] / v:.2f}x |")
    d = [a - b for a, b in zip(times["accel"], times["accel, ACCEL_REMAT=off"])]
    q = statistics.quantiles(d, n=4)
    print(f"\naccel minus accel with ACCEL_REMAT=off, step by step: median {statistics.median(d):+.2f} ms "
          f"(quartiles {q[0]:+.2f} / {q[2]:+.2f}); faster in {sum(x < 0 for x in d)} of {len(d)} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
