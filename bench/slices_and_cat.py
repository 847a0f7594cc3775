"""Slices, chunks and concatenations of values a region computes (eighty-sixth round):
eager, accel and torch.compile side by side (median ms per call, interleaved, results
checked).

    python bench/slices_and_cat.py [cpu|cuda] [--runs N] [--only NAME,...] [--host]

Inputs: ``p`` float32 of the device's workload's elements (8M on the CPU: [8192, 1024];
64M on a GPU), shaped as the workload needs; ``--host``: 256K elements (one rope batch),
every region kept (``ACCEL_EAGER_SMALL_REGIONS=0``), so that a call's host time shows.
Workloads:

- ``slice_add``: ``y = p * 2; y[:, 1:] + y[:, :-1]`` of [R, 1024] (neighbours along a row);
- ``diff``: ``torch.diff(p * 2, dim=-1)``;
- ``swiglu``: ``a, b = (p * 2).chunk(2, -1); silu(a) * b`` (a gated MLP's halves of a
  computed value); ``swiglu_ext``: the same of ``p`` itself (a projection's output: the
  chunks are inputs, fused before this round too);
- ``rope``: transformers' ``q * cos + rotate_half(q) * sin`` of ``q`` [B, 2048, 128]
  (``rotate_half``: ``cat(-x2, x1)`` of the last dim's halves), ``cos`` and ``sin``
  [2048, 128];
- ``cat_exp_sin``: ``torch.cat([p.exp(), p.sin()], -1)`` of [R, 1024];
- ``stack3``: ``torch.stack([p, p * 2, p * 3], -1)`` of [N] (three coordinates into
  points [N, 3]);
- ``cross3``: ``torch.linalg.cross(p, p * 2)`` of [N, 3] (runs eagerly under accel: its
  own op);
- ``glu``: ``F.glu(p * 2, -1)`` of [R, 1024], and ``pad``: ``F.pad(p * 2, (0, 8),
  value=1.0)`` (eighty-ninth round: ``glu`` and ``constant_pad_nd`` join the region;
  before, each ran eagerly and flushed it);
- ``cat_groupnorm``: a U-Net decoder's ``silu(group_norm(cat([h * 2, skip], 1), 32))`` of
  [B, 64, 32, 32] (``h`` and ``skip`` its channels' halves: groups of 2 channels), and
  ``cat_softmax`` / ``cat_layernorm``: a softmax / LayerNorm over the last dim of ``cat([a
  * 2, b], -1)`` of [R, 1024] (ninetieth round: the concatenation stored first, then read
  by the reduction's nest; before, each region ran eagerly; ninety-second round: each
  piece reduced where it is, the results merged, no copy of the concatenation:
  ``accel.lower_expr._Lowerer.reduce_domains``); ``cat_groupnorm_train``: the
  first with a shortcut (``y = silu(norm(x)) + x``), forward and backward
  (``torch.autograd.grad`` of ``(y * y).sum()`` for the input and the norm's weight):
  the backward splits the gradient of ``x``, merged from ``[B, G, C/G, H, W]``, between
  ``h`` and ``skip`` (``accel.lower_expr.SplitLoop``); ``cat_groupnorm_train_split``: the
  same with the forward in a function of its own, so that ``x`` and ``y`` die before the
  backward (ninety-seventh round: held, accel writes them).

Until this round a call reading a view of a pending value other than a split of its dims
(a slice at an offset, a chunk, a transpose) flushed the region first, and ``cat`` /
``stack`` ran eagerly, flushing it: now a view that reads a pending value dim by dim
(``accel.ops.pending_view``) joins the region, indexed at an offset (``Addr.offset``),
and ``cat`` / ``stack`` of up to 8 tensors are recorded as ``accel.cat``, stored piece by
piece (``accel.lowering._split_spans``).
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KERNELS_HEAD, compare_on, device_workloads_args, table  # noqa: E402


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _swiglu(p):
    a, b = p.chunk(2, -1)
    return F.silu(a) * b


_NORM = {}


def _cat_groupnorm_train(p):
    """(``p`` requires grad: torch.compile compiles the forward with its backward, and
    runs ``torch.autograd.grad`` past a graph break, as a training step's ``backward``.)"""
    norm = _NORM[p.device.type]
    x = torch.cat([p[:, :32] * 2, p[:, 32:]], 1)
    y = F.silu(norm(x)) + x
    return torch.autograd.grad((y * y).sum(), [p, norm.weight])


def _cat_groupnorm_loss(p):
    norm = _NORM[p.device.type]
    x = torch.cat([p[:, :32] * 2, p[:, 32:]], 1)
    y = F.silu(norm(x)) + x
    return (y * y).sum()


def _cat_groupnorm_train_split(p):
    """``_cat_groupnorm_train`` with its forward in a function of its own, as a module's
    ``forward``: ``x`` and ``y`` die before the backward, so no backend need write them
    (the one above holds them at the backward: accel writes them, torch.compile's graph
    knows they die)."""
    return torch.autograd.grad(_cat_groupnorm_loss(p), [p, _NORM[p.device.type].weight])


def _slice_add(p):
    y = p * 2
    return y[:, 1:] + y[:, :-1]


_ROPE = {}


def _rope(q):
    cos, sin = _ROPE[q.device.type]
    return q * cos + rotate_half(q) * sin


#: name -> (input shape for n elements, function)
WORKLOADS = {
    "slice_add": (lambda n: (n // 1024, 1024), _slice_add),
    "diff": (lambda n: (n // 1024, 1024), lambda p: torch.diff(p * 2, dim=-1)),
    "swiglu": (lambda n: (n // 1024, 1024), lambda p: _swiglu(p * 2)),
    "swiglu_ext": (lambda n: (n // 1024, 1024), _swiglu),
    "rope": (lambda n: (n // (2048 * 128), 2048, 128), _rope),
    "cat_exp_sin": (lambda n: (n // 1024, 1024), lambda p: torch.cat([p.exp(), p.sin()], -1)),
    "stack3": (lambda n: (n,), lambda p: torch.stack([p, p * 2, p * 3], -1)),
    "cross3": (lambda n: (n // 3, 3), lambda p: torch.linalg.cross(p, p * 2)),
    "glu": (lambda n: (n // 1024, 1024), lambda p: F.glu(p * 2, -1)),
    "pad": (lambda n: (n // 1024, 1024), lambda p: F.pad(p * 2, (0, 8), value=1.0)),
    "cat_groupnorm": (lambda n: (n // 65536, 64, 32, 32),
                      lambda p: F.silu(F.group_norm(torch.cat([p[:, :32] * 2, p[:, 32:]], 1), 32))),
    "cat_groupnorm_train": (lambda n: (n // 65536, 64, 32, 32), _cat_groupnorm_train),
    "cat_groupnorm_train_split": (lambda n: (n // 65536, 64, 32, 32), _cat_groupnorm_train_split),
    "cat_softmax": (lambda n: (n // 1024, 1024), lambda p: torch.cat([p[:, :512] * 2, p[:, 512:]], -1).softmax(-1)),
    "cat_layernorm": (lambda n: (n // 1024, 1024),
                      lambda p: F.layer_norm(torch.cat([p[:, :512] * 2, p[:, 512:]], -1), (1024,))),
}


def main() -> None:
    host = "--host" in sys.argv
    if host:
        sys.argv.remove("--host")
        os.environ.setdefault("ACCEL_EAGER_SMALL_REGIONS", "0")
    dev, shape, sync, runs, wanted = device_workloads_args(__doc__)
    n = 2048 * 128 if host else shape[0] * shape[1]
    g = torch.Generator().manual_seed(0)
    _ROPE[torch.device(dev).type] = (torch.randn(2048, 128, generator=g).to(dev),
                                     torch.randn(2048, 128, generator=g).to(dev))
    rows = []
    for name, (shape_of, fn) in WORKLOADS.items():
        if not wanted(name):
            continue
        p = torch.randn(*shape_of(n), generator=g).to(dev)
        if "_train" in name:
            _NORM[p.device.type] = torch.nn.GroupNorm(32, 64).to(dev)
            p.requires_grad_()
        rows.append(compare_on(name, fn, p, sync, runs))
    print(table(KERNELS_HEAD, rows))


if __name__ == "__main__":
    main()
