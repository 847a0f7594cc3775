"""Rematerializing autograd's saved values (accel/remat.py): a region's saved outputs that
pointwise calls compute from other saved values are not written in the forward and are
recomputed in the backward. Every loss and gradient is eager's; the error eager raises for
a saved value modified in place is raised; a program's own saved-tensor hooks, retained and
double backward graphs, checkpointing and no_grad behave as in eager."""
import math

import pytest
import torch
import torch.utils.checkpoint

import accel
from accel import remat
from accel.region import TrieNode

from devices import DEVICES

close = torch.testing.assert_close


def new_gelu(x):
    """GPT-2's tanh-GELU (transformers' NewGELUActivation), written out."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def mlp(device, dtype=torch.float32):
    """A Conv1D-style MLP (addmm on a [B*T, C] view, GELU on [B, T, 4C], addmm back)."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(16, 64, generator=g) * 0.2).to(device, dtype).requires_grad_()
    b1 = (torch.randn(64, generator=g) * 0.1).to(device, dtype).requires_grad_()
    w2 = (torch.randn(64, 16, generator=g) * 0.2).to(device, dtype).requires_grad_()
    x = torch.randn(4, 8, 16, generator=g).to(device, dtype)
    return x, [w1, b1, w2]


def forward(x, params):
    w1, b1, w2 = params
    h = torch.addmm(b1, x.view(-1, 16), w1).view(4, 8, 64)
    return (new_gelu(h).view(-1, 64) @ w2).square().sum()


def grads(params):
    out = [p.grad.clone() for p in params if p.grad is not None]
    for p in params:
        p.grad = None
    return out


def eager_and_accel(device, run, monkeypatch, mode="on", dtype=torch.float32):
    """``run(x, params)`` in eager, then under accel (ACCEL_REMAT=``mode``): (results,
    gradients) of each, and the saved values accel recomputed."""
    monkeypatch.setenv("ACCEL_REMAT", mode)
    x, params = mlp(device, dtype)
    ref = run(x, params)
    ref_g = grads(params)
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        got = run(x, params)
    got_g = grads(params)
    return (ref, ref_g), (got, got_g), accel.stats()["recomputed_saves"] - before


def step(x, params):
    loss = forward(x, params)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("device", DEVICES)
def test_a_tanh_gelus_saved_values_are_recomputed_and_every_gradient_is_eagers(device, monkeypatch):
    for _ in range(2):  # the second step: the trie node's plan made, kernels cached
        (ref, ref_g), (got, got_g), n = eager_and_accel(device, step, monkeypatch)
        close(got, ref)
        close(got_g, ref_g)
    assert n == 3  # 0.5 * h, tanh and 1 + tanh


def test_off_saves_them_as_eager_does(monkeypatch):
    (ref, ref_g), (got, got_g), n = eager_and_accel("cpu", step, monkeypatch, mode="off")
    close(got, ref)
    close(got_g, ref_g)
    assert n == 0


def gelu_grad_recomputes(h) -> int:
    """The gradient of ``new_gelu(h).square().sum()`` for ``h`` under accel, checked against
    eager's; returns the saved values accel recomputed."""
    ref = torch.autograd.grad(new_gelu(h).square().sum(), h)
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        got = torch.autograd.grad(new_gelu(h).square().sum(), h)
    close(got, ref)
    return accel.stats()["recomputed_saves"] - before


@pytest.mark.parametrize("device", DEVICES)
def test_auto_recomputes_values_of_at_least_its_bytes(device, monkeypatch):
    """``ACCEL_REMAT=auto`` recomputes a saved value of at least AUTO_MIN_BYTES[device
    type] bytes; a smaller one is saved as eager saves it. (Rows no other test uses: a trie
    node keeps the plan its first flush made.)"""
    monkeypatch.setenv("ACCEL_REMAT", "auto")
    monkeypatch.setitem(remat.AUTO_MIN_BYTES, device, 38 * 64 * 4)
    g = torch.Generator().manual_seed(0)
    for rows, want in ((37, 0), (38, 4)):  # 0.5 * h, tanh, 1 + tanh and the GELU (square's)
        h = torch.randn(rows, 64, generator=g).to(device).requires_grad_()
        for _ in range(2):
            assert gelu_grad_recomputes(h) == want


@pytest.mark.parametrize("device", DEVICES)
def test_auto_leaves_small_values_saved(device, monkeypatch):
    """Under ``ACCEL_REMAT=auto``'s own limits (2 MiB on the CPU, 128 MiB on a GPU) a
    [39, 64] GELU's values are saved as eager saves them; after a switch to ``on`` (the
    trie's plans forgotten, made again) they are recomputed, and after one back, saved."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(39, 64, generator=g).to(device).requires_grad_()
    for mode, want in (("auto", 0), ("on", 4), ("off", 0), ("on", 4), ("auto", 0)):
        monkeypatch.setenv("ACCEL_REMAT", mode)
        assert gelu_grad_recomputes(h) == want


def test_the_plan_names_the_saved_values_and_the_anchor_they_are_computed_from(monkeypatch):
    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")
    plans = []
    real = remat.prepare

    def spy(region):
        real(region)
        if type(region.node.remat) is tuple and region.node.remat:  # (an int: not planned yet)
            plans.append(([c[0].__name__ for c in region.calls], region.node.remat))

    def run(x, params):  # (the bias added after the matmul: addmm's is deferred only by
        w1, b1, w2 = params  # the dispatch filter's matmul path, which may not be loaded)
        h = (x.view(-1, 16) @ w1 + b1).view(4, 8, 64)
        (new_gelu(h).view(-1, 64) @ w2).square().sum().backward()

    monkeypatch.setattr(remat, "prepare", spy)
    with accel.eager():
        run(x, params)
    (calls, (entries, recipe_calls, needs, o_anchors, x_anchors, _)), = plans
    assert calls[:3] == ["add.Tensor", "mul.Tensor", "pow.Tensor_Scalar"]  # the bias, then GELU
    # 0.5 * h, tanh, 1 + tanh; h ** 3 and the tanh's unscaled argument were planned too, but
    # their multiplications by constants saved nothing: dropped at the first flush
    assert sorted({e[3] for e in entries}) == [1, 6, 7]
    assert o_anchors == (0,) and x_anchors == ()  # from h alone, which pow saves as itself
    assert needs[6] == (2, 3, 4, 5, 6)  # tanh: pow, mul, add, mul, tanh
    assert recipe_calls[6][0] is torch.ops.aten.tanh.default


def test_an_anchor_modified_in_place_raises_eagers_error(monkeypatch):
    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")

    def run(x, params):
        w1, b1, w2 = params
        h = torch.addmm(b1, x.view(-1, 16), w1).view(4, 8, 64)
        y = new_gelu(h)
        loss = y.sum()
        h.mul_(2)  # pow saved h: eager raises at the backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()

    run(x, params)
    with accel.eager():
        run(x, params)


def test_a_value_the_program_keeps_is_written_and_checked_as_eager_checks_it(monkeypatch):
    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")

    def run(x, params, modify):
        w1, b1, w2 = params
        h = torch.addmm(b1, x.view(-1, 16), w1)
        t = torch.tanh(h * 0.5)  # tanh saves t; the program keeps it
        loss = (t * h).sum()
        if modify:
            t.add_(1)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
        else:
            loss.backward()
        return t.detach().clone()

    ref = run(x, params, False)
    ref_g = grads(params)
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        got = run(x, params, False)
    close(got, ref)
    close(grads(params), ref_g)
    assert accel.stats()["recomputed_saves"] == before  # t stayed live: saved as itself
    run(x, params, True)
    with accel.eager():
        run(x, params, True)


def test_a_graph_never_backed_up_is_freed(monkeypatch):
    """No reference cycle through the hooks: a kept output saved for its own node (tanh's
    result) and the values recomputed from an anchor die with the graph."""
    import gc
    import weakref

    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")
    w1, b1, w2 = params
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        h = torch.addmm(b1, x.view(-1, 16), w1)
        t = torch.tanh(h * 0.5)  # kept: the program holds it at the flush
        y = new_gelu(h)
        loss = (t * y).sum()
        float(loss)
    assert accel.stats()["recomputed_saves"] > before
    refs = [weakref.ref(v) for v in (h, t, y, loss)]
    del h, t, y, loss
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_programs_own_saved_tensor_hooks_see_every_saved_value(monkeypatch):
    def run(x, params):
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward(x, params)
        loss.backward()
        return loss.detach(), sorted(packed)

    (ref, ref_g), (got, got_g), n = eager_and_accel("cpu", run, monkeypatch)
    close(got[0], ref[0])
    assert got[1] == ref[1]  # the same values packed by the program's hook
    close(got_g, ref_g)
    assert n == 0


def test_a_retained_graph_backs_up_twice_as_eager(monkeypatch):
    def run(x, params):
        loss = forward(x, params)
        loss.backward(retain_graph=True)
        loss.backward()
        return loss.detach()

    for _ in range(2):
        (ref, ref_g), (got, got_g), n = eager_and_accel("cpu", run, monkeypatch)
        close(got, ref)
        close(got_g, ref_g)
    assert n == 3


def test_double_backward_through_recomputed_values_is_eagers(monkeypatch):
    def run(x, params):
        w1 = params[0]
        loss = forward(x, params)
        (g,) = torch.autograd.grad(loss, w1, create_graph=True)
        g.square().sum().backward()
        return loss.detach()

    # float64: second derivatives of this float32 MLP differ from eager's by 1e-5 relative
    # where terms cancel, with the values saved or recomputed alike (a float64 check of the
    # same graph holds both to eager's)
    (ref, ref_g), (got, got_g), n = eager_and_accel("cpu", run, monkeypatch, dtype=torch.float64)
    close(got, ref)
    close(got_g, ref_g)
    assert n > 0


def test_checkpointed_gelus_are_eagers(monkeypatch):
    def run(x, params):
        w1, b1, w2 = params
        h = torch.addmm(b1, x.view(-1, 16), w1).view(4, 8, 64)
        y = torch.utils.checkpoint.checkpoint(new_gelu, h, use_reentrant=False)
        loss = (y.view(-1, 64) @ w2).square().sum()
        loss.backward()
        return loss.detach()

    (ref, ref_g), (got, got_g), _ = eager_and_accel("cpu", run, monkeypatch)
    close(got, ref)
    close(got_g, ref_g)


def test_a_backward_outside_accel_recomputes_eagerly(monkeypatch):
    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")
    step(x, params)
    ref_g = grads(params)
    with accel.eager():
        loss = forward(x, params)
    loss.backward()
    close(grads(params), ref_g)


def test_no_grad_regions_are_left_alone(monkeypatch):
    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")
    with torch.no_grad():
        ref = forward(x, params)
    before = accel.stats()["recomputed_saves"]
    with accel.eager(), torch.no_grad():  # a plan made with grad (the tests above) finds no node
        got = forward(x, params)
    close(got, ref)
    assert accel.stats()["recomputed_saves"] == before

    nodes = []
    real = remat.prepare

    def spy(region):
        real(region)
        nodes.append(region.node)

    monkeypatch.setattr(remat, "prepare", spy)
    y = torch.randn(64, 64)
    for k in range(remat.PLAN_TRIES):
        with accel.eager(), torch.no_grad():
            z = (y.sin() * 3).cos().exp()  # a region of this test's own
        close(z, (y.sin() * 3).cos().exp())
        assert nodes[-1].remat == (k + 1 if k + 1 < remat.PLAN_TRIES else ())


def test_a_region_with_an_in_place_call_is_left_alone(monkeypatch):
    monkeypatch.setenv("ACCEL_REMAT", "on")
    x, params = mlp("cpu")

    def run(x, params):
        w1, b1, w2 = params
        h = torch.addmm(b1, x.view(-1, 16), w1)
        a = h * 0.5 + 1
        a.mul_(3)  # saved by nothing: eager runs this too
        loss = (a.tanh() * h).sum()
        loss.backward()
        return loss.detach()

    ref = run(x, params)
    ref_g = grads(params)
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        got = run(x, params)
    close(got, ref)
    close(grads(params), ref_g)
    assert accel.stats()["recomputed_saves"] == before


def group_norm_silu(device, dtype=torch.float32):
    """``silu(group_norm(p * 2))`` over [4, 8, 6, 6] in groups of 2 channels, and a function
    returning its loss's gradients for ``p``, the weight and the bias (as a U-Net block's)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(4, 8, 6, 6, generator=g).to(device, dtype).requires_grad_()
    norm = torch.nn.GroupNorm(4, 8).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8, generator=g) + 0.5)
        norm.bias.copy_(torch.rand(8, generator=g) - 0.5)

    def run():
        y = torch.nn.functional.silu(norm(p * 2))
        return torch.autograd.grad((y * y).sum(), [p, norm.weight, norm.bias])

    return run


@pytest.mark.parametrize("device", DEVICES)
def test_a_group_norms_output_is_recomputed_from_its_input_and_statistics(device, monkeypatch):
    """The SiLU saves the norm's output, a result of a call with three (``native_group_norm``:
    output, mean, rstd), which accel.group_norm_apply recomputes from the norm's saved input
    (itself recomputed from ``p``) and statistics. The backward's region reads the recomputed
    output's spatial dims merged (the norm's backward sums over them) along its reduction
    loop: it is lowered, not run eagerly."""
    monkeypatch.setenv("ACCEL_REMAT", "on")
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")  # (every region through its kernel)
    run = group_norm_silu(device)
    ref = run()
    for _ in range(2):
        before = accel.stats()
        with accel.eager():
            got = run()
        after = accel.stats()
        close(got, ref)
        assert after["recomputed_saves"] - before["recomputed_saves"] == 2  # p * 2, the output
        assert after["eager_replays"] == before["eager_replays"]
        assert after["compile_failures"] == before["compile_failures"]


@pytest.mark.parametrize("affine", [True, False])
def test_a_channels_last_group_norms_output_is_recomputed(affine, monkeypatch):
    """The rebuilt output on a channels-last input, with and without weight and bias (the
    rebuild's reshape reads the input through its strides; a missing weight and bias pass
    as None): eager's gradients, and no region runs eagerly."""
    monkeypatch.setenv("ACCEL_REMAT", "on")
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    g = torch.Generator().manual_seed(2)
    p = torch.randn(4, 8, 5, 3, generator=g).to(memory_format=torch.channels_last).requires_grad_()
    norm = torch.nn.GroupNorm(2, 8, affine=affine)

    def run():
        y = torch.nn.functional.silu(norm(p * 2)) * 3
        return torch.autograd.grad(y.square().sum(), [p, *norm.parameters()])

    ref = run()
    before = accel.stats()
    with accel.eager():
        got = run()
    after = accel.stats()
    close(got, ref)
    assert after["recomputed_saves"] - before["recomputed_saves"] == 2
    assert after["eager_replays"] == before["eager_replays"]


def test_a_16_bit_group_norms_output_is_saved(monkeypatch):
    """Its statistics are rounded to bfloat16: the output recomputed from them is not the
    one the forward computed (``remat._DERIVED`` takes float32 and float64 alone)."""
    monkeypatch.setenv("ACCEL_REMAT", "on")
    run = group_norm_silu("cpu", torch.bfloat16)
    ref = run()
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        got = run()
    close(got, ref)
    assert accel.stats()["recomputed_saves"] - before == 1  # p * 2 alone


@pytest.mark.parametrize("device", DEVICES)
def test_a_training_batch_norms_output_is_recomputed_and_its_running_statistics_are_eagers(device, monkeypatch):
    """``silu(batch_norm(p * 2))`` in training mode, two steps: the batch norm writes its
    running statistics in place (and ``num_batches_tracked``), inputs no recipe reads, so
    the region is planned; the SiLU's saved input, the norm's output, is rebuilt by
    accel.batch_norm_apply from the norm's input and saved statistics. (On a GPU eager's
    batch norm is cuDNN's op, which no region records: there only the results are checked.)"""
    monkeypatch.setenv("ACCEL_REMAT", "on")
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    g = torch.Generator().manual_seed(0)
    p = torch.randn(4, 8, 5, 3, generator=g).to(device).requires_grad_()
    norms = []
    for _ in range(2):
        norm = torch.nn.BatchNorm2d(8).to(device)
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
            norm.bias.copy_(torch.linspace(-0.5, 0.5, 8))
        norms.append(norm)

    def run(norm):
        y = torch.nn.functional.silu(norm(p * 2))
        return torch.autograd.grad((y * y).sum(), [p, norm.weight, norm.bias])

    for _ in range(2):
        ref = run(norms[0])
        before = accel.stats()
        with accel.eager():
            got = run(norms[1])
        after = accel.stats()
        close(got, ref)
        for name, buf in norms[0].named_buffers():
            close(dict(norms[1].named_buffers())[name], buf, msg=name)
        if device == "cpu":
            assert after["recomputed_saves"] - before["recomputed_saves"] == 2  # p * 2, the output
            assert after["eager_replays"] == before["eager_replays"]


def test_an_input_written_in_the_region_is_read_by_no_recipe(monkeypatch):
    """A region that computes a saved value from a leaf, then writes the leaf in place under
    ``no_grad`` (nothing saved it: eager's backward is fine), is not planned: the recipe
    would read the written values in the backward, at the version the flush saw."""
    monkeypatch.setenv("ACCEL_REMAT", "on")
    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")

    def run(w):
        loss = (torch.tanh(w * 2) * 3).sum()  # tanh saves its result: a recipe from w
        with torch.no_grad():
            w.add_(1)
        loss.backward()
        return loss.detach()

    w0 = torch.randn(6, 5)
    we, wa = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = run(we)
    before = accel.stats()["recomputed_saves"]
    with accel.eager():
        got = run(wa)
    close(got, ref)
    close(wa.grad, we.grad)
    close(wa, we)
    assert accel.stats()["recomputed_saves"] == before


def test_group_norm_apply_is_the_norms_output():
    g = torch.Generator().manual_seed(1)
    for shape, groups in (((3, 6, 5, 4), 3), ((2, 8, 7), 2), ((2, 4), 4)):
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        w, b = torch.randn(shape[1], generator=g, dtype=torch.float64), torch.randn(shape[1], generator=g, dtype=torch.float64)
        for weight, bias in ((w, b), (None, None), (w, None)):
            out, mean, rstd = torch.ops.aten.native_group_norm(
                x, weight, bias, shape[0], shape[1], math.prod(shape[2:]), groups, 1e-5)
            close(torch.ops.accel.group_norm_apply(x, mean, rstd, weight, bias, groups), out)


def test_node_names_follow_autograds_codegen():
    assert remat._prefix(torch.ops.aten.pow.Tensor_Scalar) == "PowBackward"
    assert remat._prefix(torch.ops.aten._softmax.default) == "SoftmaxBackward"
    assert remat._prefix(torch.ops.aten.tanh_backward.default) == "TanhBackwardBackward"
    x = torch.randn(3, requires_grad=True)
    for func, args in [(torch.ops.aten.pow.Tensor_Scalar, (x, 2.0)),
                       (torch.ops.aten._softmax.default, (x, 0, False)),
                       (torch.ops.aten.tanh_backward.default, (x, x)),
                       (torch.ops.aten._to_copy.default, (x,))]:
        assert type(func(*args).grad_fn).__name__.startswith(remat._prefix(func))
    assert "remat" in TrieNode.__slots__
