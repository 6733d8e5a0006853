"""Model FLOPs per token of DeepSeek-V3: a hand count for the tiny config, and the projection
FLOPs checked against the model's own parameter shapes (16B too)."""
from __future__ import annotations

import pytest
import torch

from models.deepseek_v3.config import DSV3_16B, DSV3_TINY
from models.deepseek_v3.flops import flops_per_token, forward_flops_per_token
from models.deepseek_v3.model import DeepseekV3ForCausalLM
from te_npu.training.metrics.throughput import ModelFlops, default_peak_tflops, step_throughput


def test_flops_tiny_config_equals_hand_count():
    """DSV3_TINY: D=128, N=2, P=R=V=64, C=64, no q_lora, F=256, M=64, E=8, K=2, Z=2, O=256,
    4 layers (1 dense, 3 MoE), S=256 (each line is multiply-adds x 2)."""
    parts = forward_flops_per_token(DSV3_TINY, 256)
    # q 128*2*128 + kv_a 128*128 + kv_b 64*2*128 + o 2*64*128 = 81,920 MACs per layer, 4 layers
    assert parts["attention_projections"] == 4 * 2 * 81_920
    # causal: 128.5 keys per query on average; scores 2*128 dims, values 2*64 dims
    assert parts["core_attention"] == 4 * (2 * 2 * 128 * 128.5 + 2 * 2 * 64 * 128.5)
    assert parts["dense_mlp"] == 2 * 3 * 128 * 256
    # router 128*8, experts (2 routed + 2 shared) * 3 * 128*64, 3 MoE layers
    assert parts["moe_mlp"] == 3 * (2 * 128 * 8 + 2 * 4 * 3 * 128 * 64)
    assert parts["lm_head"] == 2 * 128 * 256
    flops = flops_per_token(DSV3_TINY, 256, recompute=False)
    assert flops.forward == 1_908_224 and flops.training == 3 * 1_908_224 and flops.recompute == 0
    assert flops_per_token(DSV3_TINY, 256, recompute=True).recompute == 1_908_224 - 2 * 128 * 256
    # one MTP depth: a MoE layer (projections, core, MoE MLP) + eh_proj 256 x 128, the head once more
    mtp = forward_flops_per_token(DSV3_TINY.replace(num_nextn_predict_layers=1), 256)
    assert mtp["mtp_layers"] == 2 * 81_920 + (2 * 2 * 128 * 128.5 + 2 * 2 * 64 * 128.5) + (
        2 * 128 * 8 + 2 * 4 * 3 * 128 * 64) + 2 * 256 * 128
    assert mtp["mtp_heads"] == 2 * 128 * 256
    recompute = flops_per_token(DSV3_TINY.replace(num_nextn_predict_layers=1), 256, recompute=True).recompute
    assert recompute == 1_908_224 - 2 * 128 * 256 + mtp["mtp_layers"]


@pytest.mark.parametrize("cfg", [DSV3_TINY, DSV3_16B, DSV3_TINY.replace(num_nextn_predict_layers=2),
                                 DSV3_16B.replace(num_nextn_predict_layers=1)],
                         ids=["tiny", "16b", "tiny_mtp2", "16b_mtp1"])
def test_flops_projections_match_the_models_parameter_shapes(cfg):
    """Every matmul weight of the model (meta build) contributes 2 * numel FLOPs per token,
    routed experts K / E of theirs, the shared head once more per MTP depth: the same total as
    the formula's projections, MLPs, heads and MTP layers."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, dtype=torch.bfloat16)
    from_shapes = 0.0
    for fqn, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in fqn:
            continue
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".mlp.experts." in fqn else 1.0
        uses = 1 + cfg.num_nextn_predict_layers if fqn == "lm_head.weight" else 1
        from_shapes += 2 * p.numel() * share * uses
    parts = forward_flops_per_token(cfg, 4096)
    mtp_core = cfg.num_nextn_predict_layers * parts["core_attention"] / cfg.num_hidden_layers
    assert from_shapes == pytest.approx(parts["attention_projections"] + parts["dense_mlp"] + parts["moe_mlp"]
                                        + parts["lm_head"] + parts["mtp_layers"] - mtp_core + parts["mtp_heads"],
                                        rel=1e-12)


def test_throughput_reports_tflops_per_device_and_mfu_against_the_peak():
    flops = ModelFlops(forward=1e9, recompute=5e8)  # 3e9 model FLOPs, 3.5e9 hardware FLOPs per token
    speed = step_throughput(flops, tokens_per_s=8e5, world_size=8, peak_tflops=1000.0)
    assert speed["tflops"] == pytest.approx(300.0) and speed["hardware_tflops"] == pytest.approx(350.0)
    assert speed["mfu"] == pytest.approx(0.3)
    assert step_throughput(flops, 8e5, 8, None)["mfu"] is None


def test_default_peak_is_ascend_950s_on_npu_only():
    assert default_peak_tflops("mxfp8_e4m3", "npu") == 1000.0 and default_peak_tflops("hif8", "npu") == 1000.0
    assert default_peak_tflops(None, "npu") is None  # BF16: not published
    assert default_peak_tflops("mxfp8_e4m3", "cpu") is None
