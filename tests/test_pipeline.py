"""The compile pipeline stage by stage: trace, passes (graphs before/after), lowering,
codegen (golden source), build."""
import math
import os
import re

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import accel
import accel.passes
from accel.codegen.cpp import CppRenderer
from accel.graph import TraceError, trace_region
from accel.loop_ir import BufferSpec, free_vars, reductions, walk
from accel.lowering import LoweringError, lower
from accel.passes import (constant_folding, cse, dce, remove_identities, remove_noops, round_products_across_kernels,
                          run_passes, specialize_pow)
from plugin_runs import run_under, seed_dispatch_filter  # tests/plugin_runs.py
from test_half import _cpu_flags  # tests/test_half.py

aten = torch.ops.aten
prims = torch.ops.prims
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_trace_decomposes_to_prims_with_scalar_placeholders():
    x = torch.empty(4, 8)
    calls = [(aten.mul.Tensor, (("x", 0), ("s", 0)), {}, 1),
             (aten.gelu.default, (("o", 0),), {"approximate": ("c", "tanh")}, 1)]
    tr = trace_region(calls, [x], 2, (1,), ["f"])
    phs = [n for n in tr.gm.graph.nodes if n.op == "placeholder"]
    assert len(phs) == 2 and tr.n_ext == 1 and tr.n_scalars == 1
    assert all(t.startswith("prims.") for t in _targets(tr.gm))
    assert any(phs[1] in n.args for n in tr.gm.graph.nodes if n.op == "call_function")


def test_add_with_alpha_traces_to_one_fused_multiply_add():
    """``add(x, y, alpha=s)`` as eager computes it, ``fma(y, s, x)`` rounded once
    (accel.decompositions._add_alpha), its alpha still the region's scalar placeholder."""
    x = torch.empty(4, 8)
    calls = [(aten.add.Tensor, (("x", 0), ("x", 0)), {"alpha": ("s", 0)}, 1)]
    tr = trace_region(calls, [x], 1, (0,), ["f"])
    phs = [n for n in tr.gm.graph.nodes if n.op == "placeholder"]
    assert "accel.fma.default" in _targets(tr.gm) and "prims.mul.default" not in _targets(tr.gm)
    assert any(phs[1] in n.args for n in tr.gm.graph.nodes if n.op == "call_function")


def test_trace_rejects_value_dependent_scalars():
    x = torch.zeros(4)

    def branchy(t, s):  # a decomposition that branches on the scalar's magnitude
        return aten.mul.Tensor(t, 1.0 if s > 1500 else 2.0)

    with pytest.raises(TraceError, match="scalar value"):
        trace_region([(branchy, (("x", 0), ("s", 0)), {}, 1)], [x], 1, (0,), ["f"])


def _graph(fn, *shapes):
    return fx.symbolic_trace(fn)


def test_cse_merges_equal_nodes():
    x = torch.empty(4, 8)
    calls = [(aten.sin.default, (("x", 0),), {}, 1), (aten.sin.default, (("x", 0),), {}, 1),
             (aten.add.Tensor, (("o", 0), ("o", 1)), {}, 1)]
    gm = trace_region(calls, [x], 3, (2,), []).gm
    before = _targets(gm)
    assert before.count("prims.sin.default") == 2
    assert cse(gm) == 1
    assert _targets(gm).count("prims.sin.default") == 1


def test_dce_and_noop_removal():
    x = torch.empty(4, 8)
    calls = [(aten.exp.default, (("x", 0),), {}, 1),  # dead: not returned
             (aten._to_copy.default, (("x", 0),), {"dtype": ("c", torch.float32)}, 1),
             (aten.neg.default, (("o", 1),), {}, 1)]
    gm = trace_region(calls, [x], 3, (2,), []).gm
    g = gm.graph
    with g.inserting_after(next(iter(g.nodes))):
        ph = next(iter(g.nodes))
        extra = g.call_function(prims.sin.default, (ph,))  # unused
    extra.meta["val"] = torch.empty(4, 8, device="meta")
    log = run_passes(gm)
    assert [line.split(":")[0] for line in log] == ["remove_noops", "specialize_pow", "constant_folding",
                                                      "remove_identities", "cse", "compose_strided_views", "dce",
                                                      "sink_collapse_views", "patterns",
                                                      "round_products_across_kernels"]
    assert _targets(gm) == ["prims.neg.default"], gm.graph
    assert dce(gm) == 0 and remove_noops(gm) == 0


def test_products_that_other_kernels_add_are_rounded_on_a_gpu():
    """Each node of a trace carries the number of the eager kernel it is part of (a recorded
    call, or a call that an op's composite makes, ``binary_cross_entropy_with_logits``'
    ``(1 - target) * input - log_sigmoid(input)``), and on a GPU a product that only other
    kernels add or subtract becomes ``accel.mul_rn`` (``__fmul_rn`` in CUDA source), which
    nvcc cannot contract into a fused multiply-add, while a product its own kernel adds
    (the tanh-GELU backward's ``x + kKappa * x_cube``) stays; CPU kernels are left as they
    are (they contract nothing)."""
    from accel.graph import kernel_of

    x, t = torch.randn(4, 8), torch.rand(4, 8)
    calls = [(aten.mul.Tensor, (("x", 0), ("x", 1)), {}, 1), (aten.add.Tensor, (("o", 0), ("x", 1)), {}, 1),
             (aten.binary_cross_entropy_with_logits.default, (("o", 1), ("x", 1), ("c", None), ("c", None),
                                                               ("c", 0)), {}, 1),
             (aten.gelu_backward.default, (("o", 2), ("x", 0)), {"approximate": ("c", "tanh")}, 1)]

    def traced():
        gm = trace_region(calls, [x, t], 4, (3,), []).gm
        run_passes(gm)
        return gm

    gm = traced()
    muls = [n for n in gm.graph.nodes if n.target is prims.mul.default]
    assert all(kernel_of(n) is not None for n in muls)
    # x * t, + t, bce's 1 - t, * x, log_sigmoid and -, the GELU backward
    assert len({kernel_of(n) for n in gm.graph.nodes if n.op == "call_function"}) == 7
    assert round_products_across_kernels(gm) == 0  # (CPU tensors)
    assert round_products_across_kernels(gm, "cuda") == 2  # x * t, and bce's (1 - t) * x
    rounded = [n for n in gm.graph.nodes if n.target is torch.ops.accel.mul_rn.default]
    assert {a.name for a in rounded[0].args} == {"arg0_1", "arg1_1"}
    assert all(any(u.target in (prims.add.default, prims.sub.default) and kernel_of(u) != kernel_of(n)
                   for u in n.users) for n in rounded)
    # the GELU backward's products that its own sums read stay contractible
    gelu = [n for n in gm.graph.nodes if n.target is prims.mul.default
            and any(u.target is prims.add.default and kernel_of(u) == kernel_of(n) for u in n.users)]
    assert gelu
    gm.graph.lint()
    v, w = torch.randn(4, 8), torch.rand(4, 8)
    torch.testing.assert_close(gm(v, w)[0], traced()(v, w)[0], rtol=0, atol=0)
    # pow's products, which specialize_pow builds, are pow's kernel's: x ** 3 + x rounds x ** 3
    pow3 = trace_region([(aten.pow.Tensor_Scalar, (("x", 0), ("c", 3)), {}, 1),
                         (aten.add.Tensor, (("o", 0), ("x", 0)), {}, 1)], [x], 2, (1,), []).gm
    run_passes(pow3)
    assert round_products_across_kernels(pow3, "cuda") == 1
    assert _targets(pow3) == ["prims.mul.default", "accel.mul_rn.default", "prims.add.default"]
    # and a product another kernel reads through a view: (x * x).t() + y
    viewed = trace_region([(aten.mul.Tensor, (("x", 0), ("x", 0)), {}, 1), (aten.t.default, (("o", 0),), {}, 1),
                           (aten.add.Tensor, (("o", 1), ("x", 1)), {}, 1)], [x, x.t()], 3, (2,), []).gm
    run_passes(viewed)
    assert round_products_across_kernels(viewed, "cuda") == 1
    from accel.codegen.cuda import CudaRenderer

    spec = BufferSpec(torch.float32, (4, 8), (8, 1), False)
    src = CudaRenderer().render(lower(gm, [spec, spec], [BufferSpec(torch.float32, (4, 8), (8, 1), True)], []), "k")
    assert src.count("accel::mul_rn(") == 2 * src.count("__global__"), src  # (each kernel variant)


def test_binary_cross_entropy_with_logits_traces_eagers_formula():
    """``binary_cross_entropy_with_logits`` traces as eager computes it, ``(1 - t) * x -
    log_sigmoid(x)`` (``log_sigmoid`` as ``min(x, 0) - log1p(exp(-|x|))``), not as the
    functorch hack that ``torch.func.functionalize`` runs in its place (``max_val + log(exp(
    -max_val) + exp(-x - max_val))``, accel.operands._FUNCTORCH_HACKED); with a
    ``pos_weight`` too. The older formula was an ulp off in 41 % of float32 results on an
    H200."""
    x, t, w = torch.randn(4, 8), torch.rand(4, 8), torch.rand(8)
    for pos_weight in (("c", None), ("x", 2)):
        call = (aten.binary_cross_entropy_with_logits.default,
                (("x", 0), ("x", 1), ("c", None), pos_weight, ("c", 0)), {}, 1)
        targets = _targets(trace_region([call], [x, t, w], 1, (0,), []).gm)
        assert "prims.log1p.default" in targets and "prims.minimum.default" in targets, targets
        assert "prims.log.default" not in targets, targets


def test_specialize_pow_as_eager_computes_it():
    x = torch.empty(4, 8)
    calls = [(aten.pow.Tensor_Scalar, (("x", 0), ("c", 3.0)), {}, 1),
             (aten.pow.Tensor_Scalar, (("o", 0), ("c", -0.5)), {}, 1),
             (aten.pow.Tensor_Scalar, (("o", 1), ("c", 1.7)), {}, 1)]
    gm = trace_region(calls, [x], 3, (2,), []).gm
    assert _targets(gm).count("prims.pow.default") == 3
    assert specialize_pow(gm) == 2
    gm.graph.lint()
    assert _targets(gm) == ["prims.mul.default", "prims.mul.default", "prims.rsqrt.default",
                            "prims.pow.default"], gm.graph
    v = torch.randn(4, 8).abs() + 0.1
    torch.testing.assert_close(gm(v)[0], v.pow(3.0).pow(-0.5).pow(1.7), rtol=0, atol=0)


def _lowered(calls, ext, out_meta, live, scalar_types=(), device="cpu"):
    tr = trace_region(calls, ext, len(out_meta), live, list(scalar_types))
    run_passes(tr.gm)
    exts = [BufferSpec(t.dtype, tuple(t.shape), t.stride(), False) for t in ext]
    outs = [BufferSpec(out_meta[i][2], out_meta[i][0], out_meta[i][1], True) for i in live]
    return lower(tr.gm, exts, outs, list(scalar_types), device)


def test_coalesce_merges_contiguous_loops():
    # contiguous [4, 8, 16] + [4, 8, 16]: one loop of 512
    x = torch.empty(4, 8, 16)
    ir = _lowered([(aten.add.Tensor, (("x", 0), ("x", 0)), {}, 1)], [x],
                  [((4, 8, 16), (128, 16, 1), torch.float32)], (0,))
    assert [ir.sizes[v] for v in ir.nests[0].vars] == [512]
    # a broadcast operand (stride 0 over dim 0) keeps the loops apart
    b = torch.empty(8)
    ir = _lowered([(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)], [torch.empty(4, 8), b],
                  [((4, 8), (8, 1), torch.float32)], (0,))
    assert [ir.sizes[v] for v in ir.nests[0].vars] == [4, 8]


def test_rendered_source_is_deterministic():
    """The same region renders to the same source every time (names come from counters, not
    object addresses), so a kernel built in any process is the same artifact."""
    from accel.codegen.cuda import CudaRenderer

    x, w = torch.empty(64, 1024), torch.empty(1024)
    calls = [(aten.add.Tensor, (("x", 0), ("x", 2)), {}, 1),
             (aten.native_layer_norm.default, (("o", 0), ("c", [1024]), ("x", 1), ("x", 1), ("c", 1e-5)), {}, 3)]
    meta = [((64, 1024), (1024, 1), torch.float32)] * 2 + [((64, 1), (1, 1), torch.float32)] * 2
    for renderer in (CppRenderer, CudaRenderer):
        first, again = (renderer().render(_lowered(calls, [x, w, torch.empty_like(x)], meta, (1,)), "k")
                        for _ in range(2))
        assert first == again


def test_row_reduction_is_hoisted_into_one_nest():
    """softmax over the last dim: one nest over rows, the max and the sum of exponentials
    computed once per row in one online pass (the patterns pass), before the loop over the
    row's elements; nothing else stored."""
    x = torch.empty(64, 100)
    ir = _lowered([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x],
                  [((64, 100), (100, 1), torch.float32)], (0,))
    assert len(ir.nests) == 1
    nest = ir.nests[0]
    assert [ir.sizes[v] for v in nest.vars] == [64, 100]
    reds = reductions(nest)
    assert sorted(r.args[0] for r in reds) == ["online_softmax", "online_softmax"]
    assert all(free_vars(r) == {nest.vars[0]} for r in reds)


def test_column_and_row_reductions_get_their_own_nests():
    x = torch.empty(32, 48)
    calls = [(aten.sum.dim_IntList, (("x", 0), ("c", (1,))), {}, 1),
             (aten.sum.dim_IntList, (("x", 0), ("c", (0,))), {}, 1)]
    ir = _lowered(calls, [x], [((32,), (1,), torch.float32), ((48,), (1,), torch.float32)], (0, 1))
    assert len(ir.nests) == 2


def _kernel_source(calls, ext, out_meta, live, scalar_types=()):
    return CppRenderer().render(_lowered(calls, ext, out_meta, live, scalar_types), "accel_region_golden")


def test_codegen_golden_broadcast_chain():
    x, b = torch.empty(64, 1000), torch.empty(1000)
    calls = [(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1),
             (aten.mul.Tensor, (("o", 0), ("s", 0)), {}, 1),
             (aten.tanh.default, (("o", 1),), {}, 1)]
    meta = [((64, 1000), (1000, 1), torch.float32)] * 3
    src = _kernel_source(calls, [x, b], meta, (2,), "f")
    path = os.path.join(GOLDEN, "broadcast_chain.cpp")
    if os.environ.get("ACCEL_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(src)
    with open(path) as f:
        assert src == f.read(), "generated source changed; rerun with ACCEL_UPDATE_GOLDEN=1 and review the diff"


def test_float32_row_sum_accumulates_float64_lanes():
    """A float32 sum along the contiguous dim: eight float64 lanes, each step four runs of
    eight values added pairwise in float32 and widened; the lanes then added pairwise;
    the 1000th row's last 8 values one at a time."""
    x = torch.empty(16, 1000)
    src = _kernel_source([(aten.sum.dim_IntList, (("x", 0), ("c", (1,))), {}, 1)], [x],
                         [((16,), (1,), torch.float32)], (0,))
    assert re.search(r"double (a\d+_\d+)_l\[8\] = \{\};", src), src
    assert re.search(r"(a\d+_\d+)_l\[l\d+_k\] \+= static_cast<double>\(\(\(\1_y0 \+ \1_y1\) \+ "
                     r"\(\1_y2 \+ \1_y3\)\)\);", src), src
    assert re.search(r"l\d+_c < 31;", src) and re.search(r"for \(int64_t i\d+ = 992; i\d+ < 1000;", src), src


@pytest.mark.parametrize("n, lanes, first_left", [(1024, 16, None), (1000, 16, 960), (100, 8, 96)])
def test_a_float32_sum_of_costly_values_takes_sixteen_lanes(n, lanes, first_left):
    """A float32 row sum of exponentials (values that cost more than a few additions each):
    16 float64 lanes (``cpp_groups.LANES_WIDE``), each step four runs of 16 values, so that
    the exponentials run at the 512-bit vector width; plain sums keep 8
    (:func:`test_float32_row_sum_accumulates_float64_lanes`). A row whose last values would
    be many more at 16 than at 8 (100: 36 against 4) keeps 8."""
    x = torch.empty(16, n)
    calls = [(aten.exp.default, (("x", 0),), {}, 1), (aten.sum.dim_IntList, (("o", 0), ("c", (1,))), {}, 1)]
    src = _kernel_source(calls, [x], [((16, n), (n, 1), torch.float32), ((16,), (1,), torch.float32)], (1,))
    assert re.search(rf"double (a\d+_\d+)_l\[{lanes}\] = \{{\}};", src), src
    assert re.search(rf"l(\d+)_k < {lanes}; \+\+l\1_k", src), src
    left = re.search(r"for \(int64_t i\d+ = (\d+); i\d+ < " + str(n) + ";", src)
    assert (left and int(left.group(1))) == first_left, src


def test_column_sums_with_row_operands_accumulate_a_vector_of_columns():
    """LayerNorm backward's weight gradient, sum over rows of dy * (x - mean[row]) * rstd[row]:
    the per-row operands are the same along the columns, so the column sum still loops
    rows outside and a block of contiguous columns inside (a vector of accumulators), not
    one column at a time down a 1 KiB stride."""
    dy, x, mean, rstd = torch.empty(1024, 256), torch.empty(1024, 256), torch.empty(1024, 1), torch.empty(1024, 1)
    calls = [(aten.sub.Tensor, (("x", 1), ("x", 2)), {}, 1),
             (aten.mul.Tensor, (("o", 0), ("x", 3)), {}, 1),
             (aten.mul.Tensor, (("x", 0), ("o", 1)), {}, 1),
             (aten.sum.dim_IntList, (("o", 2), ("c", (0,))), {}, 1)]
    meta = [((1024, 256), (256, 1), torch.float32)] * 3 + [((256,), (1,), torch.float32)]
    src = _kernel_source(calls, [dy, x, mean, rstd], meta, (3,))
    block = re.search(r"double a\d+_0\[(\d+)\];", src)  # one accumulator per column of a block
    assert block and 32 <= int(block.group(1)) <= 256, src
    inner = src[src.index("for (int64_t i"):]
    assert "256 * i" in inner and "#pragma omp simd" in inner
    # four rows a step, their float32 values added pairwise, then widened to meet the
    # float64 accumulator
    assert re.search(r"i(\d+)_s < (1024|a\d+_e); i\1_s \+= 4\)", src), src  # (its rows, when split)
    assert re.search(r"float (a\d+)_x0_0;", src), src
    assert re.search(r"(a\d+)_0\[v\d+_k\] \+= static_cast<double>\(\(\(\1_x0_0 \+ \1_x0_1\) \+ "
                     r"\(\1_x0_2 \+ \1_x0_3\)\)\);", src), src
    assert not re.search(r"for \(int64_t i\d+ = 1024;", src)  # no rows left over


def test_lowering_loops_follow_the_outputs_memory_order():
    """A channels-last [N, C, H, W] batch norm: its output's nest loops N, H, W, then C
    innermost (the buffer's memory order), so that every access walks memory
    contiguously, not C outside H and W (a stride of C elements)."""
    x = torch.empty(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    cl = x.stride()
    calls = [(aten.native_batch_norm.default, (("x", 0), ("c", None), ("c", None), ("c", None),
                                               ("c", None), ("c", True), ("c", 0.1), ("c", 1e-5)), {}, 3),
             (aten.mul.Tensor, (("o", 0), ("x", 0)), {}, 1)]
    ir = _lowered(calls, [x], [((2, 8, 4, 4), cl, torch.float32), ((8,), (1,), torch.float32),
                               ((8,), (1,), torch.float32), ((2, 8, 4, 4), cl, torch.float32)], (3,))
    out = next(n for n in ir.nests if any(st.buf == 1 for st in n.stores))
    (st,) = out.stores
    assert st.addr.coeff(out.vars[-1]) == 1 and not reductions(out), ir.describe()
    for e in walk(st.value, set()):
        if e.op == "load" and e.args[0] == 0:
            assert e.args[1].coeff(out.vars[-1]) == 1


def test_channels_last_group_norm_output_loops_over_a_positions_channels():
    """With weight and bias, each channel's scale and shift go to arrays once per image,
    nothing is left to compute per group, and the output's nest runs one vectorized loop
    over a position's 16 contiguous channels (the group loop held at 0), not 4 loops of
    a group's 4 (``TiledLoops._fusable``)."""
    x = torch.empty(2, 16, 5, 6).contiguous(memory_format=torch.channels_last)
    cl = x.stride()
    calls = [(aten.native_group_norm.default, (("x", 0), ("x", 1), ("x", 2), ("c", 2), ("c", 16),
                                               ("c", 30), ("c", 4), ("c", 1e-5)), {}, 3)]
    meta = [((2, 16, 5, 6), cl, torch.float32), ((2, 4), (4, 1), torch.float32),
            ((2, 4), (4, 1), torch.float32)]
    ir = _lowered(calls, [x, torch.empty(16), torch.empty(16)], meta, (0, 1, 2))
    src = CppRenderer().render(ir, "accel_region_golden")
    positions = src[src.rindex("for (int64_t i", 0, src.rindex("const int64_t i")):]
    assert re.search(r"< 30; \+\+i\d+\) \{\s*\{\s*const int64_t (i\d+) = 0;(.|\n)*#pragma omp simd\s*"
                     r"for \(int64_t i\d+ = 0; i\d+ < 16; \+\+i\d+\)", positions), src


def test_channels_last_group_norm_loops_in_memory_order():
    """A channels-last [N, C, H, W] group norm (4 groups of 4 channels): a group's channels
    are 4 contiguous floats of every 16, so its statistics are taken per channel first (a
    column reduction over the positions, vectorized across the channels, every float read
    once), in float64, then merged per group (Chan et al.: the channels' mean, their
    variances plus their means' spread); the output's nest loops N, H, W, then the
    channels, each group's scale and shift computed once per image into arrays, not once
    per position."""
    x = torch.empty(2, 16, 5, 6).contiguous(memory_format=torch.channels_last)
    cl = x.stride()
    calls = [(aten.native_group_norm.default, (("x", 0), ("c", None), ("c", None), ("c", 2), ("c", 16),
                                               ("c", 30), ("c", 4), ("c", 1e-5)), {}, 3),
             (aten.mul.Tensor, (("o", 0), ("o", 0)), {}, 1)]
    meta = [((2, 16, 5, 6), cl, torch.float32), ((2, 4), (4, 1), torch.float32),
            ((2, 4), (4, 1), torch.float32), ((2, 16, 5, 6), cl, torch.float32)]
    ir = _lowered(calls, [x], meta, (3,))
    columns, groups, out = ir.nests
    assert {ir.buffers[st.buf].shape for st in columns.stores} == {(2, 4, 4)}, ir.describe()
    assert all(ir.buffers[st.buf].dtype == torch.float64 for st in columns.stores)
    for r in reductions(columns):  # over the 30 positions, each a stride of 16 floats
        loads = [e for b in r.args[1] for e in walk(b, set()) if e.op == "load"]
        assert r.args[0] == "welford" and [ir.sizes[v] for v in r.args[2]] == [30], r
        assert all(e.args[1].coeff(columns.vars[-1]) == 1 for e in loads)
    assert {(r.args[0], tuple(ir.sizes[v] for v in r.args[2])) for r in reductions(groups)} == {("sum", (4,))}
    (st,) = [st for st in out.stores if st.buf == 1]
    assert st.addr.coeff(out.vars[-1]) == 1 and not reductions(out), ir.describe()
    src = CppRenderer().render(ir, "accel_region_golden")
    assert re.search(r"double (a\d+)_0k\[\d+\], \1_0s\[\d+\], \1_0q", src), src  # columns' moments
    positions = src[src.index("float t", src.rindex("  {\n")):]  # the output nest, after its arrays
    assert re.match(r"float (t\d+)_x\[4\];(.|\n)*\1_x\[i\d+\] = \1;(.|\n)*for \(int64_t i\d+ = 0; i\d+ < 30;",
                    positions), src


def test_column_softmax_and_moments_accumulate_vectors_of_columns():
    """A softmax over dim 0 (its max, then its sum of exponentials, the second reading the
    first) and a batch norm's mean and variance over the rows of [N, C]: each reduction
    accumulates a vector of a block's columns over the rows (unit-stride loads), not one
    column at a time down the rows; the variance as sums shifted by each column's first
    value."""
    x = torch.empty(512, 96)
    src = _kernel_source([(aten._softmax.default, (("x", 0), ("c", 0), ("c", False)), {}, 1)], [x],
                         [((512, 96), (96, 1), torch.float32)], (0,))
    stats = src[:src.index("  }\n  {")]  # the statistics' nest
    assert re.search(r"float a\d+_0\[\d+\];(.|\n)*float a\d+_0\[\d+\];", stats), stats  # max, then sum
    assert stats.count("for (int64_t i") == 2 and "96 * i" in stats
    assert re.search(r"= \(t\d+ - a\d+_0\[v\d+_k\]\);\n\s*const float t\d+ = accel::exp\(", stats), stats  # the max, read
    calls = [(aten.native_batch_norm.default, (("x", 0), ("c", None), ("c", None), ("c", None),
                                               ("c", None), ("c", True), ("c", 0.1), ("c", 1e-5)), {}, 3)]
    src = _kernel_source(calls, [x], [((512, 96), (96, 1), torch.float32), ((96,), (1,), torch.float32),
                                      ((96,), (1,), torch.float32)], (0, 1, 2))
    stats = src[:src.index("  }\n  {")]
    assert re.search(r"double (a\d+_0)k\[(\d+)\], \1s\[\2\], \1q\[\2\];", stats), stats
    assert "const int64_t i" in stats and "Welford" not in stats  # the shifts: row 0


def test_column_argmax_keeps_a_vector_of_values_and_indices():
    """argmax over the rows of [N, C]: a block's columns keep their best value and its
    index, updated by a select one row a step (vectorized), not one column at a time down
    the rows."""
    x = torch.empty(512, 96)
    src = _kernel_source([(aten.argmax.default, (("x", 0), ("c", 0)), {}, 1)], [x],
                         [((96,), (1,), torch.int64)], (0,))
    assert re.search(r"float (a\d+)_v\[\d+\];\s*int64_t \1_i\[\d+\];", src), src
    assert re.search(r"const bool w = accel::argmax_better\(t\d+, a\d+_v\[v\d+_k\]\);", src), src
    assert "96 * i" in src and "#pragma omp simd" in src


def test_cuda_transposing_nest_runs_in_shared_memory_tiles():
    """On a GPU, ``x.t() + y`` (a load strided along the loop its store walks) runs in
    tiles of 32 x 32 values, a block of 32 x 8 threads a tile: the transposed input's tile
    read along its rows into shared memory (a row one longer than the tile), then the
    values computed and stored along the output's rows; no 16-byte vector variant."""
    from accel.codegen.cuda import CudaRenderer

    calls = [(aten.t.default, (("x", 0),), {}, 1), (aten.add.Tensor, (("o", 0), ("x", 1)), {}, 1)]
    ir = _lowered(calls, [torch.empty(1000, 600), torch.empty(600, 1000)],
                  [((600, 1000), (1, 600), torch.float32), ((600, 1000), (1000, 1), torch.float32)], (1,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_golden")
    (launch,) = r.launches
    assert launch["block"] == [32, 8, 1] and launch["grid"] == [19 * 32, 1, 1] and "vector" not in launch
    assert "__shared__ float tp0[32][33];" in src
    assert re.search(r"tp0\[threadIdx.y \+ r\]\[threadIdx.x \+ c\] = b0\[i0 \+ 600 \* i1\];", src), src
    assert re.search(r"= tp0\[threadIdx.x \+ c\]\[threadIdx.y \+ r\];(.|\n)*b2\[1000 \* i0 \+ i1\] =", src), src
    assert src.count("__syncthreads();") == 2
    # y, read along the output's rows, into registers before the transposed tile's loads
    # (4 values a thread, in the order the elements take them), read there by the elements
    pre, tile = src.split("__syncthreads();")[:2]
    assert "float pf0[4];" in pre and pre.index("pf0[(r / 8) * 1 + c / 32] = b1[1000 * i0 + i1];") < pre.index("tp0[threadIdx")
    assert re.search(r"const float t\d+ = pf0\[\(r / 8\) \* 1 \+ c / 32\];", tile) and "b1[" not in tile, src


@pytest.mark.parametrize("n", [5, 6])
def test_cuda_transposing_tiles_fit_a_blocks_shared_memory(n):
    """A sum of ``n`` transposed float64 inputs: each load's 32 x 33 tile takes 8448 bytes
    of shared memory; five (41 KiB) run in tiles, six (49.5 KiB, past TRANSPOSE_SMEM) as a
    plain nest: above 48 KiB a block's shared memory must be dynamic and opted into (CUDA C++
    Programming Guide), where the tiles' is static (ptxas 13.0 builds the six tiles'
    kernel, with 50688 bytes of static shared memory)."""
    from accel.codegen.cuda import CudaRenderer
    from accel.codegen.cuda_shapes import TRANSPOSE_SMEM

    calls = [(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)]
    calls += [(aten.add.Tensor, (("o", k), ("x", k + 2)), {}, 1) for k in range(n - 2)]
    ts = [torch.empty(600, 1000, dtype=torch.float64).t() for _ in range(n)]
    m = ((1000, 600), (600, 1), torch.float64)
    ir = _lowered(calls, ts, [m] * (n - 1), (n - 2,))
    src = CudaRenderer().render(ir, "accel_region_golden")
    assert (src.count("__shared__ double tp") == n) == (n * 32 * 33 * 8 <= TRANSPOSE_SMEM), src


@pytest.mark.parametrize("cols", [50257, 65536])
def test_cuda_long_statistics_rows_in_scalar_loops_take_small_blocks(cols):
    """A row kernel computing statistics alone (``logsumexp`` over the last dim) over rows
    too long for a block's registers: in scalar block loops (rows of an odd length, no
    16-byte vectors: rows of an odd length, and the scalar kernel that runs where a
    buffer is misaligned) blocks of STATS_ROW_THREADS threads, unrolled STATS_ROW_UNROLL
    times (more rows in flight); the vector variant in blocks of ROW_THREADS as before."""
    from accel.codegen.cuda import CudaRenderer
    from accel.codegen.cuda_shapes import ROW_THREADS, STATS_ROW_THREADS, STATS_ROW_UNROLL

    calls = [(aten.logsumexp.default, (("x", 0), ("c", [1]), ("c", False)), {}, 1)]
    ir = _lowered(calls, [torch.empty(64, cols)], [((64,), (1,), torch.float32)], (0,))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_golden")
    (launch,) = r.launches
    assert launch["block"] == [STATS_ROW_THREADS, 1, 1], launch
    assert f"#pragma unroll {STATS_ROW_UNROLL}\n" in src.split("_k0v")[0], src
    if cols % 4 == 0:
        assert launch["vector"]["block"] == [ROW_THREADS, 1, 1], launch
    else:
        assert "vector" not in launch


def test_cuda_transposing_tile_with_run_values_reads_its_loads_first():
    """``x.softmax(-1) + y.t()``: the tile's run values (the rows' max and sum, once a
    tile) come after the tile's transposed loads, read into registers (``ld0``) behind the
    other loads (``pf0``), and only then does the tile go to shared memory: all three
    groups of loads are in flight together before the barrier."""
    from accel.codegen.cuda import CudaRenderer

    m = ((16384, 4096), (4096, 1), torch.float32)
    calls = [(aten._softmax.default, (("x", 0), ("c", -1), ("c", False)), {}, 1),
             (aten.add.Tensor, (("o", 0), ("x", 1)), {}, 1)]
    ir = _lowered(calls, [torch.empty(16384, 4096), torch.empty(4096, 16384).t()], [m, m], (1,))
    src = CudaRenderer().render(ir, "accel_region_golden")
    pre = src[src.index("__shared__ float tp0"):].split("__syncthreads();")[0]
    order = [pre.index(s) for s in ("pf0[(r / 8) * 2 + c / 32] = b0[", "ld0[(r / 8) * 1 + c / 32] = b1[",
                                     "tq0[k] = ", "tp0[threadIdx.y + r][threadIdx.x + c] = ld0[(r / 8) * 1 + c / 32];")]
    assert order == sorted(order) and "float ld0[8];" in pre and "float pf0[8];" in pre, src
    # tiles of 32 x 64 where there are run values (8 values a thread): the run values and the
    # barrier once per twice the values
    assert "__shared__ float tp0[64][33];" in src, src


@pytest.mark.parametrize("groups", [4, 16])
def test_cuda_channels_last_group_norm_output_runs_in_transposing_tiles(groups):
    """A channels-last group norm written contiguous (torch 2.11's CUDA group norm): its
    statistics go to memory first (:func:`accel.lowering._reads_across_rows`), and its
    output's nest runs in tiles through shared memory. A tile's contiguous run is a
    position's 64 channels, the group loop and the channel loop as one
    (``TransposeTiles._run``: a group's 16 or 4 channels alone were a short run, or too
    short to tile), so tiles of 32 x 32; the group and channel come back from the run's
    index. The mean and rstd outputs, stored beside it, by one thread each. With these run
    values (a channel's scale and shift) a tile is 32 channels by 64 positions."""
    from accel.codegen.cuda import CudaRenderer

    N, C, H, W, G = 4, 64, 16, 16, groups
    x = torch.empty(N, C, H, W).contiguous(memory_format=torch.channels_last)
    calls = [(aten.native_group_norm.default, (("x", 0), ("x", 1), ("x", 2), ("c", N), ("c", C),
                                               ("c", H * W), ("c", G), ("c", 1e-5)), {}, 3)]
    meta = [((N, C, H, W), (C * H * W, H * W, W, 1), torch.float32), ((N, G), (G, 1), torch.float32),
            ((N, G), (G, 1), torch.float32)]
    ir = _lowered(calls, [x, torch.empty(C), torch.empty(C)], meta, (0, 1, 2))
    assert not any(e.op == "reduce" for st in ir.nests[-1].stores for e in walk(st.value, set()))
    r = CudaRenderer()
    src = r.render(ir, "accel_region_golden")
    assert "__shared__ float tp0[64][33];" in src, src  # run values: tiles of 32 x 64
    assert r.launches[-1]["grid"] == [N * 2 * 4, 1, 1], r.launches  # 2 x 4 tiles an image
    k = C // G
    m = re.search(rf"const int (i\d+)_r = (f\d+)_u \+ threadIdx.x \+ c, (i\d+) = \2_v \+ threadIdx.y \+ r;\s*"
                  rf"if \(\1_r < 64 && \3 < 256\) {{\s*const uint32_t (u\d+) = \(uint32_t\)\(\1_r\);\s*"
                  rf"const int \1 = \4 % {k}u;\s*const int (i\d+) = \(\4 / {k}u\);\s*"
                  rf"tp0\[threadIdx.y \+ r\]\[threadIdx.x \+ c\] = b0\[", src)
    assert m, src
    # each channel's scale and shift once a tile, into shared memory (the tile's first 32
    # threads), where the mean and rstd are stored too; the elements read them there
    pre, tile = src.split("tq1[k] = ")[0], src.split("tq1[k] = ")[1]
    assert "__shared__ float tq0[32];" in src and "accel::rsqrt" in pre and "accel::rsqrt" not in tile
    assert re.search(r"if \(i\d+ == 0 && i\d+ == 0\) b4\[", pre), src
    assert re.search(r"const float t\d+ = tq0\[threadIdx.y \+ r\];", tile), src


def test_column_reductions_split_rows_among_threads(monkeypatch):
    """A parallel column reduction over at least SPLIT_COLUMNS columns splits its rows among
    the threads (each reads whole rows): each thread accumulates its share into its own
    accumulators, publishes them, and after a barrier the threads merge a share of the
    columns each, in thread order (sums by their operator; means and variances by Chan et
    al.'s update, by the partials' counts). Fewer columns, where the threads' blocks are as
    many as the threads, keep the column split."""
    import accel.codegen.columns as columns

    monkeypatch.setattr(columns, "machine_threads", lambda: 2)
    x = torch.empty(1024, 256)
    src = _kernel_source([(aten.sum.dim_IntList, (("x", 0), ("c", (0,))), {}, 1)], [x],
                         [((256,), (1,), torch.float32)], (0,))
    assert re.search(r"accel::Partials<double> (a\d+_0)_p\(256\);(.|\n)*#pragma omp parallel\n", src), src
    assert re.search(r"const int64_t (a\d+)_lo = 1024 \* (v\d+)_t / \2_nt, \1_hi = 1024 \* \(\2_t \+ 1\) / \2_nt;",
                     src), src
    assert re.search(r"i(\d+)_s = a\d+_lo; i\1_s < a\d+_e; i\1_s \+= 4\)", src), src  # its rows, 4 a step
    assert re.search(r"#pragma omp barrier\n\s*#pragma omp for simd schedule\(static\)", src), src
    assert re.search(r"for \(int64_t u = 1; u < v\d+_nt; \+\+u\) (a\d+_0)_r\[v\d+_k\] \+= \1_p\.p\[u \* 256", src), src
    calls = [(aten.var_mean.correction, (("x", 0), ("c", (0,))), {"correction": ("c", 0)}, 2)]
    src = _kernel_source(calls, [x], [((256,), (1,), torch.float32)] * 2, (0, 1))
    assert "double na = 0;" in src and "d * d * (na / n * nb)" in src, src  # Chan et al.
    src = _kernel_source([(aten.sum.dim_IntList, (("x", 0), ("c", (0,))), {}, 1)], [torch.empty(4096, 64)],
                         [((64,), (1,), torch.float32)], (0,))
    assert "Partials" not in src and "#pragma omp parallel for schedule(static)" in src, src


@pytest.mark.parametrize("n,threads,want", [(4096, 2, 2048), (1024, 2, 512), (3000, 2, 1504),
                                           (20000, 2, 2016), (10, 2, 32), (4096, 1, 2048),
                                           (256, 16, 32), (3000, 3, 1024)])
def test_column_blocks_give_every_thread_the_same_work(n, threads, want):
    """A column reduction's block of results: as few blocks as give each thread the same
    number (longer runs of each row read), each at most VBLOCK_MAX, a multiple of VBLOCK."""
    from accel.codegen.columns import VBLOCK, VBLOCK_MAX, vertical_block

    vb = vertical_block(n, threads)
    assert vb == want and vb % VBLOCK == 0 and VBLOCK <= vb <= VBLOCK_MAX
    blocks = -(-n // vb)
    assert blocks <= threads or blocks % threads == 0 or n < threads * VBLOCK


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_row_kernel_keeps_computed_values_between_its_loops(dtype):
    """A 16-bit softmax of ``x * 0.125``: its max loop keeps the rounded product in a row
    array and its sum loop reads it there (each 16-bit rounding costs gcc about 20 vector
    operations on the CPU); the sum loop keeps exp(v - max) for the output loop. A 16-bit
    layer norm of ``x + r`` keeps the rounded sum (not the float one, rounded again). In
    float16 the row's conversions are whole-row passes (F16C vectors, no call in a loop):
    the input rows widened before the first loop, the kept product computed by a loop of
    its own and rounded in place, the output narrowed after the last loop. The layer norm's
    last loop loads neither x nor r: the loads only its kept sum needed are not emitted."""
    ct = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    half = dtype == torch.float16
    x, r = torch.empty(64, 1024, dtype=dtype), torch.empty(64, 1024, dtype=dtype)
    meta = [((64, 1024), (1024, 1), dtype)] * 2
    calls = [(aten.mul.Tensor, (("x", 0), ("s", 0)), {}, 1),
             (aten._softmax.default, (("o", 0), ("c", -1), ("c", False)), {}, 1)]
    src = _kernel_source(calls, [x], meta, (1,), "f")
    head, *loops = src.split("#pragma omp simd")  # [the product,] max, sum of exp, output
    assert len(loops) == 3 + half
    if half:
        assert re.search(r"accel::f16_widen_row\(&b0\[1024 \* i0\], (w\d+), 1024\);", head)
        assert re.search(r"(c\d+)\[i\d+\] = t\d+;\n\s*}\n\s*accel::f16_round_row\(\1, 1024\);", loops[0])
        assert "f16_to_float" not in src and "float_to_f16(t" in loops[-1]  # (dead there)
        assert re.search(r"(o\d+)\[i\d+\] = t\d+;\n\s*}\n\s*accel::f16_narrow_row\(\1, &b1\[1024 \* i0\], 1024\);",
                         loops[-1])
        loops = loops[1:]
    else:
        assert re.search(r"c\d+\[i\d+\] = t\d+;", loops[0]) and f"accel::{ct}_to_float(t" in loops[0]
    assert re.search(r"const float t\d+ = c\d+\[i\d+\];", loops[1])  # the rounded product, read
    assert re.search(r"const float t\d+ = c\d+\[i\d+\];", loops[2])  # exp(v - max), read
    calls = [(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1),
             (aten.native_layer_norm.default, (("o", 0), ("c", [1024]), ("c", None), ("c", None), ("c", 1e-5)), {}, 3)]
    meta = [((64, 1024), (1024, 1), dtype)] * 2 + [((64, 1), (1, 1), dtype)] * 2
    src = _kernel_source(calls, [x, r], meta, (1,), ())
    last = src.split("#pragma omp simd")[-1]  # x - mean, x the kept rounded sum
    assert re.search(r"const float (t\d+) = c\d+\[i\d+\];\n\s*const float t\d+ = \(\1 - ", last), last
    assert "b0[" not in last and "b1[" not in last, last
    first = src.split("#pragma omp simd")[1]  # the sum, rounded and widened, is what is kept
    if half:  # the float sum, kept, then rounded in place
        assert re.search(r"const float (t\d+) = \(t\d+ \+ t\d+\);(.|\n)*(c\d+)\[i\d+\] = \1;\n\s*}\n"
                         r"\s*accel::f16_round_row\(\3, 1024\);", first), first
    else:
        rounded = r"accel::bf16_to_float\(t\d+\)"
        assert re.search(rf"const float (t\d+) = {rounded};(.|\n)*c\d+\[i\d+\] = \1;", first), first


def _loads(e) -> set:
    return {(x.args[0], x.args[1]) for x in walk(e, set()) if x.op == "load"}


def test_lowering_rejects_writes_each_read_by_the_other():
    """``x.add_(y.t())`` then ``y.add_(x)``: each input's new values read the other's old
    ones at other elements, so neither write can come before the other's reads, in one
    nest or apart (the region runs eagerly)."""
    x, y = torch.empty(8, 8), torch.empty(8, 8)
    calls = [(aten.t.default, (("x", 1),), {}, 1),
             (aten.add_.Tensor, (("x", 0), ("o", 0)), {}, 0),
             (aten.add_.Tensor, (("x", 1), ("x", 0)), {}, 0)]
    tr = trace_region(calls, [x, y], 1, (), [])
    exts = [BufferSpec(torch.float32, (8, 8), (8, 1), False)] * 2
    with pytest.raises(LoweringError, match="overlaps a read"):
        lower(tr.gm, exts, [], [])


def test_lowering_writes_inputs_apart_after_the_reductions_they_read():
    """``x.add_(y.sum(0))`` then ``y.mul_(x)``: y's column sums go to memory first, then
    each write runs in a nest of its own, reading its own input only at the element it
    writes: the second does not read the first's input, and the first reads the second's
    before it is written."""
    x, y = torch.empty(8), torch.empty(4, 8)
    calls = [(aten.sum.dim_IntList, (("x", 1), ("c", [0])), {}, 1),
             (aten.add_.Tensor, (("x", 0), ("o", 0)), {}, 0),
             (aten.mul_.Tensor, (("x", 1), ("x", 0)), {}, 0)]
    ir = _lowered(calls, [x, y], [((8,), (1,), torch.float32)], ())
    sums, *writes = ir.nests
    assert len(writes) == 2 and [s.buf for s in sums.stores] == [2], ir.describe()
    assert ir.buffers[2].scratch and len(reductions(sums)) == 1
    assert sorted(n.stores[0].buf for n in writes) == [0, 1]
    (first,), (second,) = writes[0].stores, writes[1].stores
    for st in (first, second):  # its own input at the element it writes, the sums
        assert {a for b, a in _loads(st.value) if b == st.buf} == {st.addr}
    assert not reductions(writes[0]) and not reductions(writes[1])
    assert first.buf not in {b for b, _ in _loads(second.value)}  # the first's new values: never read


def test_lowering_writes_an_input_in_the_nest_that_reduces_its_rows():
    """``s.div_(8)`` then ``softmax(s)``: the softmax reduces each row of the new values,
    which it computes from the old ones (``s / 8`` again), so the write shares its nest:
    each row's reductions read the row before the row's writes. One pass over ``s`` reads
    it, one writes ``s`` and the softmax; no scratch buffer."""
    s_ = torch.empty(16, 32)
    calls = [(aten.div_.Scalar, (("x", 0), ("s", 0)), {}, 0),
             (aten._softmax.default, (("x", 0), ("c", -1), ("c", False)), {}, 1)]
    ir = _lowered(calls, [s_], [((16, 32), (32, 1), torch.float32)], (0,), ["f"])
    assert len(ir.nests) == 1 and not any(b.scratch for b in ir.buffers), ir.describe()
    (nest,) = ir.nests
    write = next(st for st in nest.stores if st.buf == 0)
    assert {st.buf for st in nest.stores} == {0, 1} and _loads(write.value) == {(0, write.addr)}
    row = next(v for v, c in write.addr.terms if c == 32)
    for r in reductions(nest):  # the row's elements: the row's variable, a reduction one
        for b, a in _loads(r):
            assert b == 0 and a.coeff(row) == 32 and {c for _, c in a.terms} == {32, 1}


def test_lowering_writes_first_where_that_moves_fewer_bytes():
    """``h.add_(r)`` then ``relu(h).mean(0)``: the column means could run first, reading
    ``h`` and ``r`` (the old ``h`` plus ``r``), then the write (five passes over [64, 96]);
    with the write first, the means read the new ``h`` alone (four). The lowering keeps
    the one that moves fewer bytes."""
    from accel.lowering import _traffic

    h, r = torch.empty(64, 96), torch.empty(64, 96)
    calls = [(aten.add_.Tensor, (("x", 0), ("x", 1)), {}, 0),
             (aten.relu.default, (("x", 0),), {}, 1),
             (aten.mean.dim, (("o", 0), ("c", [0])), {}, 1)]
    ir = _lowered(calls, [h, r], [((64, 96), (96, 1), torch.float32), ((96,), (1,), torch.float32)], (1,))
    assert len(ir.nests) == 2, ir.describe()
    (st,), (means,) = ir.nests[0].stores, ir.nests[1].stores
    assert st.buf == 0 and {b for b, _ in _loads(st.value)} == {0, 1}
    assert means.buf == 2 and {b for b, _ in _loads(means.value)} == {0}
    assert _traffic(ir) == 4 * (3 * 64 * 96 + 64 * 96 + 96)


def test_lowering_writes_an_input_after_its_rows_sum_in_one_nest():
    """``x.div_(x.sum(-1, keepdim=True))`` (a mixture-of-experts router): one nest, whose
    row sums read the row before the row is written (two passes over ``x``, not three)."""
    x = torch.empty(16, 32)
    calls = [(aten.sum.dim_IntList, (("x", 0), ("c", [-1]), ("c", True)), {}, 1),
             (aten.div_.Tensor, (("x", 0), ("o", 0)), {}, 0)]
    ir = _lowered(calls, [x], [((16, 1), (1, 1), torch.float32)], ())
    assert len(ir.nests) == 1 and not any(b.scratch for b in ir.buffers), ir.describe()
    (st,) = ir.nests[0].stores
    assert st.buf == 0 and len(reductions(ir.nests[0])) == 1
    assert {b for b, _ in _loads(st.value)} == {0} and (0, st.addr) in _loads(st.value)


def test_lowering_moves_a_reduction_of_an_input_before_its_write():
    """``x.div_(x.sum(0, keepdim=True))``: the column sums go to memory in a nest of their
    own (one nest would walk each column down its rows), then the write reads ``x`` at the
    element it writes and the stored sums, along the rows."""
    x = torch.empty(16, 32)
    calls = [(aten.sum.dim_IntList, (("x", 0), ("c", [0]), ("c", True)), {}, 1),
             (aten.div_.Tensor, (("x", 0), ("o", 0)), {}, 0)]
    ir = _lowered(calls, [x], [((1, 32), (32, 1), torch.float32)], ())
    assert len(ir.nests) == 2, ir.describe()
    (sums,), (st,) = ir.nests[0].stores, ir.nests[1].stores
    assert ir.buffers[sums.buf].scratch and len(reductions(ir.nests[0])) == 1
    assert st.buf == 0 and not reductions(ir.nests[1])
    assert {b for b, _ in _loads(st.value)} == {0, sums.buf}
    assert (0, st.addr) in _loads(st.value) and len(_loads(st.value)) == 2
    assert st.addr.coeff(ir.nests[1].vars[-1]) == 1  # the rows' loop outside, the columns' inside


def test_lowering_keeps_a_shallower_reduction_of_a_written_input_out_of_its_nest():
    """``x.add_(z.sum(-1)).div_(x.sum(-1, keepdim=True))``: ``z``'s sums are a reduction at
    each element of ``x`` (the nest's deepest level), ``x``'s row sums one a row. A CUDA
    kernel computes the row sums again at each element, while other elements of the row
    may have been written: they go to memory before the write, in a nest of their own."""
    x, z = torch.empty(8, 16), torch.empty(8, 16, 4)
    calls = [(aten.sum.dim_IntList, (("x", 0), ("c", [-1]), ("c", True)), {}, 1),
             (aten.sum.dim_IntList, (("x", 1), ("c", [-1])), {}, 1),
             (aten.add.Tensor, (("x", 0), ("o", 1)), {}, 1),
             (aten.div.Tensor, (("o", 2), ("o", 0)), {}, 1),
             (aten.copy_.default, (("x", 0), ("o", 3)), {}, 0)]
    ir = _lowered(calls, [x, z], [((8, 1), (1, 1), torch.float32), ((8, 16), (16, 1), torch.float32),
                                  ((8, 16), (16, 1), torch.float32), ((8, 16), (16, 1), torch.float32)], ())
    writer = next(n for n in ir.nests if any(st.buf == 0 for st in n.stores))
    for r in reductions(writer):
        assert 0 not in {b for b, _ in _loads(r)}, ir.describe()


def test_lowering_stores_column_reductions_before_a_nest_along_the_rows():
    """``x / x.sum(0, keepdim=True)`` and a training batch norm of [N, C]: the column
    reductions (the sums; the mean and variance) run in a nest of their own, and the
    output's nest loops along the rows with the contiguous columns inside."""
    x = torch.empty(64, 32)
    for calls, meta, live in [
            ([(aten.sum.dim_IntList, (("x", 0), ("c", [0]), ("c", True)), {}, 1),
              (aten.div.Tensor, (("x", 0), ("o", 0)), {}, 1)],
             [((1, 32), (32, 1), torch.float32), ((64, 32), (32, 1), torch.float32)], (1,)),
            ([(aten.native_batch_norm.default, (("x", 0), ("c", None), ("c", None), ("c", None),
                                                 ("c", None), ("c", True), ("c", 0.1), ("c", 1e-5)), {}, 3)],
             [((64, 32), (32, 1), torch.float32), ((32,), (1,), torch.float32), ((32,), (1,), torch.float32)],
             (0,))]:
        ir = _lowered(calls, [x], meta, live)
        stats, *rest = ir.nests
        assert len(stats.vars) == 1 and reductions(stats), ir.describe()
        out = next(n for n in rest if len(n.vars) == 2)
        assert not reductions(out) and out.stores[0].addr.coeff(out.vars[-1]) == 1, ir.describe()


def test_lowering_writes_an_input_after_an_earlier_nest_reads_it():
    """``x.add_(1)`` then ``x.mean(0)``: the column means (their own nest) read the old
    values before the write's nest runs, with no scratch copy."""
    x = torch.empty(16, 32)
    calls = [(aten.add_.Scalar, (("x", 0), ("s", 0)), {}, 0),
             (aten.mean.dim, (("x", 0), ("c", [0])), {}, 1)]
    ir = _lowered(calls, [x], [((32,), (1,), torch.float32)], (0,), ["f"])
    assert len(ir.nests) == 2 and not any(b.scratch for b in ir.buffers), ir.describe()
    (st,) = ir.nests[1].stores
    assert st.buf == 0 and _loads(st.value) == {(0, st.addr)}


def test_lowering_allows_elementwise_inplace():
    x = torch.empty(4, 8)
    calls = [(aten.mul_.Tensor, (("x", 0), ("s", 0)), {}, 0),
             (aten.exp_.default, (("x", 0),), {}, 0)]
    tr = trace_region(calls, [x], 0, (), ["f"])
    ir = lower(tr.gm, [BufferSpec(torch.float32, (4, 8), (8, 1), False)], [], ["f"])
    assert len(ir.nests) == 1 and ir.nests[0].stores[0].buf == 0


def test_mean_and_variance_moved_to_memory_share_one_nest():
    """A layer norm whose output is summed in the same region (a training loss): its
    Welford statistics run in a nest before the sum's, and the mean and the variance, two
    outputs of one Welford reduction, are computed there together, not in a nest each."""
    x = torch.empty(32, 48)
    calls = [(aten.native_layer_norm.default, (("x", 0), ("c", (48,)), ("c", None), ("c", None),
                                                ("c", 1e-5)), {}, 3),
             (aten.sum.default, (("o", 0),), {}, 1)]
    meta = [((32, 48), (48, 1), torch.float32), ((32, 1), (1, 1), torch.float32),
            ((32, 1), (1, 1), torch.float32), ((), (), torch.float32)]
    ir = _lowered(calls, [x], meta, (1, 2, 3))
    assert len(ir.nests) == 3, ir.describe()
    stats = ir.nests[0]
    assert [ir.sizes[v] for v in stats.vars] == [32] and len(stats.stores) == 2
    welford = {(r.args[1], r.args[2]) for r in reductions(stats)}
    assert len(welford) == 1 and {r.args[3] for r in reductions(stats)} == {0, 1}


def test_sum_of_one_value_is_a_product():
    """A sum whose operand does not vary along the reduction (the gradient of
    ``loss.sum()``, an expanded scalar) lowers to value * count, with no loop."""
    x = torch.empty(()).expand(640, 48)
    ir = _lowered([(aten.sum.dim_IntList, (("x", 0), ("c", (0,))), {}, 1)], [x],
                  [((48,), (1,), torch.float32)], (0,))
    assert not reductions(ir.nests[0])
    ops = {e.op for st in ir.nests[0].stores for e in walk(st.value, set())}
    assert "mul" in ops and "const" in ops


def test_later_nest_reads_an_earlier_nests_output():
    """gi = dy * sigmoid(x) and its column sum (a bias gradient): two nests; the partitioner
    has the column sum read gi back from its output buffer instead of recomputing sigmoid."""
    x, dy = torch.empty(64, 48), torch.empty(64, 48)
    calls = [(aten.sigmoid.default, (("x", 0),), {}, 1),
             (aten.mul.Tensor, (("x", 1), ("o", 0)), {}, 1),
             (aten.sum.dim_IntList, (("o", 1), ("c", (0,))), {}, 1)]
    meta = [((64, 48), (48, 1), torch.float32)] * 2 + [((48,), (1,), torch.float32)]
    ir = _lowered(calls, [x, dy], meta, (1, 2))
    assert len(ir.nests) == 2
    second = {e.args[0] for st in ir.nests[1].stores for e in walk(st.value, set()) if e.op == "load"}
    assert second == {2}, "the column sum should load only the first nest's output (buffer 2)"
    assert not any(e.op == "exp" for st in ir.nests[1].stores for e in walk(st.value, set()))


@pytest.mark.parametrize("keepdim", [True, False])
def test_reductions_moved_to_memory_run_after_the_ones_they_read(keepdim):
    """A row variance of softmax values centered by their column mean, added back and
    reduced over the columns (a random program's): the variance conflicts with the column
    reductions and goes to memory, and the column mean it reads, in its own nest, goes
    first, after the softmax statistics that mean reads; then the region output of the
    variance joins no nest before those. One kernel, eager's values (without ``keepdim``
    the variance is viewed back as ``[4, 1]``: ``accel.ops.pending_view``)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 5), torch.randn(1, 5, dtype=torch.float64)

    def f():
        s = torch.softmax(x, -1)
        m = (s - s.mean(0, keepdim=True)) * w
        v = m.var(1, keepdim=True) if keepdim else m.var(1).view(4, 1)
        return s, v, (m + v).logsumexp(0, keepdim=True)

    accel.reset_stats()
    with accel.eager():
        got = f()
    st = accel.stats()
    assert (st["kernel_runs"], st["eager_replays"]) == (1, 0), st
    for g, r in zip(got, f()):
        torch.testing.assert_close(g, r)


def test_a_materialized_value_that_is_an_output_is_written_once():
    """A Linear's bias and residual adds saved as an output (the layer norm's input, for its
    backward) and read again by a later nest (the loss's sum of the layer norm, as in the
    MLP block's training step): the later nest loads the output buffer; no scratch buffer
    holds a second copy of it (one did, written beside the output in the same nest)."""
    x, r, b, w, bb = torch.empty(32, 48), torch.empty(32, 48), *(torch.empty(48) for _ in range(3))
    calls = [(aten.add.Tensor, (("x", 0), ("x", 2)), {}, 1),
             (aten.add.Tensor, (("x", 1), ("o", 0)), {}, 1),
             (aten.native_layer_norm.default, (("o", 1), ("c", (48,)), ("x", 3), ("x", 4),
                                                ("c", 1e-5)), {}, 3),
             (aten.sum.default, (("o", 2),), {}, 1)]
    meta = ([((32, 48), (48, 1), torch.float32)] * 3 + [((32, 1), (1, 1), torch.float32)] * 2
            + [((), (), torch.float32)])
    ir = _lowered(calls, [x, r, b, w, bb], meta, (1, 3, 4, 5))
    saved = 5  # the first output buffer: the residual sum
    assert not [i for i, b in enumerate(ir.buffers) if b.scratch and b.shape == (32, 48)], \
        [(i, b.shape, b.scratch) for i, b in enumerate(ir.buffers)]
    stored = [st.buf for nest in ir.nests for st in nest.stores]
    assert stored.count(saved) == 1
    loads = {e.args[0] for st in ir.nests[-1].stores for e in walk(st.value, set()) if e.op == "load"}
    assert saved in loads and not loads & {0, 1, 2}, ir.describe()  # the sum reads the saved output


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_region_with_more_buffers_than_the_core_keeps_on_its_stack(device):
    """70 inputs and their running sums: past the core's 64 stack slots the buffer
    addresses go to the heap; the kernel runs and matches eager."""
    import accel

    xs = [torch.randn(8, 8, device=device) * (i + 1) for i in range(70)]

    def fn():
        acc = xs[0]
        outs = []
        for t in xs[1:]:
            acc = acc + t
            outs.append(acc)
        return outs

    accel.reset_stats()
    with accel.eager():
        got = fn()
    torch.testing.assert_close(got, fn())
    assert accel.stats()["kernel_runs"] >= 1 and accel.stats()["eager_replays"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_exp_at_the_ends_of_its_range(device):
    """exp in a kernel (accel::exp on the CPU) where it overflows, underflows to subnormals
    and zero, and on inf, -inf and NaN: eager's results, zeros, infinities and NaNs
    exactly; subnormals within 1 ulp of eager's (no flush to zero). Both sides of the
    bounds where accel::exp selects 0 or inf, in the vector loop and its scalar tail."""
    import accel

    ends = [float("nan"), float("inf"), float("-inf"), 88.72283, 88.7229, 89.0, 1e30, -1e30,
            -87.3, -87.4, -95.0, -100.0, -103.9, -104.0, -200.0, 0.0, -0.0, 1.0, -1.0,
            99.9, 100.0, 100.1, -103.99, -104.01, 3.4e38, -3.4e38, 2.2e9, -2.2e9]
    x = torch.tensor(ends * 9, device=device)[:-1]  # not a whole number of vectors
    accel.reset_stats()
    with accel.eager():
        got = torch.exp(x * 1.0)
    want = torch.exp(x)
    assert accel.stats()["kernel_runs"] == 1
    torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=1.2e-7)
    assert torch.equal(got == 0, want == 0) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got.isnan(), want.isnan())
    tiny = (want > 0) & (want < torch.finfo(torch.float32).tiny)
    assert tiny.any() and ((got - want).abs()[tiny] <= 1.5e-45).all()  # one subnormal step


def test_gelu_erf_where_its_exp_is_clamped():
    """A float32 CPU GELU and its backward (erf by accel::vec_erf, whose exp(-x^2 / 2)
    clamps its argument at -87: include/accel/cpu_math.h, exp_erf) on both sides of that
    clamp (|x| about 13.19) and of exp's own ends, on infinities, NaN, zeros and
    subnormals, in the vector loop and its scalar tail: eager's results, saturated values
    and NaNs exactly. Eager's reference is ATen's kernel, whose scalar loop (glibc's erff and
    expf) a strided input takes (a contiguous float32 one runs oneDNN's, which gives NaN at
    +inf and inf from 2^127 on, and flushes tiny gradients to 0:
    test_chains.test_cpu_gelus_special_values_are_eagers_on_each_of_its_paths)."""
    import accel

    ends = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0,
            13.18, 13.19, 13.2, -13.18, -13.19, -13.2, 14.4, -14.4, 14.5, -14.5, 40.0,
            -40.0, 1e30, -1e30, 3.4e38, -3.4e38, 5.0, -5.0]
    x = torch.tensor(ends * 9)[:-1]  # not a whole number of vectors
    x = torch.stack([x, x], 1)[:, 0]  # strided: eager's ATen kernel
    g = torch.linspace(-2, 2, 2 * x.numel())[::2]
    accel.reset_stats()
    with accel.eager():
        got = torch.nn.functional.gelu(x)  # (x * 1.0 would be contiguous: oneDNN's)
        got_grad = torch.ops.aten.gelu_backward(g * 1.0, x)
    assert accel.stats()["kernel_runs"] == 1  # one region, both ops
    want, want_grad = torch.nn.functional.gelu(x), torch.ops.aten.gelu_backward(g, x)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(got_grad, want_grad, equal_nan=True)
    big = x.abs() >= 13.18
    for a, b in ((got, want), (got_grad, want_grad)):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[big & ~b.isnan()], b[big & ~b.isnan()])


def test_streaming_stores_only_for_large_memory_bound_stores(monkeypatch):
    """Where a nest's innermost loop stores at least STREAM_MIN_BYTES contiguously and
    computes only cheap ops, its stores go through a stack block to
    ``accel::stream_store`` and each thread fences; below the threshold, or with a
    transcendental op in the loop (compute-bound), or a store that is not contiguous along
    the innermost loop, they are plain stores. A nest in transposing tiles of 4-byte values
    (reading across the rows it writes) streams each whole row of a tile, the edge tiles'
    rows plainly; tiles of 8-byte values store plainly."""
    import accel.codegen.cpp as cpp

    x, b = torch.empty(64, 1000), torch.empty(1000)
    add = [(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)]
    meta = [((64, 1000), (1000, 1), torch.float32)]
    assert "stream_store" not in _kernel_source(add, [x, b], meta, (0,))  # 256 KB: below
    monkeypatch.setattr(cpp, "STREAM_MIN_BYTES", 1)
    src = _kernel_source(add, [x, b], meta, (0,))
    assert "accel::stream_store<64>(&b2[" in src and "stream_fence" in src
    assert "nt0[i" in src and "b2[1000 * i0 + i1] = " in src  # whole blocks; the rest plainly
    # the values before the output row's first whole cache line plainly, then the blocks
    assert "accel::line_head(&b2[1000 * i0 + i1]);" in src, src
    tanh = [(aten.tanh.default, (("x", 0),), {}, 1)]
    assert "stream_store" not in _kernel_source(tanh, [x], meta, (0,))
    t = [(aten.t.default, (("x", 0),), {}, 1), (aten.mul.Tensor, (("o", 0), ("c", 2.0)), {}, 1)]
    tmeta = [((1000, 64), (1, 1000), torch.float32), ((1000, 64), (64, 1), torch.float32)]
    src = _kernel_source(t, [x], tmeta, (1,))  # reads x down a stride, writes contiguously:
    assert "_b += 64" in src and "transpose_tile<64>" in src  # in tiles (_plan_tile)
    assert re.search(r"if \(i\d+_b_n == 64\) \{\n\s*alignas\(64\) float nt0\[64\];", src), src
    assert "accel::stream_store<64>(&b1[" in src and "#pragma omp for collapse(2) schedule(static) nowait" in src
    assert re.search(r"\n(\s*)accel::stream_fence\(\);\n\s*\}\n\1?\s*accel::stream_fence", src), src
    assert re.search(r"\} else \{\n\s*#pragma omp simd\n(.*\n){4}\s*b1\[64 \* i0 \+ i1\] = t\d+;", src), src  # edges plainly
    xd = x.double()
    src = _kernel_source(t, [xd], [(m[0], m[1], torch.float64) for m in tmeta], (1,))
    assert "stream_store" not in src and "_b += 8" in src  # tiles of 8 rows, plain stores
    monkeypatch.setattr(cpp, "STREAM_MIN_BYTES", 1 << 40)
    assert "stream_store" not in _kernel_source(add, [x, b], meta, (0,))


def test_floating_floor_division_is_one_op_with_vector_variants():
    """Floor division of float32 and float64 CPU tensors (``div`` with ``rounding_mode="floor"``,
    ``floor_divide``) lowers to one ``accel::div_floor`` (accel.library.div_floor: one
    division where the quotient is small, c10's formula elsewhere), whose vector variants the
    kernel includes; torch's decomposition took an fmod and two divisions."""
    for dt in (torch.float32, torch.float64):
        x = torch.empty(64, 1000, dtype=dt)
        for call in [(aten.div.Tensor_mode, (("x", 0), ("x", 1)), {"rounding_mode": ("c", "floor")}, 1),
                     (aten.floor_divide.default, (("x", 0), ("x", 1)), {}, 1)]:
            src = _kernel_source([call], [x, x], [((64, 1000), (1000, 1), dt)], (0,))
            assert '#include "accel/vector_fmod_variants.h"' in src, src
            assert src.count("accel::div_floor(") == 1 and "accel::fmod(" not in src and " / " not in src, src


def test_last_level_cache_size_is_read_and_keyed():
    """The last-level cache size (sysfs, or 32 MiB where Linux lists none) is positive, a
    whole number of KiB, and part of the CPU store key."""
    from accel.build import cpu_isa
    from accel.codegen import llc_bytes

    n = llc_bytes()
    assert n > 0 and n % 1024 == 0
    assert cpu_isa().endswith(f":{n >> 10}KiB")


def test_streaming_threshold_is_three_quarters_of_the_cache_up_to_32_mib(monkeypatch):
    """Outputs over three quarters of the last-level cache are streamed; a cache listed
    larger than 32 MiB (a VM listing its host's) counts as 32 MiB."""
    import accel.codegen.cpp as cpp

    for listed, threshold in ((16 << 20, 12 << 20), (32 << 20, 24 << 20), (480 << 20, 24 << 20)):
        monkeypatch.setattr(cpp, "llc_bytes", lambda: listed)
        assert cpp.stream_min_bytes() == threshold
    monkeypatch.setattr(cpp, "STREAM_MIN_BYTES", 1)
    assert cpp.stream_min_bytes() == 1


def test_streamed_outputs_match_eager(fresh_store, monkeypatch):
    """Streamed stores with every size the kernel meets: rows whose length is not a
    multiple of the block (the plain tail), rows not aligned to a vector (the general
    path's plain head), a one-loop nest in parallel chunks, float64, int32 and bool
    outputs, a row reduction with its epilogue, two outputs of one loop, rows of 1023 values
    (each starting 4 bytes past the last's line offset: the plain values before its first
    whole line) beside a bool output. Results as eager's, integers and booleans exactly."""
    import accel
    import accel.codegen.cpp as cpp

    monkeypatch.setattr(cpp, "STREAM_MIN_BYTES", 1)
    g = torch.Generator().manual_seed(0)
    cases = [
        lambda: (lambda x, b: x * 2.0 + b, (torch.randn(37, 1000, generator=g), torch.randn(1000, generator=g))),
        lambda: (lambda x, b: x - b, (torch.randn(9, 1001, dtype=torch.float64, generator=g),
                                      torch.randn(1001, dtype=torch.float64, generator=g))),
        lambda: (lambda x: x * 3.0 + 1.0, (torch.randn(3 * 4096 * 9 + 37, generator=g),)),
        lambda: (lambda x: (x * 3 + 7) // 2, (torch.randint(-1000, 1000, (17, 333), dtype=torch.int32, generator=g),)),
        lambda: (lambda x, y: (x > y) | (x < 0), (torch.randn(11, 777, generator=g), torch.randn(11, 777, generator=g))),
        lambda: (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                 (torch.randn(130, 515, generator=g), torch.randn(515, generator=g))),
        lambda: (lambda x: (x + 1.0, x * x), (torch.randn(65, 129, generator=g),)),
        # rows starting at every 4-byte offset in a cache line (the slices bench's diff),
        # and a bool output beside them whose blocks' lines are partial (accel::copy_small
        # of 1 to 63 bytes)
        lambda: (lambda x: (x[:, 1:] - x[:, :-1], x[:, 1:] > 0), (torch.randn(67, 1024, generator=g),)),
    ]
    for make in cases:
        fn, args = make()
        accel.reset_stats()
        with accel.eager():
            got = fn(*args)
        assert accel.stats()["kernel_runs"] >= 1 and accel.stats()["eager_replays"] == 0
        want = fn(*args)
        if isinstance(want, tuple):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=0, rtol=0) if not a.is_floating_point() \
                    else torch.testing.assert_close(a, b)
        elif want.is_floating_point():
            torch.testing.assert_close(got, want)
        else:
            assert got.dtype == want.dtype and torch.equal(got, want)
    store = accel.runtime.get_store()
    sources = [store.inspect(e["key"]).get("source", "") for e in store.entries() if not e["negative"]]
    assert sum("accel::stream_store" in s for s in sources) == len(cases)


@pytest.mark.suite
def test_random_chains_with_every_eligible_store_streamed(tmp_path):
    """The random chains (pointwise, reductions, views, in-place writes; at other row
    counts, in 16 bits) with every store the CPU codegen may stream streamed, whatever its
    size (tests/stream_everything.py), in a store of their own (the kernels differ from the
    same regions' unstreamed ones), which gets this process's dispatch filter first. Their
    backward variants (about 60 s of this serial run) are left out: a streamed store is
    planned per nest, from its innermost loop alone, and the forward chains (reductions
    over either dim, row kernels, in-place writes, views) lower to the kinds of nest the
    backward ones do."""
    seed_dispatch_filter(tmp_path / "store")
    run_under("stream_everything", ["test_chains.py"], "-k", "not cuda and not backward",
              ACCEL_CACHE_DIR=str(tmp_path / "store"))


@pytest.mark.parametrize("name,fn", [
    ("selu", lambda x, a: torch.nn.functional.selu(x)),
    ("elu", lambda x, a: torch.nn.functional.elu(x, alpha=a)),
    ("logit", lambda x, a: torch.logit(torch.sigmoid(x), eps=a / 100)),
])
def test_scalars_folded_by_decompositions_are_keyed_by_value(name, fn):
    """elu's alpha/scale/input_scale (selu's constants) and logit's eps are folded into
    other constants by their decompositions, so they are keyed by value: the regions run
    as kernels (they used to fail to trace and run eagerly), and a new value compiles a
    new kernel that is right for it."""
    import accel

    x = torch.randn(64, requires_grad=True)
    for a in (0.7, 1.3):
        expected = fn(x, a)
        (gx,) = torch.autograd.grad(expected.sum(), x)
        accel.reset_stats()
        with accel.eager():
            actual = fn(x, a)
            (ga,) = torch.autograd.grad(actual.sum(), x)
        st = accel.stats()
        assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= 1, st
        torch.testing.assert_close((actual, ga), (expected, gx))


@pytest.mark.parametrize("name, fn", [
    ("kl_div batchmean", lambda a, b, s: F.kl_div(a.log_softmax(1), b.softmax(1), reduction="batchmean") * s),
    ("xlogy", lambda a, b, s: torch.xlogy(b.sigmoid(), a.sigmoid() * s).sum()),
])
def test_a_nan_constant_beside_a_runtime_scalar_traces(name, fn):
    """A decomposition's NaN constant (xlogy's ``where(isnan(y), nan, ...)``, kl_div's)
    in a region with a runtime scalar: the two traces that prove the scalar's uses compared
    the constant with itself, and NaN != NaN failed them ("scalar value changes the traced
    graph"), so the region ran eagerly. It runs as a kernel, right for each value."""
    a = torch.randn(16, 8, requires_grad=True)
    b = torch.randn(16, 8)
    for s in (0.5, 3.0):
        expected = fn(a, b, s)
        (ge,) = torch.autograd.grad(expected, a)
        accel.reset_stats()
        with accel.eager():
            actual = fn(a, b, s)
            (ga,) = torch.autograd.grad(actual, a)
        st = accel.stats()
        assert st["compile_failures"] == 0 and st["eager_replays"] == 0 and st["kernel_runs"] >= 1, st
        torch.testing.assert_close((actual, ga), (expected, ge))


def test_noop_removal_drops_a_functional_copy_of_the_same_shape_and_dtype():
    """``copy(dst, src)`` (functionalization's ``dst.copy_(src)``) is ``src``'s values when
    ``src`` has ``dst``'s shape and dtype: the node goes; one that converts stays."""
    x, y, h = torch.empty(4, 8), torch.empty(4, 8), torch.empty(4, 8, dtype=torch.float64)
    calls = [(aten.sin.default, (("x", 1),), {}, 1), (aten.copy_.default, (("x", 0), ("o", 0)), {}, 0),
             (aten.copy_.default, (("x", 2), ("o", 0)), {}, 0)]
    gm = trace_region(calls, [x, y, h], 1, (), []).gm
    copies = [n for n in gm.graph.nodes if n.target is aten.copy.default]
    assert len(copies) == 2, gm.graph
    assert remove_noops(gm) == 1
    (kept,) = [n for n in gm.graph.nodes if n.target is aten.copy.default]
    assert kept.meta["val"].dtype == torch.float64
    mutations = [n.args[1] for n in gm.graph.nodes if n.target is aten.copy_.default]
    assert mutations[0].target is prims.sin.default and mutations[1] is kept


def test_identity_removal_drops_products_with_and_quotients_by_1(monkeypatch):
    """``x * 1``, ``1 * x``, ``x / 1`` (a number or a ``full`` of it: ``smooth_l1_loss``'s
    default ``/ beta``; over ``FOLD_MAX_NUMEL`` elements a 0-dim ``full`` broadcast) of the
    result's shape and dtype are ``x``: the nodes go. ``x * 2`` and ``1 / x`` stay; an int
    tensor over 1 keeps its conversion to float. The region still matches eager, bit for
    bit, at float32 and float16 (a float16 product's rounding is the identity too)."""
    for dtype in (torch.float32, torch.float16):
        x, i = torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=torch.int64)
        calls = [(aten.mul.Tensor, (("x", 0), ("c", 1)), {}, 1), (aten.mul.Tensor, (("c", 1.0), ("o", 0)), {}, 1),
                 (aten.div.Tensor, (("o", 1), ("c", 1.0)), {}, 1), (aten.smooth_l1_loss.default,
                 (("o", 2), ("x", 0), ("c", 1), ("c", 1.0)), {}, 1), (aten.mul.Tensor, (("o", 3), ("c", 2)), {}, 1),
                 (aten.reciprocal.default, (("o", 4),), {}, 1), (aten.div.Tensor, (("x", 1), ("c", 1)), {}, 1)]
        gm = trace_region(calls, [x, i], 7, (5, 6), []).gm
        muldiv = lambda: [n for n in gm.graph.nodes
                          if n.target in (prims.mul.default, prims.div.default, torch.ops.accel.div_rn.default)]
        ones = lambda: [n for n in muldiv() if any(
            a == 1 or (isinstance(a, torch.fx.Node) and a.target is prims.full.default and a.args[1] == 1)
            for a in n.args)]
        constant_folding(gm)  # (smooth_l1's beta: a full_like, broadcast, becomes a full)
        assert len(ones()) == 5, gm.graph  # x * 1, 1 * x, x / 1, smooth_l1's / beta, i / 1
        assert remove_identities(gm) == 5
        assert ones() == [], gm.graph
        assert any(n.args[1] == 2 for n in muldiv()), gm.graph
        targets = {n.target for n in gm.graph.nodes}
        assert prims.reciprocal.default in targets and prims.convert_element_type.default in targets

        monkeypatch.setattr(accel.passes, "FOLD_MAX_NUMEL", 16)  # beta's [4, 8] ones stay a broadcast
        gm = trace_region([(aten.smooth_l1_loss.default, (("x", 0), ("x", 0), ("c", 0), ("c", 1.0)), {}, 1)],
                          [x], 1, (0,), []).gm
        constant_folding(gm)
        quotients = lambda: [n for n in gm.graph.nodes if n.target in (prims.div.default, torch.ops.accel.div_rn.default)]
        (beta,) = [n.args[1] for n in quotients()]  # float32's: the number
        assert dtype == torch.float32 or (beta.target is prims.broadcast_in_dim.default
                                          and beta.args[0].target is prims.full.default)
        assert remove_identities(gm) == 1 and quotients() == []
        monkeypatch.undo()

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(64, 256, generator=g) * 3).to(dtype)
        fn = lambda t: (1 * (F.smooth_l1_loss(t * 1, t.flip(0), reduction="none") / 1)) * 2
        expected = fn(x)
        accel.reset_stats()
        with accel.eager():
            actual = fn(x)
        st = accel.stats()
        assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0, st
        assert torch.equal(actual, expected)


def test_a_non_blocking_copy_runs_in_a_kernel():
    """``dst.copy_(src, True)`` (non_blocking, positional, as DistributedDataParallel's
    buffer copies pass it) compiles like ``copy_``: its region used to fail in the no-op
    pass, which unpacked the copy's arguments as two."""
    import accel

    src = torch.randn(9, dtype=torch.float64)
    want = torch.zeros(9)
    want.copy_(src * 2, True)
    got = torch.zeros(9)
    accel.reset_stats()
    with accel.eager():
        got.copy_(src * 2, True)
    st = accel.stats()
    assert st["compile_failures"] == 0 and st["kernel_runs"] == 1, st
    torch.testing.assert_close(got, want)


def test_transposed_softmax_takes_column_statistics_and_a_tiled_output():
    """A softmax over the rows of a transposed tensor (``x.t().softmax(-1)``, x [512, 96]):
    its statistics read down x's columns (a stride of 96 a step), so they go to a nest of
    their own, where they accumulate vectors of neighbouring columns (the column form:
    unit-stride loads) instead of one row kernel reading element by element; the output's
    nest then writes its rows contiguously and reads x across them, in tiles of 64 x 64
    transposed into a stack array (C++)."""
    x = torch.empty(512, 96)
    calls = [(aten._softmax.default, (("x", 0), ("c", -1), ("c", False)), {}, 1)]
    ir = _lowered(calls, [x.t()], [((96, 512), (512, 1), torch.float32)], (0,))
    stats, out = ir.nests
    for r in reductions(stats):
        loads = [e for b in r.args[1] for e in walk(b, set()) if e.op == "load"]
        assert all(e.args[1].coeff(stats.vars[-1]) == 1 for e in loads), ir.describe()
    assert not reductions(out), ir.describe()
    src = CppRenderer().render(ir, "accel_region_golden")
    stats_src = src[:src.index("  }\n  {")]
    assert re.search(r"float a\d+_0\[\d+\];", stats_src), stats_src  # vectors of columns
    assert re.search(r"for \(int64_t (i\d+)_b = 0; \1_b < 96; \1_b \+= 64\)", src), src
    assert "accel::transpose_tile<64>" in src, src


def test_transposing_pointwise_nest_runs_in_tiles():
    """``x.t() + y`` with y contiguous: the output walks y's rows, x is read across them
    (a stride of 40 floats a step). float32: the C++ nest takes tiles of 64 x 64, x's tile
    transposed into a stack array (``accel::transpose_tile``: 8 x 8 blocks through AVX
    registers), then each output row of the tile a vectorized loop reading it
    contiguously. float64: tiles of 8 output rows, a run of x's 8 contiguous values at
    each output column, the tile's values of the outer loop computed once into arrays.
    ``x.t() * 2`` keeps x's layout (nothing to tile)."""
    x, y = torch.empty(40, 70), torch.empty(70, 40)
    src = _kernel_source([(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)], [x.t(), y],
                         [((70, 40), (40, 1), torch.float32)], (0,))
    assert re.search(r"for \(int64_t (i\d+)_b = 0; \1_b < 70; \1_b \+= 64\)", src), src
    assert re.search(r"alignas\(32\) float (i\d+_b_0)\[4096\];\n.*accel::transpose_tile<64>\(&b0\[.*\], 70, \1, ", src), src
    assert re.search(r"#pragma omp simd\n.*\n.*\n\s*const float t\d+ = i\d+_b_0\[i\d+_b_k \* 64 \+ i\d+_b_k\];", src), src
    x, y = x.double(), y.double()
    src = _kernel_source([(aten.add.Tensor, (("x", 0), ("x", 1)), {}, 1)], [x.t(), y],
                         [((70, 40), (40, 1), torch.float64)], (0,))
    assert re.search(r"for \(int64_t (i\d+)_b = 0; \1_b < 70; \1_b \+= 8\)", src), src
    src = _kernel_source([(aten.mul.Tensor, (("x", 0), ("c", 2.0)), {}, 1)], [x.t()],
                         [((70, 40), (1, 70), torch.float64)], (0,))
    assert "_b += 8" not in src and "transpose_tile" not in src, src


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("shape", [(8, 32, 512), (8, 32, 16, 32), (8, 32)], ids=str)
def test_group_norm_without_affine_runs_as_a_kernel(shape, device):
    """A GroupNorm without weight and bias: the variance plus ``eps`` (a runtime scalar) is
    elementwise on a collapsed view, which ``sink_collapse_views`` splits back; the
    scalar's placeholder has no tensor value (it once raised KeyError there, and the
    region ran eagerly). Runs as a kernel and matches eager, with a scalar after it too."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(device)
    fn = lambda t: F.group_norm(t, 4) * 1.5
    accel.reset_stats()
    with accel.eager():
        actual = fn(x)
    st = accel.stats()
    torch.testing.assert_close(actual, fn(x))
    assert st["kernel_runs"] >= 1 and st["eager_replays"] == 0 and st["compile_failures"] == 0, st


#: regions whose CPU loops gcc 12 once left scalar: selects it could not if-convert after
#: its PRE and sinking passes (clamps; float16 selects beside a rounding or a log), a
#: bool row maximum or minimum in a ``||`` / ``&&`` reduction clause, and ``round``
#: (``__builtin_roundevenf``, which it does not vectorize; now ``rintf``)
SELECT_PROGRAMS = {
    "clamp": lambda x, h: (x * 2).clamp(-1, 1),
    "hardtanh": lambda x, h: F.hardtanh(x * 3),
    "f16_where": lambda x, h: torch.where(h > 0, h, h * 2),
    "f16_logit": lambda x, h: torch.logit(h.sigmoid(), 1e-6),
    "f16_smooth_l1": lambda x, h: F.smooth_l1_loss(h, h * 0.5, reduction="none"),
    "bool_row_max": lambda x, h: (x > 1).amax(1),
    "bool_row_min": lambda x, h: (x > -1).amin(1),
    "round": lambda x, h: torch.round(x * 3.5),  # (halfway cases: 0.5 * k / 3.5 ...)
    "round_decimals": lambda x, h: torch.round(x * 3, decimals=2),
    "f16_round": lambda x, h: torch.round(h * 3.5) - h,
}


@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="checks for 256- or 512-bit instructions (AVX2 or AVX-512)")
@pytest.mark.parametrize("name", SELECT_PROGRAMS)
def test_cpu_loops_gcc_left_scalar_vectorize(name, fresh_store):
    """Each program runs as one CPU kernel matching eager (bools bit for bit), and the
    kernel's ``omp simd`` loop compiles, with accel's own flags, to 256- or 512-bit
    instructions (bench/vector_audit.py's check, from the assembly). Before ``-fno-tree-pre
    -fno-tree-sink`` (``accel.build.CXXFLAGS``), the bool maximum's ``int`` accumulator
    (``accel.codegen.cpp_groups``) and ``accel::round`` as ``rintf`` (include/accel/
    cpu_math.h) each of these loops was scalar: 65 ms against eager's 3 for ``(x *
    2).clamp(-1, 1)`` of float16 [8192, 1024]."""
    import sys
    import tempfile

    from accel.store import Store

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from vector_audit import long_simd_loop, sources, wide_instructions

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    x[3], x[5, ::7] = float("nan"), 3.0  # a NaN row (clamps keep it), bools of both kinds
    h = x.half()
    fn = SELECT_PROGRAMS[name]
    accel.reset_stats()
    with accel.eager():
        actual = fn(x, h)
    st = accel.stats()
    expected = fn(x, h)
    torch.testing.assert_close(actual, expected, equal_nan=True)  # (bools: exactly)
    assert st["kernel_runs"] == 1 and st["eager_replays"] == 0, st
    srcs = [s for s in sources(Store()) if long_simd_loop(s)]
    assert len(srcs) == 1, srcs
    with tempfile.TemporaryDirectory() as tmp:
        assert wide_instructions(srcs[0], tmp) > 0, srcs[0]


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_group_norm_input_and_output_share_one_nest(fresh_store, monkeypatch, channels_last):
    """A group norm's input (``x * 2``, which autograd saves), its output (stored as
    ``[N, G, C/G, H * W]``: ``lowering._peel_views``) and the SiLU of it, all held: stored
    by one nest with the statistics, its loops those of ``[N, G, C/G, H, W]``, which both
    shapes refine (``lowering._common_loops``; else ``x * 2`` took a nest of its own, one
    more pass over the input). Channels-last: the values match eager's (the nests as they
    fit)."""
    import accel.lowering as lowering

    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    irs, lower_ = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower_(*a)) or irs[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 12, 10, generator=g)  # (shapes no other test lowers)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)

    def program(x):
        h = x * 2
        y = F.group_norm(h, 4, w, b)
        return h, y, F.silu(y)

    with accel.eager():
        got = program(x)
    for a, e in zip(got, program(x)):
        torch.testing.assert_close(a, e)
    assert len(irs) == 1, accel.stats()
    if not channels_last:
        assert len(irs[0].nests) == 1, irs[0].nests


def test_batch_norm_backward_runs_its_channel_sums_once(fresh_store, monkeypatch):
    """A training batch norm's backward (``native_batch_norm_backward``): the gradients of
    the weight and bias (``[C]``) take the same per-channel sums as the input's gradient
    (``[N, C, H, W]``) but cannot share its nest, so they go first and the input's
    gradient reads the sums from memory: each sum runs once, the second nest reduces
    nothing (``lowering._statistics_apart``; placed after, the input's nest ran the sums
    and the weight's nest ran them again, one more pass over the input and its gradient).
    Values as eager's."""
    import accel.lowering as lowering
    from accel.loop_ir import walk

    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    monkeypatch.setenv("ACCEL_REMAT", "off")
    irs, lower_ = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower_(*a)) or irs[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 11, 9, generator=g)  # (shapes no other test lowers)
    norm = torch.nn.BatchNorm2d(8)

    def step(x):
        x = x.detach().requires_grad_()
        y = F.silu(norm(x * 2))
        return torch.autograd.grad((y * y).sum(), [x, norm.weight, norm.bias])

    with accel.eager():
        got = step(x)
    for a, e in zip(got, step(x)):
        torch.testing.assert_close(a, e)
    backward = irs[-1]
    sums = []
    for nest in backward.nests:
        seen = set()  # (each expression once a nest)
        sums.append([e for st in nest.stores for e in walk(st.value, seen) if e.op == "reduce"])
    assert len(backward.nests) == 2 and len(sums[0]) == 2 and not sums[1], sums


def _total_calls(shape):
    """``y = sigmoid(x)``, ``(y * y).sum()``: a region returning an elementwise value and a
    total reduction of the same elements (out_meta, calls)."""
    stride = torch.empty(shape).stride()
    calls = [(aten.sigmoid.default, (("x", 0),), {}, 1),
             (aten.mul.Tensor, (("o", 0), ("o", 0)), {}, 1),
             (aten.sum.default, (("o", 1),), {}, 1)]
    meta = [(shape, stride, torch.float32), (shape, stride, torch.float32), ((), (), torch.float32)]
    return calls, meta


def _reads_input(nest) -> bool:
    return any(e.op == "load" and e.args[0] == 0 for st in nest.stores for e in walk(st.value, set()))


def test_a_total_is_reduced_row_by_row_in_its_output_nest():
    """A total reduction (``(y * y).sum()``) of a value as big as the region's output is
    split (``lowering._split_totals``): the output's nest also stores each row's sum (rows
    of 600 here, 256 of them) to scratch, and a last nest sums those, reading no input;
    whole, the total's nest read the input again and computed ``y`` again (or read ``y``
    back). A GPU's lowering keeps it whole (unmeasured there)."""
    x = torch.randn(16, 16, 600)
    calls, meta = _total_calls((16, 16, 600))
    ir = _lowered(calls, [x], meta, (0, 2))
    assert len(ir.nests) == 2, ir.describe()
    big, last = ir.nests
    assert ir.sizes and [ir.sizes[v] for v in big.vars][-1] == 600
    rows = [st for st in big.stores if ir.buffers[st.buf].scratch]
    assert len(rows) == 1 and ir.buffers[rows[0].buf].dtype == torch.float64
    assert ir.buffers[rows[0].buf].shape == (16, 16, 1), ir.buffers[rows[0].buf]
    assert len(reductions(big)) == 1 and not _reads_input(last), ir.describe()
    whole = _lowered(calls, [x], meta, (0, 2), device="cuda")
    spans = [math.prod(whole.sizes[v] for v in r.args[2]) for n in whole.nests for r in reductions(n)]
    assert not any(b.scratch for b in whole.buffers) and spans == [16 * 16 * 600], whole.describe()
    calls, meta = _total_calls((8, 16, 600))  # 128 rows: too few, left whole
    assert not any(b.scratch for b in _lowered(calls, [torch.randn(8, 16, 600)], meta, (0, 2)).buffers)


@pytest.mark.parametrize("case", ["sum", "amax", "int_sum", "mean_of_view"])
def test_split_totals_match_eager(case, fresh_store, monkeypatch):
    """Totals split into rows (sums in float64 or int64 as whole, maxima exact) give
    eager's values: a float sum and a maximum beside the value they reduce, an int32 sum
    (int64, bit-exact), and a mean of the value seen through a view of other dims
    ([64, 8, 520] from [512, 520]). Each region runs as one kernel, its total split."""
    import accel.lowering as lowering

    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    irs, lower_ = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower_(*a)) or irs[-1])
    g = torch.Generator().manual_seed(0)
    if case == "int_sum":
        x = torch.randint(-1000, 1000, (32, 16, 520), generator=g, dtype=torch.int32)
        fn = lambda t: (t * 3, (t * 3).sum())  # noqa: E731
    else:
        x = torch.randn(32, 16, 520, generator=g)
        fn = {"sum": lambda t: (torch.tanh(t), (torch.tanh(t) * 2).sum()),
              "amax": lambda t: (torch.exp(t), torch.exp(t).amax()),
              "mean_of_view": lambda t: (t.reshape(512, 520) + 1, (t.reshape(64, 8, 520) + 1).mean())}[case]
    runs = accel.stats()["kernel_runs"]
    with torch.no_grad():
        expected = fn(x)
        with accel.eager():
            got = fn(x)
    for a, e in zip(got, expected):
        if e.dtype.is_floating_point:
            torch.testing.assert_close(a, e)
        else:
            assert torch.equal(a, e)
    assert accel.stats()["kernel_runs"] == runs + 1 and len(irs) == 1
    assert [b.shape for b in irs[0].buffers if b.scratch] == [(64, 8, 1) if case == "mean_of_view" else (32, 16, 1)]


def test_a_split_total_that_does_not_lower_is_lowered_whole(monkeypatch):
    """Where the region with its totals split raises LoweringError (any reason), it is
    lowered again with the totals whole, and the graph keeps no node of the split."""
    import accel.lowering as lowering

    x = torch.randn(16, 16, 600)
    calls, meta = _total_calls((16, 16, 600))
    real, seen = lowering._lower_writes, []

    def once(gm, *a):
        seen.append(any(n.meta.get("accel_partial") for n in gm.graph.nodes))
        if len(seen) == 1:
            raise LoweringError("a test's")
        return real(gm, *a)

    monkeypatch.setattr(lowering, "_lower_writes", once)
    tr = trace_region(calls, [x], len(meta), (0, 2), [])
    run_passes(tr.gm)
    before = _targets(tr.gm)
    ir = lower(tr.gm, [BufferSpec(torch.float32, (16, 16, 600), x.stride(), False)],
               [BufferSpec(m[2], m[0], m[1], True) for m in (meta[0], meta[2])], [])
    assert seen == [True, False]
    assert not any(b.scratch for b in ir.buffers) and _targets(tr.gm) == before


def test_batch_norm_forward_runs_its_statistics_once(fresh_store, monkeypatch):
    """A training batch norm's forward writes its running statistics in place, in a nest
    of their own shape ([C]) after the output's: the statistics it shares with the output
    go to memory first (``_statistics_apart``'s ``early``), so the update reduces nothing
    (in the output's nest, the update's nest ran them again: one more pass over the
    input). Running statistics and outputs as eager's."""
    import accel.lowering as lowering

    monkeypatch.setenv("ACCEL_EAGER_SMALL_REGIONS", "0")
    irs, lower_ = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a: irs.append(lower_(*a)) or irs[-1])
    x = torch.randn(4, 6, 10, 7, generator=torch.Generator().manual_seed(0))  # (shapes no other test lowers)
    norms = [torch.nn.BatchNorm2d(6), torch.nn.BatchNorm2d(6)]
    with torch.no_grad():
        expected = torch.relu(norms[0](x * 2))
        with accel.eager():
            got = torch.relu(norms[1](x * 2))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(norms[1].running_mean, norms[0].running_mean)
    torch.testing.assert_close(norms[1].running_var, norms[0].running_var)
    ir = irs[-1]
    counts = [len(reductions(n)) for n in ir.nests]
    assert counts[0] == 2 and sum(counts) == 2, ir.describe()
