"""benchmarks/emulated_cluster.py: the smoke run works (the Llama against Inductor's two torchtitan-configured
planners), its JSON holds the configurations with equal losses, and it removes its network namespaces on a
normal exit and when terminated.

The runs need root, ``ip`` and ``tc`` (network namespaces, a veth pair, a tbf qdisc); without them those
tests are skipped.  The one-line refusal without them is tested everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "emulated_cluster.py"

_missing = []
if not hasattr(os, "geteuid") or os.geteuid() != 0:
    _missing.append("root")
_missing += [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_netns = pytest.mark.skipif(
    bool(_missing),
    reason=f"emulated cluster needs root, ip and tc (network namespaces + tbf); missing: {', '.join(_missing)}",
)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix + "-")]


def _prefix(tag: str) -> str:
    return f"fsdptest{tag}{os.getpid()}"


@needs_netns
def test_smoke_run_writes_configurations_with_equal_losses(tmp_path):
    out = tmp_path / "smoke.json"
    prefix = _prefix("s")
    t0 = time.monotonic()
    configs = ["fsdp2_eager", "inductor_overlap", "inductor_manual", "fsdp_passes"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--model", "llama", "--configs", ",".join(configs),
                           "--kernel-profile", "--out", str(out), "--prefix", prefix],
                          capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["smoke"] is True
    assert set(data["configs"]) == set(configs)
    for name, cfg in data["configs"].items():
        assert len(cfg["times_s"]) == 2 and cfg["min_s"] <= cfg["median_s"] <= cfg["max_s"], name
        assert all(isinstance(v, float) for v in cfg["loss"]), (name, cfg["loss"])
    assert data["losses_equal"], data["loss_max_rel_diff"]
    assert data["loss_max_rel_diff"] <= 1e-5
    # the passes really ran inside the compiled configuration (a fallback would have failed the run)
    assert any("[scheduler]" in line for line in data["extra"]["fsdp_passes_reports"]["fsdp_passes"])
    assert "fsdp_passes" in proc.stdout and "losses equal across configurations: True" in proc.stdout
    # the untimed profiled steps: tensor memory above the sharded parameters, backward waits of the compiled step
    for name, cfg in data["configs"].items():
        prof = cfg["profiled_step"]
        assert prof["step_peak_bytes"] == prof["state_bytes"] + prof["transient_peak_bytes"], name
        assert 0 < prof["state_bytes"] < data["model"]["param_bytes"] and prof["transient_peak_bytes"] > 0, name
        assert prof["backward_s"] > 0, name
    assert data["configs"]["fsdp_passes"]["profiled_step"]["backward_wait_s"] >= 0
    assert data["configs"]["fsdp2_eager"]["profiled_step"]["backward_wait_s"] is None
    assert set(data["peak_memory_vs_fsdp2_eager"]) == {"fsdp_passes"}
    # Inductor's planners really ran: a step waits once per collective, and the smoke Llama's 2 blocks have 21
    # parameters (9 each, embeddings, norm, output): 21 gathers, a re-gather each but the embedding's, 21
    # reductions unbucketed. The manual plan (embeddings, each block, norm with output) leaves at most a gather,
    # a re-gather and a reduction per entry; the OverlapScheduler buckets too.
    def waits(name: str) -> int:
        return data["configs"][name]["profiled_step"]["per_rank"][0]["wait_events"]["_c10d_functional::wait_tensor"]

    plan = data["extra"]["inductor_manual_plan"]
    assert plan == ["tok_embeddings", "layers.0", "layers.1", ["norm", "output"]]
    assert waits("inductor_manual") <= 3 * len(plan), waits("inductor_manual")
    assert waits("inductor_overlap") < (21 + 20 + 21) // 2, waits("inductor_overlap")
    assert {t for t in data["targets"] if t.endswith("_vs_best_inductor")} == {"fsdp_passes_vs_best_inductor"}
    # where each compiled step's time went: the profiler's self times on the stepping thread, by op
    for name in ("inductor_overlap", "inductor_manual", "fsdp_passes"):
        for sample in data["configs"][name]["profiled_step"]["per_rank"][0]["samples"]:
            cat = sample["self_ms_by_category"]
            waited_ms = 1e3 * (sample["forward_wait_s"] + sample["backward_wait_s"])  # from the events' spans
            assert abs(cat["collective_wait"] - waited_ms) <= 0.02 * waited_ms + 0.05, (name, cat, waited_ms)
            assert sum(cat.values()) <= 1e3 * sample["step_s"] * 1.001, (name, cat, sample["step_s"])
            assert cat["matmul"] > 0 and cat["generated_kernel"] > 0, (name, cat)  # --kernel-profile names kernels
            # the collective timeline: every wait counted above, in time order, inside the step
            timeline = sample["collective_timeline"]
            waits_in_timeline = [end - start for op, start, end in timeline if op == "wait_tensor"]
            assert len(waits_in_timeline) == len(sample["forward_waits_ms"]) + len(sample["backward_waits_ms"])
            assert [start for _, start, _ in timeline] == sorted(start for _, start, _ in timeline)
            assert 0 <= timeline[0][1] and timeline[-1][2] <= 1e3 * sample["step_s"] + 1e-3, (name, timeline)
            # each planner's bucket copies are its own ops: ours fsdp_passes::*, the manual pass's bucketing::*
            # (the OverlapScheduler's buckets copy in generated kernels)
            assert (cat["bucket_copy_ours"] > 0) == (name == "fsdp_passes"), (name, cat)
            assert (cat["bucket_copy_inductor"] > 0) == (name == "inductor_manual"), (name, cat)
    assert _namespaces(prefix) == []
    print(f"smoke run took {elapsed:.1f} s")


@needs_netns
def test_namespaces_removed_when_terminated(tmp_path):
    prefix = _prefix("t")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path / "x.json"),
                             "--prefix", prefix], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_namespaces(prefix)) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the namespaces never appeared"
            time.sleep(0.1)
        time.sleep(1.0)  # the ranks are starting inside them
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert _namespaces(prefix) == [], err
    veths = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"fb{proc.pid}a" not in veths and f"fb{proc.pid}b" not in veths
    assert not (tmp_path / "x.json").exists()


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("emulated_cluster_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # top level imports the standard library only
    return module


def test_balanced_batch_scales_the_probe_to_equal_times():
    choose = _load_script().choose_balanced_batch
    assert choose(1024, 0.5, 1.5) == 3072  # compute grows with the batch: 3x the probe's rows
    assert choose(1024, 0.4, 1.5) == 3840  # 3.75x, a multiple of 64
    assert choose(1024, 1.0, 0.01) == 64  # never below one multiple
    assert choose(1000, 1.0, 1.0, multiple=10) == 1000
    # compute-bound (2x communication) and communication-bound (half) batches
    assert choose(8, 1.0, 1.0, multiple=1, compute_over_comm=2.0) == 16
    assert choose(8, 1.0, 1.0, multiple=1, compute_over_comm=0.5) == 4
    with pytest.raises(ValueError, match="compute_over_comm"):
        choose(8, 1.0, 1.0, compute_over_comm=0.0)
    with pytest.raises(ValueError):
        choose(1024, 0.0, 1.0)


@pytest.mark.parametrize("script", ["emulated_cluster.py", "fidelity.py"])
def test_refuses_in_one_line_without_tools(tmp_path, script):
    # an empty PATH hides ip and tc (and without root the first complaint is root); both benchmarks share the
    # launcher
    env = dict(os.environ, PATH=str(tmp_path))
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / script), "--smoke", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script[:-3]}: needs "), lines
    assert not (tmp_path / "x.json").exists()


def test_paired_ratios_pair_steps_of_the_same_round():
    mod = _load_script()
    # a slow spell in rounds 2 and 3 slows both: round by round ours is 0.9x in every round, while the ratio of
    # the medians (1.05 / 1.0) says slower
    ours = [0.9, 0.9, 1.8, 1.8, 1.2]
    reference = [1.0, 1.0, 2.0, 2.0, 1.333333333]
    r = mod.paired_ratios(ours, reference)
    assert r["rounds_ours_faster"] == 5 and r["rounds"] == 5
    assert abs(r["paired_ratio_median"] - 0.9) < 1e-6
    assert mod.statistics.median(ours) / mod.statistics.median(reference) > 0.9
    with pytest.raises(ValueError, match="equally many rounds"):
        mod.paired_ratios([1.0], [1.0, 2.0])
