"""Tensor parallel under ``data_parallel`` on the fake process group: layouts, errors, and the passes on the 2-D
graphs (fake world 8 = dp 4 x tp 2 and 64 = dp 8 x tp 8): the tensor-parallel group's collectives as a compile
without the passes has them, the data-parallel group's merged (by the defaults, by a strict per-block plan, by the
planner under a memory budget that counts both groups' buffers).  Numerics: test_frontend_tp_gloo.py."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_passes
from fsdp_passes.frontend import data_parallel, sharded_params
from fsdp_passes.testing.models import build_sequence_parallel_lm, sequence_parallel_plan


def _lm(mesh, vocab: int = 22, n_layers: int = 1):
    model = build_sequence_parallel_lm(vocab, n_layers=n_layers)
    parallelize_module(model, mesh["tp"], sequence_parallel_plan(model))
    return data_parallel(model, mesh["dp"])


def test_the_gathered_part_is_the_tensor_parallel_local_part(fake_pg):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))  # rank 0: dp 0, tp 0
    model = _lm(mesh)
    infos = sharded_params(model)
    out = infos["output.weight"]  # (22, 16), ColwiseParallel: 11 rows on tp rank 0, 3 per dp rank (padded)
    assert (out.full_shape, out.gathered_shape, out.shard_shape, out.local_rows) == ((22, 16), (11, 16), (3, 16), 3)
    assert out.tensor_parallel == (Shard(0),) and out.world_size == 4
    assert out.group_name == mesh.get_group(0).group_name
    w2 = infos["layers.0.ffn.w2.weight"]  # (16, 24), RowwiseParallel: columns split by tp, rows by dp
    assert (w2.gathered_shape, w2.shard_shape, w2.tensor_parallel) == ((16, 12), (4, 12), (Shard(1),))
    p = model.output._parameters["weight"]
    assert p.shape == (22, 16) and p.to_local().shape == (3, 16)
    assert p.device_mesh.mesh_dim_names == ("dp", "tp") and p.placements == (_StridedShard(0, split_factor=2), Shard(0))
    # read outside forward: the module's view, a DTensor on the tp mesh with the tensor-parallel placement
    gathered = model.output.weight
    assert isinstance(gathered, DTensor) and gathered.placements == (Shard(0),)
    assert gathered.device_mesh == mesh["tp"] and gathered.to_local().shape == (11, 16) and gathered.shape == (22, 16)


def test_dtensors_it_cannot_shard_further_are_value_errors(fake_pg):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))

    def with_weight(value: DTensor) -> nn.Linear:
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(value)
        return lin

    full = torch.randn(4, 4)
    on_2d = with_weight(distribute_tensor(full, mesh, (Replicate(), Shard(0))))
    with pytest.raises(ValueError, match=r"parameter weight of module Linear is a DTensor on a 2-D mesh.*1-D tensor-"):
        data_parallel(on_2d, mesh["dp"])
    partial = with_weight(DTensor.from_local(full, mesh["tp"], (Partial(),)))
    with pytest.raises(ValueError, match=r"weight .* placement Partial\(sum\); supported .* Shard\(dim\), Replicate"):
        data_parallel(partial, mesh["dp"])
    on_dp = with_weight(distribute_tensor(full, mesh["dp"], (Shard(0),)))
    with pytest.raises(ValueError, match=r"does not combine with mesh=.*distinct named dimensions of one DeviceMesh"):
        data_parallel(on_dp, mesh["dp"])
    other_root = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    elsewhere = with_weight(distribute_tensor(full, other_root, (Replicate(),)))
    with pytest.raises(ValueError, match=r"does not combine with mesh="):
        data_parallel(elsewhere, mesh["dp"])


# -- the passes on the 2-D graphs: one module-scoped set of compiles shared by the tests below ---------------------

N_LAYERS = 2
#: one bucket per transformer block, the embedding, and the final norm with the output projection
BLOCK_PLAN = ["embed", f"layers.[0-{N_LAYERS - 1}]", ["norm", "output"]]
BLOCK_PLAN_ENTRIES = [["embed"], *[[f"layers.{i}"] for i in range(N_LAYERS)], ["norm", "output"]]
BUDGET_BYTES = 1000  # a few shards' worth at these sizes: the planner can merge some, not all
CONFIGS = {
    "without": None,
    "defaults": {},
    "block_plan": dict(bucketing="manual", bucket_plan=BLOCK_PLAN, strict=True),
    "auto_budget": dict(bucketing="auto", memory_budget=BUDGET_BYTES, strict=True),
}


@dataclass
class _Run:
    """One compile, measured on Inductor's final scheduler order of each graph (``"forward"``, ``"backward"``)."""

    sequences: dict[str, dict[str, list[str]]]  # graph -> process group -> "op group bytes dtype"
    peak_bytes: dict[str, int]  # graph -> simulated peak of the final order
    peak_bytes_without_tp_buffers: dict[str, int]  # the same order with the tp collectives' outputs sized 0
    reports: list  # fsdp_passes.last_reports() of this compile
    warnings: list[str]  # UserWarnings and RuntimeWarnings raised while compiling


@dataclass
class _TwoD:
    world_size: int
    dp: str
    tp: str
    dp_gathered_bytes: dict[str, int]  # parameter FQN -> bytes of its dp all-gather (the tp-local part, padded)
    runs: dict[str, _Run]


def _compile_2d(mesh, vocab: int, seq: int, options) -> _Run:
    from fsdp_passes.dag.graph import NodeKind
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
    from fsdp_passes.simulate import peak_memory
    from fsdp_passes.testing.capture import capture_scheduler_nodes

    tp = mesh.get_group(1).group_name
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    fsdp_passes.last_reports(clear=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captures = capture_scheduler_nodes(_lm(mesh, vocab, N_LAYERS), tokens, options=options)
    torch._dynamo.reset()
    run = _Run({}, {}, {}, fsdp_passes.last_reports(),
               [str(w.message) for w in caught if issubclass(w.category, (UserWarning, RuntimeWarning))])
    for capture in captures:
        with capture.graph_context():
            dag = dag_from_scheduler_nodes(capture.after)
        order = list(range(len(dag)))
        per_group: dict[str, list[str]] = {}
        for node in dag.nodes:
            if node.kind is NodeKind.COLLECTIVE:
                per_group.setdefault(node.group_name, []).append(
                    f"{node.collective.value} {node.group_name} {node.comm_bytes} {node.dtype}")
        run.sequences[capture.graph_name] = per_group
        run.peak_bytes[capture.graph_name] = peak_memory(dag, order)
        for node in dag.nodes:
            if node.kind is NodeKind.COLLECTIVE and node.group_name == tp:
                node.out_bytes, node.output_buffers = 0, ()
        run.peak_bytes_without_tp_buffers[capture.graph_name] = peak_memory(dag, order)
    return run


@pytest.fixture(scope="module", params=[(8, (4, 2), 22, 8), (64, (8, 8), 64, 16)], ids=["world8", "world64"])
def two_d(request) -> _TwoD:
    """dp x tp on a fake process group, the model of ``_lm`` with ``N_LAYERS`` blocks compiled once per entry of
    ``CONFIGS`` (up to the scheduler's final order; caches off, as ``fresh_inductor``).  The process group is
    gone when the tests run: they read only these results."""
    import math

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from fsdp_passes.testing import fake_process_group

    world_size, shape, vocab, seq = request.param
    torch._dynamo.reset()
    with fake_process_group(world_size, 0), inductor_config.patch(
            fx_graph_cache=False, fx_graph_remote_cache=False), functorch_config.patch(enable_autograd_cache=False):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        infos = sharded_params(_lm(mesh, vocab, N_LAYERS))
        gathered = {fqn: math.prod(i.shard_shape) * i.world_size * 4 for fqn, i in infos.items()}  # fp32
        runs = {name: _compile_2d(mesh, vocab, seq, options) for name, options in CONFIGS.items()}
        out = _TwoD(world_size, mesh.get_group(0).group_name, mesh.get_group(1).group_name, gathered, runs)
    torch._dynamo.reset()
    return out


def _ops(sequence: list[str], op: str) -> list[int]:
    """The payload bytes of ``sequence``'s collectives of kind ``op``, in issue order."""
    return [int(item.split(" ")[2]) for item in sequence if item.split(" ")[0] == op]


def test_the_passes_keep_the_tensor_parallel_collectives_and_merge_the_data_parallel_ones(two_d):
    """``fsdp_passes.enable()``'s defaults: each graph's tp-group collectives (all-gathers, reduce-scatters and
    all-reduces of activations and of the replicated parameters' gradients) are the same ops, payloads and order
    as in a compile without the passes; the dp group's are merged into fewer."""
    with_, without = two_d.runs["defaults"], two_d.runs["without"]
    assert not [r.fallback for r in with_.reports if r.fallback]
    assert set(with_.sequences) == set(without.sequences) == {"forward", "backward"}
    dp, tp = two_d.dp, two_d.tp
    for graph in ("forward", "backward"):
        w, wo = with_.sequences[graph], without.sequences[graph]
        assert w[tp] == wo[tp] and len(wo[tp]) >= 3, (graph, w[tp], wo[tp])
        assert len(w[dp]) < len(wo[dp]), (graph, w[dp], wo[dp])


def test_a_strict_per_block_plan_merges_the_data_parallel_group_per_block(two_d):
    """``bucketing="manual", strict=True`` with one plan entry per block in the compiled module's names: no
    fallback, no warning (strict would raise on an entry that matched nothing); the dp group's collectives are
    one per plan entry and op, their payloads the sums of the entry's parameters' gathers, worked out here from
    the frontend's shard shapes; the tp group's collectives as without the passes."""
    run, without = two_d.runs["block_plan"], two_d.runs["without"]
    assert not [r.fallback for r in run.reports if r.fallback] and run.reports
    assert run.warnings == []

    def entry_bytes(entry: list[str], needed_in_backward: bool = False) -> int:
        def in_entry(fqn: str) -> bool:
            return any(fqn == p or fqn.startswith(p + ".") for p in entry)

        # backward re-gathers only what the gradients need: a bias enters them only through its own gradient,
        # an embedding's gradient needs only the token ids
        return sum(b for fqn, b in two_d.dp_gathered_bytes.items() if in_entry(fqn) and not (
            needed_in_backward and (fqn.endswith(".bias") or fqn.startswith("embed."))))

    assert sum(entry_bytes(e) for e in BLOCK_PLAN_ENTRIES) == sum(two_d.dp_gathered_bytes.values())  # all claimed
    forward_gathers = [entry_bytes(e) for e in BLOCK_PLAN_ENTRIES]
    backward_regathers = [b for b in (entry_bytes(e, True) for e in reversed(BLOCK_PLAN_ENTRIES)) if b]
    gradient_scatters = list(reversed(forward_gathers))
    assert len(backward_regathers) == N_LAYERS + 1  # every block and [norm, output]; the embedding is not
    dp, tp = two_d.dp, two_d.tp
    forward, backward = run.sequences["forward"], run.sequences["backward"]
    assert (_ops(forward[dp], "all_gather"), _ops(forward[dp], "reduce_scatter")) == (forward_gathers, [])
    assert _ops(backward[dp], "all_gather") == backward_regathers
    assert _ops(backward[dp], "reduce_scatter") == gradient_scatters
    assert len(forward[dp]) + len(backward[dp]) == len(forward_gathers) + len(backward_regathers) + len(
        gradient_scatters)
    for graph in ("forward", "backward"):
        assert run.sequences[graph][tp] == without.sequences[graph][tp], graph
        assert len(without.sequences[graph][dp]) > len(run.sequences[graph][dp]), graph


def test_the_memory_budget_holds_with_both_groups_buffers_counted(two_d):
    """``bucketing="auto"`` with ``memory_budget`` in bytes: each graph's final peak, as the scheduler pass reports
    it and as measured on the final order here, is at most the peak of a compile without the passes plus the
    budget; the reported peak counts the tp group's buffers (it is the peak of the final order with them, and the
    forward graph's peak is lower with the tp collectives' outputs sized 0: tp buffers are live at it);
    the planner still merged dp collectives under the budget, and left the tp group's sequence as it was."""
    run, without = two_d.runs["auto_budget"], two_d.runs["without"]
    assert not [r.fallback for r in run.reports if r.fallback]
    scheduler = {"fwd" in r.graph and "forward" or "backward": r for r in run.reports if r.pass_name == "scheduler"}
    assert set(scheduler) == set(run.peak_bytes) == {"forward", "backward"}
    for graph, report in scheduler.items():
        assert report.budget.memory_budget_bytes == BUDGET_BYTES
        limit = without.peak_bytes[graph] + BUDGET_BYTES
        assert report.peak_memory_bytes_after == run.peak_bytes[graph] <= limit, (graph, run.peak_bytes, limit)
        assert run.sequences[graph][two_d.tp] == without.sequences[graph][two_d.tp], graph
    assert run.peak_bytes["forward"] > run.peak_bytes_without_tp_buffers["forward"]
    dp = two_d.dp
    assert sum(len(s[dp]) for s in run.sequences.values()) < sum(len(s[dp]) for s in without.sequences.values())


def test_pipeline_stages_of_the_sequence_parallel_lm():
    from fsdp_passes.testing.models import sequence_parallel_lm_stage

    full = build_sequence_parallel_lm(n_layers=4)
    first = sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 0, 2)
    last = sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 1, 2)
    assert first.norm is None and first.output is None and last.embed is None and len(last.layers) == 2
    # the stages' plans name only what each stage holds
    first_plan, last_plan = set(sequence_parallel_plan(first)), set(sequence_parallel_plan(last))
    assert {"embed", "layers.1.ffn.w2"} <= first_plan and not {"norm", "output"} & first_plan
    assert {"norm", "output", "layers.1.ffn.w2"} <= last_plan and "embed" not in last_plan
    tokens = torch.randint(0, 22, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(last(first(tokens)), full(tokens))
    with pytest.raises(ValueError, match="stage=2; expected 0 <= stage < n_stages=2"):
        sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 2, 2)
    with pytest.raises(ValueError, match="n_stages=3 does not divide the model's 4 layers"):
        sequence_parallel_lm_stage(build_sequence_parallel_lm(n_layers=4), 0, 3)
