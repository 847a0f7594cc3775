"""accel.partition: materialize-or-recompute between kernel groups, by a min vertex cut.

Each case has a known best plan; the bytes are spelled out in comments (float32, so an
[64, 128] tensor is B = 32768 bytes, a [64] row result 256, a [128] column result 512).
Two-group cases are also checked against a brute force over every materialized set.
"""
import itertools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from accel.graph import trace_region
from accel.partition import (PartitionError, choose_materialized, describe,
                             memory_traffic, node_bytes)
from accel.passes import run_passes

aten = torch.ops.aten
prims = torch.ops.prims
N, M = 64, 128
B = N * M * 4  # bytes of one float32 [64, 128]


def _region(calls, inputs, n_out, live):
    gm = trace_region(calls, inputs, n_out, live, []).gm
    run_passes(gm)  # partition sees the graph after passes, as the pipeline runs it
    return gm


def _outputs(gm):
    rets = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(rets) if isinstance(rets, (tuple, list)) else [rets]


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def _plan(gm, groups, **kw):
    chosen = choose_materialized(gm, groups, **kw)
    return chosen, memory_traffic(gm, groups, chosen), describe(gm, groups, chosen)


def _brute_force(gm, groups):
    """Least traffic over every set of nodes group 0 computes (two groups: exact)."""
    cands = [n for n in gm.graph.nodes if n.op == "call_function" and node_bytes(n)
             and n not in groups[0]]
    assert len(cands) <= 14, "graph too big to enumerate"
    return min(memory_traffic(gm, groups, s) for r in range(len(cands) + 1)
               for s in itertools.combinations(cands, r))


def _sum(src, dim, keepdim=False):
    return (aten.sum.dim_IntList, (src, ("c", (dim,)), ("c", keepdim)), {}, 1)


def test_softmax_one_group_materializes_nothing():
    x = torch.empty(N, M)
    gm = _region([(aten._softmax.default, (("x", 0), ("c", 1), ("c", False)), {}, 1)], [x], 1, (0,))
    chosen, traffic, plan = _plan(gm, [_outputs(gm)])
    assert chosen == set(), plan
    assert traffic == B + B, plan  # read x, write the result; amax, exp, sum stay in registers


def test_layer_norm_gelu_one_group_materializes_nothing():
    def f(x, w, b):
        return aten.gelu.default(aten.native_layer_norm.default(x, [M], w, b, 1e-5)[0])

    ex = (torch.empty(N, M), torch.empty(M), torch.empty(M))
    gm = make_fx(f, decomposition_table=torch._decomp.decomposition_table,
                 tracing_mode="fake")(*ex)
    run_passes(gm)
    var_mean = torch.ops.accel.var_mean.default  # the patterns pass: one Welford reduction
    assert _nodes(gm, var_mean) and _nodes(gm, prims.erf.default), gm.graph
    chosen, traffic, plan = _plan(gm, [_outputs(gm)])
    assert chosen == set(), plan
    assert traffic == B + 512 + 512 + B, plan  # x, weight, bias in; the result out


def test_exp_under_two_reductions_is_recomputed():
    x = torch.empty(N, M)
    gm = _region([(aten.exp.default, (("x", 0),), {}, 1), _sum(("o", 0), 1), _sum(("o", 0), 0)],
                 [x], 3, (1, 2))
    rows, cols = _outputs(gm)
    groups = [[rows], [cols]]
    chosen, traffic, plan = _plan(gm, groups)
    # recompute: each group reads x (2B) + writes 256 + 512          = 66304
    # materialize exp: group 1 reads exp instead of x, exp written  = 66304 + B
    assert chosen == set(), plan
    assert traffic == 2 * B + 256 + 512 == _brute_force(gm, groups), plan
    (exp,) = _nodes(gm, prims.exp.default)
    assert memory_traffic(gm, groups, {exp}) == traffic + B


def test_product_of_three_inputs_is_materialized():
    a, b, c = (torch.empty(N, M) for _ in range(3))
    calls = [(aten.mul.Tensor, (("x", 0), ("x", 1)), {}, 1),
             (aten.mul.Tensor, (("o", 0), ("x", 2)), {}, 1), _sum(("o", 1), 1), _sum(("o", 1), 0)]
    gm = _region(calls, [a, b, c], 4, (2, 3))
    rows, cols = _outputs(gm)
    groups = [[rows], [cols]]
    y = rows.args[0]
    chosen, traffic, plan = _plan(gm, groups)
    # recompute: group 1 re-reads a, b, c (3B)           -> 3B + 3B + 768  = 197376
    # materialize y: written once, read once (2B)         -> 3B + 2B + 768  = 164608
    # (a*b and c: 2B + B: no better than a, b, c)
    assert chosen == {y}, plan
    assert traffic == 5 * B + 256 + 512 == _brute_force(gm, groups), plan
    assert memory_traffic(gm, groups, set()) == 6 * B + 768


def test_third_group_reads_what_the_second_materialized():
    a, b, c = (torch.empty(N, M) for _ in range(3))
    calls = [(aten.mul.Tensor, (("x", 0), ("x", 1)), {}, 1),
             (aten.mul.Tensor, (("o", 0), ("x", 2)), {}, 1), _sum(("o", 1), 1), _sum(("o", 1), 0),
             (aten.mul.Tensor, (("o", 1), ("c", 2.0)), {}, 1)]
    gm = _region(calls, [a, b, c], 5, (2, 3, 4))
    rows, cols, twice = _outputs(gm)
    y = rows.args[0]
    chosen, traffic, plan = _plan(gm, [[rows], [cols], [twice]])
    assert chosen == {y}, plan  # group 2 reads y (B) rather than a, b, c (3B); y is written once
    assert traffic == 3 * B + B + B + (B + 768) + B, plan


def _centered(keep_mean=False):
    """x - mean(x, 1): group 0 its row sum of squares, group 1 its column sum."""
    x = torch.empty(N, M)
    calls = [(aten.mean.dim, (("x", 0), ("c", (1,)), ("c", True)), {}, 1),
             (aten.sub.Tensor, (("x", 0), ("o", 0)), {}, 1),
             (aten.mul.Tensor, (("o", 1), ("o", 1)), {}, 1),
             _sum(("o", 2), 1), _sum(("o", 1), 0)]
    live = (0, 3, 4) if keep_mean else (3, 4)
    gm = _region(calls, [x], 5, live)
    *first, cols = _outputs(gm)
    return gm, [first, [cols]]


def test_row_mean_needed_with_x_is_recomputed_by_bytes():
    gm, groups = _centered()
    (row_sum,) = [n for n in _nodes(gm, prims.sum.default) if n.args[0].op == "placeholder"]
    # group 1 reads x for x - mean anyway, so recomputing the mean adds no bytes:
    #   recompute:        g0 reads x (B), g1 reads x (B); writes 256 + 512  = 66304
    #   materialize mean: g1 also reads mean (256) and g0 writes it (256)  = 66816
    chosen, traffic, plan = _plan(gm, groups)
    assert chosen == set(), plan
    assert traffic == 2 * B + 768 == _brute_force(gm, groups), plan
    assert memory_traffic(gm, groups, {row_sum}) == traffic + 512
    # not recomputing reductions: the row sum [64] is written, not its broadcast or the
    # [64, 1] mean after it (same bytes: the tie goes to the node nearest the inputs)
    chosen, traffic, plan = _plan(gm, groups, recompute_reductions=False)
    assert chosen == {row_sum}, plan
    assert traffic == 2 * B + 768 + 512, plan


def test_row_mean_that_is_an_output_is_read_back():
    gm, groups = _centered(keep_mean=True)
    mean = groups[0][0]
    assert mean.target is prims.div.default, describe(gm, groups)
    # a value in memory is read, never recomputed: group 1 reads x and the mean (B + 256);
    # writes: mean 256, row sum of squares 256, column sum 512   -> 2B + 256 + 1024 = 66816
    for recompute_reductions in (True, False):
        chosen, traffic, plan = _plan(gm, groups, recompute_reductions=recompute_reductions)
        assert chosen == set() and traffic == 2 * B + 256 + 1024, plan
        assert traffic == _brute_force(gm, groups), plan


def test_reduction_is_materialized_not_its_broadcast():
    a, b, c = (torch.empty(N, M) for _ in range(3))
    calls = [(aten.mul.Tensor, (("x", 0), ("x", 1)), {}, 1), _sum(("o", 0), 1, keepdim=True),
             (aten.div.Tensor, (("o", 0), ("o", 1)), {}, 1),
             (aten.div.Tensor, (("x", 2), ("o", 1)), {}, 1), _sum(("o", 3), 0)]
    gm = _region(calls, [a, b, c], 5, (2, 4))
    normalized, cols = _outputs(gm)
    groups = [[normalized], [cols]]
    (r,) = [n for n in _nodes(gm, prims.sum.default) if n.args[0].target is prims.mul.default]
    # group 1 needs c / r: recompute r from a, b (B + 2B), its [64, 128] broadcast
    # (B + 2B written and read), or r itself (B + 2 * 256)
    chosen, traffic, plan = _plan(gm, groups)
    assert chosen == {r}, plan
    assert traffic == 2 * B + B + B + 256 + 512 + 256 == _brute_force(gm, groups), plan


def test_tie_goes_to_recompute():
    x = torch.empty(N, M, dtype=torch.float64)
    calls = [(aten._to_copy.default, (("x", 0),), {"dtype": ("c", torch.float32)}, 1),
             (aten.exp.default, (("o", 0),), {}, 1), _sum(("o", 1), 1), _sum(("o", 1), 0)]
    gm = _region(calls, [x], 4, (2, 3))
    rows, cols = _outputs(gm)
    groups = [[rows], [cols]]
    # re-read x (float64: 2B) or write and read the float32 cast or exp (2B): a tie
    chosen, traffic, plan = _plan(gm, groups)
    assert chosen == set(), plan
    assert traffic == 2 * (2 * B) + 768 == _brute_force(gm, groups), plan
    (cast,) = _nodes(gm, prims.convert_element_type.default)
    assert memory_traffic(gm, groups, {cast}) == traffic


def test_scalar_placeholders_cost_nothing():
    x = torch.empty(N, M)
    calls = [(aten.mul.Tensor, (("x", 0), ("s", 0)), {}, 1), _sum(("o", 0), 1), _sum(("o", 0), 0)]
    gm = trace_region(calls, [x], 3, (1, 2), ["f"]).gm
    rows, cols = _outputs(gm)
    chosen, traffic, plan = _plan(gm, [[rows], [cols]])
    assert chosen == set() and traffic == 2 * B + 768, plan


def test_bad_input_is_refused():
    x = torch.empty(N, M)
    gm = _region([(aten.exp.default, (("x", 0),), {}, 1)], [x], 1, (0,))
    other = _region([(aten.exp.default, (("x", 0),), {}, 1)], [x], 1, (0,))
    with pytest.raises(PartitionError, match="not a value node"):
        choose_materialized(gm, [_outputs(other)])
    ph = next(iter(gm.graph.nodes))
    with pytest.raises(PartitionError, match="cannot be materialized"):
        memory_traffic(gm, [_outputs(gm)], {ph})
