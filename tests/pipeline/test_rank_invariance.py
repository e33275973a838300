"""Every process group issues the same collectives in the same order on every rank, whatever the rank's local
batch, sequence length or dynamic size hints: the sequences are read from Inductor's final scheduler order.

Models from ``fsdp_passes.testing`` (reshard on/off, bf16 parameters with fp32 reduction, HSDP, TP + FSDP,
Llama) are compiled at several local shapes with ``bucketing`` auto / manual / none, ``reorder=True`` and
memory budgets 0, "5%", "100%" and bytes; every value of every axis appears, in a subset of the full product
that keeps the file within a few minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fsdp_passes
from fsdp_passes.testing import build_llama, build_mlp, example_inputs
from fsdp_passes.testing.end_to_end import measure_compile

PER_BLOCK = dict(bucketing="manual", bucket_plan=["layers.[0-1]"])
AUTO = dict(bucketing="auto", cluster="cpu-gloo")  # a cluster where merging pays on these small models
NONE = dict(bucketing="none")


def _mlp(**kw):
    # two blocks: the plans still choose what to merge and prefetch between blocks
    return build_mlp(2, 64, **kw)


def _llama(seq_len, n_layers=2):
    return build_llama(n_layers, 64, seq_len=seq_len, reshard_after_forward=True)


def _sequences(make_model, batch, options, *, dims=None):
    """Per graph, per process group: the collective sequence of Inductor's final order."""
    model = make_model()
    inputs = example_inputs(model, batch=batch, seed=0)
    for d in dims or ():
        torch._dynamo.mark_dynamic(inputs[0], d)
    fsdp_passes.last_reports(clear=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # manual buckets over a small budget are split with a warning
        measures = measure_compile(model, *inputs, options=options)
    assert not [r.fallback for r in fsdp_passes.last_reports() if r.fallback]
    return {m.graph_name: m.sequences for m in measures}


def _assert_same(per_shape: dict, ignore_bytes_of: frozenset = frozenset()):
    """The sequences of every shape equal the first shape's (for the groups in ``ignore_bytes_of``, op and dtype
    only: their payloads are activations, which legitimately differ with the batch)."""

    def view(seqs):
        return {g: {grp: [s.split(" ")[0] + " " + s.split(" ")[3] if grp in ignore_bytes_of else s for s in items]
                    for grp, items in groups.items()} for g, groups in seqs.items()}

    shapes = list(per_shape)
    ref = view(per_shape[shapes[0]])
    assert ref and any(ref.values())
    for shape in shapes[1:]:
        assert view(per_shape[shape]) == ref, f"collective sequences differ between shapes {shapes[0]} and {shape}"


CASES = [
    # (id, model factory, options, local batch sizes)
    # a small, an odd and a large batch: where a size-hint-sensitive choice would show
    ("mlp-auto-100%", lambda: _mlp(reshard_after_forward=True), dict(AUTO, memory_budget="100%"), [1, 3, 64]),
    ("mlp-noreshard-auto-bytes", lambda: _mlp(reshard_after_forward=False), dict(AUTO, memory_budget=100_000), [2, 8]),
    ("mlp-bf16-manual-100%", lambda: _mlp(reshard_after_forward=True, param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32), dict(PER_BLOCK, memory_budget="100%"), [3, 64]),
    ("mlp-none-reorder-0", lambda: _mlp(reshard_after_forward=True), dict(NONE, memory_budget=0), [2, 64]),
]


@pytest.fixture(scope="module")
def sequences_of_cases():
    """``(case id, batch) -> sequences`` of the compiles of ``CASES``, kept for the module's other tests."""
    return {}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_sequences_for_every_local_batch(fake_pg, fresh_inductor, sequences_of_cases, case):
    name, make, options, batches = case
    per_shape = {b: _sequences(make, b, dict(options, reorder=True)) for b in batches}
    sequences_of_cases.update(((name, b), seqs) for b, seqs in per_shape.items())
    _assert_same(per_shape)
    if options.get("memory_budget") == "100%" and options["bucketing"] != "none":
        # the case is not vacuous: something was bucketed
        plain = _sequences(make, batches[0], dict(NONE, reorder=False))
        assert sum(map(len, per_shape[batches[0]]["backward"].values())) < sum(map(len, plain["backward"].values()))


LLAMA_CASES = [
    ("auto-100%", dict(AUTO, memory_budget="100%"), [(1, 17), (3, 128)]),
    ("manual-5%", dict(bucketing="manual", bucket_plan=["tok_embeddings", "layers.[0-1]", ["norm", "output"]],
                       memory_budget="5%"), [(8, 17), (1, 128)]),
]


@pytest.mark.parametrize("case", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_llama_same_sequences_for_every_batch_and_sequence_length(fake_pg, fresh_inductor, case):
    _, options, shapes = case
    per_shape = {(b, s): _sequences(lambda s=s: _llama(s), b, dict(options, reorder=True)) for b, s in shapes}
    _assert_same(per_shape)


def test_hsdp_same_sequences_for_every_local_batch(fake_pg, fresh_inductor):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_passes.testing.models import hsdp

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    per_shape = {b: _sequences(lambda: hsdp(_mlp(fsdp=False), mesh), b,
                               dict(AUTO, memory_budget="100%", reorder=True)) for b in (1, 3)}
    _assert_same(per_shape)
    assert len(per_shape[1]["backward"]) == 2  # shard and replicate groups


def test_tp_fsdp_same_fsdp_sequences_for_every_local_batch(fake_pg, fresh_inductor):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_passes.testing.models import build_tp_mlp

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group(0), mesh.get_group(1)
    per_shape = {b: _sequences(lambda: build_tp_mlp(2, 64, tp_group=tp, dp_group=dp), b,
                               dict(AUTO, memory_budget="5%", bucket_non_fsdp=False, reorder=True)) for b in (2, 64)}
    # the TP group's all-reduces carry activations: same ops in the same order, payloads follow the batch
    _assert_same(per_shape, ignore_bytes_of=frozenset({tp.group_name}))
    assert dp.group_name in per_shape[2]["backward"]


def test_mark_dynamic_with_different_first_sizes(fake_pg, fresh_inductor):
    make = lambda: _mlp(reshard_after_forward=True)  # noqa: E731
    options = dict(AUTO, memory_budget="100%", reorder=True)
    per_hint = {b: _sequences(make, b, options, dims=[0]) for b in (3, 64)}
    _assert_same(per_hint)


def test_dynamic_shapes_everywhere_with_different_first_sizes(fake_pg, fresh_inductor):
    """``torch.compile(dynamic=True)``: every input dimension symbolic (sequence length and batch)."""
    with torch._dynamo.config.patch(assume_static_by_default=False, automatic_dynamic_shapes=True):
        # one layer: the symbolic dimensions are those of every layer
        per_hint = {(b, s): _sequences(lambda s=s: _llama(s, n_layers=1), b,
                                       dict(AUTO, memory_budget="100%", reorder=True))
                    for b, s in ((2, 17), (5, 64))}
    _assert_same(per_hint)


_CHILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch._inductor.config as ic
    ic.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    from fsdp_passes.testing import build_mlp, example_inputs, fake_process_group
    from fsdp_passes.testing.end_to_end import measure_compile
    batch, options = int(sys.argv[1]), json.loads(sys.argv[2])
    with fake_process_group(world_size=8):
        model = build_mlp(2, 64, reshard_after_forward=True)  # the model of CASES[0]
        measures = measure_compile(model, *example_inputs(model, batch=batch, seed=0), options=options)
    print("SEQUENCES=" + json.dumps({m.graph_name: m.sequences for m in measures}, sort_keys=True))
""")


def test_plans_identical_across_processes_with_different_hash_seeds(fake_pg, fresh_inductor, sequences_of_cases):
    """This process and a child process with another PYTHONHASHSEED (and another local batch) plan the same
    sequences: the child compiles the first of ``CASES`` (strict), this process's compile of it is reused."""
    name, make, options, batches = CASES[0]
    options = dict(options, reorder=True)
    if (name, batches[0]) not in sequences_of_cases:  # this test run alone
        sequences_of_cases[name, batches[0]] = _sequences(make, batches[0], options)
    here = sequences_of_cases[name, batches[0]]
    own_seed = os.environ.get("PYTHONHASHSEED")
    child_seed = "12345" if own_seed != "12345" else "0"
    # this process hashes with a random key, or with a fixed seed that is not the child's
    assert own_seed not in (None, "random") or sys.flags.hash_randomization
    env = dict(os.environ, PYTHONHASHSEED=child_seed, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(batches[1]), json.dumps(dict(options, strict=True))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SEQUENCES="))
    assert json.loads(line[len("SEQUENCES="):]) == here
    assert here["forward"] and here["backward"]


# -- a real gloo group: ranks with different local batches train without hanging --------------------------------

def _train_with_different_batches(rank: int, world_size: int) -> dict:
    import torch._dynamo
    import torch._inductor.config as ic

    import fsdp_passes
    from fsdp_passes.testing import build_mlp

    ic.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()
    model = build_mlp(2, 32, reshard_after_forward=True)
    batch = (2, 5)[rank]  # every rank a different local batch
    fsdp_passes.enable(bucketing="auto", memory_budget="100%", reorder=True, strict=True, cluster="cpu-gloo")
    try:
        step = torch.compile(lambda x: model(x).square().mean())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for i in range(3):
            (x,) = example_inputs(model, batch=batch, seed=10 * i + rank)
            loss = step(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fsdp_passes.verify_rank_consistency()
        merged = [r.n_collectives_before - r.n_collectives_after for r in fsdp_passes.last_reports()
                  if r.pass_name == "fx"]
    finally:
        fsdp_passes.disable()
    return {"losses": losses, "merged": merged}


def test_gloo_ranks_with_different_batches_train_three_steps():
    from fsdp_passes.testing import run_on_gloo

    # a rank that issued another collective sequence would block in gloo until the timeout: a failure
    results = run_on_gloo(2, _train_with_different_batches, timeout=600)
    for res in results:
        assert len(res["losses"]) == 3 and all(v == v for v in res["losses"])
        assert any(m > 0 for m in res["merged"])  # the passes did bucket
