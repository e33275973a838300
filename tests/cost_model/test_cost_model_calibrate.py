"""The calibrate command: a real 2-rank gloo sweep, and the table it writes driving the CostModel."""

from __future__ import annotations

import argparse
import json

import pytest
import torch.distributed as dist

from fsdp_passes.cost_model import Calibration, CostModel
from fsdp_passes.cli import main as cli_main
from fsdp_passes.cli.calibrate import add_arguments, parse_size, run
from fsdp_passes.cost_model.calibrate import calibrate
from fsdp_passes.dag.graph import CollectiveOp


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_parse_size_and_arguments(capsys):
    assert parse_size("65536") == 65536
    assert parse_size("64K") == parse_size("64KiB") == 65536
    assert parse_size("1M") == 1 << 20
    with pytest.raises(ValueError, match="sizes"):
        parse_size("lots")
    # on the command line argparse prints the message itself (a plain ValueError would read "invalid value")
    with pytest.raises(SystemExit):
        _parse(["--out", "x.json", "--sizes", "12Q"])
    assert "--sizes entry '12Q' is not valid: expected a positive size" in capsys.readouterr().err
    args = _parse(["--out", "x.json", "--sizes", "4K", "1M", "--iters", "3"])
    assert args.sizes == [4096, 1 << 20] and args.iters == 3 and args.world_size == 2
    assert args.ops == ["all_gather", "reduce_scatter", "all_reduce"]


@pytest.mark.parametrize("argv, needle", [(["--iters", "0"], "--iters 0"), (["--world-size", "1"], "--world-size 1"),
                                          (["--dtype", "int64"], "--dtype 'int64'")])
def test_bad_arguments_are_one_line_errors_before_anything_runs(tmp_path, capsys, argv, needle):
    out = str(tmp_path / "c.json")
    with pytest.raises(ValueError, match=needle):
        run(_parse(["--out", out, *argv]))
    # the command line reports it like every other command's: one line, code 2
    assert cli_main(["calibrate", "--out", out, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m fsdp_passes calibrate: error: ") and needle in err[0]
    assert not (tmp_path / "c.json").exists()


def test_calibrate_inside_an_existing_process_group(tmp_path):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        lines = []
        samples = []
        cal = calibrate(sizes=[4096, 65536], iters=2, warmup=1, ops=[CollectiveOp.ALL_REDUCE], progress=lines.append,
                        samples=samples)
        points = cal.points(CollectiveOp.ALL_REDUCE, 1)
        # every timed sample of every point; the table holds their median (one rank: nothing to agree on)
        assert [(op, b, len(t)) for op, b, t in samples] == [("all_reduce", 4096, 2), ("all_reduce", 65536, 2)]
        assert [sum(t) / 2 for _, _, t in samples] == pytest.approx([ms for _, ms in points], rel=1e-9)
        assert [b for b, _ in points] == [4096, 65536]
        # one progress line per point, with the median the table holds (one rank: nothing to agree on)
        assert [line.split(":")[0] for line in lines] == ["all_reduce 4096 B", "all_reduce 65536 B"]
        assert lines[1].endswith("(2/2)")
        assert [float(line.split(": ")[1].split(" ms")[0]) for line in lines] == pytest.approx(
            [ms for _, ms in points], rel=1e-3, abs=1e-6)
        out = tmp_path / "one.json"
        assert run(_parse(["--out", str(out), "--sizes", "4K", "--iters", "2", "--ops", "all_gather"])) == 0
        assert Calibration.load(out).points(CollectiveOp.ALL_GATHER, 1)
    finally:
        dist.destroy_process_group()


def test_calibrate_spawns_two_gloo_ranks_and_model_reproduces_it(tmp_path):
    out = tmp_path / "gloo.json"
    sizes = ["4K", "64K", "1M", "4M"]
    args = _parse(["--out", str(out), "--sizes", *sizes, "--iters", "5", "--warmup", "1", "--world-size", "2"])
    assert run(args) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["backend"] == "gloo" and data["meta"]["world_size"] == 2
    cal = Calibration.load(out)
    model = CostModel.from_options("cpu-gloo", str(out))
    expected_sizes = [parse_size(s) for s in sizes]
    for op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE):
        points = cal.points(op, 2)
        assert [b for b, _ in points] == expected_sizes
        for nbytes, ms in points:
            assert ms > 0
            assert model.collective_ms(op, nbytes, 2) == pytest.approx(ms, rel=0.15)
        # between two measured sizes the prediction stays between their times
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            mid = model.collective_ms(op, (b0 + b1) // 2, 2)
            assert min(t0, t1) <= mid <= max(t0, t1)
        # sizes never measured for this group size fall back to the profile
        assert model.collective_ms(op, 1 << 20, 4) == CostModel.from_options("cpu-gloo").collective_ms(op, 1 << 20, 4)
