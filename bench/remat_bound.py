"""What recomputing instead of saving would buy the demo's GPT-2 step on the CPU: eager
autograd saves four of the tanh-GELU's intermediates (``x``, ``tanh(...)``, ``0.5 * x``,
``1 + tanh(...)``), so accel's forward kernel writes them and its backward kernel reads
them back, where torch.compile's partitioner saves ``x`` alone and recomputes the rest in
the backward (seed: ``min_cut_rematerialization_partition``). Here the model's GELU is
swapped for a ``torch.autograd.Function`` that saves ``x`` alone and recomputes: its
forward and backward are fused by accel as usual. The step is timed with eager, accel,
accel with that GELU, and torch.compile, interleaved; every gradient of the swapped model
is checked against eager's first. An upper bound for accel doing the same on its own (a
measurement, not a feature: accel never changes the program's modules).

    python bench/remat_bound.py [--steps 40]

Prints median ms per step of each and their ratios.
"""
from __future__ import annotations

import argparse
import copy
import math

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
    fns = {"eager": lambda: demo.train_step(me, ids, labels),
           "accel": lambda: step(ma, ids, labels),
           "accel, GELU recomputed": lambda: step(mr, ids, labels), "torch.compile": compiled}
    demo.train_step(me, ids, labels)
    fns["accel, GELU recomputed"]()
    for (name, pe), pr in zip(me.named_parameters(), mr.parameters()):
        torch.testing.assert_close(pr.grad, pe.grad, msg=lambda m, n=name: f"{n}: {m}")
    for _ in range(5):
        for fn in fns.values():
            fn()
    ms = _common.interleaved_ms(fns, args.steps)
    print(f"GPT-2 train step (accel demo), cpu, {torch.get_num_threads()} threads, medians of "
          f"{args.steps} interleaved steps (ms); the recomputing GELU's gradients match eager's\n")
    print("| variant | ms | eager / variant | torch.compile / variant |")
    print("|---|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.2f} | {ms['eager'] / v:.2f}x | {ms['torch.compile'] / v:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
