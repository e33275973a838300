"""Inductor's generated code follows the order the reordering pass returned."""

import re

import torch

import fsdp_passes
from fsdp_passes.dag import NodeKind
from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
from fsdp_passes.testing import build_mlp, example_inputs


def test_generated_code_follows_the_pass_order(fake_pg, fresh_inductor, monkeypatch):
    """Full compile: the sequence of all-gather issues, waits and matmuls in Inductor's output code is the
    order the pass returned."""
    from torch._inductor.utils import run_and_get_code

    from fsdp_passes.inductor import scheduler_pass

    returned = []
    original = scheduler_pass.reorder_scheduler_nodes

    def recording(nodes, options, **kw):
        order, report = original(nodes, options, **kw)
        returned.append(order)
        return order, report

    monkeypatch.setattr(scheduler_pass, "reorder_scheduler_nodes", recording)
    model = build_mlp(n_layers=3, dim=32, reshard_after_forward=False)
    (x,) = example_inputs(model)
    fsdp_passes.enable(bucketing="none", memory_budget="100%")
    try:
        with torch.no_grad():
            _, codes = run_and_get_code(torch.compile(model), x)
    finally:
        fsdp_passes.disable()
    assert len(returned) == 1
    expected = []
    for snode in returned[0]:
        dag_node = dag_from_scheduler_nodes([snode], graph_outputs=set())[0]
        if dag_node.kind is NodeKind.COLLECTIVE:
            expected.append(("issue", snode.get_outputs()[0].get_name()))
        elif dag_node.kind is NodeKind.WAIT:
            mutated = [m for b in snode.get_outputs() for m in b.get_mutations()]
            expected.append(("wait", mutated[0]))
        elif "mm" in dag_node.op:
            expected.append(("mm", snode.get_outputs()[0].get_name()))
    code = codes[0]
    pattern = re.compile(
        r"(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor"
        r"|wait_tensor\.default\((buf\d+)\)"
        r"|extern_kernels\.(?:addmm|mm)\(.*out=(buf\d+)\)"
    )
    seen = []
    for m in pattern.finditer(code):
        if m.group(1):
            seen.append(("issue", m.group(1)))
        elif m.group(2):
            seen.append(("wait", m.group(2)))
        else:
            seen.append(("mm", m.group(3)))
    assert seen == expected
    assert any(kind == "issue" for kind, _ in seen) and any(kind == "mm" for kind, _ in seen)
    # and the pass did reorder: some all-gather is issued after a matmul's predecessor wait ... before a matmul
    first_mm = next(i for i, (k, _) in enumerate(seen) if k == "mm")
    issues_before_first_mm = sum(1 for k, _ in seen[:first_mm] if k == "issue")
    assert issues_before_first_mm >= 3  # layer 0's weight and bias plus at least one prefetch of layer 1
