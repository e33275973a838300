"""Auto on models this package did not write (transformers GPT-2 and Qwen2, torchtitan's Qwen3, sharded by
torchtitan's SimpleFSDP frontend), default options, fake 8-rank group: every candidate of auto compiled
through both passes and priced at the level of Inductor's scheduler nodes; auto's choice is the fastest
within 2 %.  (Its own file, so that it runs beside the other third-party tests.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fsdp_passes
from fsdp_passes.testing import fake_process_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
from third_party_models import MODELS, sharded_loss_module, token_ids  # noqa: E402


def _fx(reports):
    return [r for r in reports if r.pass_name == "fx"]


def _forcing(candidate: str):
    """``choose_auto_plan`` made to return ``candidate``'s plan where it built one (else auto's own choice):
    a compile of each candidate through the same passes."""
    from fsdp_passes.pipeline import choice as choice_module

    original = choice_module.choose_auto_plan

    def forced(*args, **kwargs):
        result = original(*args, **kwargs)
        score = next(c for c in result.candidates if c.name == candidate)
        if score.skipped is None and score.rejected is None:
            result.plan, result.chosen = score.plan, candidate
        return result

    return choice_module, forced


@pytest.mark.parametrize("name", MODELS)
def test_auto_is_best_of_its_candidates_by_the_final_schedule(name, monkeypatch):
    """Default options: the per-block candidate merges something, and the plan auto chose is, within 2 %,
    the fastest of its candidates by the scheduler-level estimate of the final schedule (each candidate
    compiled through both passes, its scheduler nodes priced and replayed), not by auto's own model."""
    from fsdp_passes.pipeline.choice import CANDIDATES
    from fsdp_passes.testing.end_to_end import measure_compile

    with fake_process_group(world_size=8):
        model = sharded_loss_module(name, 8)
        ids = token_ids(name)
        fsdp_passes.last_reports(clear=True)
        auto = {m.graph_name: m.makespan_ms for m in measure_compile(model, ids, options={})}
        # the FX reports in compile order: forward, backward
        choices = dict(zip(("forward", "backward"),
                           (r.extra["bucketing"]["auto_choice"] for r in _fx(fsdp_passes.last_reports()))))
        assert set(choices) == set(auto) == {"forward", "backward"}
        for graph, doc in choices.items():
            per_block = next(c for c in doc["candidates"] if c["name"] == "per_block")
            assert per_block["n_merged_buckets"] > 0 and per_block["rejected"] is None, (graph, per_block)
        chosen = {doc["chosen"] for doc in choices.values()}
        # auto's own compile is the compile of its choice where both graphs chose the same candidate
        compiled: dict[str, dict[str, float]] = {chosen.pop(): auto} if len(chosen) == 1 else {}
        # a candidate skipped, or with the same buckets as an earlier one, in both graphs compiles to the same
        # schedule as that one: not compiled again
        redundant = {c["name"] for doc in choices.values() for c in doc["candidates"] if c.get("skipped") or c.get("same_as")}
        redundant = {name for name in redundant
                     if all(any(c["name"] == name and (c.get("skipped") or c.get("same_as")) for c in doc["candidates"])
                            for doc in choices.values())}
        for candidate in CANDIDATES:
            if candidate in compiled or candidate in redundant:
                continue
            module, forced = _forcing(candidate)
            with monkeypatch.context() as patch:
                patch.setattr(module, "choose_auto_plan", forced)
                compiled[candidate] = {m.graph_name: m.makespan_ms
                                       for m in measure_compile(model, ids, options={})}
    for graph, makespan in auto.items():
        best = min(times[graph] for times in compiled.values())
        table = {c: round(t[graph], 5) for c, t in compiled.items()}
        assert makespan <= 1.02 * best, (graph, choices[graph]["chosen"], round(makespan, 5), table)
