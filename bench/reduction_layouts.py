"""Reductions whose layout decides their loops: eager, accel and torch.compile side by side
(median ms per call, interleaved, results checked; where eager's float32 result is off the
float64 one, that is the oracle).

    python bench/reduction_layouts.py [cpu|cuda] [--runs N] [--only a,b]

Workloads (float32; CPU sizes, GPU ones in brackets):

- ``argmax0``, ``max0``: ``x.argmax(0)``, ``x.max(0)`` (values and indices) over the rows
  of [8192, 1024] ([16384, 4096]): on the CPU a vector of a block's columns keeps each
  one's best value and index (0.73x and 0.92x of eager's speed before the fiftieth round,
  one column at a time down its rows);
- ``groupnorm_cl``, ``groupnorm``: ``torch.nn.GroupNorm(8, 64)`` on a channels-last and a
  contiguous [32, 64, 56, 56] ([64, 128, 64, 64]): the channels-last statistics loop H and W
  outside each group's channels (reduction variables in memory order), the output N, H,
  W, then C (0.24x of eager's speed before on the CPU);
- ``layernorm256``: ``F.layer_norm`` over the 256 channels of [64, 512, 256]
  ([256, 512, 256]): row statistics in Welford blocks;
- ``mean0``, ``var_mean0``: ``x.mean(0)``, ``torch.var_mean(x, 0)`` over the rows of
  ``x``: on the CPU each thread sums its share of the rows (whole rows) since the
  fifty-second round, the threads' partials merged after;
- ``t_add``, ``t_contiguous``, ``t_softmax``: ``x.t() + y``, ``x.t().contiguous()``,
  ``x.t().softmax(-1)``: reads across the rows written, in tiles of 8 rows on the CPU
  (fifty-first round), through 32 x 32 shared-memory tiles on a GPU (fifty-second);
- ``softmax_t_add``, ``groupnorm_cl_contig``: ``x.softmax(-1) + y.t()`` and the
  channels-last GroupNorm's output made contiguous: a reduction's epilogue reading across
  the rows it writes; the reductions go to memory first, the epilogue's nest is tiled
  (fifty-third round);
- ``cross_entropy``: ``F.cross_entropy`` of [2048, 32000] logits ([4096, 50257]) and their
  targets (under ``no_grad``, as every workload here): its ``nll_loss`` as eager's on the
  logits plus the rows' deferred statistics, so that the log-softmax is never written
  (fifty-eighth round; ``accel.losses.nll_of_log_softmax``);
- ``cross_entropy_train``: the same loss and its logits' gradient
  (``torch.autograd.grad``, grad enabled inside the workload): the backward's
  ``nll_loss_backward`` deferred, so the log-softmax backward reads the log-softmax alone
  and its incoming [N, C] gradient is never written (fifty-ninth round;
  ``accel.losses.nll_loss_backward``).
- ``sum_sq``: ``(x * x).sum()``, a whole reduction (a loss's): on a GPU over many
  blocks (grid mode), 16-byte vectors and 4 of them in flight a thread since the
  ninety-fourth round (one value at a time read at 1.9 TB/s on the H100).
- ``gn_silu_train``, ``bn_silu_train``: ``silu(norm(x * 2))`` with the GroupNorm above and a
  ``BatchNorm2d`` in training mode on the contiguous image, and the gradients of
  ``(y * y).sum()`` for ``x``, the weight and the bias (grad enabled inside the workload):
  the SiLU saves the norm's output, which accel rebuilds in the backward from the norm's
  input and statistics instead of writing it (``accel.remat``, ninety-fifth round;
  ``ACCEL_REMAT=auto``: on the CPU for values of 2 MiB or more, as these, and on a GPU for
  values of 128 MiB or more, which these 25 MiB ones are not: ``ACCEL_REMAT=on`` there).
  (On a GPU eager's batch norm is cuDNN's op, ``cudnn_batch_norm``, which runs eagerly
  under accel too: recorded as ``native_batch_norm`` the step was slower on the H100,
  ninety-eighth round.)
- ``softmax_odd``, ``rmsnorm_odd``, ``layernorm_odd``: ``softmax(x * 0.5, -1)``, a
  hand-written RMSNorm and ``F.layer_norm(x * 2, ...)`` over rows of 1023 (4095): on the
  CPU each output row starts at another offset in a cache line, and its streamed stores
  (outputs past the cache) start at the row's first whole line (ninety-first round).
"""
import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KERNELS_HEAD, compare_kernels, device_workloads_args, run_as, table  # noqa: E402


def main() -> None:
    dev, shape, sync, runs, wanted = device_workloads_args(__doc__)
    big = dev == "cuda"
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(*shape, generator=g) * 4 + 1).to(dev)
    img = torch.rand(*((64, 128, 64, 64) if big else (32, 64, 56, 56)), generator=g).to(dev) + 0.5
    img_cl = img.contiguous(memory_format=torch.channels_last)
    seq = torch.randn(*((256, 512, 256) if big else (64, 512, 256)), generator=g).to(dev)
    gn = torch.nn.GroupNorm(8, img.shape[1]).to(dev)
    gn64 = torch.nn.GroupNorm(8, img.shape[1]).to(dev).double()
    y = x.t().contiguous() * 0.5
    logits = torch.randn(*((4096, 50257) if big else (2048, 32000)), generator=g).to(dev)
    target = torch.randint(0, logits.shape[1], (logits.shape[0],), generator=g).to(dev)
    def ce_train(t):
        with torch.enable_grad():
            t = t.detach().requires_grad_()
            loss = F.cross_entropy(t, target)
            return loss.detach(), torch.autograd.grad(loss, t)[0]

    odd = torch.randn(shape[0], shape[1] - 1, generator=g).to(dev)
    w_odd = torch.randn(shape[1] - 1, generator=g).to(dev)

    bn = torch.nn.BatchNorm2d(img.shape[1]).to(dev)

    def norm_silu_train(norm):
        def f(t):
            with torch.enable_grad():
                t = t.detach().requires_grad_()
                out = F.silu(norm(t * 2))
                return torch.autograd.grad((out * out).sum(), [t, norm.weight, norm.bias])
        return f

    def rmsnorm(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w_odd

    workloads = {
        "argmax0": (lambda t: t.argmax(0), x, None),
        "max0": (lambda t: t.max(0), x, None),
        "groupnorm_cl": (gn, img_cl, lambda: gn64(img_cl.double())),
        "groupnorm": (gn, img, lambda: gn64(img.double())),
        "layernorm256": (lambda t: F.layer_norm(t, [t.shape[-1]]), seq,
                         lambda: F.layer_norm(seq.double(), [seq.shape[-1]])),
        "mean0": (lambda t: t.mean(0), x, lambda: x.double().mean(0)),
        "sum_sq": (lambda t: (t * t).sum(), x, lambda: (x.double() * x.double()).sum()),
        "var_mean0": (lambda t: torch.var_mean(t, 0), x, lambda: torch.var_mean(x.double(), 0)),
        "t_add": (lambda t: t.t() + y, x, None),
        "t_contiguous": (lambda t: t.t().contiguous(), x, None),
        "t_softmax": (lambda t: t.t().softmax(-1), x, lambda: x.double().t().softmax(-1)),
        "softmax_t_add": (lambda t: t.softmax(-1) + y.t(), x, None),
        "groupnorm_cl_contig": (lambda t: gn(t).contiguous(), img_cl, lambda: gn64(img_cl.double()).contiguous()),
        "cross_entropy": (lambda t: F.cross_entropy(t, target), logits,
                          lambda: F.cross_entropy(logits.double(), target)),
        "cross_entropy_train": (ce_train, logits, lambda: ce_train(logits.double())),
        "gn_silu_train": (norm_silu_train(gn), img, lambda: norm_silu_train(gn64)(img.double())),
        "bn_silu_train": (norm_silu_train(bn), img,
                          lambda: norm_silu_train(copy.deepcopy(bn).double())(img.double())),
        "softmax_odd": (lambda t: torch.softmax(t * 0.5, -1), odd, None),
        "rmsnorm_odd": (rmsnorm, odd, None),
        "layernorm_odd": (lambda t: F.layer_norm(t * 2, [t.shape[-1]]), odd, None),
    }
    rows = []
    with torch.no_grad():
        for name, (f, t, exact) in workloads.items():
            if not wanted(name):
                continue
            compiled = torch.compile(f)

            def call(kind, fn, t=t):
                return lambda: run_as(kind, fn, (t,), sync)

            rows.append(compare_kernels(f"{name} {list(t.shape)}", call("eager", f), call("accel", f),
                                        call("compile", compiled), runs, exact=exact))
    print(table(KERNELS_HEAD, rows))


if __name__ == "__main__":
    main()
