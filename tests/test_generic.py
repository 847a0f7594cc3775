"""Shape-generic kernels (accel/codegen/generic.py): on a CPU or a GPU, regions that differ
only in the lengths of their outer loops (the elements of flat pointwise work, the rows of
row-wise work, the rows a column reduction reduces) share one kernel that takes those lengths at run time. Every result is
checked against eager, and against the kernel built for the region's own sizes
(ACCEL_GENERIC_KERNELS=0): the same loop body, so the same bits. The CUDA cases skip
without a GPU (tests/gpu.sh runs them); the CUDA renderer's source and launch plan are
checked on any machine."""
import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import accel
from accel.codegen.generic import NotGeneric, RunTimeLength, generic_layout
from devices import DEVICES

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


def _forget_kernels() -> None:
    """Empty the trie's kernels (the process's cache of them; the trie is keyed by the
    region, not by ACCEL_GENERIC_KERNELS)."""
    from accel.region import ROOT

    todo = [ROOT]
    while todo:
        node = todo.pop()
        node.kernels.clear()
        todo += list(node.children.values())


@contextlib.contextmanager
def _static_kernels(monkeypatch):
    """Every region built for its own sizes meanwhile (ACCEL_GENERIC_KERNELS=0), in a
    store of its own and with no kernel of the trie's: a static kernel built, not the
    shared one found again. Asserts that a kernel was built and none shared."""
    from accel import runtime

    before = dict(accel.stats())
    store = os.environ["ACCEL_CACHE_DIR"]
    with monkeypatch.context() as m:
        m.setenv("ACCEL_GENERIC_KERNELS", "0")
        m.setenv("ACCEL_CACHE_DIR", store + "-static")
        _forget_kernels()
        runtime.set_store(None)
        try:
            yield
        finally:
            _forget_kernels()
            runtime.set_store(None)
    after = accel.stats()
    assert after["compiles"] > before["compiles"] and after["generic_hits"] == before["generic_hits"]


def _both(fn, *args, monkeypatch):
    """``fn(*args)`` under accel with generic kernels, then with static ones, then eagerly."""
    with accel.eager():
        got = fn(*args)
    with _static_kernels(monkeypatch), accel.eager():
        static = fn(*args)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_regions_of_other_shapes_share_one_kernel(generic, dtype, device, monkeypatch):
    """One chain over three shapes (lengths below and above a chunk and the parallel
    threshold, not multiples of either; on a GPU, one a multiple of the 16-byte vector's
    width and two not, whose launches leave the vector variant out): one shape-generic
    kernel, the other two regions served by it without a compiler run."""
    def chain(x, y):
        return torch.tanh(x * 1.5 + 0.25) * y - x.exp() / 4

    shapes = [(1000, 37), (70001,), (3, 7, 111)]
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        x, y = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
        _same(*_both(chain, x, y, monkeypatch=monkeypatch), exact=False)
    assert accel.stats()["generic_hits"] == len(shapes) - 1
    assert sum(m.get("readable", "").startswith("shape-generic") for m in _entries()) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_integer_bool_and_scalar_tensor_inputs_bit_for_bit(generic, device, monkeypatch):
    """Integers and booleans bit for bit; a 0-dim tensor read beside the flat loop (its
    element 0 at every index), in place writes into an input."""
    def program(a, b, s, m):
        c = (a * 3 + b) ^ (a >> 2)
        a.add_(s)
        return c, a.clone(), (m & (c > 0)) | ~m, torch.where(m, c, s)

    for i, n in enumerate([5000, 123457]):
        g = torch.Generator().manual_seed(i)
        a = torch.randint(-1000, 1000, (n,), generator=g).to(device)
        b = torch.randint(-1000, 1000, (n,), generator=g).to(device)
        m = (torch.rand(n, generator=g) > 0.5).to(device)
        s = torch.tensor(7, device=device)
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


@pytest.mark.parametrize("device", DEVICES)
def test_each_loop_takes_its_own_length(generic, device, monkeypatch):
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
        args = [torch.randn(k, generator=g).to(device) for k in (n, m, n, m)]
        runs = []
        for mode in ("generic", "static", "eager"):
            p, q = args[0].clone(), args[1].clone()
            with contextlib.ExitStack() as stack:
                if mode == "static":
                    stack.enter_context(_static_kernels(monkeypatch))
                if mode != "eager":
                    stack.enter_context(accel.eager())
                runs.append(update(p, q, args[2], args[3]))
        _same(*runs, exact=False)
    assert accel.stats()["generic_hits"] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [96, 10])
def test_rows_of_other_counts_share_one_kernel(generic, device, width, monkeypatch):
    """Row-wise regions over other row counts (a bias + GELU + LayerNorm, a softmax, a row
    sum, a broadcast row): one kernel each, the other counts served by it, every result the
    static kernel's bits; a single row too (its IR has no row loop). Rows of 96 values and
    of 10 (the CPU kernel's loop over the rows vectorized, each row unrolled:
    accel.codegen.cpp.SMALL_ROWS)."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    b, w = torch.randn(width, generator=g).to(device), torch.randn(width, generator=g).to(device)
    programs = [lambda x: F.layer_norm(F.gelu(x + b, approximate="tanh"), (width,), w, b),
                lambda x: torch.softmax(x * 0.125, -1), lambda x: (x * 2).sum(1) + 1,
                lambda x: (x + w) * 3]
    rows = [300, 7, 1000]
    for p in programs:
        for n in rows:
            x = torch.randn(n, width, generator=g).to(device)
            _same(*_both(p, x, monkeypatch=monkeypatch), exact=False)
    assert accel.stats()["generic_hits"] == len(programs) * (len(rows) - 1)
    assert sum(m.get("readable", "").startswith("shape-generic") for m in _entries()) == len(programs)
    for p in programs:  # one row: the lowering drops the dim, another IR (another kernel)
        _same(*_both(p, torch.randn(1, width, generator=g).to(device), monkeypatch=monkeypatch), exact=False)


@pytest.mark.parametrize("device", DEVICES)
def test_column_reductions_over_other_row_counts_share_one_kernel(generic, device, monkeypatch):
    """Reductions down the rows (a column sum, a bias's gradient beside its elementwise
    input gradient, an argmax over dim 0) over other row counts share one
    kernel, the rows a run-time length. On the CPU, 88 columns in blocks (in parallel past
    the parallel threshold) and 264 with the rows split among the threads where each has
    64 rows and the work is parallel, the column blocks where not: both forms in the
    kernel, each the static kernel's bits. On a GPU, a thread a column for those; and 96
    columns in tiles of 32, whose rows of threads and split among blocks (none, 9 and 86
    blocks a tile here) are chosen at launch. Values in quarters: eager's float32 column
    sums are exact too."""
    programs = [lambda x: (x * 2).sum(0) + 1, lambda x: (x * 3 - 1, (x * 3 - 1).sum(0)),
                lambda x: (x * 2).argmax(0)]
    shapes = {88: (300, 5001), 264: (100, 2000), **({96: (300, 5001, 100000)} if device == "cuda" else {})}
    for p in programs:
        for c, rows in shapes.items():
            for n in rows:
                g = torch.Generator().manual_seed(n + c)
                x = (torch.randint(-8, 8, (n, c), generator=g) / 4).to(device)
                _same(*_both(p, x, monkeypatch=monkeypatch), exact=True)
    assert accel.stats()["generic_hits"] == len(programs) * sum(len(r) - 1 for r in shapes.values())


@pytest.mark.parametrize("device", DEVICES)
def test_whole_reductions_over_other_lengths_share_one_kernel(generic, device, monkeypatch):
    """Reductions of a whole tensor over other lengths (a sum, a mean, a max, a variance: a
    loss's shapes) share one kernel, a mean's or a variance's count computed from the
    length (_counts: n, n - 1), as do column variances. On the CPU, the threads and float32
    lanes decided in the kernel (lengths below and above the parallel threshold), an argmax
    and the centered sum of squares too. On a GPU, one accumulator over the grid (65536
    elements or more: the blocks as a launch formula); below that, and an argmax, a
    variance or the centered sum (a block's reduction, planned on the length), built per
    size. Every result the static kernel's bits."""
    programs = [lambda x: (x * 2).sum() + 1, lambda x: (x * x).mean(), lambda x: (x * 2).amax(),
                lambda x: (x * 2).std(0), lambda x: (x * 2).argmax(), lambda x: (x - x.mean()).pow(2).sum(),
                lambda x: (x * 2).var()]
    rows = (3001, 2100, 20000)
    for p in programs:
        for n in rows:
            x = torch.randn(n, 32, generator=torch.Generator().manual_seed(n)).to(device)
            _same(*_both(p, x, monkeypatch=monkeypatch), exact=False)
    shared = len(programs) if device == "cpu" else 4
    assert accel.stats()["generic_hits"] == shared * (len(rows) - 1)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_backward_over_other_row_counts_builds_nothing(generic, device, monkeypatch):
    """A GELU + LayerNorm forward and backward (float64) over other row counts: after the
    first, no kernel built. The backward's regions hold scratch buffers (its row
    statistics, allocated for each region's rows) and column reductions (the weight's and
    bias's gradients over 88 columns); every result the static kernels' bits."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(5)
    w, b = (torch.randn(88, generator=g, dtype=torch.float64).to(device) for _ in range(2))

    def step(x, gy):
        x, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        F.layer_norm(F.gelu(x, approximate="tanh"), (88,), ww, bb).backward(gy)
        return x.grad, ww.grad, bb.grad

    def builds():
        return accel.stats()["compiles"] - accel.stats()["generic_hits"]

    for i, n in enumerate((300, 1000, 2001)):
        x, gy = (torch.randn(n, 88, generator=g, dtype=torch.float64).to(device) for _ in range(2))
        before = builds()
        with accel.eager():
            got = step(x, gy)
        assert (builds() > before) == (i == 0), n
        with _static_kernels(monkeypatch), accel.eager():
            static = step(x, gy)
        _same(got, static, step(x, gy), exact=False)
    assert accel.stats()["generic_hits"] >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_regions_whose_code_holds_a_length_keep_static_kernels(generic, device):
    """A transposed read (its addresses hold the row count) and a variance (its count
    less one, a constant that is no multiple of the length): each built for its own sizes,
    no kernel shared."""
    programs = [lambda x, y: x.t() * 2 + y, lambda x, y: (x * 2).var() + y]
    for p in programs:
        for n in (300, 200):
            g = torch.Generator().manual_seed(n)
            x, y = (torch.randn(n, 50, generator=g).to(device), torch.randn(50, n, generator=g).to(device))
            with accel.eager():
                got = p(x, y)
            close(got, p(x, y))
    assert accel.stats()["generic_hits"] == 0


def test_a_decision_on_a_run_time_length_builds_the_regions_own_kernel(generic, monkeypatch, caplog):
    """Where the generic renderer meets a decision on a run-time length (NotGeneric), or
    its kernel does not build, the region is built for its own sizes: results right, no
    shared kernel, the build failure logged."""
    from accel import runtime
    from accel.build import BuildError
    from accel.codegen.generic import GenericCppRenderer

    def refuse(self, ir, name):
        raise NotGeneric("test")

    def fail(*args):
        raise BuildError("test: no generic build")

    x = torch.randn(400, 30)
    for patch, value in ((GenericCppRenderer, ("render", refuse)), (runtime, ("_shared_kernel", fail))):
        with monkeypatch.context() as m:
            m.setattr(patch, *value)
            for n in (400, 100):
                with accel.eager():
                    got = torch.tanh(x[:n] * 3) + 1
                close(got, torch.tanh(x[:n] * 3) + 1)
        x = torch.randn(400, 31)
    assert accel.stats()["generic_hits"] == 0 and accel.stats()["compile_failures"] == 0
    assert not any(m.get("readable", "").startswith("shape-generic") for m in _entries())
    assert "shape-generic kernel did not build" in caplog.text


def test_a_run_time_length_prints_and_refuses_every_other_use():
    """RunTimeLength formats as the kernel's variable; arithmetic, comparison, truth,
    conversion and hashing raise NotGeneric (so no decision can read it)."""
    n = RunTimeLength(3)
    assert f"{n}" == str(n) == "n3" and f"i < {n}" == "i < n3"
    for use in (lambda: n + 1, lambda: 1 + n, lambda: n * 2, lambda: 2 * n, lambda: -n,
                lambda: n < 5, lambda: 5 < n, lambda: n == 3, lambda: bool(n), lambda: int(n),
                lambda: hash(n), lambda: max(n, 4), lambda: sum([1, n])):
        with pytest.raises(NotGeneric):
            use()


def test_generic_layout_reads_the_ir():
    """What generic_layout accepts and its text: each nest's outer loop of run-time length,
    every other length, address and operand in the text, and which buffers are scratch; a
    whole reduction's length on the CPU; no layout without one (a whole reduction on a GPU)
    or with stores of the streaming size."""
    from accel.codegen.cpp import stream_min_bytes
    from accel.loop_ir import Addr, BufferSpec, Expr, LoopIR, Nest, Store

    f32 = torch.float32

    def ir(n, d=None, coeff=1, scratch=False, loops=True):
        sizes = [n] if d is None else [n, d]
        inner = () if d is None else ((1, 1),)
        load = Expr("load", f32, (0, Addr(((0, coeff * (d or 1)),) + inner)))
        bufs = [BufferSpec(f32, (n * coeff,), (1,), False), BufferSpec(f32, (n,), (1,), True, scratch)]
        if not loops:  # a whole reduction in a nest without a loop
            value = Expr("reduce", f32, ("sum", (load,), (0,), 0))
            return LoopIR(bufs, [], sizes, [Nest([], [Store(1, Addr(()), value)])])
        out = Addr(((0, d or 1),) + inner)
        return LoopIR(bufs, [], sizes, [Nest(list(range(len(sizes))), [Store(1, out, Expr("exp", f32, (load,)))])])

    a, b = generic_layout(ir(100)), generic_layout(ir(7))
    assert a.loops == [0] and a.sizes == [100] and b.sizes == [7] and a.text == b.text
    assert generic_layout(ir(100, coeff=2)).text != a.text  # every other element
    rows = [generic_layout(ir(n, 64)) for n in (100, 7)]
    assert rows[0].text == rows[1].text and rows[0].sizes == [100]
    assert generic_layout(ir(100, 65)).text != rows[0].text  # another row length
    whole = generic_layout(ir(100, loops=False))  # a whole reduction: its length on the CPU
    assert whole.sizes == [100] and whole.text == generic_layout(ir(7, loops=False)).text
    assert generic_layout(ir(100, loops=False), "cuda") is None
    assert generic_layout(ir(100, scratch=True)).text != a.text  # (a scratch buffer: an argument too)
    assert generic_layout(ir(stream_min_bytes() // 4)) is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_process_launches_the_shared_kernel_from_the_store(tmp_path, device):
    """The store keeps each region's entry with its loop lengths: a later process loads it
    (no build, no trace) and launches it with them."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import os, torch, accel
        os.environ["ACCEL_EAGER_SMALL_REGIONS"] = "0"
        for i, n in enumerate([50000, 300, 12345]):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(n, generator=g).to(DEVICE), torch.randn(7, n, generator=g).to(DEVICE)
            with accel.eager():
                got = (x * 2 + 1).sigmoid(), (y - 3).abs() * 0.5
            torch.testing.assert_close(got[0], (x * 2 + 1).sigmoid())
            torch.testing.assert_close(got[1], (y - 3).abs() * 0.5)
        s = accel.stats()
        print(s["compiles"], s["store_hits"], s["generic_hits"])
    """).replace("DEVICE", repr(device)))
    env = {**__import__("os").environ, "ACCEL_CACHE_DIR": str(tmp_path / "store"),
           "ACCEL_GENERIC_KERNELS": "1"}
    runs = [subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (list(map(int, r.stdout.split()[-3:])) for r in runs)
    assert first == [3, 0, 2]  # three regions (one a block), one kernel built
    assert second == [0, 3, 0]


def test_cuda_renderer_shares_source_and_plans_each_regions_grid(generic, monkeypatch):
    """Without a GPU: the loop IR of row-wise and flat regions (traced on the CPU), rendered
    for CUDA with run-time lengths, is one source for every row count, and its launch plan
    for a region's lengths (launches_for) is the static renderer's for that region, vector
    not; so are column sums over 88 columns (a thread a column) and 96 or 1024 (tiles of
    32 columns: the rows of threads and the split among blocks a launch formula), and a
    mean of 65536 or more elements (a grid-wide reduction), whose smaller lengths keep
    static kernels (generic_layout None)."""
    import accel.lowering as lowering
    from accel.codegen.cuda import CudaRenderer
    from accel.codegen.generic import GenericCudaRenderer, launches_for

    F = torch.nn.functional
    irs = []
    lower = lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower(*a)) or irs[-1])
    g = torch.Generator().manual_seed(0)
    b, w = torch.randn(88, generator=g), torch.randn(88, generator=g)  # (shapes no other test traces:
    programs = {  # a region traced in this process before is not built again)
        "layer_norm": (lambda x: F.layer_norm(F.gelu(x + b, approximate="tanh"), (88,), w, b), 88),
        "softmax": (lambda x: torch.softmax(x * 0.125, -1), 88),
        "broadcast": (lambda x: (x + w) * 3, 88), "flat": (lambda x: torch.atan(x * 1.5) * x, 1)}
    for name, (p, width) in programs.items():
        sources = set()
        for n in (300, 7, 1001):
            irs.clear()
            with accel.eager():
                out = p(torch.randn(n, width, generator=g))
            assert out.shape[0] == n and len(irs) == 1
            ir = irs[0]
            gen = generic_layout(ir, "cuda")
            assert gen is not None and gen.sizes == [n * width if width == 1 else n]
            r, s = GenericCudaRenderer(gen.loops, gen.index_types), CudaRenderer()
            sources.add(r.render(ir, "k"))
            s.render(ir, "k")
            assert launches_for(r.launches, gen.sizes) == s.launches, (name, n)
            vector = [("vector" in l) for l in launches_for(r.launches, gen.sizes)]
            assert all(vector) == (width != 1 or n % 4 == 0), (name, n)
        assert len(sources) == 1, name
    cases = {(88, 300): ([1001], 1), (96, 1000): ([88, 5001, 100000], 4), (1024, 3): ([40, 400, 20000], 4),
             (64, 1): ([1024, 1500], 2)}  # (columns, a whole mean's first rows): (rows, distinct launches)
    for (c, first), (rows, plans) in cases.items():
        sources, blocks = set(), set()
        for n in [first] + rows:
            irs.clear()
            x = torch.randn(n, c, generator=g)
            with accel.eager():
                out = (x * 2).mean() if first == 1 else (x * 2).sum(0)
            gen = generic_layout(irs[0], "cuda")
            if n * c < 1 << 16 and first == 1:
                assert gen is None  # (one block, planned on the length)
                continue
            assert gen.sizes == [n * c if first == 1 else n]
            r, s = GenericCudaRenderer(gen.loops, gen.index_types), CudaRenderer()
            sources.add(r.render(irs[0], "k"))
            s.render(irs[0], "k")
            assert launches_for(r.launches, gen.sizes) == s.launches, (c, n)
            blocks.add(repr(s.launches))
        assert len(sources) == 1 and len(blocks) == plans, c


def test_cuda_generic_kernels_index_in_32_bits_for_regions_whose_indices_fit():
    """A GPU's shape-generic kernel indexes in 32 bits (its loops' variables, its flat
    index split into rows and columns by 32-bit division) where the region it is built for
    has every index below 2**30, in 64 bits where not; the index types are in the layout's
    text, so regions of the two kinds never share a kernel (on the CPU they do)."""
    from accel.codegen.generic import GenericCudaRenderer
    from accel.loop_ir import Addr, BufferSpec, Expr, LoopIR, Nest, Store

    f32 = torch.float32

    def rows(n, d):  # y[i, j] = exp(x[i, j + 1] - x[i, j]): torch.diff's loop
        bufs = [BufferSpec(f32, (n, d + 1), (d + 1, 1), False), BufferSpec(f32, (n, d), (d, 1), True)]
        x = [Expr("load", f32, (0, Addr(((0, d + 1), (1, 1)), c))) for c in (1, 0)]
        value = Expr("exp", f32, (Expr("sub", f32, tuple(x)),))
        return LoopIR(bufs, [], [n, d], [Nest([0, 1], [Store(1, Addr(((0, d), (1, 1))), value)])])

    small, other, large = (generic_layout(rows(n, 1024), "cuda") for n in (65536, 300, 1 << 20))
    assert small.index_types == other.index_types == ["int"] and large.index_types == ["int64_t"]
    assert small.text == other.text != large.text
    assert generic_layout(rows(300, 1024)).text == generic_layout(rows(7, 1024)).text  # (CPU: no index types)
    assert generic_layout(rows(300, 1024)).index_types == []
    narrow = GenericCudaRenderer(small.loops, small.index_types).render(rows(65536, 1024), "k")
    wide = GenericCudaRenderer(large.loops, large.index_types).render(rows(1 << 20, 1024), "k")
    assert "int64_t i" not in narrow and "const int i0" in narrow and "4294967296LL" not in narrow
    assert "const int64_t i0" in wide or "int64_t i0" in wide
    assert "4294967296LL" in wide  # (its rows split in 32 bits only below 2**32)


def test_launches_for_evaluates_grid_formulas():
    """A grid formula, ceil(length * coeff / per) capped; a vector variant kept only where its
    loop's length is a multiple of its width (its condition not kept in the plan); a
    column tile's rows of threads (an eighth of its rows, a power of 2, at most 32) and
    split among blocks (256 blocks aimed at, 16 rows a thread at least)."""
    from accel.codegen.generic import launches_for

    plan = [{"kernel": "k0", "grid": [{"loop": 1, "coeff": 96, "per": 1024, "cap": 65535}, 1, 1], "block": [256, 1, 1],
             "vector": {"kernel": "k0v", "grid": [{"loop": 1, "coeff": 1, "per": 2048, "cap": 65535}, 1, 1],
                        "block": [256, 1, 1], "buffers": [0, 1], "multiple": [1, 4]}},
            {"kernel": "k1", "grid": [{"loop": 0, "coeff": 1, "per": 1, "cap": 10}, 1, 1], "block": [32, 1, 1]}]
    got = launches_for(plan, [300, 4096])
    assert got[0]["grid"] == [384, 1, 1] and got[0]["vector"] == {
        "kernel": "k0v", "grid": [2, 1, 1], "block": [256, 1, 1], "buffers": [0, 1]}
    assert got[1]["grid"] == [10, 1, 1] and "vector" not in got[1]
    assert "vector" not in launches_for(plan, [300, 4097])[0]
    assert plan[0]["vector"]["multiple"] == [1, 4]  # (the stored plan unchanged)
    rows = {"fn": "col_rows", "loop": 0, "coeff": 2}  # a column tile's block and split
    tiles = [{"kernel": "k2", "grid": [3, dict(rows, fn="col_split", tiles=3), 1], "block": [32, rows, 1]}]
    for n, block_rows, split in ((4, 1, 1), (150, 32, 1), (2500, 32, 9), (50000, 32, 86)):
        assert launches_for(tiles, [n]) == [{"kernel": "k2", "grid": [3, split, 1], "block": [32, block_rows, 1]}], n
