"""Tensor + sequence parallel inside pipeline stages, each stage under ``data_parallel`` and the passes, on 4 gloo
ranks: mesh ``(pp 2, dp 1, tp 2)``.

``SequenceParallelLM`` with two blocks is split into two stages (``sequence_parallel_lm_stage``: the embedding and
block 0; block 1, the final norm and the output).  Each stage is made tensor and sequence parallel over its ``tp``
pair (``parallelize_module``), sharded by ``data_parallel`` over ``dp`` (one rank: the cheapest layout that runs
all three on the 2 cores this suite has; eight processes for dp 2 would not fit its time), compiled whole with
``fsdp_passes.enable()`` (defaults) and trained by ``ScheduleGPipe``, then afresh by ``Schedule1F1B`` (two
microbatches each; the second runs the graphs compiled for the first) for two AdamW steps.  The
activations sent between stages are the sequence-sharded local tensors: each tp rank of stage 0 sends its part to
the same tp rank of stage 1.

Checked against the unsharded two-block model trained on the same batches in one process: parameters after the
two steps within 1e-5 relative (float32; the tensor-parallel partial sums and the per-microbatch gradient sums
round differently from one backward over the whole batch, and AdamW's normalised step carries those last bits;
measured 5e-8) and each step's loss within 1e-6 (measured 8e-8); both passes planned both graphs of each stage
with no fallback.  With one dp rank the cost model prices the dp gathers and reductions at zero, so auto
bucketing leaves them one per bucket (forward 10 and 14 collectives per stage, unchanged).

``run_on_gloo(8, _rank, 2)`` runs the same with dp 2 (pp 2 x dp 2 x tp 2), not part of the suite: on 2 shared
cores it took 84-111 s (the suite's 4 processes: 69-104 s); parameters within 8e-8 of the unsharded model after
both schedules, and the dp collectives merged (forward 10 -> 5 and 14 -> 6 per stage, backward 15 -> 7 and
22 -> 9).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_passes.testing import run_on_gloo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import check_passes_ran, fresh_compile_state, max_rel, report_summary  # noqa: E402

VOCAB, SEQ, BATCH, N_LAYERS = 22, 8, 4, 2
N_STAGES, TP = 2, 2
DP = 1  # the suite's layout; _rank takes others (dp 2: 8 processes, see the module docstring)
MICROBATCHES, STEPS, LR = 2, 2, 1e-2
SCHEDULES = ("gpipe", "1f1b")
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


def _rank(rank: int, world_size: int, dp: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import parallelize_module

    import fsdp_passes
    from fsdp_passes.testing.models import (build_sequence_parallel_lm, sequence_parallel_lm_stage,
                                            sequence_parallel_plan)

    mesh = init_device_mesh("cpu", (N_STAGES, dp, TP), mesh_dim_names=("pp", "dp", "tp"))
    # sliced once: each slice is a new DeviceMesh object, and Dynamo guards the tp mesh's identity (through
    # parallelize_module's hooks), so a stage built on a new slice would compile again
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    stage, dp_rank, local = mesh["pp"].get_local_rank(), dp_mesh.get_local_rank(), BATCH // dp
    ref_losses, ref_params = _reference()
    out: dict = {"stage": stage, "tp_rank": tp_mesh.get_local_rank(), "ref_losses": ref_losses}

    fresh_compile_state()
    fsdp_passes.enable()
    try:
        for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            fsdp_passes.last_reports(clear=True)
            module = sequence_parallel_lm_stage(build_sequence_parallel_lm(VOCAB, n_layers=N_LAYERS), stage, N_STAGES)
            parallelize_module(module, tp_mesh, sequence_parallel_plan(module))
            fsdp_passes.data_parallel(module, dp_mesh)
            pipe_stage = PipelineStage(torch.compile(module, fullgraph=True), stage, N_STAGES, torch.device("cpu"),
                                       group=mesh["pp"].get_group())
            schedule = schedule_class(pipe_stage, MICROBATCHES, loss_fn=_loss)
            opt = torch.optim.AdamW(module.parameters(), lr=LR)
            losses = []
            for tokens, targets in _batches():
                tokens, targets = (t[dp_rank * local:(dp_rank + 1) * local] for t in (tokens, targets))
                mb_losses: list = []
                if stage == 0:
                    schedule.step(tokens)
                else:
                    schedule.step(target=targets, losses=mb_losses)
                    # this dp rank's loss: equal-sized microbatches' means, averaged (with dp 1: the batch's)
                    losses.append(torch.stack([m.detach() for m in mb_losses]).mean().item())
                opt.step()
                opt.zero_grad()
            params = {_stage_ref_name(n, stage): p.full_tensor().detach() for n, p in module.named_parameters()}
            out[name] = {"losses": losses, "names": sorted(params),
                         "max_rel": max_rel(params, {n: ref_params[n] for n in params}),
                         "placements": {n: str(p.placements) for n, p in module.named_parameters()},
                         "reports": report_summary(fsdp_passes.last_reports())}
    finally:
        fsdp_passes.disable()
    dist.barrier()
    return out


def test_gpipe_and_1f1b_stages_tensor_parallel_under_data_parallel_train_like_the_unsharded_model():
    import numpy as np

    results = run_on_gloo(N_STAGES * DP * TP, _rank, DP, timeout=300)
    assert [(r["stage"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for name in SCHEDULES:
        # the two stages hold the whole model between them, each parameter once
        assert sorted(results[0][name]["names"] + results[2][name]["names"]) == sorted(
            ["embed.weight", "norm.weight", "norm.bias", "output.weight", "output.bias"]
            + [f"layers.{i}.{p}" for i in range(N_LAYERS) for p in
               ("norm.weight", "norm.bias", "ffn.w1.weight", "ffn.w1.bias", "ffn.w2.weight", "ffn.w2.bias")])
        for rank, res in enumerate(results):
            got = res[name]
            # a DTensor on the combined (dp, tp) mesh: tensor parallel inside the stage, data parallel over it
            assert got["placements"]["layers.0.ffn.w2.weight"] == "(Shard(dim=0), Shard(dim=1))", got["placements"]
            assert got["max_rel"] < TOL, (rank, name, got["max_rel"])
            if res["stage"] == N_STAGES - 1:
                assert np.allclose(got["losses"], res["ref_losses"], rtol=1e-6, atol=0), (rank, name, got["losses"],
                                                                                          res["ref_losses"])
            if name == SCHEDULES[0]:
                # the stage's own forward and backward graph, planned by both passes and kept
                check_passes_ran(got["reports"], (rank, name))
            else:
                # the second schedule's fresh stage runs the graphs compiled (and planned) for the first
                assert got["reports"] == [], (rank, [r["graph"] for r in got["reports"]])
