"""Tensor + sequence parallel inside pipeline stages, each stage under ``data_parallel`` and the passes, on 4 gloo
ranks: mesh ``(pp 2, dp 1, tp 2)``.

``SequenceParallelLM`` with two blocks is split into two stages (``sequence_parallel_lm_stage``: the embedding and
block 0; block 1, the final norm and the output).  Each stage is made tensor and sequence parallel over its ``tp``
pair (``parallelize_module``), sharded by ``data_parallel`` over ``dp`` (one rank: the cheapest layout that runs
all three on the 2 cores this suite has; eight processes for dp 2 would not fit its time), compiled whole with
``fsdp_passes.enable()`` (defaults) and trained by ``ScheduleGPipe`` (two microbatches) for two AdamW steps.  The
activations sent between stages are the sequence-sharded local tensors: each tp rank of stage 0 sends its part to
the same tp rank of stage 1.

Checked against the unsharded two-block model trained on the same batches in one process: parameters after the
two steps within 1e-5 relative (float32; the tensor-parallel partial sums and the per-microbatch gradient sums
round differently from one backward over the whole batch, and AdamW's normalised step carries those last bits;
measured 5e-8) and each step's loss within 1e-6 (measured 8e-8); both passes planned both graphs of each stage
with no fallback.  With one dp rank the cost model prices the dp gathers and reductions at zero, so auto
bucketing leaves them one per bucket (forward 10 and 14 collectives per stage, unchanged).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_passes.testing import run_on_gloo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import check_passes_ran, fresh_compile_state, max_rel, report_summary  # noqa: E402

VOCAB, SEQ, BATCH, N_LAYERS = 22, 8, 4, 2
N_STAGES, DP, TP = 2, 1, 2
MICROBATCHES, STEPS, LR = 2, 2, 1e-2
TOL = 1e-5


def _batches() -> list:
    import torch

    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _reference() -> tuple[list[float], dict]:
    """The unsharded two-block model trained on the batches in this process: losses, parameters."""
    import torch

    from fsdp_passes.testing.models import build_sequence_parallel_lm

    model = build_sequence_parallel_lm(VOCAB, n_layers=N_LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens, targets in _batches():
        loss = _loss(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _stage_ref_name(name: str, stage: int) -> str:
    """A stage's parameter name in the unsharded model (the stage numbers its blocks from 0)."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts[1] = str(int(parts[1]) + stage * (N_LAYERS // N_STAGES))
    return ".".join(parts)


def _rank(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor.parallel import parallelize_module

    import fsdp_passes
    from fsdp_passes.testing.models import (build_sequence_parallel_lm, sequence_parallel_lm_stage,
                                            sequence_parallel_plan)

    mesh = init_device_mesh("cpu", (N_STAGES, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    ref_losses, ref_params = _reference()

    module = sequence_parallel_lm_stage(build_sequence_parallel_lm(VOCAB, n_layers=N_LAYERS), stage, N_STAGES)
    parallelize_module(module, mesh["tp"], sequence_parallel_plan(module))
    fsdp_passes.data_parallel(module, mesh["dp"])
    fresh_compile_state()
    fsdp_passes.last_reports(clear=True)
    fsdp_passes.enable()
    try:
        pipe_stage = PipelineStage(torch.compile(module, fullgraph=True), stage, N_STAGES, torch.device("cpu"),
                                   group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(pipe_stage, MICROBATCHES, loss_fn=_loss)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        losses = []
        for tokens, targets in _batches():
            mb_losses: list = []
            if stage == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=targets, losses=mb_losses)
                # the batch's loss: equal-sized microbatches' means, averaged
                losses.append(torch.stack([m.detach() for m in mb_losses]).mean().item())
            opt.step()
            opt.zero_grad()
    finally:
        fsdp_passes.disable()
    params = {_stage_ref_name(n, stage): p.full_tensor().detach() for n, p in module.named_parameters()}
    dist.barrier()
    return {"stage": stage, "tp_rank": mesh["tp"].get_local_rank(), "losses": losses, "ref_losses": ref_losses,
            "names": sorted(params), "max_rel": max_rel(params, {n: ref_params[n] for n in params}),
            "placements": {n: str(p.placements) for n, p in module.named_parameters()},
            "reports": report_summary(fsdp_passes.last_reports())}


def test_gpipe_stages_tensor_parallel_under_data_parallel_train_like_the_unsharded_model():
    import numpy as np

    results = run_on_gloo(N_STAGES * DP * TP, _rank, timeout=300)
    assert [(r["stage"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the two stages hold the whole model between them, each parameter once
    assert sorted(results[0]["names"] + results[2]["names"]) == sorted(
        ["embed.weight", "norm.weight", "norm.bias", "output.weight", "output.bias"]
        + [f"layers.{i}.{p}" for i in range(N_LAYERS) for p in
           ("norm.weight", "norm.bias", "ffn.w1.weight", "ffn.w1.bias", "ffn.w2.weight", "ffn.w2.bias")])
    for rank, res in enumerate(results):
        # a DTensor on the combined (dp, tp) mesh: tensor parallel inside the stage, data parallel over it
        assert res["placements"]["layers.0.ffn.w2.weight"] == "(Shard(dim=0), Shard(dim=1))", res["placements"]
        assert res["max_rel"] < TOL, (rank, res["max_rel"])
        if res["stage"] == N_STAGES - 1:
            assert np.allclose(res["losses"], res["ref_losses"], rtol=1e-6, atol=0), (rank, res["losses"],
                                                                                      res["ref_losses"])
        # the stage's own forward and backward graph, planned by both passes and kept
        check_passes_ran(res["reports"], rank)
