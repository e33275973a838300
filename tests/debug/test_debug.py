"""Debug dumps: every file's content, dag.json round trip, summaries against the simulator, artifacts, logs."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest

from fsdp_passes import Options
from fsdp_passes.dag.graph import CollectiveOp, Dag, DagNode, NodeKind
from fsdp_passes.debug import (
    DUMP_FILES,
    SUMMARY_KEYS,
    DagJsonError,
    dag_from_json,
    dag_to_json,
    graph_dir,
    load_dag_dump,
    log_move_reasons,
    parse_schedule_table,
    read_dag_json,
    write_bucketing_dump,
    write_scheduler_dump,
)
from fsdp_passes.debug.whatif import scale_world_size, world_size_of
from fsdp_passes.pipeline.report import GraphReport, collective_fingerprint, fill_schedule_numbers
from fsdp_passes.simulate import lower_bound, simulate
from fsdp_passes.simulate.timeline import group_key

MB = 1 << 20


def toy_dag() -> Dag:
    """Two groups; an all-gather feeding a matmul, a reduce-scatter of its result, an all-reduce on 'tp'."""
    nodes = [
        DagNode("cast", NodeKind.COMPUTE, op="aten._to_copy", out_bytes=MB // 8, in_bytes=MB // 8, flops=0.0),
        DagNode("ag", NodeKind.COLLECTIVE, op="_c10d_functional.all_gather_into_tensor", collective=CollectiveOp.ALL_GATHER,
                group_name="0", group_size=8, group_ranks=tuple(range(8)), comm_bytes=MB, in_bytes=MB // 8,
                out_bytes=MB, dtype="bfloat16", fsdp=True, module_fqn="layers.0", param_fqn="layers.0.w"),
        DagNode("x", NodeKind.COMPUTE, op="aten.mm", out_bytes=4 * MB, in_bytes=2 * MB, flops=3e9, dtype="float32"),
        DagNode("y", NodeKind.COMPUTE, op="aten.mm", out_bytes=4 * MB, in_bytes=8 * MB, flops=2e9 + 0.1, dtype="float32"),
        DagNode("ag_wait", NodeKind.WAIT, op="_c10d_functional.wait_tensor", group_name="0", alias_of=1, collective_of=1),
        DagNode("mm", NodeKind.COMPUTE, op="aten.mm", out_bytes=2 * MB, in_bytes=5 * MB, flops=4e9, dtype="float32"),
        DagNode("rs", NodeKind.COLLECTIVE, op="_c10d_functional.reduce_scatter_tensor",
                collective=CollectiveOp.REDUCE_SCATTER, group_name="0", group_size=8, reduce_op="sum",
                comm_bytes=2 * MB, in_bytes=2 * MB, out_bytes=MB // 4, dtype="float32", fsdp=True),
        DagNode("ar", NodeKind.COLLECTIVE, op="_c10d_functional.all_reduce", collective=CollectiveOp.ALL_REDUCE,
                group_name="tp", group_size=2, group_ranks=(0, 1), reduce_op="sum", comm_bytes=MB, in_bytes=MB,
                out_bytes=MB),
        DagNode("rs_wait", NodeKind.WAIT, op="_c10d_functional.wait_tensor", group_name="0", alias_of=6,
                collective_of=6, is_output=True),
        DagNode("ar_wait", NodeKind.WAIT, op="_c10d_functional.wait_tensor", group_name="tp", alias_of=7,
                collective_of=7, is_output=True),
    ]
    edges = [(0, 1), (1, 4), (2, 3), (4, 5), (3, 5), (5, 6), (3, 7), (6, 8), (7, 9)]
    return Dag(nodes, edges)


# the ag is issued before the independent x, y and waited on after them: a valid overlapping order
TOY_AFTER = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
TOY_BEFORE = [0, 2, 3, 1, 4, 5, 6, 8, 7, 9]


def toy_durations() -> list[float]:
    return [0.01, 0.4, 0.3, 0.2, 0.0, 0.35, 0.5, 0.3, 0.0, 0.0]


def make_dump(tmp_path, dag, before, after, durations, graph="000_fwd", reasons=None, fx=None):
    report = GraphReport(graph=graph, pass_name="scheduler", options=Options(debug_dir=str(tmp_path)).to_json())
    if reasons:
        report.extra["reasons"] = reasons
    if fx is not None:
        write_bucketing_dump(str(tmp_path), fx)
    timelines = fill_schedule_numbers(report, (dag, list(before), durations), (dag, list(after), durations))
    report.pass_time_s = 0.0125
    folder = write_scheduler_dump(str(tmp_path), report, dag, durations, list(before), list(after), timelines,
                                  fx_report=fx)
    assert folder == os.path.join(str(tmp_path), graph)
    return report, folder


@pytest.fixture
def toy_dump(tmp_path):
    dag = toy_dag()
    fx = GraphReport(graph="000_fwd", pass_name="fx", n_collectives_before=5, n_collectives_after=3,
                     pass_time_s=0.5)
    fx.extra["buckets"] = [{"members": ["ag_a", "ag_b"], "op": "all_gather", "group": "0", "dtype": "bfloat16",
                            "bytes": MB, "estimated_ms": 0.4, "close_reason": "cap",
                            "params": ["layers.0.w", "layers.0.v"]}]
    report, folder = make_dump(tmp_path, dag, TOY_BEFORE, TOY_AFTER, toy_durations(),
                               reasons={"ag": "prefetched above x, y"}, fx=fx)
    return dag, report, folder, fx


def test_dump_folder_has_every_file(toy_dump):
    _, _, folder, _ = toy_dump
    for name in DUMP_FILES:
        assert os.path.isfile(os.path.join(folder, name)), name
    summary = json.load(open(os.path.join(folder, "summary.json")))
    try:
        import matplotlib  # noqa: F401

        assert os.path.isfile(os.path.join(folder, "timeline.png"))
        assert "timeline.png" in summary["files"]
    except ImportError:
        assert not os.path.exists(os.path.join(folder, "timeline.png"))
        assert "timeline.png" not in summary["files"]


def test_schedule_tables_list_every_node_with_simulated_times(toy_dump):
    dag, _, folder, _ = toy_dump
    durations = toy_durations()
    for fname, order in (("schedule_before.txt", TOY_BEFORE), ("schedule_after.txt", TOY_AFTER)):
        text = open(os.path.join(folder, fname)).read()
        assert text.startswith("# graph 000_fwd")
        rows = parse_schedule_table(text)
        assert [r["name"] for r in rows] == [dag.nodes[i].name for i in order]
        tl = simulate(dag, order, durations)
        for pos, (r, i) in enumerate(zip(rows, order)):
            node = dag.nodes[i]
            assert int(r["pos"]) == pos
            assert int(r["was"]) == TOY_BEFORE.index(i)
            assert r["kind"] == node.kind.value
            assert float(r["est_ms"]) == pytest.approx(durations[i], abs=1e-4)
            assert float(r["start_ms"]) == pytest.approx(tl.start[i], abs=1e-4)
            assert float(r["end_ms"]) == pytest.approx(tl.end[i], abs=1e-4)
            if node.kind is NodeKind.COLLECTIVE:
                assert r["op"] == node.collective.value and r["group"] == node.group_name
                assert int(r["bytes"]) == node.comm_bytes
                assert float(r["exposed_ms"]) == pytest.approx(tl.exposed[i], abs=1e-4)
            elif node.kind is NodeKind.WAIT:
                assert r["op"] == f"wait {dag.nodes[node.collective_of].name}"
                assert float(r["exposed_ms"]) == pytest.approx(tl.wait_blocked.get(i, 0.0), abs=1e-4)
        # every line of the table body is aligned to the header width
        body = [ln for ln in text.splitlines() if not ln.startswith("#")]
        assert len(body) == len(order) + 1
        header_cols = body[0].split()
        assert header_cols[:4] == ["pos", "was", "name", "kind"]
        assert f"makespan {tl.makespan:.4f} ms" in text and f"exposed comm {tl.exposed_total:.4f} ms" in text


def test_buckets_json_is_the_fx_report_buckets(toy_dump, tmp_path):
    _, _, folder, fx = toy_dump
    assert json.load(open(os.path.join(folder, "buckets.json"))) == fx.extra["buckets"]
    # bucket_graph's own reports keep the list under extra["bucketing"]["buckets"]
    other = GraphReport(graph="001_bwd", pass_name="fx", n_collectives_before=4, n_collectives_after=2)
    other.extra["bucketing"] = {"mode": "auto", "buckets": [{"members": ["rs_a", "rs_b"], "op": "reduce_scatter"}],
                                "unbucketed": {"rs_c": "alone"}}
    path = write_bucketing_dump(str(tmp_path), other)
    assert path == os.path.join(str(tmp_path), "001_bwd", "buckets.json")
    assert json.load(open(path)) == [{"members": ["rs_a", "rs_b"], "op": "reduce_scatter"}]
    # a graph the FX pass did not bucket gets an empty list
    _, plain = make_dump(tmp_path, toy_dag(), TOY_BEFORE, TOY_AFTER, toy_durations(), graph="002_fwd")
    assert json.load(open(os.path.join(plain, "buckets.json"))) == []


def test_dag_json_round_trips(toy_dump):
    dag, _, folder, _ = toy_dump
    dump = read_dag_json(os.path.join(folder, "dag.json"))
    assert dump.graph == "000_fwd"
    assert dump.dag.nodes == dag.nodes  # dataclass equality: every field but origin
    for a, b in zip(dump.dag.nodes, dag.nodes):
        # field by field, types too (equality alone takes a list for a tuple, 1 for 1.0)
        for f in dataclasses.fields(a):
            if f.name != "origin":
                assert type(getattr(a, f.name)) is type(getattr(b, f.name)), f.name
    assert list(dump.dag.edges()) == list(dag.edges())
    assert dump.before == TOY_BEFORE and dump.after == TOY_AFTER
    assert dump.durations == toy_durations()
    assert dump.meta["options"]["debug_dir"]
    # text form, and dag_to_json(dag_from_json(x)) == x
    text = open(os.path.join(folder, "dag.json")).read()
    again = dag_to_json(dag_from_json(text), dump.before, dump.after, dump.durations, graph=dump.graph,
                        meta=dump.meta)
    assert again == json.loads(text)


def test_dag_json_round_trip_of_a_captured_graph(fake_pg, fresh_inductor):
    from fsdp_passes.cost_model import CostModel
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
    from fsdp_passes.testing import build_llama, capture_scheduler_nodes, example_inputs

    model = build_llama(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=64, seq_len=8)
    caps = capture_scheduler_nodes(model, *example_inputs(model))
    for cap in caps:
        dag = dag_from_scheduler_nodes(cap.before)
        durations = CostModel.from_options("h100-nvlink").estimate(dag)
        data = json.loads(json.dumps(dag_to_json(dag, durations=durations)))
        dump = load_dag_dump(data)
        assert dump.dag.nodes == dag.nodes
        assert list(dump.dag.edges()) == list(dag.edges())
        assert dump.durations == durations
        assert simulate(dump.dag, dump.before, dump.durations).makespan == simulate(dag, dump.before,
                                                                                   durations).makespan


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("format"), "not a fsdp_passes.dag document"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d["nodes"][0].update(kind="bogus"), "nodes[0]"),
        (lambda d: d["nodes"][0].update(colour="red"), "unknown field"),
        (lambda d: d.update(edges=[[0, 99]]), "outside"),
        (lambda d: d["orders"].update(after=[0, 0]), "orders.after"),
        (lambda d: d.update(durations_ms=[1.0]), "durations_ms"),
    ],
)
def test_dag_json_errors_name_the_problem(mutate, message):
    data = json.loads(json.dumps(dag_to_json(toy_dag())))
    mutate(data)
    with pytest.raises(DagJsonError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_dag_dump(data)
    with pytest.raises(DagJsonError, match="not valid JSON"):
        dag_from_json("{not json")


def test_dot_lists_every_node_and_edge(toy_dump):
    dag, _, folder, _ = toy_dump
    dot = open(os.path.join(folder, "dag.dot")).read()
    assert dot.startswith('digraph "000_fwd" {')
    for i, node in enumerate(dag.nodes):
        assert f"  n{i} [label=\"{node.name}" in dot
    assert sum(1 for ln in dot.splitlines() if "->" in ln) == len(list(dag.edges()))


def test_trace_has_before_and_after_with_compute_and_group_tracks(toy_dump):
    dag, _, folder, _ = toy_dump
    trace = json.load(open(os.path.join(folder, "trace.json")))
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == ["after", "before"]
    groups = {group_key(dag.nodes[c].group_name) for c in dag.collectives()}
    assert groups == {"0", "tp"}
    for pid, run in procs.items():
        threads = {e["tid"]: e["args"]["name"] for e in events
                   if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}
        assert sorted(threads.values()) == sorted(["compute"] + [f"pg {g}" for g in groups])
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        tid_of = {name: tid for tid, name in threads.items()}
        for c in dag.collectives():
            node = dag.nodes[c]
            (s,) = [e for e in slices if e["name"] == node.name]
            assert s["tid"] == tid_of[f"pg {node.group_name}"]
        compute = {e["name"] for e in slices if e["tid"] == tid_of["compute"]}
        assert {"x", "y", "mm"} <= compute
        order = TOY_BEFORE if run == "before" else TOY_AFTER
        tl = simulate(dag, order, toy_durations())
        (mm,) = [e for e in slices if e["name"] == "mm"]
        assert mm["ts"] == pytest.approx(tl.start[5] * 1000) and mm["dur"] == pytest.approx(
            (tl.end[5] - tl.start[5]) * 1000)


def test_summary_matches_a_fresh_simulation_of_dag_json(toy_dump):
    _, report, folder, fx = toy_dump
    summary = json.load(open(os.path.join(folder, "summary.json")))
    for key in SUMMARY_KEYS:
        assert key in summary, key
    dump = read_dag_json(os.path.join(folder, "dag.json"))
    tb = simulate(dump.dag, dump.before, dump.durations)
    ta = simulate(dump.dag, dump.after, dump.durations)
    assert summary["graph"] == "000_fwd"
    assert summary["exposed_comm_ms_before"] == pytest.approx(tb.exposed_total)
    assert summary["exposed_comm_ms_after"] == pytest.approx(ta.exposed_total)
    assert summary["makespan_ms_before"] == pytest.approx(tb.makespan)
    assert summary["makespan_ms_after"] == pytest.approx(ta.makespan)
    assert summary["peak_memory_bytes_before"] == tb.peak_memory
    assert summary["peak_memory_bytes_after"] == ta.peak_memory
    assert summary["lower_bound_ms"] == pytest.approx(lower_bound(dump.dag, dump.durations))
    assert summary["collective_fingerprint"] == collective_fingerprint(dump.dag, dump.after)
    assert ta.makespan < tb.makespan  # the toy's after order overlaps the gather
    # collectives before bucketing come from the FX report of the same graph
    assert summary["n_collectives_before"] == fx.n_collectives_before == 5
    assert summary["n_collectives_before_scheduler"] == 3
    assert summary["n_collectives_after"] == 3
    assert summary["pass_time_s"] == pytest.approx(0.0125 + 0.5)
    assert summary["options"] == report.options
    assert summary["n_buckets"] == 1 and summary["n_nodes"] == 10


def test_fallen_back_fx_report_does_not_change_the_count(tmp_path):
    fx = GraphReport(graph="000_fwd", pass_name="fx", fallback="pass failed; graph left unchanged")
    _, folder = make_dump(tmp_path, toy_dag(), TOY_BEFORE, TOY_AFTER, toy_durations(), fx=fx)
    summary = json.load(open(os.path.join(folder, "summary.json")))
    assert summary["n_collectives_before"] == 3
    assert json.load(open(os.path.join(folder, "buckets.json"))) == []


def test_structured_trace_artifacts(tmp_path):
    from torch._logging._internal import trace_log

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.metadata, record.payload))

    handler = Keep()
    level = trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        make_dump(tmp_path, toy_dag(), TOY_BEFORE, TOY_AFTER, toy_durations())
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)
    artifacts = {m["artifact"]["name"]: (m["artifact"]["encoding"], p) for m, p in seen if "artifact" in m}
    assert set(artifacts) == {"fsdp_passes_000_fwd_summary", "fsdp_passes_000_fwd_schedule_before",
                              "fsdp_passes_000_fwd_schedule_after"}
    encoding, payload = artifacts["fsdp_passes_000_fwd_summary"]
    assert encoding == "json"
    on_disk = json.load(open(os.path.join(tmp_path, "000_fwd", "summary.json")))
    assert {k: v for k, v in json.loads(payload).items()} == {k: v for k, v in on_disk.items() if k != "files"}
    assert artifacts["fsdp_passes_000_fwd_schedule_after"][1] == open(
        os.path.join(tmp_path, "000_fwd", "schedule_after.txt")).read()


def test_debug_log_says_why_nodes_moved(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="fsdp_passes"):
        make_dump(tmp_path, toy_dag(), TOY_BEFORE, TOY_AFTER, toy_durations(),
                  reasons={"ag": "prefetched above x, y"})
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "moved" in r.getMessage()]
    assert any("000_fwd: ag 3 -> 1: prefetched above x, y" in ln for ln in lines), lines
    # x and y moved down because the gather was hoisted above them
    assert any(" x 1 -> 2" in ln for ln in lines)


def test_move_reasons_are_logged_once_per_report(caplog):
    dag = toy_dag()
    first = GraphReport(graph="000_fwd", pass_name="scheduler", extra={"reasons": {"ag": "prefetched"}})
    second = GraphReport(graph="001_bwd", pass_name="scheduler")
    # by hand from TOY_BEFORE -> TOY_AFTER: ag hoisted above x and y, ar and rs_wait swapped
    moved = ["x 1 -> 2", "y 2 -> 3", "ar 8 -> 7", "rs_wait 7 -> 8"]
    first_lines = ["000_fwd: ag 3 -> 1: prefetched"] + [f"000_fwd: {m}: moved by its dependencies" for m in moved]
    second_lines = [f"001_bwd: {m}: moved by its dependencies" for m in ["ag 3 -> 1"] + moved]

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("fsdp_passes moved ")]

    with caplog.at_level(logging.INFO, logger="fsdp_passes"):
        log_move_reasons(first, dag, TOY_BEFORE, TOY_AFTER)
    assert logged() == []  # without DEBUG nothing is said, and nothing is marked as said
    with caplog.at_level(logging.DEBUG, logger="fsdp_passes"):
        for _ in range(2):
            log_move_reasons(first, dag, TOY_BEFORE, TOY_AFTER)
            log_move_reasons(second, dag, TOY_BEFORE, TOY_AFTER)
    assert logged() == [f"fsdp_passes moved {line}" for line in first_lines + second_lines]
    # the mark is no part of the report's numbers
    assert "reasons_logged" not in first.to_json()
    assert first == GraphReport(graph="000_fwd", pass_name="scheduler", extra={"reasons": {"ag": "prefetched"}})


def test_no_debug_dir_writes_nothing_but_still_emits(tmp_path):
    dag = toy_dag()
    report = GraphReport(graph="000_fwd", pass_name="scheduler")
    d = toy_durations()
    assert write_scheduler_dump(None, report, dag, d, TOY_BEFORE, TOY_AFTER) is None
    assert write_bucketing_dump(None, GraphReport(graph="x", pass_name="fx")) is None
    assert os.listdir(tmp_path) == []


def test_a_dump_that_cannot_be_written_warns_and_returns_none(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    report = GraphReport(graph="000_fwd", pass_name="scheduler")
    with pytest.warns(RuntimeWarning, match="could not write the debug dump of graph 000_fwd"):
        assert write_scheduler_dump(str(blocker), report, toy_dag(), toy_durations(), TOY_BEFORE, TOY_AFTER) is None


def test_other_ranks_dump_into_rank_folders(tmp_path, fake_pg_factory):
    fake_pg_factory(8, 3)
    assert graph_dir(str(tmp_path), "000_fwd") == os.path.join(str(tmp_path), "rank3", "000_fwd")
    assert graph_dir(str(tmp_path), "../x y") == os.path.join(str(tmp_path), "rank3", "_x_y")


@pytest.mark.parametrize("fixed", ["model", "shard"])
def test_scale_world_size(fixed):
    dag = toy_dag()
    assert world_size_of(dag) == 8
    scaled = scale_world_size(dag, 32, fixed)
    ag, rs, ar = scaled.nodes[1], scaled.nodes[6], scaled.nodes[7]
    assert ag.group_size == rs.group_size == 32 and ag.group_ranks == tuple(range(32))
    assert ar.group_size == 2 and ar.comm_bytes == MB  # the smaller 'tp' group is kept
    if fixed == "model":
        assert (ag.comm_bytes, ag.out_bytes, ag.in_bytes) == (MB, MB, MB // 32)
        assert (rs.comm_bytes, rs.in_bytes, rs.out_bytes) == (2 * MB, 2 * MB, 2 * MB // 32)
    else:
        assert (ag.comm_bytes, ag.out_bytes, ag.in_bytes) == (4 * MB, 4 * MB, MB // 8)
        assert (rs.comm_bytes, rs.in_bytes, rs.out_bytes) == (8 * MB, 8 * MB, MB // 4)
    assert list(scaled.edges()) == list(dag.edges())
    assert dag.nodes[1].group_size == 8  # the original is untouched
    assert [n.name for n in scaled.nodes] == [n.name for n in dag.nodes]


def test_installed_passes_dump_every_graph_of_a_compile(tmp_path, fake_pg, fresh_inductor):
    import fsdp_passes
    from fsdp_passes.testing import build_llama, capture_scheduler_nodes, example_inputs

    model = build_llama(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=64, seq_len=8,
                        reshard_after_forward=True)
    fsdp_passes.last_reports(clear=True)
    capture_scheduler_nodes(model, *example_inputs(model),
                            options={"debug_dir": str(tmp_path), "strict": True, "bucketing": "auto"})
    reports = fsdp_passes.last_reports(clear=True)
    sched = [r for r in reports if r.pass_name == "scheduler"]
    fx = {r.graph: r for r in reports if r.pass_name == "fx"}
    assert [r.graph.split("_")[1] for r in sched] == ["fwd", "bwd"]
    assert sorted(os.listdir(tmp_path)) == sorted(r.graph for r in sched)
    for r in sched:
        folder = os.path.join(tmp_path, r.graph)
        summary = json.load(open(os.path.join(folder, "summary.json")))
        assert summary["makespan_ms_after"] == r.makespan_ms_after
        assert summary["n_collectives_before"] == fx[r.graph].n_collectives_before
        buckets = json.load(open(os.path.join(folder, "buckets.json")))
        assert buckets == fx[r.graph].extra["bucketing"]["buckets"]
        dump = read_dag_json(os.path.join(folder, "dag.json"))
        assert dump.dag.order_violations(dump.after) == []
        assert simulate(dump.dag, dump.after, dump.durations, dump.overlap).exposed_total == pytest.approx(
            summary["exposed_comm_ms_after"])
        rows = parse_schedule_table(open(os.path.join(folder, "schedule_after.txt")).read())
        assert [row["name"] for row in rows] == [dump.dag.nodes[i].name for i in dump.after]


def test_summary_table_shows_the_pass_note():
    from fsdp_passes.debug.tables import summary_table

    text = summary_table({"graph": "000_bwd", "extra": {"note": "bucketing used the whole memory_budget"}})
    assert "note: bucketing used the whole memory_budget" in text
    assert "note:" not in summary_table({"graph": "000_bwd", "extra": {}})
