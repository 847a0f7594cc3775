"""Concatenations in regions (``accel.library.cat``): eager's ``cat`` and ``stack`` of 2 to
``CAT_MAX`` tensors are recorded as ``accel.cat``, and the lowering stores a value that
reads one across its pieces piece by piece (``accel.lowering._split_spans``); a reduction
along the concatenated dim reduces each piece and merges the results
(``accel.lower_expr._Lowerer.reduce_domains``), or, where it cannot, the concatenation is
stored first and read back (``accel.lowering._split_concats``). Results, layouts and gradients are eager's; what a
kernel cannot take (an ``out=`` tensor, more tensors, an empty one, other ranks) runs as
eager runs it, with eager's errors."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import accel
from accel.interceptor import _state
from devices import DEVICES

close = torch.testing.assert_close


def rotate_half(x):
    """transformers' rotary embedding helper: the halves of the last dim, swapped, one negated."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rope(q, cos, sin):
    return q * cos + rotate_half(q) * sin


PROGRAMS = {
    "rope": lambda x, w: _rope(x * 1.5, w, w * 0.5 - 1),
    "written": lambda x, w: torch.cat([x.exp(), x.sin(), w * 2], -1),
    "dim0": lambda x, w: torch.cat([x * 2, x[:3] + 1, w[:5]], 0) - 1,
    "middle": lambda x, w: torch.cat([x.view(6, 4, 12) * 2, w.view(6, 4, 12)[:, :1]], 1).abs().sqrt(),
    "stack": lambda x, w: torch.stack([x, x * 2, w], -1) + 1,
    "stack0": lambda x, w: torch.stack([x.sin(), w.cos()]) * x,
    "stack_pairs": lambda x, w: torch.stack([x[:, :24] * 2, w[:, 24:]], -1),  # (pairs from offsets)
    "nested": lambda x, w: torch.cat([torch.cat([x, w], 0) * 2, torch.cat([w, x], 0)], -1).tanh(),
    "promoted": lambda x, w: torch.cat([x * 2, (w > 0).to(torch.int32), w.double()], -1) * 3,
    "eight": lambda x, w: torch.cat([x * k for k in range(8)], -1) + w[:, :1],
    "reduced_across": lambda x, w: torch.cat([x * 2, w + 1], 0).sum(-1),  # rows of pieces
    # reductions along the concatenated dim: each piece reduced, the results merged
    "summed_along": lambda x, w: torch.cat([x * 2, w + 1], 0).sum(0),
    "amax_along": lambda x, w: torch.cat([x * 2, w.view(48, 6)[:5].t() + 1], -1).amax(-1),
    "softmax_along": lambda x, w: torch.cat([x * 2, w + 1], -1).softmax(-1),
    "layer_norm_along": lambda x, w: F.layer_norm(torch.cat([x, w * 2], -1), (96,)) * 3,
    # a U-Net decoder's skip connection: groups of channels across the pieces
    "group_norm_along": lambda x, w: F.silu(F.group_norm(torch.cat([x.view(6, 3, 16), w.view(6, 3, 16) * 2], 1), 3)),
    "stored_and_summed": lambda x, w: torch.cat([x * 2, w], 0).tanh() + torch.cat([x * 2, w], 0).sum(0),
    "transposed": lambda x, w: torch.cat([x.t() * 2, w.t()], 0).t() + 1,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_a_concatenation_runs_in_the_region_as_eager(device, program):
    torch.manual_seed(0)
    x, w = torch.randn(6, 48, device=device), torch.randn(6, 48, device=device)
    f = PROGRAMS[program]
    want = f(x, w)
    accel.reset_stats()
    with accel.eager():
        got = f(x, w)
    close(got, want)
    assert got.stride() == want.stride()
    st = accel.stats()
    assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_concatenations_of_other_dtypes(device, dtype):
    torch.manual_seed(0)
    x = (torch.randn(16, 40, device=device) * 4).to(dtype)
    y = (torch.randn(16, 40, device=device) * 4).to(dtype)

    def f(x, y):
        a = torch.maximum(x, y)
        return torch.cat([a, torch.minimum(x, y), x], -1), torch.stack([a, y], 1), torch.stack([a, y, a], -1)

    with accel.eager():
        got = f(x, y)
    for g, r in zip(got, f(x, y)):
        close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_pieces_give_eagers_layout(device):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 5, device=device).to(memory_format=torch.channels_last)
    y = torch.randn(2, 4, 5, 5, device=device).to(memory_format=torch.channels_last)
    with accel.eager():
        got = torch.cat([x * 2, y.relu()], 1) + 1
    want = torch.cat([x * 2, y.relu()], 1) + 1
    close(got, want)
    assert got.stride() == want.stride()


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_through_chunks_and_concatenations(device):
    """A SwiGLU on chunks of one projection and a rotary embedding, forward and backward:
    the chunks' gradient is a ``cat`` in autograd's backward, recorded there too."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    cos, sin = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)

    def step():
        a, b = (x * 2).chunk(2, -1)
        h = F.silu(a) * b
        r = _rope(h, cos, sin)
        loss = (r * r).sum()
        return r, torch.autograd.grad(loss, x)[0]

    want = step()
    for _ in range(2):
        with accel.eager():
            got = step()
        for g, r in zip(got, want):
            close(g, r)


ALONG = {  # name -> (program, whether each piece is read where it is, no copy of the concatenation)
    "softmax": (lambda x, w: torch.cat([x * 2, w + 1], -1).softmax(-1), True),
    "bfloat16_softmax": (lambda x, w: torch.cat([x.bfloat16() * 2, w.bfloat16()], -1).softmax(-1), True),
    "uneven_log_softmax": (lambda x, w: torch.cat([x * 2, w[:, :16]], -1).log_softmax(-1), True),
    "layer_norm": (lambda x, w: F.layer_norm(torch.cat([x, w * 2], -1), (96,)) * 3, True),
    "rms_norm": (lambda x, w: F.rms_norm(torch.cat([x, w * 2, x[:, :5]], -1), (101,)), True),
    "var_mean": (lambda x, w: torch.var_mean(torch.cat([x.exp(), w], -1), -1, correction=1), True),
    "var": (lambda x, w: torch.cat([x.exp(), w], -1).var(-1), True),
    "sum_amax_amin_prod": (lambda x, w: (lambda c: (c.sum(-1), c.amax(-1), c.amin(-1), c[:, 40:60].prod(-1)))(
        torch.cat([x * 2, w], -1)), True),
    "viewed_sum": (lambda x, w: torch.cat([x, w * 2], 1).view(7, 48, 2).sum((1, 2)), True),  # (at 2 * i + j)
    "int_sum": (lambda x, w: torch.cat([(x * 9).int(), (w * 9).int() * 3], -1).sum(-1), True),
    "nan_amax": (lambda x, w: torch.cat([x, (w - 2.5).sqrt()], -1).amax(-1), True),  # (some rows' NaN)
    "minus_inf_piece": (lambda x, w: torch.cat([torch.full_like(x, float("-inf")), w], -1).softmax(-1), True),
    "all_minus_inf": (lambda x, w: torch.cat([x * 0 - torch.inf, w.abs() * -torch.inf], -1).softmax(-1), True),
    # groups of 2 channels, the pieces' boundary between groups: each group's statistics of one input
    "group_norm": (lambda x, w: F.silu(F.group_norm(torch.cat([x.view(7, 4, 12), (w.view(7, 4, 12) * 2)[:, :2]], 1), 3)),
                   True),
    "two_concatenations": (lambda x, w: (torch.cat([x, w], -1) * torch.cat([w[:, :8], x, w[:, 8:]], -1)).softmax(-1),
                           True),
    # read back: an arg reduction's first index is its order's; more pieces than MAX_SEGMENTS
    "argmax": (lambda x, w: torch.cat([x * 2, w], -1).argmax(-1), False),
    "many_pieces": (lambda x, w: (torch.cat([x[:, 6 * k:6 * k + 6] for k in range(8)], -1)
                                  + torch.cat([w[:, :3]] + [w[:, 3 + 6 * k:9 + 6 * k] for k in range(6)] + [w[:, 39:]],
                                              -1)).softmax(-1), False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ALONG))
def test_a_reduction_along_a_concatenation_reads_each_piece(device, name, fresh_store, monkeypatch):
    """A reduction along a concatenation's dim (a softmax, a norm over ``torch.cat``'s last
    dim; a group norm whose groups each lie in one piece) runs over each piece where it is
    and merges the pieces' results (``accel.lower_expr._Lowerer.reduce``): no copy of the
    concatenation in memory. Where it cannot (an argmax, whose tie-break is its order; more
    than ``MAX_SEGMENTS`` pieces), the concatenation is stored first. Eager's results:
    integer sums bit for bit, NaN and ``-inf`` pieces as eager."""
    import accel.lowering as lowering

    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    torch.manual_seed(0)
    # (7 rows: shapes no other test traces; a region built in this process before is not lowered again)
    x, w = torch.randn(7, 48, device=device), torch.randn(7, 48, device=device)
    f, in_place = ALONG[name]
    want = f(x, w)
    accel.reset_stats()
    with accel.eager():
        got = f(x, w)
    close(got, want, equal_nan=True)
    st = accel.stats()
    assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st
    (ir,) = irs
    copies = [b.shape for b in ir.buffers if b.scratch]
    assert (not copies) == in_place, (copies, ir.describe())


@pytest.mark.parametrize("name", ["softmax", "layer_norm", "group_norm"])
def test_a_row_kernels_pieces_store_each_through_a_vector_of_its_own(name, fresh_store, monkeypatch):
    """The CUDA row kernel of a reduction along a concatenation stores the output's pieces,
    two stores into one buffer, each through a vector register of its own: with one
    register a buffer, the second piece's lanes overwrote the first's before its vector was
    written (an H200 run of this round: the softmax, LayerNorm and GroupNorm programs not
    eager's). Rendered here, without a GPU."""
    import re

    import accel.lowering as lowering
    from accel.codegen.cuda import CudaRenderer

    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    x, w = torch.randn(5, 48), torch.randn(5, 48)  # (5 rows: shapes no other test traces)
    f = {"softmax": lambda: torch.cat([x * 2, w + 1], -1).softmax(-1),
         "layer_norm": lambda: F.layer_norm(torch.cat([x, w * 2], -1), (96,)),
         "group_norm": lambda: F.group_norm(torch.cat([x.view(5, 4, 12), (w.view(5, 4, 12) * 2)[:, :2]], 1), 3),
         }[name]
    want = f()
    with accel.eager():
        got = f()
    close(got, want)
    (ir,) = irs
    src = CudaRenderer().render(ir, "k")
    stores = re.findall(r"lane_ref\((w\w+), j & \d+\) = \w+; if \(\(j & \d+\) == \d+\) "
                        r"\*reinterpret_cast<[^;]+?\*>\((b\d+ [^;]*?) - \d+\) = (w\w+);", src)
    assert len(stores) >= 2, src
    registers: dict = {}
    for lane, at, written in stores:
        assert lane == written
        registers.setdefault(lane, set()).add(at)
    assert all(len(at) == 1 for at in registers.values()), registers


@pytest.mark.parametrize("device", DEVICES)
def test_pieces_of_unequal_sizes_share_a_nest(device, fresh_store, monkeypatch):
    """A softmax and a LayerNorm over ``torch.cat`` of 192 and 64 columns: the stores and
    the reductions are cut into spans of 64 (``accel.lower_expr.even_cuts``), one nest
    whose row statistics are computed once for the four spans, no copy of the
    concatenation. Eager's results."""
    import accel.lowering as lowering

    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    torch.manual_seed(0)
    a, b = torch.randn(5, 192, device=device), torch.randn(5, 64, device=device)

    def f():
        c = torch.cat([a * 2, b], -1)
        return c.softmax(-1), F.layer_norm(c, (256,))

    want = f()
    with accel.eager():
        got = f()
    close(got, want)
    (ir,) = irs
    assert len(ir.nests) == 1 and not any(b.scratch for b in ir.buffers), ir.describe()
    assert [ir.sizes[v] for v in ir.nests[0].vars] == [5, 64] and len(ir.nests[0].stores) == 8, ir.describe()


@pytest.mark.parametrize("device", DEVICES)
def test_an_output_stored_piece_by_piece_is_read_back_whole(device, fresh_store, monkeypatch):
    """A rotary embedding's output (stored piece by piece) and its sum of squares, a loss's:
    the sum's nest, after the output's, reads the output back
    (``accel.lowering._outputs_in_pieces``) instead of computing it again from ``q``."""
    import accel.lowering as lowering
    from accel.loop_ir import walk

    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    torch.manual_seed(0)
    q, cos = torch.randn(3, 9, 32, device=device), torch.randn(9, 32, device=device)

    def f():
        y = _rope(q * 2, cos, cos * 0.5)
        return y, (y * y).sum()

    want = f()
    with accel.eager():
        got = f()
    close(got, want)
    (ir,) = irs
    out = next(i for i, b in enumerate(ir.buffers) if b.output and b.shape == (3, 9, 32))
    (total,) = [n for n in ir.nests if not n.vars]
    loads = {e.args[0] for st in total.stores for e in walk(st.value, set()) if e.op == "load"}
    assert loads == {out}, (loads, ir.describe())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, split", [(torch.float32, 12), (torch.bfloat16, 12), (torch.float32, 10)])
def test_a_unet_skip_connection_normalized_across_its_pieces(device, dtype, split):
    """A U-Net decoder block's start, forward and backward: the upsampled features and the
    skip connection concatenated along channels, GroupNorm's groups (of 4 channels)
    spanning both, SiLU; the concatenation is also the block's shortcut input. Eager's
    values and gradients. The forward's concatenation is stored, then normalized; the
    backward's gradient of ``x`` (``[N, G, C/G, H, W]`` merged) is split between ``h`` and
    ``skip`` along a channel loop split in groups; with 10 channels of ``h``, ``h``'s last 2
    and ``skip``'s first 2 (group 2's) are stored apart from the whole groups."""
    torch.manual_seed(0)
    h = torch.randn(2, split, 6, 6, device=device, dtype=dtype, requires_grad=True)
    skip = torch.randn(2, 32 - split, 6, 6, device=device, dtype=dtype, requires_grad=True)
    norm = torch.nn.GroupNorm(8, 32).to(device, dtype)

    def block():
        x = torch.cat([h * 2, skip], 1)
        y = F.silu(norm(x)) + x
        return y, torch.autograd.grad((y * y).sum(), [h, skip, norm.weight, norm.bias])

    want = block()
    accel.reset_stats()
    with accel.eager():
        got = block()
    close(got[0], want[0])
    for g, r in zip(got[1], want[1]):
        close(g, r)
    st = accel.stats()
    assert st["kernel_runs"] >= 2 and st["compile_failures"] == st["eager_replays"] == 0, st


SLICED = {
    "halves": lambda x: (x[:, :16] * 2).sum() + x[:, 16:].sin().sum(),
    "rows": lambda x: (x[1:5] * 2).sum() + x[2:].tanh().sum(),
    "whole": lambda x: (x[:, 0:40] * 2).sum(),
    "step2": lambda x: ((x[:, ::2] * x[:, 1::2]) ** 2).sum(),
    "step3": lambda x: x[:, 1:30:3].exp().sum(),
    # GPT-J's rotary embedding: the even and odd channels, interleaved again
    "interleaved": lambda x: (torch.stack([-x[:, 1::2], x[:, ::2]], -1).flatten(-2) * x).pow(2).sum(),
    "step9": lambda x: (x[:, ::9] * 3).sum(),
    "step_2d": lambda x: (x[::2, 3::4] * 3).sum() + x[1::3].sum(),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(SLICED))
def test_gradients_of_slices_run_in_regions(device, case):
    """``slice_backward`` (a slice's gradient: zeros but at the slice's elements) as padding
    (``accel.cat_decompositions.slice_backward``), a step's elements each followed by its
    zeros (a concatenation merged), fused with the gradients around it: eager's values,
    each step's in one kernel."""
    torch.manual_seed(0)
    x = torch.randn(6, 40, device=device, requires_grad=True)
    f = SLICED[case]
    want = torch.autograd.grad(f(x), x)[0]
    accel.reset_stats()
    with accel.eager():
        got = torch.autograd.grad(f(x), x)[0]
    close(got, want)
    st = accel.stats()
    assert st["eager_replays"] == 0 and st["kernel_runs"] >= 1, st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_glu_and_its_gradient_accumulated_in_place_run_in_regions(device, dtype, dim):
    """``F.glu`` and its backward (``glu_backward``: a ``cat`` of the halves' gradients)
    along each dim of a 3-d input run in regions, the second backward accumulating into
    ``x.grad`` in place piece by piece; no warning reaches the user (the backward's probe
    runs at the real sizes: ``accel.ops.REAL_SIZE_PROBES``), and no region fails its build."""
    torch.manual_seed(0)
    x = torch.randn(16, 48, 6, device=device, dtype=dtype, requires_grad=True)

    def step():
        x.grad = None
        for _ in range(2):
            out = F.glu(x * 2 + 1, dim).tanh() * 3
            out.backward(torch.ones_like(out))
        return out, x.grad

    want = step()
    accel.reset_stats()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(2):
            with accel.eager():
                got = step()
            for g, r in zip(got, want):
                close(g, r)
    assert not [str(w.message) for w in warned]
    st = accel.stats()
    assert st["kernel_runs"] > 0 and st["compile_failures"] == st["eager_replays"] == 0, st


PADS = {  # name -> (program, input shape, dtype); F.pad's constant mode: constant_pad_nd
    "right": (lambda x: F.pad(x * 2, (1, 2)) + 1, (6, 10), torch.float32),
    "two_dims": (lambda x: F.pad(x.exp(), (0, 3, 2, 0), value=-1.5).sin(), (6, 10), torch.float32),
    "three_dims": (lambda x: F.pad(x * 2, (1, 1, 1, 1, 1, 1), value=2.0), (3, 4, 5), torch.float32),
    "crop": (lambda x: F.pad(x * 2, (-1, 2)), (6, 10), torch.float32),
    "crop_both": (lambda x: F.pad(x * 2, (-2, -3, 1, -1)), (6, 10), torch.float32),
    "int": (lambda x: F.pad(x * 3, (1, 1), value=7.9) - 1, (6, 10), torch.int32),
    "bool": (lambda x: F.pad(~x, (2, 0), value=True), (6, 10), torch.bool),
    "half": (lambda x: F.pad(x * 3, (4, 4), value=0.1), (6, 10), torch.bfloat16),
    "channels_last": (lambda x: F.pad(x.relu(), (1, 1, 2, 2)), (2, 3, 5, 5), torch.float32),
    # a reduction along the padded dim: the padded value stored first, read back
    "summed_along": (lambda x: F.pad(x * 2, (2, 2)).sum(-1), (6, 10), torch.float32),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(PADS))
def test_constant_padding_runs_in_the_region_as_eager(device, case):
    """``F.pad`` of a pending value (``constant_pad_nd``: crops as views, pads as a
    concatenation with blocks of the value, :func:`accel.cat_decompositions.constant_pad_nd`):
    eager's values, exactly for integers and booleans, its layout, one kernel."""
    f, shape, dtype = PADS[case]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    if case == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    want = f(x)
    accel.reset_stats()
    with accel.eager():
        got = f(x)
    exact = {} if dtype.is_floating_point else {"rtol": 0, "atol": 0}
    close(got, want, **exact)
    assert got.stride() == want.stride()
    st = accel.stats()
    assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_through_constant_padding(device):
    """The gradient of a padded value (``constant_pad_nd`` of the gradient by the negated
    pads: a crop) in the backward's region."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    dy = torch.randn(6, 12, device=device)

    def grad():
        return torch.autograd.grad(F.pad(x * 2, (1, 3, 0, 2), value=0.5) ** 2, x, dy)[0]

    want = grad()
    accel.reset_stats()
    with accel.eager():
        got = grad()
    close(got, want)
    assert accel.stats()["kernel_runs"] >= 1 and accel.stats()["eager_replays"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["swap", "halves", "add", "add_self", "rows", "read_after", "scaled"])
def test_an_input_written_in_place_from_a_concatenation(device, case):
    """An input written in place (``copy_``, ``add_``) with a value read across the pieces
    of a concatenation: written piece by piece where no read of another element sees a new
    value, else eagerly (the halves of ``x`` swapped); its values are eager's either way."""
    f = {"swap": lambda x, a, b: x.copy_(torch.cat([x[:, 24:], x[:, :24]], 1)),
         "halves": lambda x, a, b: x.copy_(torch.cat([x[:, :24] * 2, x[:, :24] * 3], 1)),
         "add": lambda x, a, b: x.add_(torch.cat([a * 2, b.exp()], 1)),
         "add_self": lambda x, a, b: x.add_(torch.cat([x[:, 24:], a], 1)),
         "rows": lambda x, a, b: x.copy_(torch.cat([x[:32] * 2, x[:32] + 1], 0)),
         "read_after": lambda x, a, b: (x.copy_(torch.cat([a, b], 1)), (x * 2).sum(1))[1],
         "scaled": lambda x, a, b: x.copy_(torch.cat([a, b], 1) / ((x * x).sum(1, keepdim=True) + 1)),
         }[case]
    g = torch.Generator().manual_seed(0)
    x0, a, b = (torch.randn(64, n, generator=g).to(device) for n in (48, 24, 24))
    want_x = x0.clone()
    want = f(want_x, a, b)
    x = x0.clone()
    for _ in range(2):
        with accel.eager():
            x.copy_(x0)
            got = f(x, a, b)
        close(x, want_x)
        close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["nine", "empty", "out", "ranks", "sizes", "scalar"])
def test_other_concatenations_run_as_eager(device, case):
    """More than CAT_MAX tensors, an empty one, an ``out=`` tensor: eager's call, the region
    flushed first; mismatched ranks or sizes, 0-d tensors: eager's error."""
    x = torch.randn(4, 6, device=device)

    def f():
        y = x * 2
        if case == "nine":
            return torch.cat([y] * 9, 1)
        if case == "empty":
            return torch.cat([y, x[:, :0], y], 1)
        if case == "out":
            out = torch.empty(4, 12, device=device)
            torch.cat([y, x], 1, out=out)
            return out
        if case == "ranks":
            return torch.cat([y, x[0]], 0)
        if case == "sizes":
            return torch.cat([y, x[:, :2]], 0)
        return torch.stack([y[0, 0], x[0, 0]])

    try:
        want = f()
    except RuntimeError as e:
        with accel.eager(), pytest.raises(RuntimeError, match=str(e).split(".")[0][:40]):
            f()
        return
    with accel.eager():
        got = f()
        assert not _state.region.calls or case == "scalar"
    close(got, want)


#: OpInfos whose samples reach eager's ``cat``, ``stack`` or ``linalg_cross`` (directly or
#: through a composite op: ``hstack``, ``vstack``, ``column_stack``, ``cross``)
SAMPLED = ("cat", "stack", "hstack", "vstack", "dstack", "column_stack", "linalg.cross", "cross")


def _sampled_cases():
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.name in SAMPLED and not op.variant_test_name]
    dtypes = (torch.float32, torch.float64, torch.float16, torch.int64, torch.bool)
    devices = [(d, ()) if isinstance(d, str) else (d.values[0], d.marks) for d in DEVICES]
    return [pytest.param(op, dt, device, marks=marks, id=f"{op.name}-{str(dt)[6:]}-{device}")
            for op in ops for dt in dtypes if dt in op.supported_dtypes("cpu") for device, marks in devices]


@pytest.mark.parametrize("op, dtype, device", _sampled_cases())
def test_opinfo_samples_of_concatenations_and_cross_products(op, dtype, device):
    """Every OpInfo sample (empty pieces, mixed ranks and dtypes, broadcast cross products,
    ``out=`` aside) of the inputs times 2 (a pending value): eager's result, or eager's error."""
    torch.manual_seed(0)
    for s in op.sample_inputs(device, dtype):
        def run():
            ins = s.input
            if isinstance(ins, (list, tuple)):
                ins = [t * 2 if t.dtype != torch.bool else ~t for t in ins]
            else:
                ins = ins * 2 if ins.dtype != torch.bool else ~ins
            args = [a * 2 if isinstance(a, torch.Tensor) and a.dtype != torch.bool else a for a in s.args]
            return op(ins, *args, **s.kwargs)
        try:
            want = run()
        except RuntimeError:
            with accel.eager(), pytest.raises(RuntimeError):
                run()
            continue
        with accel.eager():
            got = run()
        close(got, want, equal_nan=True, rtol=0 if not dtype.is_floating_point else None,
              atol=0 if not dtype.is_floating_point else None)
        assert got.stride() == want.stride() or got.numel() <= 1


_MERGED = {  # program of x, w [3, 40]: (block reductions a row, the merged partials rendered)
    "softmax": (lambda x, w: torch.cat([x * 2, w + 1], -1).softmax(-1), 2,
                [r"accel::maximum\(a\d+_0, a\d+_0\), accel::Max\(\)", r"\(a\d+_0 \+ a\d+_0\), accel::Sum\(\)"]),
    "sum3": (lambda x, w: torch.cat([x, w * 2, x - w], -1).sum(-1, keepdim=True) * x, 1,
             [r"\(\(a\d+_0 \+ a\d+_0\) \+ a\d+_0\), accel::Sum\(\)"]),
    "amin": (lambda x, w: x - torch.cat([x, w.exp()], -1).amin(-1, keepdim=True), 1,
             [r"accel::minimum\(a\d+_0, a\d+_0\), accel::Min\(\)"]),
}


@pytest.mark.parametrize("name", sorted(_MERGED))
def test_a_reduction_along_pieces_reduces_across_the_block_once(name, fresh_store, monkeypatch):
    """A CUDA block reducing along a concatenation's pieces merges the pieces' values a
    thread at a time, then reduces across the block once (``accel.codegen.cuda_merges``):
    a softmax over two pieces runs two block reductions a row (its maximum and its sum),
    not four. Rendered here, without a GPU; eager's results on the CPU."""
    import re

    import accel.lowering as lowering
    from accel.codegen.cuda import CudaRenderer

    program, reductions, merged = _MERGED[name]
    irs, lower = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    x, w = torch.randn(3, 40), torch.randn(3, 40)  # (3 rows of 40: shapes no other test traces)
    want = program(x, w)
    with accel.eager():
        got = program(x, w)
    close(got, want)
    (ir,) = irs
    r = CudaRenderer()
    src = r.render(ir, "k")
    assert [d["block"][0] % 32 for d in r.launches] == [0], r.launches  # block mode
    for k in ("k_k0(", "k_k0v("):
        if k not in src:
            continue
        body = src[src.index(k):]
        body = body[:body.find("extern", 1)] if "extern" in body[1:] else body
        assert body.count("accel::block_reduce(") == reductions, body
        for m in merged:
            assert re.search(r"accel::block_reduce\(" + m, body), (m, body)
