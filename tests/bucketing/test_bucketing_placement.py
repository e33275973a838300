"""Backward re-gathers go ahead of the reductions before them (bucketing/placement.py), within the budget."""

import pytest

from fsdp_passes import Options
from fsdp_passes.pipeline import bucket_graph
from fsdp_passes.dag import CollectiveOp
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.testing import build_mlp, capture_fx_graphs, example_inputs


@pytest.fixture(scope="module")
def process_group():
    import torch._dynamo

    from fsdp_passes.testing import fake_process_group

    with fake_process_group(world_size=8):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def backward_graph(process_group):
    model = build_mlp(n_layers=4, dim=64, reshard_after_forward=True)
    return capture_fx_graphs(model, *example_inputs(model, batch=16)).backward


def _sequence(gm):
    dag = dag_from_fx(gm)
    ((_, seq),) = dag.group_sequences().items()
    return [dag[i].collective for i in seq]


def _sequence_with_bytes(gm):
    dag = dag_from_fx(gm)
    ((_, seq),) = dag.group_sequences().items()
    return [("AG" if dag[i].collective is CollectiveOp.ALL_GATHER else "RS", dag[i].comm_bytes) for i in seq]


def _copy(gm):
    import copy

    return copy.deepcopy(gm)


PLAN = dict(bucketing="manual", bucket_plan=["layers.[0-3]"])


def test_regathers_go_ahead_of_the_previous_reduction(backward_graph):
    plain = _copy(backward_graph)
    bucket_graph(plain, Options(**PLAN, reorder=False, memory_budget="100%"))  # same buckets as below
    before = _sequence(plain)
    ag, rs = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    assert any(a is rs and b is ag for a, b in zip(before, before[1:]))  # RS(i) then AG(i-1)

    placed = _copy(backward_graph)
    result = bucket_graph(placed, Options(**PLAN, reorder=True, memory_budget="100%"))
    placed.graph.lint()
    after = _sequence(placed)
    assert result.rewrite.gathers_ahead_of_reductions >= 2

    def reductions_before_each_gather(seq):
        out, count = [], 0
        for kind in seq:
            count += kind is rs
            if kind is ag:
                out.append(count)
        return out

    # every re-gather after the first now goes ahead of the reduction that used to precede it
    old, new = reductions_before_each_gather(before), reductions_before_each_gather(after)
    assert new[0] == old[0] and all(n == o - 1 for n, o in zip(new[1:], old[1:])), (old, new)
    # only gathers and reductions swapped: each kind keeps its own order and count
    assert sorted(map(str, after)) == sorted(map(str, before))
    names = lambda gm, kind: [n.name for n in dag_from_fx(gm) if n.collective is kind]  # noqa: E731
    assert names(placed, ag) == names(plain, ag) and names(placed, rs) == names(plain, rs)
    # the report's fingerprint is that of the new sequence
    assert result.report.collective_fingerprint != bucket_graph(_copy(backward_graph), Options(**PLAN, reorder=False, memory_budget="100%")).report.collective_fingerprint


def test_placement_is_undone_when_over_the_memory_budget(backward_graph):
    plain = _copy(backward_graph)
    bucket_graph(plain, Options(**PLAN, reorder=False, memory_budget=0))
    tight = _copy(backward_graph)
    result = bucket_graph(tight, Options(**PLAN, reorder=True, memory_budget=0))
    assert result.rewrite.gathers_ahead_of_reductions == 0
    assert [n.name for n in tight.graph.nodes] == [n.name for n in plain.graph.nodes]


def test_a_small_gather_between_a_reduction_and_the_next_block_is_passed_too(process_group):
    """A Llama's backward starts with the output projection (a vocab x dim weight), then the final norm (a dim
    vector), then the last block.  Per-module buckets: the output's reduce-scatter must not stay between the
    norm's tiny gather and the last block's re-gather, where that re-gather would queue behind it on the link.
    The expected sequence is written from the parameter sizes, not read from the code under test."""
    from fsdp_passes.testing import build_llama

    dim, vocab, ffn = 64, 512, 128
    model = build_llama(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, ffn_dim=ffn, vocab=vocab, seq_len=16)
    backward = capture_fx_graphs(model, *example_inputs(model, batch=2)).backward
    plan = dict(bucketing="manual", bucket_plan=["tok_embeddings", "layers.[0-1]", "norm", "output"],
                memory_budget="100%")
    per_layer = 4 * (dim * dim + dim * dim // 2 * 2 + dim * dim + 3 * dim * ffn + 2 * dim)  # q, k+v, o, ffn, 2 norms
    out_b, norm_b = 4 * vocab * dim, 4 * dim

    plain = _copy(backward)
    bucket_graph(plain, Options(**plan, reorder=False))
    assert _sequence_with_bytes(plain)[:5] == [("AG", out_b), ("RS", out_b), ("AG", norm_b), ("RS", norm_b),
                                   ("AG", per_layer)]
    placed = _copy(backward)
    bucket_graph(placed, Options(**plan, reorder=True))
    placed.graph.lint()
    assert _sequence_with_bytes(placed)[:7] == [("AG", out_b), ("AG", norm_b), ("AG", per_layer), ("RS", out_b),
                                    ("RS", norm_b), ("AG", per_layer), ("RS", per_layer)]
    assert sorted(_sequence_with_bytes(placed)) == sorted(_sequence_with_bytes(plain))


def test_unbucketed_gathers_of_a_block_each_count_as_a_block(process_group):
    """Gathered one parameter at a time, each gather of the last block is the next one's lookahead: the output's
    reduce-scatter passes the norm's tiny gather and the last block's first gather, not the whole block."""
    from fsdp_passes.testing import build_llama

    model = build_llama(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab=4096,
                        seq_len=16)  # output 1 MiB, 16-32 KiB per block weight
    backward = capture_fx_graphs(model, *example_inputs(model, batch=2)).backward

    plain = _copy(backward)
    bucket_graph(plain, Options(bucketing="none", reorder=False, memory_budget="100%"))
    before = _sequence_with_bytes(plain)
    gathers = [item for item in before if item[0] == "AG"]
    out_b, norm_b = 4 * 4096 * 64, 4 * 64
    assert before[:4] == [("AG", out_b), ("RS", out_b), ("AG", norm_b), ("RS", norm_b)]
    assert gathers[2][1] > 8 * norm_b  # the last block's first gather is a block of its own
    placed = _copy(backward)
    bucket_graph(placed, Options(bucketing="none", reorder=True, memory_budget="100%"))
    after = _sequence_with_bytes(placed)
    assert after[:5] == [("AG", out_b), ("AG", norm_b), gathers[2], ("RS", out_b), ("RS", norm_b)], after[:8]
