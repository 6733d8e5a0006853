"""Q3-01..Q3-08 (docs/a5.md, acceptance matrix) through the production Trainer on 2 gloo ranks (CPU emulation).

Each format's 2-rank job (``conftest``) runs once per session; the tests below read its
per-rank results. ``main``: 20 steps, reshard_after_forward true, accumulation 1.
``variant``: reshard_after_forward false + activation_checkpoint full + accumulation 2.
"""
from __future__ import annotations

import pytest
import torch

from models.deepseek_v3.config import expected_low_precision_scope
from models.deepseek_v3.pretrain import model_config
from te_npu.testing.acceptance import rules as R
from tests.system import harness as H

LOW = ["mxfp8", "hif8"]
ALL = ["bf16", *LOW]


def _weights(rank_phase) -> set[str]:
    return set(rank_phase["weights"])


# ---- Q3-01 / Q3-02 / Q3-03: 20 steps, finite and falling --------------------------------------
# Each rule is stated once, in te_npu.testing.acceptance.rules (scripts/q3_acceptance.py judges with it too):
# a check returns its problems, and an empty list is a pass.


@pytest.mark.parametrize("fmt", ALL)
def test_q3_01_03_twenty_steps_finite_and_falling(run_of, fmt):
    ranks = run_of(fmt)["ranks"]
    for rank in ranks:
        records = rank["main"]["records"]
        assert not R.check_steps(rank["main"], H.MAIN_STEPS)
        assert not R.check_loss_falls(records, min_drop=0.5)
    # lm_loss is the mean over ranks: both ranks report the same numbers.
    assert H.per_step(ranks[0]["main"]["records"], "lm_loss") == H.per_step(ranks[1]["main"]["records"], "lm_loss")


def test_q3_01_bf16_runs_no_low_precision_work(bf16_run):
    for rank in bf16_run["ranks"]:
        main = rank["main"]
        assert not R.check_no_low_precision_work(main)
        assert sum(sum(main["probe"].refresh_counts(s).values()) for s in range(H.MAIN_STEPS)) == 0


@pytest.mark.parametrize("fmt", ALL)
def test_trainer_subscribers_see_the_run_and_end_with_close(run_of, fmt):
    for rank in run_of(fmt)["ranks"]:
        main = rank["main"]
        assert main["probe"].step_updated == dict.fromkeys(range(H.MAIN_STEPS), True)  # OptimizerStepEvent per step
        assert main["subscribed_after_close"] is False


@pytest.mark.parametrize("fmt", LOW)
def test_training_path_takes_no_dequantizing_fallback(run_of, fmt):
    """Setup, every step, the DCP save and the variant's recompute read the 8-bit weights only
    through their handlers: not one op took TE's dequantizing fallback (``DequantizeFallbackEvent``)."""
    for rank in run_of(fmt)["ranks"]:
        phases = [p for p in ("main", "variant", "fallback") if p in rank]
        assert "main" in phases and "variant" in phases
        for phase in phases:
            assert rank[phase]["probe"].dequantize_fallbacks == [], phase


@pytest.mark.parametrize("fmt", ALL)
def test_optimizer_state_is_fp32(run_of, fmt):
    for rank in run_of(fmt)["ranks"]:
        dtypes = rank["main"]["optimizer_dtypes"]
        assert dtypes and set(dtypes.values()) == {("torch.float32",) * 4}, dtypes


# ---- Q3-02 / Q3-03 / Q3-04: kernel contract ------------------------------------------------------


@pytest.mark.parametrize("fmt", LOW)
def test_q3_02_03_every_gemm_role_runs_in_the_recipe_format(run_of, fmt):
    for rank in run_of(fmt)["ranks"]:
        for phase in ("main", "variant"):
            assert not R.check_gemm_roles(rank[phase], fmt, "emulation", torch.bfloat16), phase


@pytest.mark.parametrize("fmt", LOW)
def test_q3_02_03_exact_low_precision_gemm_count_per_step(run_of, fmt):
    for rank in run_of(fmt)["ranks"]:
        main = rank["main"]
        probe = main["probe"]
        assert not R.check_gemm_counts(main, micro_steps=1)
        # the number is what the TE module list implies (grouped GEMMs: 2 per SwiGLU experts call)
        expected = R.expected_gemm_counts(probe.low_precision_modules, micro_steps=1)
        n_dense = sum(1 for t in probe.low_precision_modules.values() if R.unwrapped(t) == "TELinear")
        n_experts = sum(1 for t in probe.low_precision_modules.values() if R.unwrapped(t) == "TEGroupedSwiGLUExperts")
        assert sum(expected.values()) == 3 * n_dense + 3 * 2 * n_experts


def test_q3_03_hif8_scales_are_current_amax_over_format_max(hif8_run):
    for rank in hif8_run["ranks"]:
        assert not R.check_hif8_activation_scales(rank["main"])


# ---- Q3-04: model boundary -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", LOW)
def test_q3_04_low_precision_scope_is_exactly_the_te_modules(run_of, fmt, st_data_dir, tmp_path):
    run = run_of(fmt)
    cfg = H.st_config(fmt, tmp_path, st_data_dir)
    expected = expected_low_precision_scope(model_config(cfg))
    for rank in run["ranks"]:
        assert not R.check_scope(rank["main"], expected)
        assert not R.check_high_precision_pieces(rank["main"], cfg.model.overrides["num_hidden_layers"])


# ---- Q3-05 / Q3-06: FSDP gathers of quantized weights ------------------------------------------------


def test_q3_05_mxfp8_gathers_by_phase_and_reshard(mxfp8_run):
    for rank in mxfp8_run["ranks"]:
        # reshard_after_forward=true: forward row only, backward row + col
        assert not R.check_gathers(rank["main"], "mxfp8", micro_steps=1, reshard=True, world=H.WORLD)
        # reshard_after_forward=false: the (first) forward gather carries both directions; the
        # weight stays unsharded for backward (no backward gather), also under full recompute
        assert not R.check_gathers(rank["variant"], "mxfp8", micro_steps=2, reshard=False, world=H.WORLD)


def test_q3_06_hif8_gathers_data_and_scale(hif8_run):
    for rank in hif8_run["ranks"]:
        assert not R.check_gathers(rank["main"], "hif8", micro_steps=1, reshard=True, world=H.WORLD)
        assert not R.check_gathers(rank["variant"], "hif8", micro_steps=2, reshard=False, world=H.WORLD)
    assert not R.check_hif8_weight_scales([r["main"]["weights"] for r in hif8_run["ranks"]], H.WORLD)


def test_q3_rules_report_what_breaks_them(mxfp8_run):
    """The rules can fail: a run read with the wrong expectations names what differs."""
    main = mxfp8_run["ranks"][0]["main"]
    assert any("GEMM formats" in p for p in R.check_gemm_roles(main, "hif8", "emulation", torch.bfloat16))
    assert any("backend" in p for p in R.check_gemm_roles(main, "mxfp8", "npu", torch.bfloat16))
    assert R.check_gathers(main, "mxfp8", micro_steps=1, reshard=False, world=H.WORLD)
    assert R.check_refreshes(main, "mxfp8", micro_steps=2)
    assert R.check_steps(main, H.MAIN_STEPS + 1) == [f"{H.MAIN_STEPS} optimizer steps, expected {H.MAIN_STEPS + 1}"]


# ---- Q3-07 / Q3-08: refresh once per successful step; micro-steps and recompute never refresh -------


@pytest.mark.parametrize("fmt", LOW)
@pytest.mark.parametrize("phase", ["main", "variant"])
def test_q3_07_08_one_refresh_per_weight_per_step(run_of, fmt, phase):
    micro, recompute = (1, False) if phase == "main" else (2, True)
    for rank in run_of(fmt)["ranks"]:
        result = rank[phase]
        assert not R.check_steps(result, len(result["records"]))
        assert not R.check_refreshes(result, fmt, micro, recompute)
        assert not R.check_gemm_counts(result, micro, recompute)


# ---- Q3-10 (shard rows): misaligned MXFP8 shard fails with the FQN; the fallback trains ------------


def test_q3_10_misaligned_mxfp8_shard_fails_then_fallback_trains(mxfp8_run):
    for rank in mxfp8_run["ranks"]:
        assert not R.check_misaligned_shard(rank["misaligned_error"], "model.layers.0.self_attn.o_proj.weight",
                                            "[96, 96]", rank["misaligned_has_model"])
        fallback = rank["fallback"]
        assert "model.layers.0.self_attn.o_proj.weight" in fallback["replicated"]
        for fqn in fallback["replicated"]:
            assert not fallback["weights"][fqn]["sharded"]
        assert fallback["probe"].kernel_formats() == {"mxfp8_e4m3"}
        assert not R.check_steps(fallback, 2)
        assert not R.check_gemm_counts(fallback, 1)
        assert not R.check_refreshes(fallback, "mxfp8", 1)
        gathered = {g.context.param_fqn for g in fallback["probe"].gathers()}
        assert gathered == _weights(fallback) - set(fallback["replicated"])


# ---- slow duplicates: each switch on its own ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", LOW)
def test_q3_05_06_08_switches_alone(fmt, tmp_path, st_data_dir):
    ranks = H.spawn(H.run_main_worker, tmp_path, str(st_data_dir), fmt, ("reshard_false", "recompute"))
    for rank in ranks:
        rf, rc = rank["reshard_false"], rank["recompute"]
        assert not R.check_gathers(rf, fmt, micro_steps=1, reshard=False, world=H.WORLD)
        # recompute with reshard_after_forward=true: the replayed forward runs inside backward and
        # gathers both directions there, once per micro-step
        assert not R.check_gathers(rc, fmt, micro_steps=2, reshard=True, world=H.WORLD)
        for result, micro, recompute in ((rf, 1, False), (rc, 2, True)):
            assert not R.check_steps(result, len(result["records"]))
            assert not R.check_refreshes(result, fmt, micro, recompute)
            assert not R.check_gemm_counts(result, micro, recompute)
