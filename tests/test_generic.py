"""Shape-generic flat kernels (accel/codegen/flat.py): on a CPU, flat regions (pointwise work
over contiguous tensors) of different sizes share one kernel that takes its loops' lengths
at run time. Every result is checked against eager, and against the kernel built for the
region's own sizes (ACCEL_GENERIC_KERNELS=0): the same loop body, so the same bits."""
import subprocess
import sys
import textwrap

import pytest
import torch

import accel
from accel.codegen.flat import flat_layout

close = torch.testing.assert_close


@pytest.fixture
def generic(fresh_store, monkeypatch):
    """A fresh store, generic kernels on (the default), small regions fused (as in the
    suite: tiny tensors would otherwise run eagerly)."""
    monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "1")
    monkeypatch.setenv("ACCEL_RECOMPILE_LIMIT", "0")
    accel.reset_stats()
    return fresh_store


def _entries():
    from accel.runtime import get_store

    st = get_store()
    return [st.inspect(e["key"]) if "key" in e else e for e in st.entries()]


def _both(fn, *args, monkeypatch):
    """``fn(*args)`` under accel with generic kernels, then with static ones, then eagerly."""
    with accel.eager():
        got = fn(*args)
    monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "0")
    try:
        with accel.eager():
            static = fn(*args)
    finally:
        monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "1")
    return got, static, fn(*args)


def _same(got, static, want, exact: bool):
    got, static, want = (t if isinstance(t, tuple) else (t,) for t in (got, static, want))
    for g, s, w in zip(got, static, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
        assert torch.equal(g, s)  # the generic kernel's bits are the static kernel's
        if exact:
            assert torch.equal(g, w)
        else:
            close(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_regions_of_other_shapes_share_one_kernel(generic, dtype, monkeypatch):
    """One chain over three shapes (lengths below and above a chunk and the parallel
    threshold, not multiples of either): one shape-generic kernel, the other two regions
    served by it without a compiler run."""
    def chain(x, y):
        return torch.tanh(x * 1.5 + 0.25) * y - x.exp() / 4

    shapes = [(1000, 37), (70001,), (3, 7, 111)]
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        x, y = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        _same(*_both(chain, x, y, monkeypatch=monkeypatch), exact=False)
    assert accel.stats()["generic_hits"] == len(shapes) - 1
    assert sum(m.get("readable", "").startswith("shape-generic") for m in _entries()) == 1


def test_integer_bool_and_scalar_tensor_inputs_bit_for_bit(generic, monkeypatch):
    """Integers and booleans bit for bit; a 0-dim tensor read beside the flat loop (its
    element 0 at every index), in place writes into an input."""
    def program(a, b, s, m):
        c = (a * 3 + b) ^ (a >> 2)
        a.add_(s)
        return c, a.clone(), (m & (c > 0)) | ~m, torch.where(m, c, s)

    for i, n in enumerate([5000, 123457]):
        g = torch.Generator().manual_seed(i)
        a = torch.randint(-1000, 1000, (n,), generator=g)
        b = torch.randint(-1000, 1000, (n,), generator=g)
        m = torch.rand(n, generator=g) > 0.5
        s = torch.tensor(7)
        got, static, want = ((lambda: program(a.clone(), b, s, m)) for _ in range(3))
        with accel.eager():
            got = got()
        monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "0")
        with accel.eager():
            static = static()
        monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "1")
        _same(got, static, want(), exact=True)
    kernels = sum(m.get("readable", "").startswith("shape-generic") for m in _entries())
    assert kernels >= 1 and accel.stats()["generic_hits"] == kernels  # (its second size)


def test_each_loop_takes_its_own_length(generic, monkeypatch):
    """A region over two parameters of different sizes (as an optimizer's loop makes): two
    flat loops, each of its own length; the same region over two other sizes shares the
    kernel and passes each loop its length, in order. (The lowering orders the loops by
    size: the sizes swapped are another IR, another kernel.)"""
    def update(p, q, gp, gq):
        p.mul_(0.9).add_(gp, alpha=-0.1)
        q.mul_(0.9).add_(gq, alpha=-0.1)
        return p.clone(), q.clone()

    for i, (n, m) in enumerate([(50000, 300), (70001, 40000)]):
        g = torch.Generator().manual_seed(i)
        args = [torch.randn(k, generator=g) for k in (n, m, n, m)]
        runs = []
        for mode in ("1", "0", None):
            p, q = args[0].clone(), args[1].clone()
            if mode is None:
                runs.append(update(p, q, args[2], args[3]))
                continue
            monkeypatch.setenv("ACCEL_GENERIC_KERNELS", mode)
            with accel.eager():
                runs.append(update(p, q, args[2], args[3]))
        monkeypatch.setenv("ACCEL_GENERIC_KERNELS", "1")
        _same(*runs, exact=False)
    assert accel.stats()["generic_hits"] == 1


def test_regions_that_are_not_flat_keep_static_kernels(generic):
    """A transposed read, a broadcast row, a reduction: none is flat, each is built for its
    own sizes."""
    x, y, r = torch.randn(300, 200), torch.randn(200, 300), torch.randn(300)
    programs = [lambda: x.t() * 2 + y, lambda: (x.t() + r) * 3, lambda: (x * 2).sum(1) + 1]
    for p in programs:
        with accel.eager():
            got = p()
        close(got, p())
    assert accel.stats()["generic_hits"] == 0
    assert not any(m.get("readable", "").startswith("shape-generic") for m in _entries())


def test_flat_layout_reads_the_ir():
    """What flat_layout accepts: one loop a nest, unit addresses, contiguous buffers of the
    loop's length, nothing reduced; the text leaves the lengths out."""
    from accel.loop_ir import Addr, BufferSpec, Expr, LoopIR, Nest, Store

    f32 = torch.float32

    def ir(n, addr=((0, 1),), shape=None, stride=(1,), reduce=False):
        load = Expr("load", f32, (0, Addr(addr)))
        value = Expr("reduce", f32, ("sum", (load,), (0,), 0)) if reduce else Expr("exp", f32, (load,))
        bufs = [BufferSpec(f32, shape or (n,), stride, False), BufferSpec(f32, (n,), (1,), True)]
        return LoopIR(bufs, [], [n], [Nest([0], [Store(1, Addr(((0, 1),)), value)])])

    a, b = flat_layout(ir(100)), flat_layout(ir(7))
    assert a.sizes == [100] and b.sizes == [7] and a.text == b.text
    assert flat_layout(ir(100, shape=(10, 10), stride=(10, 1))).text == a.text  # contiguous
    assert flat_layout(ir(100, addr=((0, 2),), shape=(200,))) is None  # every other element
    assert flat_layout(ir(100, shape=(10, 10), stride=(1, 10))) is None  # transposed
    assert flat_layout(ir(100, addr=(), shape=(100,))) is None  # element 0 of a longer buffer
    assert flat_layout(ir(100, reduce=True)) is None


def test_a_new_process_launches_the_shared_kernel_from_the_store(tmp_path):
    """The store keeps each region's entry with its loop lengths: a later process loads it
    (no build, no trace) and launches it with them."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import os, torch, accel
        os.environ["ACCEL_EAGER_SMALL_REGIONS"] = "0"
        for i, n in enumerate([50000, 300, 12345]):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(n, generator=g), torch.randn(7, n, generator=g)
            with accel.eager():
                got = (x * 2 + 1).sigmoid(), (y - 3).abs() * 0.5
            torch.testing.assert_close(got[0], (x * 2 + 1).sigmoid())
            torch.testing.assert_close(got[1], (y - 3).abs() * 0.5)
        s = accel.stats()
        print(s["compiles"], s["store_hits"], s["generic_hits"])
    """))
    env = {**__import__("os").environ, "ACCEL_CACHE_DIR": str(tmp_path / "store"),
           "ACCEL_GENERIC_KERNELS": "1"}
    runs = [subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (list(map(int, r.stdout.split()[-3:])) for r in runs)
    assert first == [3, 0, 2]  # three regions (one a block), one kernel built
    assert second == [0, 3, 0]
