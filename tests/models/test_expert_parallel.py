"""Expert parallel under ``data_parallel`` and the passes: a mixture of experts whose experts are sharded over an
``ep`` group of a ``(dp 2, ep 2)`` mesh, tokens dispatched and combined by all-to-all (``ep_models``), expert
weights sharded by ``data_parallel`` over ``dp`` (the ranks holding the same experts), dense weights over the world.

Fake 4-rank group (structure), one compile without the passes, one with the defaults, one with a strict
per-block plan: every all-to-all is left out of buckets, each process group's all-to-all sequence equals the
compile without the passes, no all-to-all is issued later (fewer kernels before it) nor waited on after a kernel
that reads its output, and the per-block plan buckets each block's expert weights together on the ``dp`` group.
4-rank gloo: three AdamW steps with the per-block plan equal the unsharded model in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fsdp_passes
from fsdp_passes.testing import capture_scheduler_nodes, fake_process_group, run_on_gloo
from fsdp_passes.testing.end_to_end import per_group_sequences

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_models as ep  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state, max_rel  # noqa: E402

N_LAYERS = 2
STEPS = 3
A2A = torch.ops._c10d_functional.all_to_all_single.default
OPTIONS = {"defaults": dict(strict=True),
           "per_block": dict(bucketing="manual", bucket_plan=ep.per_block_plan(N_LAYERS), strict=True)}


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")), init_device_mesh("cpu", (4,))


def _mse_step(model):
    def step(x, y):
        return torch.nn.functional.mse_loss(model(x), y)
    return step


@pytest.fixture(scope="module")
def compiles() -> dict:
    """Per configuration (no passes, each of ``OPTIONS``): scheduler captures and the passes' reports."""
    out = {}
    with fake_process_group(4):
        mesh, world = _meshes()
        model = ep.expert_parallel(N_LAYERS, mesh, world)
        x, y = ep.inputs(4, 1)[0][0]
        for name, options in {"plain": None, **OPTIONS}.items():
            fsdp_passes.last_reports(clear=True)
            caps = capture_scheduler_nodes(_mse_step(model), x, y, options=options)
            out[name] = {"captures": caps, "reports": fsdp_passes.last_reports(clear=True),
                         "sequences": {c.graph_name: per_group_sequences(c) for c in caps}}
        out["groups"] = {"dp": mesh["dp"].get_group().group_name, "ep": mesh["ep"].get_group().group_name,
                         "world": world.get_group().group_name}
    return out


def _a2a_sequences(sequences: dict) -> dict:
    return {graph: {g: seq for g, seq in per_group.items() if any(s.startswith("all_to_all") for s in seq)}
            for graph, per_group in sequences.items()}


@pytest.mark.parametrize("config", OPTIONS)
def test_all_to_alls_never_bucketed_and_their_group_order_kept(compiles, config):
    plain, got, groups = compiles["plain"], compiles[config], compiles["groups"]
    a2a = _a2a_sequences(plain["sequences"])
    # dispatch + combine per block in forward and again in backward, all on the ep group, blocks told apart by size
    for graph in ("forward", "backward"):
        assert list(a2a[graph]) == [groups["ep"]], a2a[graph]
        assert len(a2a[graph][groups["ep"]]) == 2 * N_LAYERS
        assert len(set(a2a[graph][groups["ep"]])) == N_LAYERS
    assert _a2a_sequences(got["sequences"]) == a2a
    fx = [r for r in got["reports"] if r.pass_name == "fx"]
    assert [r.fallback for r in got["reports"]] == [None] * 4
    assert all(r.n_collectives_after < r.n_collectives_before for r in fx)  # the FSDP collectives around merged
    not_bucketed = [n for r in fx for n, why in r.extra["bucketing"]["unbucketed"].items()
                    if n.startswith("all_to_all") and "not bucketed" in why]
    assert len(not_bucketed) == 4 * N_LAYERS
    for r in fx:
        assert all(b["op"] != "all_to_all" for b in r.extra["bucketing"]["buckets"])


def _reads(snode) -> set[str]:
    """Buffers ``snode`` reads data of (not the ordering-only ``WeakDep``s Inductor adds between collectives)."""
    from torch._inductor.dependencies import WeakDep

    return {d.name for d in snode.read_writes.reads if not isinstance(d, WeakDep)}


def _written(snode) -> set[str]:
    names = set(snode.get_buffer_names())
    for buf in snode.get_outputs():
        names.update(buf.get_mutations())
    return names


@pytest.mark.parametrize("config", OPTIONS)
def test_all_to_alls_never_issued_later_nor_waited_on_after_their_consumer(compiles, config):
    from torch._inductor.utils import is_collective, is_wait

    checked = 0
    for cap in compiles[config]["captures"]:
        kernels_before = {}
        for which in ("before", "after"):
            count = 0
            for snode in getattr(cap, which):
                if getattr(snode.node, "op_overload", None) is A2A:
                    kernels_before.setdefault(id(snode), []).append(count)
                elif not (is_wait(snode.node) or is_collective(snode.node)):
                    count += 1  # a compute kernel (collectives issued early, prefetched gathers, are no delay)
        # an all-to-all gates the experts (forward) or the next gradients (backward): never issued after more compute
        assert all(after <= before for before, after in kernels_before.values()), kernels_before
        order = cap.after
        for pos, snode in enumerate(order):
            if getattr(snode.node, "op_overload", None) is not A2A:
                continue
            out = set(snode.get_buffer_names())
            waits = [p for p in range(pos + 1, len(order)) if is_wait(order[p].node) and _reads(order[p]) & out]
            assert len(waits) == 1, snode.get_name()
            wait = order[waits[0]]
            done = out | _written(wait)
            readers = [p for p in range(pos + 1, len(order)) if p != waits[0] and _reads(order[p]) & done]
            assert readers and waits[0] < min(readers), (cap.graph_name, snode.get_name(), waits, readers)
            checked += 1
    assert checked == 4 * N_LAYERS


def test_per_block_plan_buckets_each_blocks_expert_weights_on_the_dp_group(compiles):
    groups = compiles["groups"]
    for r in compiles["per_block"]["reports"]:
        if r.pass_name != "fx":
            continue
        buckets = r.extra["bucketing"]["buckets"]
        for layer in range(N_LAYERS):
            label = f"layers.{layer}"
            experts = {f"{label}.experts.w1", f"{label}.experts.w2"}
            on_dp = [b for b in buckets if b["label"] == label and b["group"] == groups["dp"]]
            assert on_dp and all(set(b["params"]) == experts for b in on_dp), (r.graph, label, on_dp)
            # the block's dense weights in buckets of the world group, never with an expert weight
            dense = [b for b in buckets if b["label"] == label and b["group"] == groups["world"]]
            assert dense and all(not (set(b["params"]) & experts) for b in dense), (r.graph, label, dense)
        assert all(b["group"] != groups["ep"] for b in buckets)


def _reference() -> tuple[list[float], dict]:
    """The unsharded model (every expert local) trained in this process: per step, the mean over the four ranks'
    losses on their own tokens, as the expert-parallel job's global loss."""
    model = ep.EPModel(N_LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for per_rank in ep.inputs(4, STEPS):
        loss = torch.stack([torch.nn.functional.mse_loss(model(x), y) for x, y in per_rank]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _ep_run(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    mesh, world = _meshes()
    ep_rank, per = mesh["ep"].get_local_rank(), ep.N_EXPERTS // mesh["ep"].size()
    ref_losses, ref = _reference()
    model = ep.expert_parallel(N_LAYERS, mesh, world)
    fresh_compile_state()
    fsdp_passes.enable(**OPTIONS["per_block"])
    try:
        step = torch.compile(_mse_step(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for per_rank in ep.inputs(4, STEPS):
            loss = step(*per_rank[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
    finally:
        fsdp_passes.disable()
    got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    # this rank's experts are its ep slice of the reference's stacked experts
    want = {n: (r[ep_rank * per:(ep_rank + 1) * per] if ".experts." in n else r) for n, r in ref.items()}
    reports = fsdp_passes.last_reports()
    return {"max_rel": max_rel(got, want), "losses": losses, "ref_losses": ref_losses,
            "fallbacks": [r.fallback for r in reports], "merged": [r.n_collectives_before - r.n_collectives_after
                                                                  for r in reports if r.pass_name == "fx"]}


def test_expert_parallel_trains_like_the_unsharded_model_on_gloo():
    import numpy as np

    for rank, res in enumerate(run_on_gloo(4, _ep_run, timeout=300)):
        assert res["fallbacks"] == [None] * 4 and all(m > 0 for m in res["merged"]), (rank, res)
        # fp32 rounding only: Inductor's fused kernels, and gradients summed over ranks in another order than the
        # reference's one backward of the mean loss
        assert res["max_rel"] <= 1e-6, (rank, res["max_rel"])
        assert np.allclose(res["losses"], res["ref_losses"], rtol=1e-6, atol=0), (rank, res["losses"])
