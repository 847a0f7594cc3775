"""Losses whose eager calls the interceptor replaces by accel's own ops (``accel.library``)
where the call's inputs allow, so that a region fuses what eager writes to memory between
them: ``F.cross_entropy``'s ``nll_loss_forward`` of a pending log-softmax, and autograd's
``nll_loss_backward`` ahead of the log-softmax backward. Each function here matches a call
(the region's pending state as :class:`accel.region.Region` keeps it) and returns the accel
op's arguments; :mod:`accel.interceptor` records the op (``_record_whole``)."""
from __future__ import annotations

from typing import Optional

import torch

from . import library  # noqa: F401 - registers torch.ops.accel.*
from .region import storage_base

_aten = torch.ops.aten
_NLL_FORWARD = _aten.nll_loss_forward.default
_LOG_SOFTMAX = _aten._log_softmax.default
_current_node = torch._C._current_autograd_node


def _pending(region, t) -> bool:
    """Whether ``t`` is a pending output of ``region`` or a view of one."""
    return id(t) in region.out_ids or storage_base(t) in region.out_bases


def nll_of_log_softmax(region, args, kwargs) -> Optional[tuple]:
    """``nll_loss_forward(logp, target, None, reduction, ignore_index)`` where ``logp`` [N, C]
    is the pending output of ``_log_softmax(x, 1)`` over a float32 or float64 ``x`` from
    outside the region (``F.cross_entropy``'s two halves), without reading ``logp``: since
    ``-logp[i, t] = (max_i - x[i, t]) + log(sum_j exp(x[i, j] - max_i))``, eager's own
    ``nll_loss_forward`` on ``x`` gives each row's ``-x[i, t]`` (0 where ``t`` is
    ``ignore_index``; its checks and errors on the target are eager's; run here), and the
    rest (the rows' max and sum of exponentials, the mask of ignored targets, the total
    weight and the reduction) is deferred into the region as one call,
    :func:`accel.library.nll_of_log_softmax`, which its trace decomposes. One recorded call,
    not the ten of its aten calls: the host's time for a [64, 128] ``cross_entropy`` under
    accel 57 -> 25 µs on the dev VM (eager's: 4.4). ``logp`` is then written only where
    something keeps it: the region reads ``x`` once and writes no [N, C] output, as
    Inductor's fused cross entropy does. Not where ``logp`` requires grad (training:
    autograd keeps it for the backward, so it is written anyway, and the usual path
    computes its statistics and writes it in one pass over each row).

    Returns:
        ``(op_args, total_weight)``: ``accel.nll_of_log_softmax``'s arguments ``(x, rows,
        target, reduction, ignore_index)`` and eager's total weight for reduction none (the
        op's second result stands for it otherwise); None where the pattern does not hold
        or eager's ``nll_loss_forward`` on ``x`` raised (the call then runs as usual: the
        region flushed, eager's call on ``logp``, raising its error).
    """
    if kwargs or len(args) != 5:
        return None
    logp, target, weight, reduction, ignore_index = args
    if weight is not None or region.mutates_ext or reduction not in (0, 1, 2) or logp.requires_grad:
        # (a pending write into an external input: x or the target read twice; autograd
        # keeps a logp that requires grad for the backward: written anyway)
        return None
    i = region.out_ids.get(id(logp))
    if i is None or region.outs[i] is not logp or type(target) is not torch.Tensor:
        return None
    k = 0
    for func, targs, tkw, n_new in region.calls:  # the call whose output logp is
        if k + n_new > i:
            break
        k += n_new
    else:
        return None
    if func is not _LOG_SOFTMAX or n_new != 1 or tkw or len(targs) != 3:
        return None
    dim, half = (r[1] if r[0] == "c" else region.scalars[r[1]] if r[0] == "s" else None for r in targs[1:])
    x = region.ext[targs[0][1]] if targs[0][0] == "x" else None
    if (x is None or type(dim) is not int or dim not in (1, -1) or half is not False or x.dim() != 2
            or x.shape != logp.shape or x.dtype != logp.dtype
            or x.dtype not in (torch.float32, torch.float64) or target.dim() != 1
            or target.dtype != torch.int64 or target.device != x.device):
        return None
    if _pending(region, target):
        return None  # eager would read it unwritten
    try:
        rows, total = _NLL_FORWARD._op(x, target, None, 0, ignore_index)  # -x[i, t], eager's checks
    except Exception:  # noqa: BLE001 - the usual path raises eager's error on logp
        return None
    return (x, rows, target, reduction, ignore_index), total


def nll_loss_backward(region, args, kwargs) -> Optional[tuple]:
    """``nll_loss_backward(grad_output, self, target, None, reduction, ignore_index,
    total_weight)`` run by autograd's ``NllLossBackward0`` (the forward's ``nll_loss``, eager's,
    checked every target against ``self``'s classes; autograd refuses a target changed
    since), deferred as one call of :func:`accel.library.nll_loss_backward`: its [N, C]
    result (``-grad_output / total_weight`` at each row's target, 0 elsewhere) is then
    computed where it is read, and a log-softmax backward reading it (``F.cross_entropy``'s)
    reads only the log-softmax: the gradient's zeros and scatter are never written. Eager
    writes them (C values a row) and reads them back in the log-softmax backward.

    Returns:
        ``accel.nll_loss_backward``'s arguments ``(grad_output, target, total_weight,
        classes, reduction, ignore_index)``, or None where the case does not hold (a class
        weight, ``self`` not 2-D float32 or float64, a pending target, not autograd's
        ``NllLossBackward0``): the call then runs as usual.
    """
    if kwargs or len(args) != 7:
        return None
    grad_output, logp, target, weight, reduction, ignore_index, total = args
    if (weight is not None or reduction not in (0, 1, 2) or type(logp) is not torch.Tensor
            or logp.dim() != 2 or logp.dtype not in (torch.float32, torch.float64)
            or type(target) is not torch.Tensor or target.dim() != 1 or target.dtype != torch.int64
            or target.shape[0] != logp.shape[0] or grad_output.dtype != logp.dtype
            or total.dtype != logp.dtype or len({t.device for t in (grad_output, logp, target, total)}) != 1):
        return None
    node = _current_node()
    if node is None or node.name() != "NllLossBackward0":
        return None  # (called elsewhere: eager's checks of the target are needed)
    if _pending(region, target):
        return None
    return grad_output, target, total, logp.shape[1], reduction, ignore_index
