"""Views of pending outputs read inside the region (``accel.ops.pending_view``): a call
reading a contiguous view that splits a pending output's dims (a Linear's ``[B * T, C]``
output viewed as ``[B, T, C]``), or a view that reads a contiguous pending output dim by
dim (a slice, a narrow, a chunk, a select, a transpose, an expand:
``accel.ops.dense_view_map``) is recorded into the region, which reads it as index
arithmetic; any other view of a pending output (a merge of dims, a diagonal, another
dtype, a view of a transposed output) flushes the region first. Either way the results,
the viewed output and the gradients are eager's."""
import pytest
import torch

import accel
from accel import dispatch
from accel.interceptor import _state
from accel.ops import dense_view_map, splits
from accel.region import native
from devices import DEVICES

close = torch.testing.assert_close


def pending():
    return len(_state.region.calls)


@pytest.mark.parametrize("src, dst, ok", [
    ((1024, 1024), (8, 128, 1024), True),
    ((64, 48), (1, 64, 48), True),
    ((64, 48), (64, 1, 48), True),
    ((64, 48), (64, 48, 1), True),
    ((64, 1, 48), (64, 48), True),
    ((64, 48), (4, 16, 6, 8), True),
    ((1,), (1, 1), True),
    ((8, 128, 1024), (1024, 1024), False),  # a merge
    ((64, 48), (48, 64), False),
    ((64, 48), (32, 96), False),
    ((6, 4), (3, 8), False),
])
def test_splits(src, dst, ok):
    assert splits(src, dst) is ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 16, 48), (1, 64, 48), (64, 1, 48), (64, 48, 1), (4, 16, 6, 8)])
def test_a_split_view_is_read_in_the_region(device, shape):
    torch.manual_seed(0)
    x = torch.randn(64, 48, device=device)
    b = torch.randn(48, device=device)
    accel.reset_stats()
    with accel.eager():
        y = x * 2 + b
        v = y.view(shape)
        z = torch.sin(v) * 0.5 + v
        assert pending() == 5  # the view's reader joined the region
    st = accel.stats()
    assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st
    ry = x * 2 + b
    close(y, ry)
    close(v, ry.view(shape))
    close(z, torch.sin(ry.view(shape)) * 0.5 + ry.view(shape))
    assert v._base is y


@pytest.mark.parametrize("shape, strides, size, stride, offset, want", [
    ((8, 6), (6, 1), (8, 5), (6, 1), 1, ([(0, 1), (1, 1)], [0, 1])),  # y[:, 1:]
    ((8, 6), (6, 1), (6, 8), (1, 6), 0, ([(1, 1), (0, 1)], [0, 0])),  # y.t()
    ((8, 6), (6, 1), (4, 3), (12, 2), 7, ([(0, 2), (1, 2)], [1, 1])),  # y[1::2, 1::2]
    ((8, 6), (6, 1), (8,), (6,), 2, ([(0, 1)], [0, 2])),  # y[:, 2]
    ((8, 1), (1, 1), (8, 6), (1, 0), 0, ([(0, 1), None], [0, 0])),  # expand
    ((48,), (1,), (4, 12), (12, 1), 0, ([(0, 12), (0, 1)], [0])),  # a split
    ((8, 6), (1, 8), (8, 5), (1, 8), 8, ([(0, 1), (1, 1)], [0, 1])),  # of a transposed layout
    ((8, 6), (6, 1), (48,), (1,), 0, None),  # a merge
    ((8, 6), (6, 1), (6,), (7,), 0, None),  # a diagonal
    ((8, 6), (6, 1), (8, 6), (6, 1), 1, None),  # an extent past a dim
    ((8, 6), (6, 1), (2, 6), (6, 1), 48, None),  # past the end
    ((8, 6), (12, 1), (8, 6), (6, 1), 0, None),  # not dense
])
def test_dense_view_map(shape, strides, size, stride, offset, want):
    assert dense_view_map(shape, strides, size, stride, offset) == want


#: views that read a pending [8, 16, 48] output dim by dim
STRIDED = {"transpose": lambda y: y.transpose(1, 2), "offset": lambda y: y[1:],
           "slice": lambda y: y[:, 3:11, 5:40], "step": lambda y: y[:, ::3, 1::2],
           "select": lambda y: y[:, 7], "narrow": lambda y: y.narrow(2, 24, 24),
           "chunk": lambda y: y.chunk(2, -1)[1], "unbind": lambda y: y.unbind(0)[5],
           "permute": lambda y: y.permute(2, 0, 1)[4:], "expand": lambda y: y[:, :, :1].expand(8, 16, 48)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", list(STRIDED))
def test_a_strided_view_is_read_in_the_region(device, view):
    torch.manual_seed(0)
    x = torch.randn(8, 16, 48, device=device)
    f = STRIDED[view]
    accel.reset_stats()
    with accel.eager():
        y = x * 2 + 1
        v = f(y)
        z = torch.sin(v) * 0.5 + v
        assert pending() == 5  # the view's reader joined the region
    st = accel.stats()
    assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st
    ry = x * 2 + 1
    close(y, ry)
    close(v, f(ry))
    close(z, torch.sin(f(ry)) * 0.5 + f(ry))


@pytest.mark.parametrize("device", DEVICES)
def test_slices_of_one_output_read_together(device):
    """Neighbouring slices of one pending value in one expression (a difference along a
    dim; a product of slices at offsets 1 and 0, of 92 elements: on a GPU the one at 0
    moves as 16-byte vectors, the one at 1 as single elements; a gated unit's halves,
    forward and backward): one kernel, eager's values and gradients."""
    torch.manual_seed(0)
    x = torch.randn(64, 96, device=device, requires_grad=True)

    def program(x):
        y = x * 2
        d = y[:, 1:] - y[:, :-1]
        e = y[:, 1:-3] * y[:, :-4]
        a, b = (x * 3).chunk(2, -1)
        g = torch.nn.functional.silu(a) * b
        return d, e, g, torch.autograd.grad((d.sum() + e.sum() + (g * g).sum()), x)[0]

    with accel.eager():
        got = program(x)
    for g, r in zip(got, program(x)):
        close(g, r)


@pytest.mark.parametrize("device", DEVICES)
def test_other_views_flush_the_region_first(device):
    """A merge of dims, a diagonal, a view of another dtype, a slice of an output laid out
    transposed."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 48, device=device)
    views = {"merge": lambda y: y.view(128, 48), "diagonal": lambda y: y.diagonal(0, 1, 2),
             "dtype": lambda y: y.view(torch.int32)}
    for name, view in views.items():
        accel.reset_stats()
        with accel.eager():
            y = x * 2 + 1
            v = view(y)
            z = v + v
            assert pending() == 1, name  # y's region flushed, v's reader pending
        assert accel.stats()["kernel_runs"] == 2, name
        close(z, view(x * 2 + 1) + view(x * 2 + 1), msg=name)
    xt = x.transpose(1, 2)
    accel.reset_stats()
    with accel.eager():
        y = xt * 2 + 1  # laid out as xt: not contiguous
        v = y[:, 1:]
        z = v + v
        assert pending() == 1
    close(z, (xt * 2 + 1)[:, 1:] * 2)


def _write_between(x):
    y = x + 1
    v = y.view(4, 8, 24)
    y.mul_(2)  # v sees it: one storage
    z = v * 3
    w = y.view(2, 16, 24).exp()
    return y, v, z, w


def _write_through(x):
    y = x + 1
    v = y.view(4, 8, 24)
    v.add_(0.5)  # writes y's elements through a split view: the region flushes first
    v.mul_(v)
    return y, v, y * 2


def _write_through_slice(x):
    y = x + 1
    v = y[:, 1:]
    v.mul_(2)  # through a strided view: the region flushes first
    w = y[:, :-1] + v  # overlapping slices, one written
    return y, v, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("program", [_write_between, _write_through, _write_through_slice],
                         ids=["output written between the view and its reader", "written through the view",
                              "written through a slice"])
def test_writes_around_a_view(device, program):
    torch.manual_seed(0)
    x = torch.randn(32, 24, device=device)
    with accel.eager():
        got = program(x)
    for g, r in zip(got, program(x)):
        close(g, r)


@pytest.mark.parametrize("device", DEVICES)
def test_a_view_that_outlives_the_region_reads_the_written_output(device):
    """The output behind a live view is written, though the region's reader took its values
    from registers, and nothing refers to the output but the view."""
    torch.manual_seed(0)
    x = torch.randn(64, 48, device=device)
    with accel.eager():
        v = (x * 2 - 1).view(8, 8, 48)
        z = v.tanh()
    close(v, (x * 2 - 1).view(8, 8, 48))
    close(z, (x * 2 - 1).view(8, 8, 48).tanh())
    with accel.eager():
        z = (x * 2 - 1).view(8, 8, 48).tanh()  # the view dies in the region: not written
    close(z, (x * 2 - 1).view(8, 8, 48).tanh())


class Conv1D(torch.nn.Module):
    """transformers' GPT-2 ``Conv1D``: ``addmm`` on the flattened rows, viewed back."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.weight.size(-1),)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


@pytest.mark.parametrize("device", DEVICES)
def test_a_gpt2_mlp_trains_as_eager(device, needs_dispatch_filter):
    """GPT-2's MLP (``Conv1D``, tanh-GELU, ``Conv1D``, residual add), forward and backward,
    four steps: the output and every gradient are eager's, at the mode's first steps and
    the dispatch filter's later ones (which record the GELU's reads of the viewed output)."""
    torch.manual_seed(0)
    fc, proj = Conv1D(48, 192).to(device), Conv1D(192, 48).to(device)
    x = torch.randn(4, 16, 48, device=device)

    def step():
        h = fc(x)
        g = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        out = proj(g) + x
        loss = (out * out).mean()
        grads = torch.autograd.grad(loss, [fc.weight, fc.bias, proj.weight, proj.bias])
        return out, *grads

    want = step()
    before = dispatch.recorded()
    for _ in range(4):
        with accel.eager():
            got = step()
        for g, r in zip(got, want):
            close(g, r)
    if not native.__name__.endswith("_core_py"):  # (the pure-Python core has no filter)
        assert dispatch.recorded() > before
