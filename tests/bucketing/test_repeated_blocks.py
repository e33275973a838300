"""Blocks found without module names: the per-block plan of a graph whose collectives carry no FQN, from the
graph's repeated structure alone, against the same plan by the modules' names (the reference)."""

import dataclasses

import pytest

from fsdp_passes.bucketing.blocks import REPEAT, plan_per_block
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.graph import Dag, NodeKind
from fsdp_passes.testing import build_llama, capture_fx_graphs, example_inputs, fake_process_group


def _without_names(dag: Dag) -> Dag:
    nodes = [dataclasses.replace(n, origin=None, module_fqn=None, param_fqn=None)
             if n.kind is NodeKind.COLLECTIVE else n for n in dag.nodes]
    return Dag(nodes, list(dag.edges()))


N_LAYERS = 3  # a pattern repeated more than twice: a first, a middle and a last block


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no_reshard"])
def test_blocks_from_repeated_structure_are_the_layers(reshard):
    with fake_process_group(world_size=8):
        model = build_llama(n_layers=N_LAYERS, reshard_after_forward=reshard)
        graphs = capture_fx_graphs(model, *example_inputs(model))
    for gm, graph in ((graphs.forward, "forward"), (graphs.backward, "backward")):
        dag = dag_from_fx(gm.graph)
        by_names = {tuple(b.members) for b in plan_per_block(dag).buckets if b.label.startswith("block:layers.")}
        anonymous = _without_names(dag)
        assert all(not n.module_fqn for n in anonymous.nodes if n.kind is NodeKind.COLLECTIVE)
        plan = plan_per_block(anonymous)
        by_structure = {tuple(b.members) for b in plan.buckets if b.label.startswith(f"block:{REPEAT}.")}
        assert len(by_names) >= N_LAYERS
        if graph == "forward":
            assert by_structure == by_names
            # the rest (embedding, norm, output) stays alone
            assert all(len(b) == 1 for b in plan.buckets if b.label == "block:?")
        else:
            # as many blocks, each a layer up to one collective: the final norm's gradient looks like a
            # layer's norm, so a sequence may be cut one collective early (docs/bucketing.md)
            assert len(by_structure) == len(by_names)
            for members in by_structure:
                assert max(len(set(members) & set(layer)) for layer in by_names) >= len(members) - 1


def test_no_repetition_no_blocks():
    """Two collectives of different sizes repeat nothing: no block is made up."""
    from fsdp_passes.bucketing.blocks import repeated_blocks
    from fsdp_passes.testing import build_mlp

    with fake_process_group(world_size=8):
        model = build_mlp(n_layers=1, dim=32)
        graphs = capture_fx_graphs(model, *example_inputs(model))
    dag = _without_names(dag_from_fx(graphs.forward.graph))
    assert set(repeated_blocks(dag, dag.collectives()).values()) == {None}
