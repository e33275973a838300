"""Each collective kind's record (``fsdp_passes.dag.collectives.KINDS``) against facts from outside it: torch's
own functional ops and their schemas, what they output on a fake process group, the DAG built from a traced
graph, and nccl-tests' bus-bandwidth factors."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_passes.dag.collectives import KINDS, kind_of
from fsdp_passes.dag.from_fx import dag_from_fx
from fsdp_passes.dag.graph import CollectiveOp, NodeKind
from fsdp_passes.dag.ops import classify
from fsdp_passes.testing.process_group import fake_process_group

C10D = torch.ops._c10d_functional
WORLD = 4
ISSUED = [k for k in KINDS.values() if k.op is not CollectiveOp.OTHER]


def test_one_record_per_kind():
    assert set(KINDS) == set(CollectiveOp)
    assert all(KINDS[op].op is op for op in KINDS)
    assert kind_of("all_gather") is KINDS[CollectiveOp.ALL_GATHER]


@pytest.mark.parametrize("kind", ISSUED, ids=lambda k: k.op.value)
def test_ops_are_torchs_functional_collectives(kind):
    for name in kind.ops:
        assert hasattr(C10D, name), name
        assert classify(f"_c10d_functional.{name}.default") == (NodeKind.COLLECTIVE, kind.op)
    schema = getattr(C10D, kind.ops[0]).default._schema
    names = [a.name for a in schema.arguments if not a.kwarg_only][1:]  # after the input tensor
    if kind.args:
        assert tuple(names) == kind.args
    else:
        assert names[-1] == "group_name"


@pytest.mark.parametrize("kind", [k for k in KINDS.values() if k.bucketable], ids=lambda k: k.op.value)
def test_bucket_op_is_the_single_tensor_op(kind):
    ns, name, overload = kind.bucket_op.split(".")
    assert ns == "_c10d_functional" and name == kind.ops[0]
    assert overload in getattr(C10D, name).overloads()


def test_eager_calls_exist():
    for kind in KINDS.values():
        if kind.eager:
            assert any(hasattr(dist, name) for name in kind.eager), kind.op


def _calls(name):
    return {
        CollectiveOp.ALL_GATHER: lambda x: C10D.all_gather_into_tensor(x, WORLD, name),
        CollectiveOp.REDUCE_SCATTER: lambda x: C10D.reduce_scatter_tensor(x, "sum", WORLD, name),
        CollectiveOp.ALL_REDUCE: lambda x: C10D.all_reduce(x, "sum", name),
        CollectiveOp.ALL_TO_ALL: lambda x: C10D.all_to_all_single(x, [x.shape[0] // WORLD] * WORLD,
                                                                  [x.shape[0] // WORLD] * WORLD, name),
    }


@pytest.mark.parametrize("kind", ISSUED, ids=lambda k: k.op.value)
def test_sizes_agree_with_a_real_call(kind):
    """What the functional op outputs on a fake group, and the payload, shard and group the DAG reads off
    the traced call, follow from the record."""
    with fake_process_group(WORLD) as pg:
        call = _calls(pg.group_name)[kind.op]
        x = torch.ones(8 * WORLD, dtype=torch.bfloat16)
        out = C10D.wait_tensor(call(x))
        assert out.numel() == kind.output_numel(x.numel(), WORLD)
        assert kind.input_numel(max(out.numel(), x.numel()), WORLD) == x.numel()

        graph = make_fx(lambda t: C10D.wait_tensor(call(t)))(x).graph
        node = next(n for n in dag_from_fx(graph).nodes if n.collective is kind.op)
    assert node.in_bytes == 2 * x.numel() and node.out_bytes == 2 * out.numel()
    # NCCL's convention: the payload is the full size, the larger side
    assert node.comm_bytes == kind.comm_bytes(node.in_bytes, node.out_bytes) == max(node.in_bytes, node.out_bytes)
    if kind.shard_field is not None:
        assert getattr(node, kind.shard_field) * WORLD == getattr(node, kind.full_field) == node.comm_bytes
    else:
        assert node.in_bytes == node.out_bytes
    assert node.group_size == WORLD and node.group_name == pg.group_name
    assert (node.reduce_op == "sum") == kind.reduces


@pytest.mark.parametrize("op, factor", [
    (CollectiveOp.ALL_GATHER, lambda n: (n - 1) / n),       # nccl-tests doc/PERFORMANCE.md busbw factors
    (CollectiveOp.REDUCE_SCATTER, lambda n: (n - 1) / n),
    (CollectiveOp.ALL_REDUCE, lambda n: 2 * (n - 1) / n),
])
def test_ring_bytes_are_nccl_tests_bus_factors(op, factor):
    for n in (2, 8, 64):
        assert KINDS[op].ring_wire_bytes(1 << 20, n) == pytest.approx((1 << 20) * factor(n))
