"""``predict_memory_reorder`` / ``inductor_peak_estimate`` on hand-built DAGs whose peaks are worked out by hand.

The comparison with Inductor's own reordering of its own nodes is in ``test_fusion_estimate.py``.
"""

from fsdp_passes.dag.graph import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.dag.memory_reorder import inductor_peak_estimate, predict_memory_reorder
from fsdp_passes.simulate import peak_memory


def _compute(name, out_bytes, **kw):
    return DagNode(name=name, kind=NodeKind.COMPUTE, op="kernel", out_bytes=out_bytes, **kw)


def test_a_freeable_input_counts_until_its_last_reader_and_a_parameter_not_at_all():
    # a reads the saved activation "relu" (100 B) and the parameter shard "primals_1"; b reads a
    dag = Dag([_compute("a", 10, input_reads={"relu": 100, "primals_1": 1000}), _compute("b", 1)], [(0, 1)])
    # step 0: relu + a = 110; step 1: a + b = 11 (relu freed after a)
    assert inductor_peak_estimate(dag, [0, 1]) == 110
    assert peak_memory(dag, [0, 1]) == 11  # the simulator counts no graph input


def test_graph_output_part_of_a_kernel_lives_to_the_end_the_rest_is_freed():
    # k writes 40 B, 30 of them returned; r reads k
    dag = Dag([_compute("k", 40, is_output=True, graph_output_bytes=30), _compute("r", 5)], [(0, 1)])
    assert inductor_peak_estimate(dag, [0, 1]) == 45
    dag.nodes.append(_compute("s", 50))
    dag = Dag(dag.nodes, [(0, 1)])
    # after r the 10 B part is freed: s runs with the 30 B returned part only
    assert inductor_peak_estimate(dag, [0, 1, 2]) == 80


def test_inductors_estimate_counts_each_buffer_of_a_kernel_until_its_own_reader():
    from fsdp_passes.dag.graph import OutputBuffer

    # k writes a (40 B, read by r1), b (20 B, read by r2) and t (100 B, read inside k only: Inductor counts it
    # at k's step, then frees it); x runs between r1 and r2
    bufs = (OutputBuffer(40, ("r1",)), OutputBuffer(20, ("r2",)), OutputBuffer(100, allocated=False))
    nodes = [_compute("k", 60, non_owning_bytes=100, output_buffers=bufs), _compute("r1", 1), _compute("x", 30),
             _compute("r2", 1)]
    dag = Dag(nodes, [(0, 1), (0, 3), (1, 2)])
    # step k: 160 (t freed after k); r1: 60 + 1; x: 20 + 1 + 30 (a freed after r1); r2: 20 + 1
    assert inductor_peak_estimate(dag, [0, 1, 2, 3]) == 160
    nodes[0] = _compute("k", 60, output_buffers=bufs[:2])
    dag = Dag(nodes, [(0, 1), (0, 3), (1, 2)])
    assert inductor_peak_estimate(dag, [0, 1, 2, 3]) == 61  # as one 60 B buffer: 91 at x
    assert peak_memory(dag, [0, 1, 2, 3]) == 61


def test_a_wide_fan_out_in_graph_order_is_reordered_like_inductor():
    # x (big) feeds y; four small independent producers p_i each feed a consumer c_i.  The graph order makes
    # x, then all p_i, then y: x is live while the p_i's outputs pile up.  Running each c_i right after its p_i
    # (depth first, or least peak first) frees them at once.
    nodes = [_compute("x", 100)]
    edges = []
    for i in range(4):
        nodes.append(_compute(f"p{i}", 50))
    nodes.append(_compute("y", 1))
    edges.append((0, 5))
    for i in range(4):
        nodes.append(_compute(f"c{i}", 1))
        edges.append((1 + i, 6 + i))
    dag = Dag(nodes, edges)
    graph_order = list(range(len(dag)))
    order = predict_memory_reorder(dag)
    assert dag.order_violations(order) == []
    assert inductor_peak_estimate(dag, graph_order) == 100 + 4 * 50 + 1
    assert inductor_peak_estimate(dag, order) < inductor_peak_estimate(dag, graph_order)
    assert peak_memory(dag, order) < peak_memory(dag, graph_order)


def test_collectives_keep_a_global_order_and_each_follows_the_previous_wait():
    def coll(name, group):
        return DagNode(name=name, kind=NodeKind.COLLECTIVE, op="all_gather", collective=CollectiveOp.ALL_GATHER,
                       group_name=group, out_bytes=64, comm_bytes=64)

    def wait(name, c):
        return DagNode(name=name, kind=NodeKind.WAIT, op="wait_tensor", alias_of=c, collective_of=c)

    # two groups, collectives issued c0 (g0), c1 (g1); each wait read by a consumer
    nodes = [coll("c0", "0"), wait("w0", 0), coll("c1", "1"), wait("w1", 2), _compute("u0", 1), _compute("u1", 1)]
    dag = Dag(nodes, [(0, 1), (2, 3), (1, 4), (3, 5)])
    order = predict_memory_reorder(dag)
    pos = {v: k for k, v in enumerate(order)}
    assert pos[0] < pos[1] < pos[2] < pos[3]
