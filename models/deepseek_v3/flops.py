"""Model FLOPs per token of DeepSeek-V3 (matmul FLOPs, 2 per multiply-add), from its config.

Legend: D hidden, N heads, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, C kv_lora_rank,
Q q_lora_rank, F intermediate size (dense), M moe_intermediate_size, E routed experts, K experts
per token, Z shared experts, O vocabulary, S sequence length, L layers (L_dense of them dense).

Forward, per token:

    MLA projections   2 * (D*N*(P+R)  [or D*Q + Q*N*(P+R) with q_lora_rank]
                           + D*(C+R) + C*N*(P+V) + N*V*D)
    core attention    2 * N*(P+R) * S_avg  (scores)  +  2 * N*V * S_avg  (values),
                      S_avg = (S + 1) / 2: causal, query i attends i + 1 keys
    dense MLP         2 * 3 * D*F                          (gate, up, down)
    MoE MLP           2 * D*E (router) + 2 * 3 * D*M * (K + Z)   (routed top-K and shared)
    lm_head           2 * D*O
    MTP, per depth    a MoE layer (MLA projections, core attention, MoE MLP) + eh_proj 2 * 2D*D,
                      and the shared head again: 2 * D*O   (T = num_nextn_predict_layers depths)

Training counts 3x the forward (``te_npu.training.metrics.throughput``); full activation recompute
replays the decoder layers' forward (everything above but the heads; the MTP layers are
recompute units too) once more. Norms, RoPE,
softmax, SwiGLU and the routing's sort are elementwise or memory-bound and not counted.
"""
from __future__ import annotations

from models.deepseek_v3.config import DeepseekV3Config
from te_npu.training.metrics.throughput import ModelFlops

__all__ = ["forward_flops_per_token", "flops_per_token"]


def forward_flops_per_token(cfg: DeepseekV3Config, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by component: ``attention_projections``, ``core_attention``,
    ``dense_mlp``, ``moe_mlp`` (router, routed and shared experts), ``lm_head``, ``mtp_layers``
    (each MTP depth's block and ``eh_proj``), ``mtp_heads`` (the shared head once per depth)."""
    D, N, P, R, V, C = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    q = D * N * (P + R) if cfg.q_lora_rank is None else D * cfg.q_lora_rank + cfg.q_lora_rank * N * (P + R)
    projections = 2 * (q + D * (C + R) + C * N * (P + V) + N * V * D)
    s_avg = (seq_len + 1) / 2
    core = 2 * N * (P + R) * s_avg + 2 * N * V * s_avg
    dense_layers = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    moe_layers = cfg.num_hidden_layers - dense_layers
    dense = 2 * 3 * D * cfg.intermediate_size
    moe = 2 * D * cfg.n_routed_experts + 2 * 3 * D * cfg.moe_intermediate_size * (
        cfg.num_experts_per_tok + cfg.n_shared_experts)
    return {
        "attention_projections": cfg.num_hidden_layers * projections,
        "core_attention": cfg.num_hidden_layers * core,
        "dense_mlp": dense_layers * dense,
        "moe_mlp": moe_layers * moe,
        "lm_head": 2 * D * cfg.vocab_size,
        "mtp_layers": cfg.num_nextn_predict_layers * (projections + core + moe + 2 * 2 * D * D),
        "mtp_heads": cfg.num_nextn_predict_layers * 2 * D * cfg.vocab_size,
    }


def flops_per_token(cfg: DeepseekV3Config, seq_len: int, *, recompute: bool) -> ModelFlops:
    """``ModelFlops`` of one training token; ``recompute``: full activation recompute of the layers."""
    parts = forward_flops_per_token(cfg, seq_len)
    forward = sum(parts.values())
    heads = parts["lm_head"] + parts["mtp_heads"]
    return ModelFlops(forward=forward, recompute=forward - heads if recompute else 0.0)
