"""te_npu.testing.acceptance.rules on hand-made inputs: each rule passes what it allows and names
what it does not (the system tests run them on real 2-rank runs)."""
from __future__ import annotations

import pytest

from te_npu.errors import ConfigError
from te_npu.testing.acceptance import rules as R


def _records(losses, grad_norm=1.0):
    return [{"step": i + 1, "lm_loss": v, "grad_norm": grad_norm, "updated": True, "lr": 1e-3,
             "elapsed_ms": 100.0, "tokens_per_s": 1000.0} for i, v in enumerate(losses)]


def test_check_steps_names_skipped_and_non_finite_steps():
    assert R.check_steps({"records": _records([3.0] * 4)}, 4) == []
    records = _records([3.0, float("nan"), 2.0])
    records[2]["updated"] = False
    problems = R.check_steps({"records": records}, 4)
    assert problems[0] == "3 optimizer steps, expected 4"
    assert any("[3] skipped" in p for p in problems) and any("non-finite" in p for p in problems)


def test_check_loss_falls():
    falling = [10.0 - 0.2 * i for i in range(20)]
    assert R.check_loss_falls(_records(falling), min_drop=0.5) == []
    assert R.check_loss_falls(_records([5.0] * 20), min_drop=None) == ["the loss never changes (training does not update)"]
    assert "explodes" in R.check_loss_falls(_records([1.0] * 10 + [9.0] * 10), min_drop=None)[0]
    assert "too few" in R.check_loss_falls(_records([1.0] * 5))[0]


def test_steady_ratios_are_over_the_steps_after_warmup():
    def run(tps, ms):
        rows = _records([1.0] * 23)
        for r in rows[3:]:
            r["tokens_per_s"], r["elapsed_ms"] = tps, ms
        return rows

    ratios = R.steady_ratios({"bf16": run(1000.0, 100.0), "mxfp8": run(1250.0, 80.0), "hif8": run(900.0, 110.0)}, 3)
    assert ratios["bf16"]["steady_steps"] == 20
    assert ratios["mxfp8"]["throughput_ratio"] == pytest.approx(1.25) and ratios["mxfp8"]["step_time_ratio"] == 0.8
    assert ratios["hif8"]["throughput_ratio"] == pytest.approx(0.9)


def test_check_illegal_config_and_misaligned_shard():
    def load(override):
        if "comm_fusion" in override:
            raise ConfigError("fsdp_config.comm_fusion: must be false")

    assert R.check_illegal_config(load, "fsdp_config.comm_fusion=true", "fsdp_config.comm_fusion") == []
    assert "accepted" in R.check_illegal_config(load, "parallel.tensor_parallel_size=2", "parallel")[0]
    assert "does not name" in R.check_illegal_config(load, "fsdp_config.comm_fusion=true", "checkpoint.format")[0]
    fqn = "model.layers.0.self_attn.o_proj.weight"
    good = f"{fqn} [96, 96]: no MXFP8 shard dim (set fsdp_config.fallback_to_unsharded: true)"
    assert R.check_misaligned_shard(good, fqn, "[96, 96]", had_model=False) == []
    assert R.check_misaligned_shard(None, fqn, "[96, 96]", had_model=False)
    assert R.check_misaligned_shard(good, fqn, "[96, 96]", had_model=True) == [
        "the model was built before the shard refusal"]


def test_hif8_weight_scales_across_ranks():
    dense = {"shape": (64, 64), "local_shape": (32, 64), "scale": 0.5, "scale_matches_master": True}
    experts = {"shape": (4, 64, 64), "local_shape": (2, 64, 64), "scale": [0.1, 0.2], "scale_matches_master": True}
    ranks = [{"w": dense, "e": experts}, {"w": dense, "e": experts}]
    assert R.check_hif8_weight_scales(ranks, 2) == []
    other = [{"w": dense, "e": experts}, {"w": {**dense, "scale": 0.25}, "e": experts}]
    assert "dense scale differs across ranks" in R.check_hif8_weight_scales(other, 2)[0]
