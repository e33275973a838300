"""Real gloo group, composability numerics: tensor parallel + FSDP (4 ranks, 2 x 2 mesh).  Mixed precision, fp32
FSDP numerics and ``verify_rank_consistency`` (2 ranks): tests/inductor/test_numerics_gloo.py; HSDP on a 2 x 2
mesh: tests/frontend/test_frontend_gloo.py (trained against the unsharded model).

The rank functions compare on the rank and return plain values: tensors do not survive the trip out of a
finished spawned process.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_passes.testing import run_on_gloo

# the shared helpers live in tests/ (test modules are imported by path, not as a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_reports import check_passes_ran, fresh_compile_state, max_rel, report_summary  # noqa: E402


# -- tensor parallel + FSDP ------------------------------------------------------------------------------------

TP_CONFIGS = {
    "auto": dict(bucketing="auto", reorder=True, strict=True),
    # on a model this small auto may keep graphs unmerged (launch-bound on the default profile), so a
    # per-layer manual plan makes the bucket checks below bite: it merges each layer's FSDP collectives
    # around the TP all-reduces
    "manual": dict(bucketing="manual", bucket_plan=["layers.[0-1]"], reorder=True, strict=True, memory_budget="1GB"),
}


def _tp_step(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_passes
    from fsdp_passes.testing.models import build_tp_mlp

    # ranks [[0, 1], [2, 3]]: dim 0 is the FSDP group ({0, 2}, {1, 3}), dim 1 the TP group ({0, 1}, {2, 3})
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group(0), mesh.get_group(1)
    # the input is replicated over the TP group and differs across the FSDP group
    torch.manual_seed(100 + mesh.get_local_rank(0))
    x = torch.randn(4, 32)
    out = {}
    for name in ("eager", *TP_CONFIGS):
        model = build_tp_mlp(2, 32, tp_group=tp, dp_group=dp)
        fresh_compile_state()
        fsdp_passes.last_reports(clear=True)
        if name == "eager":
            fn = model
        else:
            fsdp_passes.enable(**TP_CONFIGS[name])
            fn = torch.compile(model)
        try:
            loss = fn(x).square().mean()
            loss.backward()
        finally:
            fsdp_passes.disable()
        out[name] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                     report_summary(fsdp_passes.last_reports()))
    le, ge, _ = out["eager"]
    return {
        name: {
            "loss_rel": ((out[name][0] - le).abs() / le.abs().clamp_min(1e-30)).item(),
            "max_rel": max_rel(out[name][1], ge),
            "reports": out[name][2],
            "dp": dp.group_name,
            "tp": tp.group_name,
        }
        for name in TP_CONFIGS
    }


def test_tp_fsdp_compiled_matches_eager_on_gloo():
    results = run_on_gloo(4, _tp_step, timeout=300)
    for rank, per_config in enumerate(results):
        for name, res in per_config.items():
            where = (rank, name)
            assert res["loss_rel"] <= 1e-6, (where, res["loss_rel"])
            assert res["max_rel"] <= 1e-5, (where, res["max_rel"])
            reports = res["reports"]
            check_passes_ran(reports, where)
            tp, dp = res["tp"], res["dp"]
            assert tp != dp
            fx = [r for r in reports if r["pass"] == "fx"]
            # the TP all-reduces (not FSDP-like) are left out of bucketing, named; no bucket holds one of them
            # and every bucket is of the FSDP group
            tp_names = {n for r in fx for n, why in r["unbucketed"].items() if "not an FSDP" in why}
            assert len(tp_names) == 3, (where, [r["unbucketed"] for r in fx])
            buckets = [b for r in fx for b in r["buckets"]]
            assert buckets, where
            for b in buckets:
                assert b["group"] == dp and not set(b["members"]) & tp_names, (where, b)
            # every TP all-reduce still runs, one by one, on the TP group: two in forward (row-parallel outputs),
            # one in backward (the column-parallel input gradient of layer 1; layer 0's input needs none)
            for pass_name in ("fx", "scheduler"):
                seq = [c for r in reports if r["pass"] == pass_name for c in r["sequence"]]
                assert {c[1] for c in seq} == {tp, dp}, (where, pass_name, seq)
                tp_seq = [c for c in seq if c[1] == tp]
                assert len(tp_seq) == 3 and all(c[0] == "all_reduce" and c[2] == "512" for c in tp_seq), tp_seq
        # the per-layer plan merged FSDP collectives (of the FSDP group only, above) in both graphs
        fx = [r for r in per_config["manual"]["reports"] if r["pass"] == "fx"]
        assert all(r["after"] < r["before"] for r in fx), (rank, fx)
