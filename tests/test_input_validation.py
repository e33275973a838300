"""Every input is checked when it is given: options at ``enable()`` / ``Options(...)``, every ``FSDP_PASSES_*``
variable, the keywords of the functions that also take an ``Options``.

One table per kind of input.  Each bad case must raise ``ValueError`` (never ``TypeError`` or a bare
``json.JSONDecodeError``) at the call that received it, and the message must name the option or variable and
carry the words that say what is wrong / allowed.  Each good case must be accepted, so the checks do not
reject what the documentation allows.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch.fx as fx

import fsdp_passes
from fsdp_passes import Options
from fsdp_passes.cost_model import Calibration
from fsdp_passes.dag.graph import CollectiveOp

PLAN_SYNTAX = "'layers.[0-3]'"  # every plan-pattern error shows the allowed syntax with this example


@pytest.fixture(autouse=True)
def _disabled():
    fsdp_passes.disable()
    yield
    fsdp_passes.disable()


@pytest.fixture
def files(tmp_path):
    """Calibration and cluster files, good and bad, by name."""
    paths = {}

    def put(name: str, text: str) -> None:
        path = tmp_path / name
        path.write_text(text)
        paths[name] = str(path)

    put("corrupt.json", '{"collectives": [')
    put("wrong_shape.json", json.dumps({"hello": 1}))
    put("list.json", "[1, 2]")
    put("cluster_wrong_shape.json", json.dumps({"hello": 1}))
    put("cluster_corrupt.json", '{"base": "a100"')
    put("cluster_good.json", json.dumps({"base": "a100", "intra_node_bw_gbps": 100.0}))
    good = Calibration()
    good.add_collective(CollectiveOp.ALL_GATHER, 8, 1 << 20, 0.1)
    good.add_collective(CollectiveOp.ALL_GATHER, 8, 1 << 24, 1.0)
    paths["calibration_good.json"] = str(tmp_path / "calibration_good.json")
    good.save(paths["calibration_good.json"])
    return paths


def _error(call) -> ValueError:
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    assert isinstance(err, ValueError) and not isinstance(err, json.JSONDecodeError), repr(err)
    return err


# -- options ---------------------------------------------------------------------------------------------------
# (keywords, words the message must hold: the option first)
BAD_OPTIONS = [
    # kept from the first validation tests
    ({"bucketing": "sometimes"}, ["bucketing", "'sometimes'", "'auto'"]),
    ({"cluster": "tpu-pod"}, ["cluster", "'tpu-pod'", "h100-nvlink"]),
    ({"memory_budget": "lots"}, ["memory_budget", "'lots'", "5%"]),
    ({"memory_budget": -1}, ["memory_budget", "-1", ">= 0"]),
    ({"max_prefetch": 0}, ["max_prefetch", "0", ">= 1"]),
    ({"bucket_cap_mb": -5}, ["bucket_cap_mb", "-5", "positive"]),
    ({"bucketing": "manual"}, ["bucket_plan", "bucketing='manual'"]),
    ({"bucketing": "manual", "bucket_plan": ["layers.0", 3]}, ["bucket_plan", "non-empty strings"]),
    ({"bucket_plan": ["layers.0"]}, ["bucketing", "'manual'"]),
    ({"reorder": "yes"}, ["reorder", "'yes'", "True or False"]),
    ({"calibration": "/no/such/file.json"}, ["calibration", "/no/such/file.json", "existing"]),
    ({"strict": 1}, ["strict", "True or False"]),
    ({"bucket_non_fsdp": None}, ["bucket_non_fsdp", "True or False"]),
    ({"debug_dir": 3}, ["debug_dir", "3"]),
    ({"debug_dir": __file__}, ["debug_dir", __file__, "is a file"]),  # a dump folder under a file: refused now
    ({"cluster": "H100-NVLINK"}, ["cluster", "did you mean h100-nvlink?"]),
    ({"cluster": "/no/such/profile.json"}, ["cluster", "/no/such/profile.json", "no such file"]),
    ({"cluster": {"base": "h100-nvlink", "gpus_per_node": -1}}, ["cluster", "gpus_per_node"]),
    # plan patterns are parsed when given (the same parser as the bucketing pass)
    ({"bucketing": "manual", "bucket_plan": ["layers.[3-1]"]}, ["bucket_plan", "'layers.[3-1]'", "empty", PLAN_SYNTAX]),
    ({"bucketing": "manual", "bucket_plan": ["layers.[a-b]"]}, ["bucket_plan", "'layers.[a-b]'", PLAN_SYNTAX]),
    ({"bucketing": "manual", "bucket_plan": ["layers.["]}, ["bucket_plan", "'layers.['", PLAN_SYNTAX]),
    ({"bucketing": "manual", "bucket_plan": ["layers.[0-]"]}, ["bucket_plan", "'layers.[0-]'", PLAN_SYNTAX]),
    ({"bucketing": "manual", "bucket_plan": ["layers.[]"]}, ["bucket_plan", "'layers.[]'", PLAN_SYNTAX]),
    ({"bucketing": "manual", "bucket_plan": [["norm", "layers.[2-0]"]]}, ["bucket_plan", "'layers.[2-0]'"]),
    ({"bucketing": "manual", "bucket_plan": []}, ["bucket_plan", "non-empty"]),
    # a bare number in a string: bytes? MB? percent?
    ({"memory_budget": "5"}, ["memory_budget", "'5'", "ambiguous", "'5%'", "'512MB'", "int"]),
    ({"memory_budget": "5.5"}, ["memory_budget", "'5.5'", "ambiguous"]),
    ({"memory_budget": "5 parsecs"}, ["memory_budget", "'5 parsecs'"]),
    ({"memory_budget": "-2 blocks"}, ["memory_budget", "'-2 blocks'", "'2 blocks'"]),
    ({"memory_budget": True}, ["memory_budget", "True"]),
]


@pytest.mark.parametrize("kwargs, words", BAD_OPTIONS, ids=[repr(k) for k, _ in BAD_OPTIONS])
def test_bad_option_is_a_value_error_at_enable(kwargs, words):
    err = _error(lambda: fsdp_passes.enable(**kwargs))
    for word in words:
        assert word in str(err), (word, str(err))
    assert not fsdp_passes.is_enabled()
    # the same check when the Options object is built
    assert str(_error(lambda: Options(**kwargs))) == str(err)


# (option, file name, words): files are loaded and checked against their schema at enable()
BAD_FILES = [
    ("calibration", "corrupt.json", ["calibration", "corrupt.json", "not valid JSON"]),
    ("calibration", "wrong_shape.json", ["calibration", "wrong_shape.json", "'hello'", "collectives"]),
    ("calibration", "list.json", ["calibration", "list.json", "JSON object"]),
    ("cluster", "cluster_wrong_shape.json", ["cluster", "cluster_wrong_shape.json", "'hello'"]),
    ("cluster", "cluster_corrupt.json", ["cluster", "cluster_corrupt.json", "JSON"]),
]


@pytest.mark.parametrize("option, name, words", BAD_FILES, ids=[f"{o}={n}" for o, n, _ in BAD_FILES])
def test_bad_file_is_a_value_error_at_enable(files, option, name, words):
    err = _error(lambda: fsdp_passes.enable(**{option: files[name]}))
    for word in words:
        assert word in str(err), (word, str(err))
    err = _error(lambda: fsdp_passes.enable(strict=True, **{option: files[name]}))
    assert option in str(err)


GOOD_OPTIONS = [
    {"memory_budget": "5%"},
    {"memory_budget": "2 blocks"},
    {"memory_budget": "1 block"},
    {"memory_budget": "0.5blocks"},
    {"memory_budget": "512MB"},
    {"memory_budget": "2GiB"},
    {"memory_budget": "4096B"},
    {"memory_budget": 5},
    {"memory_budget": 0},
    {"bucketing": "manual", "bucket_plan": ["tok_embeddings", "layers.[0-3]", ["norm", "output"]]},
    {"bucketing": "manual", "bucket_plan": ["layers.[0,2,5]", "layers.[7]", "layers.*.attention", "lay?rs.9"]},
    {"cluster": {"base": "a100"}},
    {"strict": True, "max_prefetch": 2, "bucket_cap_mb": 25.5, "debug_dir": "/tmp/x"},
]


@pytest.mark.parametrize("kwargs", GOOD_OPTIONS, ids=[repr(k) for k in GOOD_OPTIONS])
def test_documented_forms_are_accepted(kwargs):
    opts = fsdp_passes.enable(**kwargs)
    for key, value in kwargs.items():
        assert getattr(opts, key) == value


def test_good_files_are_accepted(files):
    opts = fsdp_passes.enable(calibration=files["calibration_good.json"], cluster=files["cluster_good.json"])
    assert opts.calibration == files["calibration_good.json"]
    from fsdp_passes.cost_model import CostModel

    model = CostModel.from_options(opts.cluster, opts.calibration)
    assert model.profile.intra_node_bw_gbps == 100.0  # the file's value, over the a100 base
    assert model.calibration.collective_ms(CollectiveOp.ALL_GATHER, 1 << 20, 8) == 0.1


# -- environment variables ---------------------------------------------------------------------------------------
# (variables, words the message must hold: the variable first)
BAD_ENV = [
    ({"FSDP_PASSES_BUCKTING": "none"}, ["FSDP_PASSES_BUCKTING", "did you mean FSDP_PASSES_BUCKETING"]),
    ({"FSDP_PASSES_MEMORYBUDGET": "lots"}, ["FSDP_PASSES_MEMORYBUDGET", "did you mean FSDP_PASSES_MEMORY_BUDGET"]),
    ({"FSDP_PASSES_STRIKT": "1"}, ["FSDP_PASSES_STRIKT", "did you mean FSDP_PASSES_STRICT"]),
    ({"FSDP_PASSES_CLUSTER": '{"base": "h100-nvlink"'}, ["FSDP_PASSES_CLUSTER", '{"base": "h100-nvlink"', "JSON"]),
    ({"FSDP_PASSES_CLUSTER": "tpu"}, ["FSDP_PASSES_CLUSTER", "'tpu'", "h100-nvlink"]),
    ({"FSDP_PASSES_CLUSTER": '{"base": "a100", "gpus_per_node": 0}'}, ["FSDP_PASSES_CLUSTER", "gpus_per_node"]),
    ({"FSDP_PASSES_MEMORY_BUDGET": "5"}, ["FSDP_PASSES_MEMORY_BUDGET", "'5'", "ambiguous"]),
    ({"FSDP_PASSES_MEMORY_BUDGET": "lots"}, ["FSDP_PASSES_MEMORY_BUDGET", "'lots'", "5%"]),
    ({"FSDP_PASSES_MAX_PREFETCH": "many"}, ["FSDP_PASSES_MAX_PREFETCH", "'many'", "max_prefetch", ">= 1"]),
    ({"FSDP_PASSES_MAX_PREFETCH": "0"}, ["FSDP_PASSES_MAX_PREFETCH", "'0'", ">= 1"]),
    ({"FSDP_PASSES_BUCKET_CAP_MB": "-5"}, ["FSDP_PASSES_BUCKET_CAP_MB", "'-5'", "positive"]),
    ({"FSDP_PASSES_BUCKETING": "sometimes"}, ["FSDP_PASSES_BUCKETING", "'sometimes'", "'manual'"]),
    ({"FSDP_PASSES_REORDER": "maybe"}, ["FSDP_PASSES_REORDER", "'maybe'", "true", "false"]),
    ({"FSDP_PASSES_STRICT": "2"}, ["FSDP_PASSES_STRICT", "'2'", "true"]),
    ({"FSDP_PASSES_BUCKET_NON_FSDP": "x"}, ["FSDP_PASSES_BUCKET_NON_FSDP", "'x'"]),
    ({"FSDP_PASSES_CALIBRATION": "/no/such.json"}, ["FSDP_PASSES_CALIBRATION", "/no/such.json", "existing"]),
    ({"FSDP_PASSES_BUCKETING": "manual", "FSDP_PASSES_BUCKET_PLAN": '["layers.[3-1]"]'},
     ["FSDP_PASSES_BUCKET_PLAN", "layers.[3-1]", PLAN_SYNTAX]),
    ({"FSDP_PASSES_BUCKETING": "manual", "FSDP_PASSES_BUCKET_PLAN": '["layers.0"'},
     ["FSDP_PASSES_BUCKET_PLAN", "JSON"]),
    ({"FSDP_PASSES_BUCKETING": "manual", "FSDP_PASSES_BUCKET_PLAN": "layers.0"},  # a bare pattern, not a list
     ["FSDP_PASSES_BUCKET_PLAN", "'layers.0'", "a JSON list"]),
    ({"FSDP_PASSES_BUCKETING": "manual"}, ["bucket_plan", "FSDP_PASSES_BUCKETING='manual'"]),
]


@pytest.mark.parametrize("env, words", BAD_ENV, ids=[" ".join(e) for e, _ in BAD_ENV])
def test_bad_environment_variable_is_a_value_error_naming_it(monkeypatch, env, words):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = _error(fsdp_passes.enable)
    for word in words:
        assert word in str(err), (word, str(err))
    assert not fsdp_passes.is_enabled()


def test_environment_values_that_are_allowed(monkeypatch, files):
    env = {
        "FSDP_PASSES_CLUSTER": '{"base": "a100"}',
        "FSDP_PASSES_MEMORY_BUDGET": "2GB",
        "FSDP_PASSES_BUCKETING": "manual",
        "FSDP_PASSES_BUCKET_PLAN": '["layers.[0-1]", ["norm", "output"]]',
        "FSDP_PASSES_REORDER": "off",
        "FSDP_PASSES_MAX_PREFETCH": "2",
        "FSDP_PASSES_CALIBRATION": files["calibration_good.json"],
        "FSDP_PASSES_DEBUG_DIR": "",
        "FSDP_PASSES_TEST_CACHE": "/somewhere",  # read by the test suite, not an option: not an error
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    opts = fsdp_passes.enable(bucketing="auto", memory_budget="5%")
    assert (opts.cluster, opts.memory_budget, opts.bucketing, opts.reorder, opts.max_prefetch) == (
        {"base": "a100"}, "2GB", "manual", False, 2)
    assert opts.bucket_plan == ["layers.[0-1]", ["norm", "output"]]
    assert opts.calibration == files["calibration_good.json"] and opts.debug_dir is None


# -- functions taking an Options and keywords ---------------------------------------------------------------------

def _empty_graph() -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(x)
    return g


BAD_CALLS = [
    ("enable(Options(), bogus=1)", lambda: fsdp_passes.enable(Options(), bogus=1), ["bogus"]),
    ("enable(bucket_size=3)", lambda: fsdp_passes.enable(bucket_size=3), ["bucket_size"]),
    ("enable(memory_budgt='5%')", lambda: fsdp_passes.enable(memory_budgt="5%"), ["memory_budgt", "memory_budget"]),
    ("enable('auto')", lambda: fsdp_passes.enable("auto"), ["options", "Options"]),
    ("enable(Options(), memory_budget='lots')", lambda: fsdp_passes.enable(Options(), memory_budget="lots"),
     ["memory_budget", "'lots'"]),
    ("bucket_graph(g, Options(bucketing='none'), bucketing='auto', memory_budget='lots')",
     lambda: fsdp_passes.bucket_graph(_empty_graph(), Options(bucketing="none"), bucketing="auto",
                                      memory_budget="lots"), ["memory_budget", "'lots'"]),
    ("bucket_graph(g, Options(), bogus=1)", lambda: fsdp_passes.bucket_graph(_empty_graph(), Options(), bogus=1),
     ["bogus"]),
    ("reorder_scheduler_nodes([], Options(), memory_budget='lots')",
     lambda: fsdp_passes.reorder_scheduler_nodes([], Options(), memory_budget="lots"), ["memory_budget"]),
    ("reorder_scheduler_nodes([], Options(), max_prefetch=0)",
     lambda: fsdp_passes.reorder_scheduler_nodes([], Options(), max_prefetch=0), ["max_prefetch"]),
    # what is not a graph / DAG / node list is named at the call (it was an AttributeError from deep inside)
    ("bucket_graph(None)", lambda: fsdp_passes.bucket_graph(None), ["graph=NoneType", "torch.fx.Graph"]),
    ("reorder_scheduler_nodes(None)", lambda: fsdp_passes.reorder_scheduler_nodes(None),
     ["nodes=NoneType", "scheduler nodes"]),
    ("reorder_scheduler_nodes([1])", lambda: fsdp_passes.reorder_scheduler_nodes([1]),
     ["nodes[0] is of type int", "BaseSchedulerNode"]),
    ("plan_order(None, [])", lambda: _plan_order()(None, [], memory_budget_bytes=0), ["dag=NoneType", "Dag"]),
    ("plan_bucketing(None, Options())", lambda: _plan_bucketing()(None, Options()), ["dag=NoneType", "Dag"]),
    ("plan_bucketing(dag, {})", lambda: _plan_bucketing()(_empty_dag(), {}), ["options=dict", "Options"]),
]


def _plan_order():
    from fsdp_passes.reordering import plan_order

    return plan_order


def _plan_bucketing():
    from fsdp_passes.pipeline import plan_bucketing

    return plan_bucketing


def _empty_dag():
    from fsdp_passes.dag import Dag

    return Dag([], [])


@pytest.mark.parametrize("label, call, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call_is_a_value_error(label, call, words):
    err = _error(call)
    for word in words:
        assert word in str(err), (word, str(err))


def test_keywords_are_applied_over_the_options():
    """bucket_graph and reorder_scheduler_nodes merge like enable: the keywords win."""
    result = fsdp_passes.bucket_graph(_empty_graph(), Options(bucketing="none"), bucketing="auto")
    assert result.mode == "auto"
    result = fsdp_passes.bucket_graph(_empty_graph(), Options(bucketing="auto"), bucketing="none")
    assert result.mode == "none"
    _, report = fsdp_passes.reorder_scheduler_nodes([], Options(memory_budget="5%"), memory_budget="1GB",
                                                    max_prefetch=3)
    assert report.options["memory_budget"] == "1GB" and report.options["max_prefetch"] == 3
    assert fsdp_passes.enable(Options(bucketing="none"), reorder=False).bucketing == "none"


# -- plan entries that match nothing (not strict): the warning names the FQNs the graph has ----------------------

def test_unmatched_plan_entry_warning_lists_the_fqns_seen(fake_pg):
    from fsdp_passes.testing import build_mlp, capture_fx_graphs, example_inputs

    model = build_mlp(n_layers=2, dim=32, reshard_after_forward=False)
    graphs = capture_fx_graphs(model, *example_inputs(model))
    plan = ["layers.0", "layer.1"]  # a typo: the second entry matches nothing
    fqns = sorted({n.meta["custom"]["fsdp_param"] for n in graphs.forward.graph.nodes
                   if "all_gather_into_tensor" in str(n.target) and "fsdp_param" in n.meta.get("custom", {})})
    assert len(fqns) >= 2
    strict_copy = copy.deepcopy(graphs.forward.graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a budget the whole-layer bucket fits in: only the unmatched entry is warned about
        result = fsdp_passes.bucket_graph(graphs.forward, bucketing="manual", bucket_plan=plan, memory_budget="1GB")
    messages = [str(w.message) for w in caught if "bucket_plan" in str(w.message)]
    assert len(messages) == 1, messages  # once per graph, not twice
    assert "'layer.1'" in messages[0] and "FQNs seen: " + ", ".join(fqns[:2]) in messages[0], (messages, fqns)
    assert result.unmatched_entries == ["layer.1"]
    # strict: the error lists them the same way
    with pytest.raises(ValueError) as err:
        fsdp_passes.bucket_graph(strict_copy, bucketing="manual", bucket_plan=plan, strict=True,
                                 memory_budget="1GB")
    assert "FQNs seen: " + ", ".join(fqns[:2]) in str(err.value)
