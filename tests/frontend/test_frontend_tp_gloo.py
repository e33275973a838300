"""Tensor + sequence parallel under ``data_parallel`` on 4 gloo ranks (dp 2 x tp 2), FSDP2's way:
``parallelize_module(model, mesh["tp"], plan)`` then ``data_parallel(model, mesh["dp"])``.

The model (``build_sequence_parallel_lm``: 22-token vocabulary, so the embedding and output weights' 11-row
tensor-parallel parts split 6 / 5 over dp, padded) trains 3 AdamW steps; every run is compared with the unsharded
model trained on the global batches in one process.  Tolerance 1e-5 (relative, per parameter) in float32: the
sharded model sums in another order (tensor-parallel partial sums all-reduced / reduce-scattered, gradients
averaged by the dp reduce-scatter), which changes the last bits; AdamW's normalised steps carry those bits on (the
measured differences are near 1e-7).  All runs share one spawned group (``tp_runs``): the checkpoint is also
loaded into other layouts on the same 4 ranks (dp 4 without tensor parallel, dp 1 x tp 4; parameters and AdamW
state), and loss parallel
(vocabulary-sharded logits, ``loss_parallel()``) runs eager and with the model compiled with the passes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp_passes.testing import run_on_gloo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import fresh_compile_state, max_rel  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 22, 8, 4, 3
TOL = 1e-5


def _batches(n_data_ranks: int, data_rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(3)
    out = []
    per = GLOBAL_BATCH // n_data_ranks
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)[data_rank * per:(data_rank + 1) * per]
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _loss(fn, tokens, targets):
    import torch.nn.functional as F

    return F.cross_entropy(fn(tokens).float().flatten(0, 1), targets.flatten())


def _train(model, fn, batches: list, opt=None) -> list[float]:
    import torch

    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for tokens, targets in batches:
        loss = _loss(fn, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference() -> tuple[dict, list[float], dict]:
    """The unsharded model trained on the global batches: parameters, losses, and the first batch's gradients."""
    from fsdp_passes.testing.models import build_sequence_parallel_lm

    model = build_sequence_parallel_lm(VOCAB)
    tokens, targets = _batches(1, 0)[0]
    _loss(model, tokens, targets).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    losses = _train(model, model, _batches(1, 0))
    return {n: p.detach() for n, p in model.named_parameters()}, losses, grads


def _tp_dp(mesh, dp_mesh, seed: int = 0, loss_parallel: bool = False, **options):
    import fsdp_passes
    from fsdp_passes.testing.models import build_sequence_parallel_lm, sequence_parallel_plan
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_sequence_parallel_lm(VOCAB, seed=seed)
    parallelize_module(model, mesh, sequence_parallel_plan(model, loss_parallel=loss_parallel))
    return fsdp_passes.data_parallel(model, dp_mesh, **options)


def _full(model) -> dict:
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _full_optim_state(state: dict) -> dict:
    """An optimizer state dict's per-parameter entries (``get_optimizer_state_dict``: by FQN) as full tensors,
    keyed ``"<fqn>.<entry>"`` (cloned: a full_tensor() that needs no communication is the local tensor)."""
    import torch

    return {f"{fqn}.{key}": (value.full_tensor() if hasattr(value, "full_tensor") else torch.as_tensor(value)).clone()
            for fqn, entries in state["state"].items() for key, value in entries.items()}


def _rel_losses(got: list, want: list) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _global_losses(runs: list, key: str, ranks: tuple = (0, 2)) -> list[float]:
    """The global batch's losses: the mean of the data-parallel ranks' (``ranks``, one per dp index) losses."""
    per_rank = [runs[r][key]["losses"] for r in ranks]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def _rank(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    import fsdp_passes
    from fsdp_passes.testing.models import build_sequence_parallel_lm

    ref, ref_losses, ref_grads = _reference()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank(0)
    batches = _batches(2, dp_rank)
    out: dict = {}

    # eager, fp32, reshard after forward; then its checkpoint
    model = _tp_dp(mesh["tp"], mesh["dp"])
    states = [s for m in model.modules() for s in getattr(m, "_fsdp_shards", {}).values()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = _train(model, model, batches, opt)
    out["ref_losses"] = ref_losses
    out["eager"] = {"max_rel": max_rel(_full(model), ref), "losses": losses,
                    "placements": {n: str(p.placements) for n, p in model.named_parameters()},
                    "mesh_dims": {str(p.device_mesh.mesh_dim_names) for p in model.parameters()},
                    "padded": sorted(s.info.fqn for s in states if s.info.local_rows != s.storage.shape[0]),
                    "padding_zero": all(bool((s.storage[s.info.local_rows:] == 0).all()) for s in states)}
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    optim_dir = f"{ckpt_dir}/optim"  # the optimizer's state (by parameter FQN), a checkpoint of its own
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=optim_dir)
    full = _full(model)  # a collective: on every rank
    full_optim = _full_optim_state(get_optimizer_state_dict(model, opt))
    if rank == 0:  # what the checkpoint holds, for the load into the unsharded model in the test process
        torch.save(full, f"{ckpt_dir}/full.pt")
    restored = _tp_dp(mesh["tp"], mesh["dp"], seed=1)
    dcp.load(restored.state_dict(), checkpoint_id=ckpt_dir)
    tokens, targets = batches[0]
    out["dcp_same_layout"] = {
        "equal": all(torch.equal(p.to_local(), q.to_local())
                     for p, q in zip(model.parameters(), restored.parameters())),
        "same_loss": _loss(model, tokens, targets).item() == _loss(restored, tokens, targets).item()}
    # the same checkpoint loaded into other layouts on these 4 ranks: plain data_parallel over all 4 (no tensor
    # parallel), and tensor parallel over all 4 with one dp rank (22-row vocabulary: uneven tp parts 6/6/6/4);
    # each model starts from other values (seed 1), each optimizer from its initial state
    mesh_dp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    mesh_tp4 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    other_layouts = {}
    for name, other in (("dp4", fsdp_passes.data_parallel(build_sequence_parallel_lm(VOCAB, seed=1), mesh_dp4)),
                        ("dp1_tp4", _tp_dp(mesh_tp4["tp"], mesh_tp4["dp"], seed=1))):
        # cloned: with one dp rank a tp-replicated parameter's full_tensor() is its local tensor, which load overwrites
        before = {n: t.clone() for n, t in _full(other).items()}
        dcp.load(other.state_dict(), checkpoint_id=ckpt_dir)
        loaded = _full(other)
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
        optim_state = get_optimizer_state_dict(other, other_opt)  # zero moments, step 0
        optim_before = _full_optim_state(optim_state)
        dcp.load(optim_state, checkpoint_id=optim_dir)
        set_optimizer_state_dict(other, other_opt, optim_state)
        optim_loaded = _full_optim_state(get_optimizer_state_dict(other, other_opt))
        other_layouts[name] = {"differed_before": sorted(n for n in full if not torch.equal(before[n], full[n])),
                               "equal_after": sorted(n for n in full if torch.equal(loaded[n], full[n])),
                               "optim_differed_before": sorted(k for k in full_optim
                                                               if not torch.equal(optim_before[k], full_optim[k])),
                               "optim_equal_after": sorted(k for k in full_optim
                                                           if torch.equal(optim_loaded[k], full_optim[k])),
                               "placements": {n: str(p.placements) for n, p in other.named_parameters()}}
    out["dcp_other_layouts"] = other_layouts
    dist.barrier()

    # gradient accumulation: sync off for the first half of the local batch, on for the second
    model = _tp_dp(mesh["tp"], mesh["dp"])
    model.set_requires_gradient_sync(False)
    (_loss(model, tokens[:1], targets[:1]) / 2).backward()
    no_grad_while_off = all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    (_loss(model, tokens[1:], targets[1:]) / 2).backward()
    out["grad_sync"] = {"none_while_off": no_grad_while_off,
                        "max_rel": max_rel({n: p.grad.full_tensor() for n, p in model.named_parameters()},
                                           ref_grads)}

    # bf16 gathers with fp32 reductions, parameters kept after forward; and the same with float8 Linear gathers
    runs = {}
    for name, float8 in (("bf16", False), ("float8", True)):
        model = _tp_dp(mesh["tp"], mesh["dp"], reshard_after_forward=False, float8_all_gather=float8,
                       mp_policy=fsdp_passes.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
        gathered = model.layers[0].ffn.w1.weight  # read outside forward: the gathered tensor-parallel part
        runs[name] = {"losses": _train(model, model, batches), "max_rel": max_rel(_full(model), ref),
                      "gathered": (type(gathered).__name__, str(gathered.dtype), str(gathered.placements)),
                      "float8_params": sorted(i.fqn for i in fsdp_passes.frontend.sharded_params(model).values()
                                              if i.float8_all_gather)}
    out["mixed"] = runs

    # hybrid shard on a 3-D mesh (replicate 2, shard 1, tp 2): the data is split over the replicate dim
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = _tp_dp(mesh3["tp"], mesh3["replicate", "shard"], mode="hybrid_shard")
    losses = _train(model, model, _batches(2, mesh3.get_local_rank(0)))
    out["hybrid"] = {"max_rel": max_rel(_full(model), ref), "losses": losses,
                     "placements": {n: str(p.placements) for n, p in model.named_parameters()}}

    # compiled whole (fullgraph) without the passes, then with ``fsdp_passes.enable()``'s defaults
    compiled = {}
    for name in ("without", "with"):
        model = _tp_dp(mesh["tp"], mesh["dp"])
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if name == "with":
            fsdp_passes.enable()
        try:
            losses = _train(model, torch.compile(model, fullgraph=True), batches)
        finally:
            fsdp_passes.disable()
        reports = fsdp_passes.last_reports()
        compiled[name] = {"losses": losses, "params": {n: p.to_local().tolist() for n, p in model.named_parameters()},
                          "max_rel": max_rel(_full(model), ref),
                          "fallbacks": [r.fallback for r in reports if r.fallback],
                          "merged": {(r.graph.split("_")[1], r.pass_name): (r.n_collectives_before,
                                                                            r.n_collectives_after)
                                     for r in reports}}
    out["compiled"] = compiled

    # loss parallel: the output layer's logits stay sharded over the vocabulary (a DTensor), torch's
    # loss_parallel() computes the cross entropy without gathering them; the first batch's loss and gradients,
    # eager and with the model compiled with the passes (the loss itself outside the compiled region)
    runs = {}
    for name in ("eager", "compiled"):
        model = _tp_dp(mesh["tp"], mesh["dp"], loss_parallel=True)
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if name == "compiled":
            fsdp_passes.enable()
        try:
            fn = torch.compile(model, fullgraph=True) if name == "compiled" else model
            with loss_parallel():
                logits = fn(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
        finally:
            fsdp_passes.disable()
        runs[name] = {"logits": (type(logits).__name__, str(logits.placements)),
                      "loss": loss.full_tensor().item(),
                      "grads_max_rel": max_rel({n: p.grad.full_tensor() for n, p in model.named_parameters()},
                                               ref_grads),
                      "reports": [(r.graph.split("_")[1], r.pass_name, r.fallback) for r in fsdp_passes.last_reports()]}
    out["loss_parallel"] = runs
    return out


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tp_dcp")
    return run_on_gloo(4, _rank, str(ckpt), timeout=600), str(ckpt)


def test_parameters_are_2d_dtensors_strided_where_dp_and_tp_share_dim_0(tp_runs):
    eager = tp_runs[0][0]["eager"]
    placements = eager["placements"]
    assert placements["embed.weight"] == placements["output.weight"] == placements["layers.0.ffn.w1.weight"] \
        == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["layers.0.ffn.w2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["layers.0.norm.weight"] == placements["layers.0.ffn.w2.bias"] == "(Shard(dim=0), Replicate())"
    assert eager["mesh_dims"] == {"('dp', 'tp')"}
    # 11-row tensor-parallel parts over 2 dp ranks: dp rank 1 stores 5 rows and a zero padding row
    for out in tp_runs[0]:
        assert out["eager"]["padding_zero"]
    assert tp_runs[0][2]["eager"]["padded"] == ["embed.weight", "output.bias", "output.weight"]


def test_eager_trains_like_the_unsharded_model(tp_runs):
    runs = tp_runs[0]
    for rank, out in enumerate(runs):
        assert out["eager"]["max_rel"] < TOL, (rank, out["eager"]["max_rel"])
        # the two tensor-parallel ranks of a dp index compute the same loss
        assert out["eager"]["losses"] == runs[rank ^ 1]["eager"]["losses"], rank
    assert _rel_losses(_global_losses(runs, "eager"), runs[0]["ref_losses"]) < TOL


def test_compiled_with_and_without_the_passes_bitwise_and_like_the_unsharded_model(tp_runs):
    for rank, out in enumerate(tp_runs[0]):
        with_, without = out["compiled"]["with"], out["compiled"]["without"]
        assert with_["losses"] == without["losses"] and with_["params"] == without["params"], rank
        assert with_["max_rel"] < TOL and without["max_rel"] < TOL, (rank, with_["max_rel"], without["max_rel"])
        assert not with_["fallbacks"], with_["fallbacks"]
        # both graphs planned, the dp gathers / reductions merged
        fx = with_["merged"]
        assert set(fx) == {("fwd", "fx"), ("bwd", "fx"), ("fwd", "scheduler"), ("bwd", "scheduler")}, fx
        assert fx["fwd", "fx"][1] < fx["fwd", "fx"][0] and fx["bwd", "fx"][1] < fx["bwd", "fx"][0], fx


def test_gradient_accumulation_without_sync(tp_runs):
    for rank, out in enumerate(tp_runs[0]):
        assert out["grad_sync"]["none_while_off"], rank
        assert out["grad_sync"]["max_rel"] < TOL, (rank, out["grad_sync"])


def test_mixed_precision_and_float8_gathers(tp_runs):
    for rank, out in enumerate(tp_runs[0]):
        bf16, float8 = out["mixed"]["bf16"], out["mixed"]["float8"]
        # the module receives its tensor-parallel part as a bf16 DTensor on the tp mesh
        assert bf16["gathered"] == ("DTensor", "torch.bfloat16", "(Shard(dim=0),)"), bf16["gathered"]
        assert float8["float8_params"] == ["layers.0.ffn.w1.weight", "layers.0.ffn.w2.weight", "output.weight"]
        assert not bf16["float8_params"]
        # bf16 rounding of parameters and activations: 3 AdamW steps within 1e-2 of the float32 reference
        assert bf16["max_rel"] < 1e-2, (rank, bf16["max_rel"])
        # float8 weights (e4m3: 2^-4 relative rounding) move the losses by under 1 % against bf16 gathers
        assert _rel_losses(float8["losses"], bf16["losses"]) < 1e-2, (rank, float8["losses"], bf16["losses"])


def test_hybrid_shard_on_a_3d_mesh(tp_runs):
    runs = tp_runs[0]
    for rank, out in enumerate(runs):
        assert out["hybrid"]["max_rel"] < TOL, (rank, out["hybrid"]["max_rel"])
    # ranks 0 and 2: replicate index 0 and 1 (the mesh is (2, 1, 2))
    assert _rel_losses(_global_losses(runs, "hybrid"), runs[0]["ref_losses"]) < TOL
    placements = tp_runs[0][0]["hybrid"]["placements"]
    assert placements["output.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["layers.0.ffn.w2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"


def test_checkpoint_loads_into_other_layouts_on_the_same_ranks(tp_runs):
    names = sorted(tp_runs[0][0]["eager"]["placements"])
    for rank, out in enumerate(tp_runs[0]):
        for layout, got in out["dcp_other_layouts"].items():
            # every parameter started elsewhere and holds the saved (dp 2 x tp 2) values exactly after the load
            assert got["differed_before"] == names, (rank, layout, got["differed_before"])
            assert got["equal_after"] == names, (rank, layout, got["equal_after"])
            # and so does the AdamW state (both moments and the step count of every parameter)
            optim_names = sorted(f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step"))
            assert got["optim_differed_before"] == optim_names, (rank, layout, got["optim_differed_before"])
            assert got["optim_equal_after"] == optim_names, (rank, layout, got["optim_equal_after"])
    layouts = tp_runs[0][0]["dcp_other_layouts"]
    assert layouts["dp4"]["placements"]["output.weight"] == "(Shard(dim=0),)"
    assert layouts["dp1_tp4"]["placements"]["output.weight"] == "(_StridedShard(dim=0, sf=4), Shard(dim=0))"


def test_loss_parallel_eager_and_compiled_like_the_unsharded_model(tp_runs):
    runs = tp_runs[0]
    for name in ("eager", "compiled"):
        for rank, out in enumerate(runs):
            got = out["loss_parallel"][name]
            # the loss is computed on logits sharded over the vocabulary, never gathered
            assert got["logits"] == ("DTensor", "(Shard(dim=2),)"), (rank, name, got["logits"])
            assert got["grads_max_rel"] < TOL, (rank, name, got["grads_max_rel"])
            assert got["loss"] == runs[rank ^ 1]["loss_parallel"][name]["loss"], (rank, name)
        # the global batch's loss: the mean of the two dp ranks' (0 and 2) losses
        global_loss = (runs[0]["loss_parallel"][name]["loss"] + runs[2]["loss_parallel"][name]["loss"]) / 2
        assert abs(global_loss - runs[0]["ref_losses"][0]) / runs[0]["ref_losses"][0] < TOL, (name, global_loss)
    for rank, out in enumerate(runs):
        reports = out["loss_parallel"]["compiled"]["reports"]
        assert sorted((g, p) for g, p, _ in reports) == [("bwd", "fx"), ("bwd", "scheduler"), ("fwd", "fx"),
                                                         ("fwd", "scheduler")], (rank, reports)
        assert all(fallback is None for _, _, fallback in reports), (rank, reports)


def test_checkpoint_round_trip_same_layout_and_into_the_unsharded_model(tp_runs):
    import torch
    import torch.distributed.checkpoint as dcp

    from fsdp_passes.testing.models import build_sequence_parallel_lm

    for rank, out in enumerate(tp_runs[0]):
        assert out["dcp_same_layout"] == {"equal": True, "same_loss": True}, rank
    # the 2-D checkpoint loaded into one unsharded model, in this process: the trained values, exactly
    ckpt = tp_runs[1]
    model = build_sequence_parallel_lm(VOCAB, seed=1)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    saved = torch.load(f"{ckpt}/full.pt")
    assert set(saved) == set(state)
    for name, value in state.items():
        assert torch.equal(value, saved[name]), name
