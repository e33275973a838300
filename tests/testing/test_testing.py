"""Tests of the public test harness ``fsdp_passes.testing``."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from fsdp_passes.testing import (
    RankFailed,
    build_llama,
    build_mlp,
    capture_fx_graphs,
    capture_scheduler_nodes,
    example_inputs,
    fake_process_group,
    fsdp_param_of,
    fsdp_params,
    run_on_gloo,
    simple_fsdp,
)

AG = "all_gather_into_tensor"
RS = "reduce_scatter_tensor"
WAIT = "wait_tensor"


def _collectives(gm: torch.fx.GraphModule) -> Counter:
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional":
            c[n.target._opname] += 1
    return c


# ------------------------------------------------------------------ fake process group


def test_fake_process_group_sets_up_and_tears_down():
    assert not dist.is_initialized()
    with fake_process_group(world_size=4, rank=1) as group:
        assert dist.is_initialized()
        assert dist.get_world_size(group) == 4 and dist.get_rank(group) == 1
        assert group.group_name == "0"
    assert not dist.is_initialized()


def test_fake_process_group_refuses_nesting_and_tears_down_on_error():
    with pytest.raises(ZeroDivisionError):
        with fake_process_group():
            with pytest.raises(RuntimeError, match="already initialised"):
                with fake_process_group():
                    pass
            assert dist.is_initialized()  # the outer group survives the refusal
            1 / 0
    assert not dist.is_initialized()
    with pytest.raises(ValueError):
        with fake_process_group(world_size=2, rank=2):
            pass


# ------------------------------------------------------------------ models


def test_mlp_params_are_dim0_shards_and_eager_runs(fake_pg):
    from torch.distributed.tensor import DTensor, Shard

    ref = build_mlp(n_layers=2, dim=32, fsdp=False)
    model = build_mlp(n_layers=2, dim=32)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    assert "layers.0.fc1.weight" in names
    for (name, p), (_, full) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape == full.shape, name
        local = p.to_local()
        assert local.shape[0] * 8 == full.shape[0] and local.shape[1:] == full.shape[1:], name
        torch.testing.assert_close(local.detach(), full.detach().chunk(8)[0])  # rank 0's shard
    infos = fsdp_params(model)
    assert infos["layers.1.fc2.weight"].full_shape == (32, 64)
    assert infos["layers.1.fc2.weight"].module_fqn == "layers.1.fc2"
    assert model.layers[0].fc1.weight.shape == (64, 32)  # attribute access gathers
    out = model(*example_inputs(model))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_llama_mixed_precision_eager(fake_pg):
    model = build_llama(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=64, seq_len=8,
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert {n.split(".")[0] for n, _ in model.named_parameters()} == {"tok_embeddings", "layers", "norm", "output"}
    assert model.layers[0].attention.wk.weight.dtype == torch.bfloat16
    out = model(*example_inputs(model))
    assert out.shape == (2, 8, 64) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_simple_fsdp_pads_indivisible_dim0(fake_pg_factory):
    fake_pg_factory(8, 5)  # 12 rows on 8 ranks: shards of 2 rows; rank 5 owns row 10, rank 6 and 7 none
    full = torch.nn.Linear(8, 12)
    ref = full.weight.detach().clone()
    model = simple_fsdp(full)
    info = fsdp_params(model)["weight"]
    assert info.shard_shape == (2, 8) and info.local_rows == 2 and info.full_shape == (12, 8)
    torch.testing.assert_close(model._parameters["weight"].to_local(), ref[10:12])
    assert model._fsdp_shards["weight"].storage.shape == (2, 8)


# ------------------------------------------------------------------ capture_fx_graphs


def test_capture_fx_graphs_reshard_after_forward(fake_pg):
    model = build_mlp(n_layers=2, dim=32)
    t = time.perf_counter()
    graphs = capture_fx_graphs(model, *example_inputs(model))
    elapsed = time.perf_counter() - t
    fwd, bwd = _collectives(graphs.forward), _collectives(graphs.backward)
    assert fwd == {AG: 8, WAIT: 8}
    assert bwd[RS] == 8
    # resharded: the backward gathers again the weights it needs (fc2 of both layers, fc1 of layer 1)
    assert bwd[AG] == 3 and bwd[WAIT] == bwd[AG] + bwd[RS]
    regathered = {fsdp_param_of(n) for n in graphs.backward.graph.nodes if getattr(n.target, "_opname", "") == AG}
    assert regathered == {"layers.0.fc2.weight", "layers.1.fc1.weight", "layers.1.fc2.weight"}
    assert elapsed < 30


def test_capture_fx_graphs_no_reshard_and_fqn_meta(fake_pg):
    model = build_mlp(n_layers=2, dim=32, reshard_after_forward=False)
    graphs = capture_fx_graphs(model, *example_inputs(model))
    assert _collectives(graphs.backward) == {RS: 8, WAIT: 8}
    fqns = set(fsdp_params(model))
    ag = [n for n in graphs.forward.graph.nodes if getattr(n.target, "_opname", "") == AG]
    rs = [n for n in graphs.backward.graph.nodes if getattr(n.target, "_opname", "") == RS]
    assert {fsdp_param_of(n) for n in ag} == fqns == {fsdp_param_of(n) for n in rs}
    for n in ag:  # module of the gather: last nn_module_stack entry, in Dynamo's spelling
        path = list(n.meta["nn_module_stack"].values())[-1][0]
        assert path.endswith(fsdp_param_of(n).rsplit(".", 1)[0])
    infos = fsdp_params(model)  # each reduce-scatter's annotation names the parameter whose shard it produces
    assert all(tuple(n.meta["val"].shape) == infos[fsdp_param_of(n)].shard_shape for n in rs)
    assert graphs.forward_after is not None and graphs.backward_after is not None


def test_capture_fx_graphs_mixed_precision_dtypes(fake_pg):
    model = build_mlp(n_layers=1, dim=32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    graphs = capture_fx_graphs(model, *example_inputs(model))
    assert [name for name, _, _ in graphs.graphs] == ["forward", "backward"]  # the input cast is in forward
    ag = [n for n in graphs.forward.graph.nodes if getattr(n.target, "_opname", "") == AG]
    rs = [n for n in graphs.backward.graph.nodes if getattr(n.target, "_opname", "") == RS]
    assert ag and all(n.meta["val"].dtype == torch.bfloat16 for n in ag)
    assert rs and all(n.meta["val"].dtype == torch.float32 for n in rs)


def test_capture_fx_graphs_without_backward(fake_pg):
    model = build_mlp(n_layers=1, dim=32)
    graphs = capture_fx_graphs(model, *example_inputs(model), backward=False)
    assert graphs.backward is None and _collectives(graphs.forward)[AG] == 4


# ------------------------------------------------------------------ capture_scheduler_nodes


def test_capture_scheduler_nodes_forward_and_backward(fake_pg):
    from torch._inductor import config as inductor_config

    model = build_llama(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=64, seq_len=8)
    seen = []

    def reverse_nothing(nodes):
        seen.append(len(nodes))
        return list(nodes)

    before_cfg = (inductor_config.reorder_for_compute_comm_overlap,
                  list(inductor_config.reorder_for_compute_comm_overlap_passes))
    with inductor_config.patch(reorder_for_compute_comm_overlap_passes=[reverse_nothing]):
        t = time.perf_counter()
        caps = capture_scheduler_nodes(model, *example_inputs(model))
        elapsed = time.perf_counter() - t
    assert before_cfg == (inductor_config.reorder_for_compute_comm_overlap,
                          list(inductor_config.reorder_for_compute_comm_overlap_passes))
    assert [c.graph_name for c in caps] == ["forward", "backward"]
    assert seen == [len(c.before) for c in caps]  # the installed pass ran between the recorders
    for c in caps:
        assert c.before and c.after_names == c.before_names
        kinds = Counter(type(n.node).__name__ for n in c.before)
        assert kinds["_CollectiveKernel"] > 0 and kinds["_WaitKernel"] > 0
    assert elapsed < 30


def test_capture_options_run_under_fsdp_passes_enabled(fake_pg, fresh_inductor, monkeypatch):
    import contextlib

    import fsdp_passes
    from torch._inductor import config as inductor_config

    calls = []

    def marker(nodes):
        calls.append(len(nodes))
        return nodes

    @contextlib.contextmanager
    def fake_enabled(**options):
        calls.append(options)
        with inductor_config.patch(reorder_for_compute_comm_overlap=True,
                                   reorder_for_compute_comm_overlap_passes=[marker]):
            yield options

    monkeypatch.setattr(fsdp_passes, "enabled", fake_enabled, raising=False)
    model = build_mlp(n_layers=1, dim=32)
    caps = capture_scheduler_nodes(model, *example_inputs(model), options={"bucketing": "none"})
    assert calls[0] == {"bucketing": "none"} and calls[1:] == [len(c.before) for c in caps]
    assert inductor_config.reorder_for_compute_comm_overlap_passes == []


# ------------------------------------------------------------------ gloo
# (build_mlp compiled on a gloo group matches eager: tests/inductor/test_numerics_gloo.py)


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom")
    return rank


def test_run_on_gloo_propagates_rank_errors():
    with pytest.raises(RankFailed, match=r"rank 1 failed(.|\n)*KeyError: 'boom'"):
        run_on_gloo(2, _raise_on_rank_1, timeout=60)


def _abort_on_rank_0_then_wait(rank: int, world_size: int) -> int:
    import os

    import torch
    import torch.distributed as dist

    if rank == 0:
        os.abort()  # a crash: no Python traceback, the peer's next collective fails
    dist.all_reduce(torch.ones(1))
    return rank


def test_run_on_gloo_names_a_crashed_peer():
    # rank 1's own error is a connection error; the message must say that rank 0 died, and how
    with pytest.raises(RankFailed) as info:
        run_on_gloo(2, _abort_on_rank_0_then_wait, timeout=60)
    assert "SIGABRT" in str(info.value)
    assert "rank 0" in str(info.value)
    # and where it crashed: the interpreter's stacks of the crashed rank, down to the function that aborted
    assert "Fatal Python error: Aborted" in str(info.value)
    assert "_abort_on_rank_0_then_wait" in str(info.value)


def _gloo_runloop_threads() -> int:
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))


def _new_group_with_three_gloo_threads(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from fsdp_passes.testing.gloo import set_gloo_worker_threads

    dist.all_reduce(torch.ones(1))  # a group starts its worker threads at its first collective
    before = _gloo_runloop_threads()  # the default group's: run_on_gloo gives it one
    set_gloo_worker_threads(3)
    try:
        group = dist.new_group(ranks=list(range(world_size)), backend="gloo")
    finally:
        set_gloo_worker_threads(None)
    gathered = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(torch.full((3,), float(rank)), world_size, group.group_name))
    # the group's constructor starts its workers, but each names itself only when it first runs, which on a
    # loaded host can come after the collective above (one worker serves it): wait for the names, then count
    deadline = time.monotonic() + 30
    while _gloo_runloop_threads() - before < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    added = _gloo_runloop_threads() - before
    restored = c10d.ProcessGroupGloo is torch._C._distributed_c10d.ProcessGroupGloo
    return before, added, gathered.tolist(), restored


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_set_gloo_worker_threads_gives_new_groups_that_many_threads():
    """run_on_gloo's ranks run gloo on one worker thread (torch's two corrupt the heap now and then:
    benchmarks/gloo_view_race.py); set_gloo_worker_threads sets the count for groups created afterwards."""
    out = run_on_gloo(2, _new_group_with_three_gloo_threads, timeout=120)
    for before, added, gathered, restored in out:
        assert (before, added, restored) == (1, 3, True)
        assert gathered == [0.0] * 3 + [1.0] * 3
