"""Q3-01..Q3-08 (spec 17.2) through the production Trainer on 2 gloo ranks (CPU emulation).

Each format's 2-rank job (``conftest``) runs once per session; the tests below read its
per-rank results. ``main``: 20 steps, reshard_after_forward true, accumulation 1.
``variant``: reshard_after_forward false + activation_checkpoint full + accumulation 2.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from models.deepseek_v3.config import expected_low_precision_scope
from models.deepseek_v3.pretrain import model_config
from tests.system import harness as H

LOW = ["mxfp8", "hif8"]
ALL = ["bf16", *LOW]
TE_TYPES = {"TELinear", "TEGroupedLinear", "TEGroupedSwiGLUExperts"}
ROW, BOTH = ("row_data", "row_scale"), ("row_data", "row_scale", "col_data", "col_scale")
HIF8_FIELDS = ("qdata", "scale")


def _weights(rank_phase) -> set[str]:
    return set(rank_phase["weights"])


# ---- Q3-01 / Q3-02 / Q3-03: 20 steps, finite and falling --------------------------------------


@pytest.mark.parametrize("fmt", ALL)
def test_q3_01_03_twenty_steps_finite_and_falling(run_of, fmt):
    ranks = run_of(fmt)["ranks"]
    for rank in ranks:
        records = rank["main"]["records"]
        assert len(records) == H.MAIN_STEPS
        assert [r["step"] for r in records] == list(range(1, H.MAIN_STEPS + 1))
        assert all(r["updated"] for r in records)
        losses, norms = H.per_step(records, "lm_loss"), H.per_step(records, "grad_norm")
        assert all(math.isfinite(v) for v in losses + norms), (losses, norms)
        assert all(n > 0 for n in norms)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < first - 0.5, f"{fmt}: loss not falling: first5 {first:.3f}, last5 {last:.3f}"
    # lm_loss is the mean over ranks: both ranks report the same numbers.
    assert H.per_step(ranks[0]["main"]["records"], "lm_loss") == H.per_step(ranks[1]["main"]["records"], "lm_loss")


def test_q3_01_bf16_runs_no_low_precision_work(bf16_run):
    for rank in bf16_run["ranks"]:
        main = rank["main"]
        probe = main["probe"]
        assert probe.gemm_events == [] and probe.quant_events == [] and probe.gather_records == []
        assert main["weights"] == {}  # no 8-bit parameter anywhere
        assert sum(sum(probe.refresh_counts(s).values()) for s in range(H.MAIN_STEPS)) == 0


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
    expected_roles = {(k, g) for k in ("dense", "grouped") for g in H.GEMMS}
    for rank in run_of(fmt)["ranks"]:
        for phase in ("main", "variant"):
            probe = rank[phase]["probe"]
            assert expected_roles <= probe.executed_kernel_roles()
            assert probe.kernel_formats() == {H.FORMAT_VALUE[fmt]}
            assert {e.backend for e in probe.gemms()} == {"emulation"}
            assert set(probe.gemm_phases) == {"forward_backward"}  # no GEMM in the optimizer step
            scale_dtype = torch.uint8 if fmt == "mxfp8" else torch.float32  # E8M0 codes / FP32
            assert {(e.left_scale_dtype, e.right_scale_dtype) for e in probe.gemms()} == {(scale_dtype, scale_dtype)}
            assert {e.output_dtype for e in probe.gemms()} == {torch.bfloat16}


@pytest.mark.parametrize("fmt", LOW)
def test_q3_02_03_exact_low_precision_gemm_count_per_step(run_of, fmt):
    for rank in run_of(fmt)["ranks"]:
        main = rank["main"]
        probe = main["probe"]
        expected = H.expected_gemm_counts(probe.low_precision_modules, micro_steps=1)
        assert sum(expected.values()) > 0
        for step in range(H.MAIN_STEPS):
            assert probe.gemm_counts(step) == expected, step
        # the number is what the TE module list implies (grouped GEMMs: 2 per SwiGLU experts call)
        n_dense = sum(1 for t in probe.low_precision_modules.values() if H.unwrapped(t) == "TELinear")
        n_experts = sum(1 for t in probe.low_precision_modules.values() if H.unwrapped(t) == "TEGroupedSwiGLUExperts")
        assert sum(expected.values()) == 3 * n_dense + 3 * 2 * n_experts


def test_q3_03_hif8_scales_are_current_amax_over_format_max(hif8_run):
    for rank in hif8_run["ranks"]:
        probe = rank["main"]["probe"]
        events = [e for e in probe.hif8_quant_events() if e.format_max is not None]
        assert events
        assert {e.format_max for e in events} == {15.0, 224.0}
        for e in events:
            assert e.amax is not None and e.scale is not None
            assert e.scale.dtype == torch.float32 and e.amax.dtype == torch.float32
            assert torch.isfinite(e.scale).all() and (e.scale > 0).all()
            amax = e.amax.float()
            # the kernel's formula amax * (1.0f / format_max) in FP32 (te_npu.numerics.hif8.current_scale)
            recip = float(torch.tensor(1.0) / torch.tensor(e.format_max))
            expected = torch.where(torch.isfinite(amax) & (amax > 0), amax * recip, torch.ones_like(amax))
            assert torch.equal(e.scale, expected), (e.shape, e.format_max, e.amax, e.scale)
        # Activations (forward/backward) use 15 for inputs and 224 for gradients; weights 15.
        fb = {e.format_max for e in probe.quant_events_in("forward_backward")}
        assert fb == {15.0, 224.0}
        opt = {e.format_max for e in probe.quant_events_in("optimizer_step")}
        assert opt == {15.0}  # dense weights: quantize_with_scale(FSDP-group amax / 15), amax reported


# ---- Q3-04: model boundary -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", LOW)
def test_q3_04_low_precision_scope_is_exactly_the_te_modules(run_of, fmt, st_data_dir, tmp_path):
    run = run_of(fmt)
    cfg = H.st_config(fmt, tmp_path, st_data_dir)
    expected = expected_low_precision_scope(model_config(cfg))
    for rank in run["ranks"]:
        probe = rank["main"]["probe"]
        assert list(probe.low_precision_modules) == expected
        assert {H.unwrapped(t) for t in probe.low_precision_modules.values()} <= TE_TYPES
        high = {n: H.unwrapped(t) for n, t in probe.module_types.items() if n not in probe.low_precision_modules}
        # every high-precision piece exists and none is a TE module
        assert high["model.embed_tokens"] == "Embedding" and high["lm_head"] == "Linear"
        assert high["model.norm"] == "RMSNorm"
        routers = [n for n, t in high.items() if t == "TopKRouter"]
        norms = [n for n, t in high.items() if t == "RMSNorm"]
        assert routers and all(n.endswith(".mlp.gate") for n in routers)
        assert len(norms) >= 1 + 3 * cfg.model.overrides["num_hidden_layers"]  # input/post-attn/kv_a + final
        assert not TE_TYPES & set(high.values())
        # the 8-bit parameters are exactly the TE modules' weights (embedding/lm_head/router/norms stay BF16/FP32)
        assert _weights(rank["main"]) == H.expected_weight_fqns(probe.low_precision_modules)


# ---- Q3-05 / Q3-06: FSDP gathers of quantized weights ------------------------------------------------


def _check_gather_counts(phase_result, micro_steps: int, reshard: bool) -> None:
    probe, weights = phase_result["probe"], _weights(phase_result)
    for step in range(len(phase_result["records"])):
        counts = H.gather_counts(probe, step)
        expected = Counter({(w, "forward"): micro_steps for w in weights})
        if reshard:  # resharded after forward: gathered again for backward
            expected.update({(w, "backward"): micro_steps for w in weights})
        assert counts == expected, step


def test_q3_05_mxfp8_gathers_by_phase_and_reshard(mxfp8_run):
    for rank in mxfp8_run["ranks"]:
        main, variant = rank["main"], rank["variant"]
        # reshard_after_forward=true: forward row only, backward row + col
        _check_gather_counts(main, micro_steps=1, reshard=True)
        by_phase = H.group_by(main["probe"].gathers(), lambda g: g.context.phase)
        assert {g.fields for g in by_phase["forward"]} == {ROW}
        assert {g.fields for g in by_phase["backward"]} == {BOTH}
        assert all(g.context.reshard_after_forward for g in main["probe"].gathers())
        assert all(g.format == "mxfp8_e4m3" for g in main["probe"].gathers())
        for g in by_phase["forward"]:
            assert g.bytes_per_element <= 0.55 * 2.0, (g.context.param_fqn, g.bytes_per_element)
            assert g.gathered_bytes == g.local_bytes * H.WORLD
        # reshard_after_forward=false: the (first) forward gather carries both directions; the
        # weight stays unsharded for backward (no backward gather), also under full recompute
        _check_gather_counts(variant, micro_steps=2, reshard=False)
        assert {(g.context.phase, g.fields) for g in variant["probe"].gathers()} == {("forward", BOTH)}
        assert not any(g.context.reshard_after_forward for g in variant["probe"].gathers())


def test_q3_06_hif8_gathers_data_and_scale(hif8_run):
    for rank in hif8_run["ranks"]:
        _check_gather_counts(rank["main"], micro_steps=1, reshard=True)
        _check_gather_counts(rank["variant"], micro_steps=2, reshard=False)
        for phase in ("main", "variant"):
            gathers = rank[phase]["probe"].gathers()
            assert {g.fields for g in gathers} == {HIF8_FIELDS}
            assert {g.format for g in gathers} == {"hif8"}
            assert all(g.bytes_per_element <= 0.55 * 2.0 for g in gathers)
    r0, r1 = (r["main"]["weights"] for r in hif8_run["ranks"])
    for fqn, info in r0.items():
        assert info["scale"].dtype == torch.float32 and (info["scale"] > 0).all()
        assert info["scale_matches_master"] and r1[fqn]["scale_matches_master"], fqn  # amax(master) / 15
        if len(info["shape"]) == 2:  # dense: one FSDP-group scale, identical on every rank
            assert info["scale"].dim() == 0 and torch.equal(info["scale"], r1[fqn]["scale"]), fqn
        else:  # grouped: [E_local] per-expert scales of the rank's own whole experts
            E = info["shape"][0]
            assert info["local_shape"][0] == E // H.WORLD and info["scale"].shape == (E // H.WORLD,)


# ---- Q3-07 / Q3-08: refresh once per successful step; micro-steps and recompute never refresh -------


@pytest.mark.parametrize("fmt", LOW)
@pytest.mark.parametrize("phase", ["main", "variant"])
def test_q3_07_08_one_refresh_per_weight_per_step(run_of, fmt, phase):
    micro, recompute = (1, False) if phase == "main" else (2, True)
    for rank in run_of(fmt)["ranks"]:
        result = rank[phase]
        probe, weights = result["probe"], _weights(result)
        assert weights == H.expected_weight_fqns(probe.low_precision_modules)
        # setup writes each 8-bit shard once, from its master, by the route every step refreshes it
        # (the shards are allocated unwritten: nothing quantizes a high-precision weight directly)
        assert result["setup_refreshes"] == dict.fromkeys(weights, 1)
        local_shapes = sorted(info["local_shape"] for info in result["weights"].values())
        for step, record in enumerate(result["records"]):
            assert record["updated"] and math.isfinite(record["lm_loss"]) and math.isfinite(record["grad_norm"])
            assert probe.micro_steps[step] == micro
            assert probe.refresh_counts(step) == Counter(dict.fromkeys(weights, 1)), step
            # the optimizer step quantizes each local weight shard exactly once ...
            opt = probe.quant_events_in("optimizer_step", step)
            assert sorted(e.shape for e in opt) == local_shapes, step
            if fmt == "mxfp8":
                assert {e.orientation for e in opt} == {"dual"}
            # ... and forward/backward (micro-steps, recompute) quantize activations only
            fb = probe.quant_events_in("forward_backward", step)
            assert len(fb) == H.expected_activation_quants(probe.low_precision_modules, fmt, micro, recompute), step
            if fmt == "hif8":
                assert all(e.format_max in (15.0, 224.0) and len(e.shape) == 2 for e in fb)
            assert probe.gemm_counts(step) == H.expected_gemm_counts(probe.low_precision_modules, micro, recompute)
        assert not probe.quant_events_in("other")


# ---- Q3-10 (shard rows): misaligned MXFP8 shard fails with the FQN; the fallback trains ------------


def test_q3_10_misaligned_mxfp8_shard_fails_then_fallback_trains(mxfp8_run):
    for rank in mxfp8_run["ranks"]:
        error = rank["misaligned_error"]
        assert error is not None, "o_proj [96, 96] must have no MXFP8 shard dim on 2 ranks (48 rows, 48 columns)"
        assert "model.layers.0.self_attn.o_proj.weight" in error and "[96, 96]" in error
        assert "fallback_to_unsharded" in error
        assert not rank["misaligned_has_model"]  # failed before FSDP / optimizer / any step
        fallback = rank["fallback"]
        assert "model.layers.0.self_attn.o_proj.weight" in fallback["replicated"]
        for fqn in fallback["replicated"]:
            assert not fallback["weights"][fqn]["sharded"]
        probe = fallback["probe"]
        assert probe.kernel_formats() == {"mxfp8_e4m3"}
        for step, record in enumerate(fallback["records"]):
            assert record["updated"] and math.isfinite(record["lm_loss"]) and math.isfinite(record["grad_norm"])
            assert probe.gemm_counts(step) == H.expected_gemm_counts(probe.low_precision_modules, 1)
            assert probe.refresh_counts(step) == Counter(dict.fromkeys(_weights(fallback), 1))
        gathered = {g.context.param_fqn for g in probe.gathers()}
        assert gathered == _weights(fallback) - set(fallback["replicated"])


# ---- slow duplicates: each switch on its own ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", LOW)
def test_q3_05_06_08_switches_alone(fmt, tmp_path, st_data_dir):
    ranks = H.spawn(H.run_main_worker, tmp_path, str(st_data_dir), fmt, ("reshard_false", "recompute"))
    fields = BOTH if fmt == "mxfp8" else HIF8_FIELDS
    for rank in ranks:
        rf, rc = rank["reshard_false"], rank["recompute"]
        _check_gather_counts(rf, micro_steps=1, reshard=False)
        assert {g.fields for g in rf["probe"].gathers()} == {fields}
        # recompute with reshard_after_forward=true: the replayed forward runs inside backward and
        # gathers both directions there, once per micro-step
        _check_gather_counts(rc, micro_steps=2, reshard=True)
        for g in rc["probe"].gathers():
            assert g.fields == (ROW if g.context.phase == "forward" and fmt == "mxfp8" else fields)
        for result, micro, recompute in ((rf, 1, False), (rc, 2, True)):
            probe = result["probe"]
            for step, record in enumerate(result["records"]):
                assert record["updated"] and math.isfinite(record["lm_loss"])
                assert probe.refresh_counts(step) == Counter(dict.fromkeys(_weights(result), 1))
                assert probe.gemm_counts(step) == H.expected_gemm_counts(probe.low_precision_modules, micro, recompute)
                fb = probe.quant_events_in("forward_backward", step)
                assert len(fb) == H.expected_activation_quants(probe.low_precision_modules, fmt, micro, recompute)
