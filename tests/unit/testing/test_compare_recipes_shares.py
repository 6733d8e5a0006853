"""``scripts/compare_recipes.py`` publishes ``te_npu.testing.time_shares`` (the acceptance report's
definition), mean of the ranks: the same numbers both ways from one fixed span list."""
from __future__ import annotations

import argparse
import json

import pytest

from scripts import compare_recipes
from te_npu.testing.time_shares import CATEGORIES, mean_over_ranks, time_shares
from tests.unit.testing.test_time_shares import STEP, _host

# rank 1: the same step with a longer all-gather and a gloo worker thread (reported apart, not counted)
RANK1 = [*STEP[:9], _host("FSDP::all_gather (model.layers.0)", 40, 18), *STEP[10:],
         _host("gloo:all_gather", 42, 6, ("p", 7))]


def _profile_dir(tmp_path, steps: int):
    shares = [time_shares(STEP, wall_us=100.0), time_shares(RANK1, wall_us=120.0)]
    for rank, s in enumerate(shares):
        (tmp_path / f"profile_rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": steps, "shares": s}))
    return shares


def test_compare_recipes_reads_the_time_shares_of_every_rank_and_averages_them(tmp_path):
    shares = _profile_dir(tmp_path, steps=2)
    profile = compare_recipes.read_profile(tmp_path)
    assert profile == {**mean_over_ranks(shares, 2), "ranks": 2}
    for c in CATEGORIES:
        assert profile["percent"][c] == pytest.approx((shares[0]["percent"][c] + shares[1]["percent"][c]) / 2)
    assert profile["percent"]["all_gather"] == pytest.approx((11.0 + 11.67) / 2)  # 11 of 100 us, 14 of 120 us
    assert profile["comm_threads_percent"] == {"gloo:all_gather": pytest.approx(5.0 / 2)}  # 0 on rank 0, 5 % on rank 1
    assert profile["wall_ms_per_step"] == pytest.approx((0.1 + 0.12) / 2 / 2)


def test_compare_recipes_table_prints_the_time_shares_cells(tmp_path):
    _profile_dir(tmp_path, steps=1)
    profile = compare_recipes.read_profile(tmp_path)
    args = argparse.Namespace(profile_warmup=2, profile_steps=1)
    table = compare_recipes._time_shares_table(args, {"mxfp8": {}, "hif8": {}}, {"mxfp8": profile})
    header, row, missing = table[-4].split(" | "), table[-2].split(" | "), table[-1]
    assert header[2:7] == ["quant", "MM-GMM", "all-gather", "reduce-scatter", "other"]
    assert row[2:7] == [f"{profile['percent'][c]:.1f}% ({profile['ms_per_step'][c]:.0f})" for c in CATEGORIES]
    assert row[7] == f"{profile['unattributed_percent']:.1f}%" and row[8] == "gloo:all_gather 2.5% |"
    assert missing.startswith("| hif8 | (not profiled) |")


def test_compare_recipes_no_longer_labels_the_emulation_itself():
    # one definition: the script neither wraps te_npu.ops.emulation in ranges of its own nor classifies events
    for gone in ("labelled_emulation", "attribute_times", "categorize", "CATEGORIES"):
        assert not hasattr(compare_recipes, gone)


def test_an_old_profile_without_time_shares_is_not_read(tmp_path):
    (tmp_path / "profile_rank0.json").write_text(json.dumps({"rank": 0, "steps": 3, "seconds": {}}))
    assert compare_recipes.read_profile(tmp_path) is None
