"""accel's float32 CPU matmul kernel (include/accel/gemm.h), run by the dispatch filter for
``mm``, ``addmm`` and ``bmm``: results against eager's, forward and backward, over shapes
that do not fill its tiles, strided, transposed and broadcast operands, and every case it
leaves to eager's kernel."""
import copy
import functools
import os
import re
import subprocess
import sys

import pytest
import torch

import accel
from accel import config, dispatch

close = torch.testing.assert_close


@functools.lru_cache(maxsize=None)
def _kernel_where() -> tuple:
    """(whether the kernel runs here by default, whether it can run here at all); asked
    once the filter is loaded (never at import: collecting must not wait for its build)."""
    with accel.eager():
        auto, on = dispatch.set_matmul("auto"), dispatch.set_matmul("on")
        dispatch.set_matmul(config.flag("ACCEL_CPU_MATMUL"))
    return auto, on


@pytest.fixture(autouse=True)
def _kernel_on(needs_dispatch_filter, monkeypatch):
    """On a CPU where it is off by default (Intel's, with AVX-512F), the kernel forced on
    for these tests (ACCEL_CPU_MATMUL=on)."""
    auto, runs = _kernel_where()
    if runs and not auto:
        monkeypatch.setenv("ACCEL_CPU_MATMUL", "on")


@pytest.fixture
def kernel_runs_here():
    """Skips a test of accel's matmul kernel where it cannot run."""
    if not _kernel_where()[1]:
        pytest.skip("no AVX-512F on this CPU: eager's matmuls")


needs_kernel = pytest.mark.usefixtures("kernel_runs_here")


def _randn(*shape, k=1, gen=None):
    """Normal values scaled by 1/sqrt(k): products over k terms stay O(1), so two summation
    orders agree within assert_close's defaults."""
    return torch.randn(*shape, generator=gen) / k ** 0.5


def _ran(fn):
    """fn() under accel; its result and how many matmuls accel's kernel ran."""
    before = dispatch.matmuls()
    with accel.eager():
        out = fn()
    return out, dispatch.matmuls() - before


# (M, K, N), each at least the kernel's 2^22 flops: tiles of 48 x 512 over micro-tiles of 12 x 32, K blocks of 192 (halves between
# 192 and 384), odd and prime sizes
SHAPES = [(128, 128, 128), (100, 37, 600), (4, 1024, 700), (700, 8, 400), (48, 192, 512),
          (49, 193, 513), (131, 385, 67), (1024, 256, 768), (257, 1000, 33)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
def test_mm_matches_eager(shape, layout):
    M, K, N = shape
    g = torch.Generator().manual_seed(M * 7 + K * 3 + N)
    a = _randn(K, M, k=K, gen=g).t() if layout[0] == "t" else _randn(M, K, k=K, gen=g)
    b = _randn(N, K, gen=g).t() if layout[1] == "t" else _randn(K, N, gen=g)
    out, n = _ran(lambda: torch.mm(a, b))
    assert n == 1
    assert out.shape == (M, N) and out.is_contiguous()
    close(out, torch.mm(a, b))


@needs_kernel
def test_strided_and_broadcast_operands():
    g = torch.Generator().manual_seed(0)
    big = _randn(300, 400, k=150, gen=g)
    a = big[::2, 10:160]  # row stride 800, a slice
    b = _randn(1, 100, gen=g).expand(150, 100)  # row stride 0
    out, n = _ran(lambda: a @ b)
    assert n == 1
    close(out, a @ b)


@needs_kernel
@pytest.mark.parametrize("bias_shape", [(160,), (1, 160), (70, 160), (70, 1), ()])
def test_addmm_broadcasts_its_bias(bias_shape):
    g = torch.Generator().manual_seed(1)
    a, b = _randn(70, 200, k=200, gen=g), _randn(200, 160, gen=g)
    bias = torch.randn(bias_shape, generator=g)
    out, n = _ran(lambda: torch.addmm(bias, a, b))
    assert n == 1
    close(out, torch.addmm(bias, a, b))


@needs_kernel
@pytest.mark.parametrize("transposed", [False, True])
def test_bmm_matches_eager(transposed):
    g = torch.Generator().manual_seed(2)
    a = _randn(6, 100, 64, k=64, gen=g)
    b = _randn(6, 90, 64, gen=g).transpose(1, 2) if transposed else _randn(6, 64, 90, gen=g)
    out, n = _ran(lambda: torch.bmm(a, b))
    assert n == 1
    close(out, torch.bmm(a, b))


@needs_kernel
def test_a_training_step_matches_eager():
    """Linear layers (addmm), attention-like matmuls (bmm through torch.matmul) and their
    backward (mm of transposed operands): loss and gradients as eager's."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.GELU(), torch.nn.Linear(256, 96))
    x = torch.randn(4, 128, 96)

    def step(m):
        h = m(x)
        att = torch.matmul(h, h.transpose(1, 2)).softmax(-1)
        loss = torch.matmul(att, h).square().mean()
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    ref_model = copy.deepcopy(model)
    (loss, grads), n = _ran(lambda: step(model))
    ref_loss, ref_grads = step(ref_model)
    assert n == 11
    close(loss, ref_loss)
    for gr, r in zip(grads, ref_grads):
        close(gr, r)


@pytest.mark.parametrize("case", ["float64", "int64", "alpha", "beta", "small", "empty_k",
                                  "empty_m", "bad_shapes"])
def test_what_the_kernel_leaves_to_eager(case):
    """Each of these runs eager's kernel, with eager's result or eager's error."""
    g = torch.Generator().manual_seed(4)
    a, b, bias = torch.randn(128, 96, generator=g), torch.randn(96, 80, generator=g), torch.randn(80)
    fn = {
        "float64": lambda: torch.mm(a.double(), b.double()),
        "int64": lambda: torch.mm((a * 10).long(), (b * 10).long()),
        "alpha": lambda: torch.addmm(bias, a, b, alpha=2),
        "beta": lambda: torch.addmm(bias, a, b, beta=0.5),
        "small": lambda: torch.mm(a[:16, :16], b[:16, :16]),
        "empty_k": lambda: torch.addmm(bias, a[:, :0], b[:0]),
        "empty_m": lambda: torch.mm(a[:0], b),
        "bad_shapes": lambda: torch.mm(a, a),
    }[case]
    if case == "bad_shapes":
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            _ran(fn)
        return
    out, n = _ran(fn)
    assert n == 0
    expected = fn()
    assert out.dtype == expected.dtype
    if expected.dtype.is_floating_point:
        close(out, expected)
    else:
        assert torch.equal(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("op", ["mm", "addmm", "bmm"])
def test_cuda_matmuls_keep_eagers_kernel(op):
    """A GPU's matmuls reach the same kernel on the record key, which leaves them to
    cuBLAS: eager's results, forward and backward."""
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(4, 256, 128, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(4, 128, 192, device="cuda", generator=g, requires_grad=True)
    bias = torch.randn(192, device="cuda", generator=g, requires_grad=True)
    fn = {"mm": lambda: torch.mm(a[0], b[0]), "addmm": lambda: torch.addmm(bias, a[0], b[0]),
          "bmm": lambda: torch.bmm(a, b)}[op]

    def fwd_bwd():
        out = fn()
        # small output gradients: the bias gradient's column sums (accel's in float64,
        # eager's in float32) agree within assert_close's defaults
        grad_out = torch.randn(out.shape, device="cuda", generator=g2) / 16
        grads = torch.autograd.grad(out, (a, b, bias), grad_out, allow_unused=True)
        return out, grads

    g2 = torch.Generator(device="cuda").manual_seed(6)
    (out, grads), n = _ran(fwd_bwd)
    g2.manual_seed(6)
    ref, ref_grads = fwd_bwd()
    assert n == 0
    close(out, ref)
    for gr, r in zip(grads, ref_grads):
        assert (gr is None) == (r is None)
        if r is not None:
            close(gr, r)


def test_a_reduced_matmul_precision_keeps_eagers_kernel():
    """torch.set_float32_matmul_precision("medium") lets eager use oneDNN's reduced-precision
    path: accel then leaves the product to eager."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    torch.set_float32_matmul_precision("medium")
    try:
        out, n = _ran(lambda: a @ b)
        expected = a @ b
    finally:
        torch.set_float32_matmul_precision("highest")
    assert n == 0
    close(out, expected)


def test_accel_cpu_matmul_off_keeps_eagers_kernel(monkeypatch):
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    on = os.environ.get("ACCEL_CPU_MATMUL", "auto")
    monkeypatch.setenv("ACCEL_CPU_MATMUL", "off")
    out, n = _ran(lambda: a @ b)
    assert n == 0
    close(out, a @ b)
    monkeypatch.setenv("ACCEL_CPU_MATMUL", on)
    _, n = _ran(lambda: a @ b)
    assert n == (1 if _kernel_where()[1] else 0)


def _cpu_family() -> tuple:
    """(vendor id, CPU family as CPUID reports it: base plus extended family) from
    /proc/cpuinfo, whose "cpu family" line is that sum."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M)
    family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    return (vendor.group(1) if vendor else "", int(family.group(1)) if family else 0)


def test_auto_runs_the_kernel_on_amd_cpus_from_zen_5_only():
    vendor, family = _cpu_family()
    full_width = vendor == "AuthenticAMD" and family >= 0x1A  # Zen 5 and later
    with accel.eager():
        auto = dispatch.set_matmul("auto")
        dispatch.set_matmul(os.environ.get("ACCEL_CPU_MATMUL", "auto"))
    runs_by_default, runs = _kernel_where()
    assert auto == (full_width and runs) == runs_by_default


@needs_kernel
def test_the_kernel_follows_torchs_thread_count():
    a, b = _randn(512, 300, k=300), _randn(300, 400)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, n = _ran(lambda: a @ b)
    finally:
        torch.set_num_threads(threads)
    assert n == 1
    close(out, a @ b)


@needs_kernel
def test_the_kernel_runs_in_a_new_process_with_the_filter_stored():
    """Without the dispatch filter there is no matmul kernel; a process that finds the
    filter in the store runs it from its first step."""
    code = ("import torch, accel\nfrom accel import dispatch\n"
            "a, b = torch.randn(256, 128), torch.randn(128, 64)\n"
            "with accel.eager():\n    c = a @ b\n"
            "torch.testing.assert_close(c, a @ b)\nprint(dispatch.loaded(), dispatch.matmuls())\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cpu_linears_bias_add_joins_the_region_that_reads_it(dtype, fresh_store, monkeypatch):
    """With eager's matmul (ACCEL_CPU_MATMUL=off), a CPU Linear's addmm runs ``mm`` and its
    bias add is deferred into the region of the activation that reads it (eager's addmm
    copies the bias into its output for the gemm to read back): one kernel, add then GELU;
    the output and every gradient match eager's, at the mode's first call and the filter's
    later ones. A bias of more than one row keeps eager's addmm."""
    monkeypatch.setenv("ACCEL_CPU_MATMUL", "off")
    g = torch.Generator().manual_seed(0)
    x = _randn(64, 128, k=128, gen=g).to(dtype).requires_grad_()
    lin = torch.nn.Linear(128, 256, dtype=dtype)

    def f(x):
        return torch.nn.functional.gelu(lin(x))

    want = f(x)
    grads = torch.autograd.grad(want.sum(), (x, lin.weight, lin.bias))
    for _ in range(3):
        accel.reset_stats()
        with accel.eager():
            got = f(x)
            got_grads = torch.autograd.grad(got.sum(), (x, lin.weight, lin.bias))
        close(got, want)
        close(got_grads, grads)
        assert accel.stats()["eager_replays"] == 0
    readable = [e["readable"] for e in accel.runtime.get_store().entries()]
    assert any(r.startswith("add.Tensor > gelu.default") for r in readable), readable
    full = torch.randn(64, 256, dtype=dtype)  # a bias of 64 rows: addmm as eager runs it
    got, _ = _ran(lambda: torch.addmm(full, x.detach(), lin.weight.detach().t()))
    close(got, torch.addmm(full, x.detach(), lin.weight.detach().t()))


def _pooled(fn):
    """fn() under accel; its result and how many matmul outputs came from the pool."""
    before = dispatch.pooled_matmuls()
    with accel.eager():
        out = fn()
    return out, dispatch.pooled_matmuls() - before


def _pool_inputs(dtype, gen):
    """[m, 16] by [16, 4096] operands and an [m, 4096] bias, the product 32 MiB (64 MiB in
    float64): m = 2048, 4096 for bfloat16. (The output's size is what the pool sees; a
    short inner dim keeps eager's bfloat16 gemm, emulated without AVX-512 BF16, to 4 s a
    test on the AMD dev VM, against 19 s with 64.)"""
    m = 4096 if dtype == torch.bfloat16 else 2048
    a, b = _randn(m, 16, k=16, gen=gen).to(dtype), _randn(16, 4096, gen=gen).to(dtype)
    return a, b, torch.randn(m, 4096, generator=gen).to(dtype)


POOLED_OPS = {  # each on rows `m` of the first operand: all of them, or 256 (4-8 MiB)
    "mm": lambda a, b, c, m: torch.mm(a[:m], b),
    "bmm": lambda a, b, c, m: torch.bmm(a[:m].view(4, m // 4, 16), b.expand(4, *b.shape)),
    "addmm": lambda a, b, c, m: torch.addmm(c[:m], a[:m], b),  # every row a bias: eager's addmm
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("op", sorted(POOLED_OPS))
def test_cpu_matmul_outputs_come_from_the_pool(op, dtype, monkeypatch):
    """Where regions take their CPU outputs from accel's pool, eager's mm, bmm and addmm
    write outputs of 32 MiB or more (which glibc always maps afresh) into pooled blocks
    (their out= overloads): the same bits as eager's, a freed output's block handed to the
    next matmul of its size, a live one never; with the pool off, and below 32 MiB, eager
    allocates them."""
    monkeypatch.setenv("ACCEL_CPU_MATMUL", "off")
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")
    f = POOLED_OPS[op]
    a, b, c = _pool_inputs(dtype, torch.Generator().manual_seed(4))
    m = a.shape[0]
    want = f(a, b, c, m)
    got, pooled = _pooled(lambda: f(a, b, c, m))
    assert pooled == 1
    assert torch.equal(got, want)
    ptr = got.data_ptr()
    again, pooled = _pooled(lambda: f(a, b, c, m))  # `got` still holds its block
    assert pooled == 1 and again.data_ptr() != ptr
    assert torch.equal(got, want) and torch.equal(again, want)
    del got, again
    third, _ = _pooled(lambda: f(a, b, c, m))
    assert third.data_ptr() == ptr and torch.equal(third, want)
    small, pooled = _pooled(lambda: f(a, b, c, 256))
    assert pooled == 0 and torch.equal(small, f(a, b, c, 256))
    monkeypatch.setenv("ACCEL_CPU_POOL", "off")
    got, pooled = _pooled(lambda: f(a, b, c, m))
    assert pooled == 0 and torch.equal(got, want)


def test_pooled_matmuls_train_as_eager(monkeypatch):
    """Forward and backward through Linears (their products and gradients' matmuls on pooled
    blocks): the loss and every gradient match eager's."""
    monkeypatch.setenv("ACCEL_CPU_MATMUL", "off")
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")
    torch.manual_seed(5)
    base = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 64))
    x = torch.randn(2048, 64)  # fc1's product and its gradient: [2048, 4096], 32 MiB
    copies = [copy.deepcopy(base) for _ in range(2)]
    losses = [copies[0](x).square().mean()]
    losses[0].backward()
    before = dispatch.pooled_matmuls()
    with accel.eager():
        losses.append(copies[1](x).square().mean())
        losses[1].backward()
    assert dispatch.pooled_matmuls() - before == 2  # fc1's product, the gradient of fc2's input
    close(losses[1], losses[0])
    for p, q in zip(copies[1].parameters(), copies[0].parameters()):
        close(p.grad, q.grad)


def test_a_pool_allocator_that_raises_leaves_matmuls_to_eager(monkeypatch):
    """An error from the pool's allocator is dropped: the matmul allocates its own output,
    with eager's result."""
    monkeypatch.setenv("ACCEL_CPU_MATMUL", "off")
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")
    a, b = torch.randn(2048, 64), torch.randn(64, 4096)

    def broken(*args):
        raise MemoryError("no block")

    with accel.eager():
        pass  # settings applied: the pool on
    dispatch._lib.accel_filter_pool(broken)
    try:
        got, pooled = _pooled(lambda: torch.mm(a, b))
    finally:
        dispatch._set_pool(dispatch._lib)
    assert pooled == 0
    assert torch.equal(got, torch.mm(a, b))
