"""The GEMM shapes the self-check runs: the DeepSeek-V3 16B's (``--shapes 16b``) or small ones.

The 16B dims are the model's (``models/deepseek_v3/config.py`` ``DSV3_16B``; te_npu never
imports ``models``, so they are written out here and a test checks they are the config's):
one micro-batch of ``seq_len`` 4096 tokens, every distinct TE weight ``[N, K]`` and the routed
experts' stacked ``[E, N, K]`` weights with ``tokens x num_experts_per_tok`` routed rows.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShapeSet", "SHAPE_SETS", "DSV3_16B_DIMS"]

# hidden, dense intermediate, routed-expert intermediate, shared experts, heads, kv_lora_rank,
# qk_nope / qk_rope / v head dims, routed experts, experts per token, tokens per micro-batch
DSV3_16B_DIMS = dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_shared_experts=2,
                     num_attention_heads=16, kv_lora_rank=3072, qk_nope_head_dim=64, qk_rope_head_dim=64,
                     v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, tokens=4096)


@dataclass(frozen=True)
class ShapeSet:
    """tokens: M of every dense GEMM; dense: ``(name, N, K)`` weights; grouped: ``(name, E, N, K)``
    expert weights; routed: rows of the grouped GEMMs (tokens x experts per token)."""

    name: str
    tokens: int
    dense: tuple[tuple[str, int, int], ...]
    grouped: tuple[tuple[str, int, int, int], ...]
    routed: int


def _dsv3_16b() -> ShapeSet:
    d = DSV3_16B_DIMS
    D, H = d["hidden_size"], d["num_attention_heads"]
    F, Fe, Fs = d["intermediate_size"], d["moe_intermediate_size"], d["moe_intermediate_size"] * d["n_shared_experts"]
    dense = (
        ("q_proj / o_proj", H * (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]), D),
        ("kv_a_proj_with_mqa", d["kv_lora_rank"] + d["qk_rope_head_dim"], D),
        ("kv_b_proj", H * (d["qk_nope_head_dim"] + d["v_head_dim"]), d["kv_lora_rank"]),
        ("mlp.gate_proj / up_proj", F, D),
        ("mlp.down_proj", D, F),
        ("shared_experts.gate_proj / up_proj", Fs, D),
        ("shared_experts.down_proj", D, Fs),
    )
    E = d["n_routed_experts"]
    grouped = (("experts.gate_up_proj", E, 2 * Fe, D), ("experts.down_proj", E, D, Fe))
    return ShapeSet("16b", d["tokens"], dense, grouped, d["tokens"] * d["num_experts_per_tok"])


SHAPE_SETS: dict[str, ShapeSet] = {
    "16b": _dsv3_16b(),
    # odd block counts (K = 96: 3 blocks, N = 160: 5), an odd pair count, small experts
    "small": ShapeSet("small", 128, (("square", 128, 128), ("odd blocks", 160, 96)),
                      (("experts", 4, 128, 64),), 200),
}
