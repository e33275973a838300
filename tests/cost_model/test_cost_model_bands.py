"""A profile's ``small_collective_bands`` and ``small_collective_extra_us`` (measured prices of small
collectives) and their fit to a sweep, against hand-computed figures."""

from __future__ import annotations

import json

import pytest

from fsdp_passes.cost_model import (
    Calibration,
    collective_ms,
    estimate_collective,
    fit_small_collectives,
    load_profile,
)
from fsdp_passes.dag import CollectiveOp

BANDS = [[4096, 100, 30], [65536, 200, 50]]


@pytest.fixture
def banded():
    return load_profile({"base": "cpu-gloo", "small_collective_bands": BANDS})


def test_band_prices_hand_computed(banded):
    # a call of one ring step costs call_us, each further step step_us; gloo's reduce-scatter is its all-reduce
    e = estimate_collective("all_gather", 1024, 2, banded)
    assert (e.ms, e.algorithm, e.protocol, e.latency_us) == (pytest.approx(0.100), "ring", "band", 100.0)
    assert collective_ms("all_gather", 4096, 2, banded) == pytest.approx(0.100)  # max_bytes is inside the band
    assert collective_ms("all_reduce", 4096, 2, banded) == pytest.approx(0.130)  # 100 + 1 x 30
    assert collective_ms("reduce_scatter", 4096, 2, banded) == pytest.approx(0.130)
    assert collective_ms("all_gather", 4097, 2, banded) == pytest.approx(0.200)  # the second band
    # 8 ranks: an all-gather 7 steps (200 + 6 x 50 us), an all-reduce 14 (200 + 13 x 50 us)
    assert collective_ms("all_gather", 65536, 8, banded) == pytest.approx(0.500)
    assert collective_ms("all_reduce", 65536, 8, banded) == pytest.approx(0.850)


def test_above_the_last_band_and_other_collectives_keep_the_alpha_beta_price(banded):
    plain = load_profile("cpu-gloo")
    for op, nbytes in (("all_gather", 65537), ("all_reduce", 1 << 20), ("all_to_all", 1024), ("other", 1024)):
        assert collective_ms(op, nbytes, 2, banded) == collective_ms(op, nbytes, 2, plain), (op, nbytes)
    assert collective_ms("all_gather", 0, 2, banded) == 0.0 and collective_ms("all_gather", 1024, 1, banded) == 0.0


def test_bands_on_an_nccl_profile_and_the_call_floor():
    p = load_profile({"base": "h100-nvlink", "small_collective_bands": BANDS})
    # NCCL's reduce-scatter takes an all-gather's n-1 steps: 100 + 6 x 30 us on 8 ranks, whatever the tree / LL
    assert estimate_collective("reduce_scatter", 4096, 8, p).ms == pytest.approx(0.280)
    assert estimate_collective("all_reduce", 4096, 8, p).ms == pytest.approx(0.490)  # 100 + 13 x 30
    # h100-nvlink's collective_floor_us (45) still bounds a band price from below
    low = load_profile({"base": "h100-nvlink", "small_collective_bands": [[4096, 10, 1]]})
    assert collective_ms("all_gather", 1024, 2, low) == pytest.approx(0.045)


def test_bands_round_trip_through_json(banded, tmp_path):
    assert banded.small_collective_bands == ((4096, 100.0, 30.0), (65536, 200.0, 50.0))
    assert load_profile(json.loads(json.dumps(banded.to_dict()))) == banded
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"base": "cpu-gloo", "small_collective_bands": BANDS}))
    assert load_profile(str(path)) == banded
    assert load_profile("cpu-gloo").small_collective_bands == ()


def test_extra_adds_to_one_ops_band_price_only(banded):
    p = banded.replace(small_collective_extra_us=(("reduce_scatter", 45.0),))
    # 100 + 1 x 30 + 45 us; the all-reduce of the same steps and the all-gather keep the band price
    assert collective_ms("reduce_scatter", 4096, 2, p) == pytest.approx(0.175)
    assert collective_ms("all_reduce", 4096, 2, p) == pytest.approx(0.130)
    assert collective_ms("all_gather", 4096, 2, p) == pytest.approx(0.100)
    # above the bands the α–β price, without the extra
    assert collective_ms("reduce_scatter", 1 << 20, 2, p) == collective_ms("reduce_scatter", 1 << 20, 2, banded)
    # a JSON object or a list of pairs; the profile keeps pairs sorted by op and round-trips through JSON
    as_object = load_profile({"base": "cpu-gloo", "small_collective_bands": BANDS,
                              "small_collective_extra_us": {"reduce_scatter": 45, "all_gather": 0}})
    assert as_object.small_collective_extra_us == (("all_gather", 0.0), ("reduce_scatter", 45.0))
    assert load_profile(json.loads(json.dumps(as_object.to_dict()))) == as_object
    # pairs given in another order make the same profile
    assert banded.replace(small_collective_extra_us=(("reduce_scatter", 45.0), ("all_gather", 0.0))) == as_object
    # on NCCL the reduce-scatter takes the all-gather's n-1 steps: 100 + 6 x 30 + 45 us on 8 ranks
    nccl = load_profile({"base": "h100-nvlink", "small_collective_bands": BANDS,
                         "small_collective_extra_us": {"reduce_scatter": 45}})
    assert collective_ms("reduce_scatter", 4096, 8, nccl) == pytest.approx(0.325)


@pytest.mark.parametrize("extra, words", [
    ({"broadcast": 10}, ["small_collective_extra_us", "'broadcast'"]),
    ({"reduce_scatter": -1}, ["small_collective_extra_us", "reduce_scatter: -1.0"]),
    ({"reduce_scatter": float("inf")}, ["small_collective_extra_us", "reduce_scatter: inf"]),
    ([["reduce_scatter", 1], ["reduce_scatter", 2]], ["small_collective_extra_us", "repeated"]),
    ([["reduce_scatter"]], ["small_collective_extra_us", "pairs"]),
    ([["reduce_scatter", 1], [1, 2]], ["small_collective_extra_us", "op 1"]),
    ({"reduce_scatter": True}, ["small_collective_extra_us", "reduce_scatter: True"]),
    ("x", ["small_collective_extra_us", "pairs"]),
])
def test_bad_extra_is_a_value_error_naming_the_field(extra, words):
    with pytest.raises(ValueError) as info:
        load_profile({"base": "cpu-gloo", "small_collective_extra_us": extra})
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("bands, words", [
    ("x", ["small_collective_bands", "triples"]),
    ([[4096, 100]], ["small_collective_bands", "triples"]),
    ([[0, 1, 1]], ["small_collective_bands", "band 0", "max_bytes=0"]),
    ([[4096.5, 1, 1]], ["small_collective_bands", "band 0", "max_bytes=4096.5"]),
    ([[True, 1, 1]], ["small_collective_bands", "max_bytes=True"]),
    ([[4096, -1, 0]], ["small_collective_bands", "band 0", "call_us=-1.0"]),
    ([[4096, 1, float("nan")]], ["small_collective_bands", "band 0", "step_us=nan"]),
    ([[4096, 1, 1], [4096, 2, 2]], ["small_collective_bands", "band 1", "does not exceed"]),
    ([[4096, 100, 30], [65536, 90, 30]], ["small_collective_bands", "band 1", "below band 0"]),
    ([[4096, 100, 30], [65536, 100, 20]], ["small_collective_bands", "band 1", "below band 0"]),
])
def test_bad_bands_are_value_errors_naming_the_field(bands, words):
    with pytest.raises(ValueError) as info:
        load_profile({"base": "cpu-gloo", "small_collective_bands": bands})
    for w in words:
        assert w in str(info.value)


def _cal(points: dict[str, dict[int, float]], n: int = 2) -> Calibration:
    cal = Calibration()
    for op, table in points.items():
        for nbytes, ms in table.items():
            cal.add_collective(op, n, nbytes, ms)
    return cal


def test_fit_two_ranks_hand_computed():
    cal = _cal({"all_gather": {1024: 0.30, 4096: 0.40, 16384: 0.32, 1 << 20: 10.0},
                "all_reduce": {1024: 0.50, 4096: 0.55, 16384: 0.60, 1 << 20: 21.0},
                "reduce_scatter": {1024: 0.70, 4096: 0.65, 16384: 0.62}})
    fit = fit_small_collectives(cal, 2, 65536)
    # without samples each op's median is one sample.  One-step times (all-gather) 0.30 0.40 0.32: 0.40 > 0.32,
    # so 4096 and 16384 pool to median(0.40, 0.32) = 0.36 >= 0.30 -> 0.30 0.36 0.36 ms; two-step times (the
    # all-reduce) 0.50 0.55 0.60, already non-decreasing; call = t1, step = t2 - t1: (300, 200),
    # (360, 190 -> raised to 200), (360, 240)
    bands = fit["small_collective_bands"]
    assert [b[0] for b in bands] == [1024, 4096, 16384]
    assert [b[1:] for b in bands] == [pytest.approx((300, 200)), pytest.approx((360, 200)), pytest.approx((360, 240))]
    # gloo's reduce-scatter, 0.70 0.65 0.62 falling: one pool, median 0.65 ms at every size; less the two-step
    # band prices 500, 560, 600 us: 150, 90, 50 -> median 90 us
    assert fit["small_collective_extra_us"] == (("reduce_scatter", pytest.approx(90)),)
    p = load_profile({"base": "cpu-gloo", **fit})
    assert load_profile("cpu-gloo").replace(**fit) == p.replace(name="cpu-gloo")
    assert collective_ms("all_gather", 1024, 2, p) == pytest.approx(0.30)
    assert collective_ms("all_reduce", 1024, 2, p) == pytest.approx(0.50)
    assert collective_ms("reduce_scatter", 1024, 2, p) == pytest.approx(0.59)
    plain = load_profile("cpu-gloo")
    assert collective_ms("all_gather", 1 << 20, 2, p) == collective_ms("all_gather", 1 << 20, 2, plain)


SAMPLES = {("all_gather", 1024): [0.30, 0.32, 0.34], ("all_gather", 4096): [0.26, 0.28, 0.30],
           ("all_gather", 16384): [0.22, 0.24, 0.40],
           ("all_reduce", 1024): [0.50, 0.52, 0.54], ("all_reduce", 4096): [0.55, 0.57, 0.59],
           ("all_reduce", 16384): [0.60, 0.62, 0.64],
           ("reduce_scatter", 1024): [0.56, 0.58, 0.60], ("reduce_scatter", 4096): [0.61, 0.63, 0.65],
           ("reduce_scatter", 16384): [0.60, 0.62, 0.64]}


def _median_cal(samples):
    cal = Calibration()
    for (op, nbytes), times in samples.items():
        cal.add_collective(op, 2, nbytes, sorted(times)[len(times) // 2])
    return cal


def test_fit_pools_the_samples_of_sizes_that_measured_faster_than_smaller_ones():
    fit = fit_small_collectives(_median_cal(SAMPLES), 2, 65536, samples=SAMPLES)
    # all-gather medians fall with size (0.32, 0.28, 0.24): 1024 and 4096 pool (0.26 .. 0.34, median 0.30), then
    # 16384 joins them (median of the nine 0.22 .. 0.40 is 0.30): one-step time 0.30 ms at every size, where the
    # smallest-median-at-or-above rule would price all three at the luckiest median, 0.24 ms.  Two-step times
    # (all-reduce) 0.52, 0.57, 0.62 ms, non-decreasing.  call = t1, step = t2 - t1
    assert fit["small_collective_bands"] == (pytest.approx((1024, 300, 220)), pytest.approx((4096, 300, 270)),
                                             pytest.approx((16384, 300, 320)))
    # reduce-scatter medians 0.58, 0.63, 0.62: 4096 and 16384 pool (0.60 .. 0.65, median 0.625); less the band
    # prices 520, 570, 620 us: 60, 55, 5 -> 55 us
    assert fit["small_collective_extra_us"] == (("reduce_scatter", pytest.approx(55)),)
    # the same sweep's medians alone (one sample an op): t1 0.32, 0.28, 0.24 pool to median 0.28 at every size;
    # t2 0.52, 0.57, 0.62; the reduce-scatter as above (its pooled medians are the same)
    assert fit_small_collectives(_median_cal(SAMPLES), 2, 65536) == {
        "small_collective_bands": (pytest.approx((1024, 280, 240)), pytest.approx((4096, 280, 290)),
                                   pytest.approx((16384, 280, 340))),
        "small_collective_extra_us": (("reduce_scatter", pytest.approx(55)),)}
    # op keys may be CollectiveOp members
    keyed = {(CollectiveOp(op), nbytes): times for (op, nbytes), times in SAMPLES.items()}
    assert fit_small_collectives(_median_cal(SAMPLES), 2, 65536, samples=keyed) == fit


@pytest.mark.parametrize("samples", [
    [1, 2],  # not a mapping
    {("all_gather", 1024): []},
    {("all_gather", 1024): [0.3, -0.1]},
    {("all_gather", 1024): [float("nan")]},
    {("all_gather", 1024): "0.3"},
    {"all_gather": [0.3]},
    {("all_gather", 1024.0): [0.3]},
    {k: v for k, v in SAMPLES.items() if k != ("reduce_scatter", 4096)},  # a point of the fit missing
])
def test_fit_bad_samples_are_value_errors_naming_them(samples):
    with pytest.raises(ValueError, match="samples"):
        fit_small_collectives(_median_cal(SAMPLES), 2, 65536, samples=samples)


def _bands_and_extra(*args):
    fit = fit_small_collectives(*args)
    return fit["small_collective_bands"], dict(fit["small_collective_extra_us"])


def test_fit_edge_cases_hand_computed():
    # two-step calls measured faster than one-step ones: no per-step time, the call the mean of the two; a
    # reduce-scatter faster than its band price costs nothing extra
    cal = _cal({"all_gather": {1024: 0.5}, "all_reduce": {1024: 0.4}, "reduce_scatter": {1024: 0.4}})
    assert _bands_and_extra(cal, 2, 4096) == ((pytest.approx((1024, 450, 0)),), {"reduce_scatter": 0.0})
    # NCCL: the reduce-scatter takes the all-gather's steps: band (300, 300); its extra 500 - 300 us
    cal = _cal({"all_gather": {1024: 0.3}, "reduce_scatter": {1024: 0.5}, "all_reduce": {1024: 0.6}})
    assert _bands_and_extra(cal, 2, 4096, "nccl") == ((pytest.approx((1024, 300, 300)),),
                                                      {"reduce_scatter": pytest.approx(200)})
    # 4 ranks (3 and 6 steps): step = (1.6 - 1.0) / 3 = 0.2 ms, call = 1.0 - 2 x 0.2 = 0.6 ms; gloo's
    # reduce-scatter takes the all-reduce's 6 steps (band price 1.6 ms), NCCL's the all-gather's 3 (1.0 ms)
    cal = _cal({"all_gather": {1024: 1.0}, "all_reduce": {1024: 1.6}, "reduce_scatter": {1024: 1.75}}, n=4)
    assert _bands_and_extra(cal, 4, 4096) == ((pytest.approx((1024, 600, 200)),),
                                              {"reduce_scatter": pytest.approx(150)})
    assert _bands_and_extra(cal, 4, 4096, "nccl")[1] == {"reduce_scatter": pytest.approx(750)}
    # a reduce-scatter measured at some band sizes only: its extra from those (1.8 - 1.6 ms at 4096)
    cal = _cal({"all_gather": {1024: 1.0, 4096: 1.0}, "all_reduce": {1024: 1.6, 4096: 1.6},
                "reduce_scatter": {4096: 1.8}}, n=4)
    assert _bands_and_extra(cal, 4, 4096)[1] == {"reduce_scatter": pytest.approx(200)}
    # a negative call (1.0 - 2 x 0.4667 < 0 for t1 = 0.2): call 0, step (2 x 0.2 + 5 x 1.6) / (4 + 25) ms
    cal = _cal({"all_gather": {1024: 0.2}, "all_reduce": {1024: 1.6}}, n=4)
    assert _bands_and_extra(cal, 4, 4096) == ((pytest.approx((1024, 0, 8400 / 29)),), {})
    # sizes above max_bytes, or without both step counts, give no band; nothing measured, no bands
    cal = _cal({"all_gather": {1024: 0.3, 4096: 0.3, 1 << 20: 10}, "all_reduce": {1024: 0.5, 1 << 20: 20}})
    assert [b[0] for b in _bands_and_extra(cal, 2, 65536)[0]] == [1024]
    assert _bands_and_extra(Calibration(), 2, 65536) == ((), {})


@pytest.mark.parametrize("kwargs, word", [(dict(group_size=1), "group_size"), (dict(max_bytes=0), "max_bytes"),
                                          (dict(collective_library="mpi"), "collective_library")])
def test_fit_bad_arguments(kwargs, word):
    args = {**dict(calibration=Calibration(), group_size=2, max_bytes=4096), **kwargs}
    with pytest.raises(ValueError, match=word):
        fit_small_collectives(**args)
