"""Decompositions that write an op as views and concatenations (``accel.cat``, which the
lowering stores piece by piece or stores first and reads back: :mod:`accel.lowering`),
where torch._decomp's write into a slice of a tensor (``prims.copy_to``) or gather
(``index_select``, a masked index), which the loop IR does not express. Installed into
:func:`accel.decompositions.decomposition_table`; each takes torch's decomposition of the
op first where it may fall back to it.
"""
from __future__ import annotations

import functools

import torch

from . import library

aten = torch.ops.aten


def install(table: dict) -> None:
    """Put this module's decompositions into ``table`` (torch._decomp's, a copy), each
    given the one it replaces where it falls back to it."""
    for op, f in ((aten.cat.default, cat), (aten.constant_pad_nd.default, constant_pad_nd),
                  (aten.slice_backward.default, slice_backward)):
        table[op] = functools.partial(f, table[op])
    table[aten.linalg_cross.default] = linalg_cross


def cat(decomposition, tensors, dim=0):
    """``cat`` inside another op's decomposition (``stack``'s: ``linalg_cross``'s) as
    ``accel.cat``, which the lowering reads (torch._decomp's ``prims.cat`` it does not), for
    2 to ``accel.library.CAT_MAX`` tensors of one rank; else torch._decomp's."""
    if 2 <= len(tensors) <= library.CAT_MAX and len({t.dim() for t in tensors}) == 1 and tensors[0].dim():
        return torch.ops.accel.cat(*library.cat_args(tensors, dim))
    return decomposition(tensors, dim)


def constant_pad_nd(decomposition, x, pad, value=0):
    """``constant_pad_nd`` (``F.pad``'s constant mode) as views and a concatenation: each
    dim cropped where its pad is negative (``narrow``), then ``x`` between two blocks of
    ``value`` (in ``x``'s dtype, as eager fills them) where it is positive, concatenated
    along the dim (``accel.cat``, which the lowering stores piece by piece). torch's
    decomposition writes ``x`` into a slice of a filled tensor (``prims.copy_to``), which
    the loop IR does not express (:func:`accel.lowering.lower` rejects such a write).
    ``decomposition`` is not used: the call's meta function has checked ``pad``."""
    for k in range(len(pad) // 2):
        d, (lo, hi) = x.dim() - 1 - k, pad[2 * k: 2 * k + 2]
        x = x.narrow(d, max(-lo, 0), x.shape[d] - max(-lo, 0) - max(-hi, 0))
        blocks = [x.new_full(x.shape[:d] + (max(n, 0),) + x.shape[d + 1:], value) for n in (lo, hi)]
        pieces = [t for t in (blocks[0], x, blocks[1]) if t.shape[d]]
        if len(pieces) > 1:
            x = torch.cat(pieces, d)
    return x


def slice_backward(decomposition, grad, input_sizes, dim, start, end, step):
    """``slice_backward`` (the gradient of ``x[..., start:end:step, ...]``: ``grad`` at
    every ``step``-th position of a tensor of zeros of ``input_sizes``) as padding
    (:func:`constant_pad_nd`): of ``grad`` itself for a step of 1, else of ``grad``
    concatenated with ``step - 1`` zeros along a new dim after ``dim``, the two dims
    merged (each element followed by its zeros). torch's decomposition (a masked gather
    the loop IR does not express) for an empty ``grad``. ``start`` and ``end`` are in
    range (autograd's ``slice_backward_wrapper`` clamps them)."""
    d = dim % len(input_sizes)
    if step != 1:
        if grad.numel() == 0:
            return decomposition(grad, input_sizes, dim, start, end, step)
        g = grad.unsqueeze(d + 1)
        zeros = g.new_zeros(g.shape[:d + 1] + (step - 1,) + g.shape[d + 2:])
        grad = torch.cat([g, zeros], d + 1).flatten(d, d + 1)
    pad = [0, 0] * (len(input_sizes) - 1 - d) + [start, input_sizes[d] - start - grad.shape[d]]
    return constant_pad_nd(None, grad, pad)


def linalg_cross(a, b, *, dim=-1):
    """``torch.linalg.cross`` as eager's kernel computes each component (``a1 * b2 - a2 *
    b1``, ``a2 * b0 - a0 * b2``, ``a0 * b1 - a1 * b0``: ATen's ``cross_kernel``), the three
    values of each vector selected along ``dim`` and the components stacked: views and
    pointwise ops the loop IR reads (torch._decomp's gathers them with ``index_select``).
    ``a`` and ``b`` broadcast; their size along ``dim`` is 3 (the call's meta function
    checks it before the call is deferred)."""
    a, b = torch.broadcast_tensors(a, b)
    d = dim % a.dim()
    a0, a1, a2 = a.unbind(d)
    b0, b1, b2 = b.unbind(d)
    return torch.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], d)
