"""DeepSeek-V3 configuration: HF field names, the frozen 16B spec and small test flavors.

``DeepseekV3Config`` carries only what the model implements. Fields that exist in HF
configs but are not implemented here fail with a ``te_npu.ConfigError`` naming the field
(tensor / expert parallel sizes > 1, rope scaling, tied embeddings, ...). One is carried
``num_nextn_predict_layers`` = D builds D multi-token-prediction layers after the main ones
(``model.layers.{num_hidden_layers + k}``, DeepSeek-V3's checkpoint numbering; ``mtp.py``);
transformers' default and the releases' value is 1, the frozen 16B model's is 0.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

import te_npu

__all__ = [
    "DeepseekV3Config", "from_hf_config", "to_hf_config_dict", "TRANSFORMERS_VERSION", "DSV3_16B", "DSV3_TINY", "DSV3_16B_NUM_PARAMS",
    "DSV3_16B_MTP_LAYER_PARAMS",
    "expected_low_precision_scope", "expected_parameter_shapes", "validate_16b",
]

DSV3_16B_NUM_PARAMS = 16_585_005_056  # the frozen 16B model's count; router bias buffers are not parameters
DSV3_16B_MTP_LAYER_PARAMS = 603_730_944
"""Parameters of one MTP layer of the 16B (``num_nextn_predict_layers`` = 1 adds them): a MoE
decoder layer (595,336,192) + ``eh_proj`` [2048, 4096] + ``enorm``, ``hnorm``,
``shared_head.norm`` [2048] each; the embedding and head are shared, not counted again."""


@dataclass(frozen=True)
class DeepseekV3Config:
    """Model hyper-parameters under their Hugging Face ``DeepseekV3Config`` names."""

    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944          # dense MLP (layers < first_k_dense_replace)
    moe_intermediate_size: int = 1408       # per routed expert; shared experts use n_shared_experts x this
    num_hidden_layers: int = 28
    first_k_dense_replace: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    q_lora_rank: int | None = None
    kv_lora_rank: int = 3072
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    rope_scaling: Mapping[str, Any] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1

    def __post_init__(self) -> None:
        _check_supported(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def replace(self, **changes: Any) -> "DeepseekV3Config":
        return dataclasses.replace(self, **changes)


def _fail(field: str, value: Any, why: str) -> None:
    raise te_npu.ConfigError(f"DeepseekV3Config.{field}={value!r}: {why}")


def _check_supported(c: DeepseekV3Config) -> None:
    """Reject configurations the model does not implement, naming the field."""
    if not isinstance(c.num_nextn_predict_layers, int) or c.num_nextn_predict_layers < 0:
        _fail("num_nextn_predict_layers", c.num_nextn_predict_layers, "must be an integer >= 0")
    scaling = dict(c.rope_scaling or {})
    if c.rope_scaling is not None and scaling.get("rope_type", scaling.get("type")) != "default":
        _fail("rope_scaling", c.rope_scaling, "only default RoPE is implemented (no yarn / mscale)")
    if c.tie_word_embeddings:
        _fail("tie_word_embeddings", True, "tied embeddings are not supported (lm_head is separate)")
    if c.hidden_act != "silu":
        _fail("hidden_act", c.hidden_act, "only 'silu' (SwiGLU) is implemented")
    if c.attention_bias:
        _fail("attention_bias", True, "MLA projections carry no bias")
    if c.attention_dropout:
        _fail("attention_dropout", c.attention_dropout, "attention dropout is not implemented")
    if c.num_key_value_heads != c.num_attention_heads:
        _fail("num_key_value_heads", c.num_key_value_heads, "MLA needs num_key_value_heads == num_attention_heads")
    if c.n_routed_experts % c.n_group:
        _fail("n_group", c.n_group, f"must divide n_routed_experts={c.n_routed_experts}")
    if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
        _fail("n_group", c.n_group, "group scores sum the top-2 experts of a group: need >= 2 experts per group")
    if not 1 <= c.topk_group <= c.n_group:
        _fail("topk_group", c.topk_group, f"must be in [1, n_group={c.n_group}]")
    if not 1 <= c.num_experts_per_tok <= c.n_routed_experts * c.topk_group // c.n_group:
        _fail("num_experts_per_tok", c.num_experts_per_tok, "more than the experts of the selected groups")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        _fail("first_k_dense_replace", c.first_k_dense_replace, f"must be in [0, {c.num_hidden_layers}]")
    if not c.rope_interleave:
        _fail("rope_interleave", False, "only interleaved RoPE (DeepSeek's layout) is implemented")
    if c.qk_rope_head_dim % 2:
        _fail("qk_rope_head_dim", c.qk_rope_head_dim, "RoPE needs an even dimension")


# Keys of an HF config.json that carry no model semantics here.
_HF_METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache", "auto_map",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "qk_head_dim", "head_dim",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
    "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type",
})
# Keys whose only supported value is fixed: field -> supported value.
_HF_FIXED_KEYS = {"pretraining_tp": 1, "ep_size": 1, "tp_size": 1, "moe_layer_freq": 1,
                  "scoring_func": "sigmoid", "topk_method": "noaux_tc", "quantization_config": None}
_HF_ALIASES = {"num_mtp_layers": "num_nextn_predict_layers", "num_local_experts": "n_routed_experts"}


def from_hf_config(
    path_or_dict: str | os.PathLike | Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> DeepseekV3Config:
    """Read an HF ``config.json`` (file, directory holding one, or dict) and apply ``overrides``.

    Understands both ``rope_parameters`` (transformers 5.x) and the legacy top-level
    ``rope_theta`` / ``rope_scaling``. Unknown keys and unsupported values raise ``ConfigError``.
    """
    if isinstance(path_or_dict, Mapping):
        raw = dict(path_or_dict)
    else:
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    if raw.get("model_type", "deepseek_v3") != "deepseek_v3":
        _fail("model_type", raw["model_type"], "expected 'deepseek_v3'")
    known = {f.name for f in fields(DeepseekV3Config)}
    kwargs: dict[str, Any] = {}
    for key, value in {**raw, **dict(overrides or {})}.items():
        key = _HF_ALIASES.get(key, key)
        if key == "rope_parameters" and value is not None:
            value = dict(value)
            kwargs["rope_theta"] = value.pop("rope_theta", kwargs.get("rope_theta", 10000.0))
            if value.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = value
        elif key in _HF_FIXED_KEYS:
            if value != _HF_FIXED_KEYS[key]:
                _fail(key, value, f"only {_HF_FIXED_KEYS[key]!r} is supported")
        elif key in known:
            kwargs[key] = value
        elif key not in _HF_METADATA_KEYS:
            raise te_npu.ConfigError(f"DeepseekV3 config: unknown field {key!r}")
    return DeepseekV3Config(**kwargs)


TRANSFORMERS_VERSION = "5.24.0"
"""The transformers release whose ``DeepseekV3Config`` (``configuration_deepseek_v3.py``) the
fields below were read from; an export without a source config.json names it."""


def _transformers_only_fields(config: DeepseekV3Config) -> dict[str, Any]:
    """transformers' ``DeepseekV3Config`` fields this model does not carry: derived ones
    (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``, ``head_dim = qk_rope_head_dim``, as
    transformers sets them) and the rest at transformers' defaults (``use_cache`` True: a
    generation setting, nothing this training code reads)."""
    return {"qk_head_dim": config.qk_head_dim, "head_dim": config.qk_rope_head_dim, "output_router_logits": False,
            "pretraining_tp": 1, "use_cache": True, "transformers_version": TRANSFORMERS_VERSION}


def to_hf_config_dict(config: DeepseekV3Config, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` that HF ``DeepseekV3ForCausalLM.from_pretrained`` reads: every field
    transformers' ``DeepseekV3Config`` writes (the model's values, transformers' defaults for the
    fields it does not carry; an export from an HF start lays its source's fields over these)."""
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    out.pop("rope_theta"), out.pop("rope_scaling")
    out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", dtype=dtype,
               rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
               **_transformers_only_fields(config))
    return out


# The frozen DeepSeek-V3 16B model (docs/a5.md, the 16B recipes): the dataclass defaults.
DSV3_16B = DeepseekV3Config()

# CPU flavor: every TE weight dim (and kv_lora_rank + qk_rope_head_dim) is a multiple of 64,
# so MXFP8 blocks of 32 and FSDP shards over 2 ranks stay whole.
DSV3_TINY = DeepseekV3Config(
    vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=2,
    num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=64,
    qk_rope_head_dim=64, v_head_dim=64, max_position_embeddings=512,
)


def expected_low_precision_scope(config: DeepseekV3Config) -> list[str]:
    """Explicit FQNs of the 8-bit GEMM modules (the acceptance matrix's Q3-04, docs/a5.md), in module order: every MLA
    q/kv/o projection, every dense and shared-expert projection, every routed-experts module.
    MTP layers (``num_hidden_layers + k``) add their ``eh_proj``. Nothing else (embedding,
    lm_head, router, norms, core attention) is listed."""
    names = []
    for i in range(config.num_hidden_layers + config.num_nextn_predict_layers):
        attn = f"model.layers.{i}.self_attn"
        q = [f"{attn}.q_proj"] if config.q_lora_rank is None else [f"{attn}.q_a_proj", f"{attn}.q_b_proj"]
        names += [*q, f"{attn}.kv_a_proj_with_mqa", f"{attn}.kv_b_proj", f"{attn}.o_proj"]
        mlp = f"model.layers.{i}.mlp"
        if config.is_moe_layer(i):
            names += [f"{mlp}.experts", *(f"{mlp}.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))]
        else:
            names += [f"{mlp}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        if i >= config.num_hidden_layers:
            names.append(f"model.layers.{i}.eh_proj")
    return names


def expected_parameter_shapes(config: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter FQN -> shape (HF names; router bias buffers excluded)."""
    c, D = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, D)}
    for i in range(c.num_hidden_layers + c.num_nextn_predict_layers):
        a = f"model.layers.{i}.self_attn"
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            shapes[f"{a}.q_proj.weight"] = (q_out, D)
        else:
            shapes.update({f"{a}.q_a_proj.weight": (c.q_lora_rank, D), f"{a}.q_a_layernorm.weight": (c.q_lora_rank,),
                           f"{a}.q_b_proj.weight": (q_out, c.q_lora_rank)})
        shapes.update({
            f"{a}.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, D),
            f"{a}.kv_a_layernorm.weight": (c.kv_lora_rank,),
            f"{a}.kv_b_proj.weight": (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            f"{a}.o_proj.weight": (D, c.num_attention_heads * c.v_head_dim),
        })
        m = f"model.layers.{i}.mlp"
        if c.is_moe_layer(i):
            E, F, Fs = c.n_routed_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
            shapes.update({f"{m}.gate.weight": (E, D), f"{m}.experts.gate_up_proj": (E, 2 * F, D),
                           f"{m}.experts.down_proj": (E, D, F)})
            prefix, F_mlp = f"{m}.shared_experts", Fs
        else:
            prefix, F_mlp = m, c.intermediate_size
        shapes.update({f"{prefix}.gate_proj.weight": (F_mlp, D), f"{prefix}.up_proj.weight": (F_mlp, D),
                       f"{prefix}.down_proj.weight": (D, F_mlp)})
        shapes.update({f"model.layers.{i}.input_layernorm.weight": (D,),
                       f"model.layers.{i}.post_attention_layernorm.weight": (D,)})
        if i >= c.num_hidden_layers:  # an MTP layer
            shapes.update({f"model.layers.{i}.enorm.weight": (D,), f"model.layers.{i}.hnorm.weight": (D,),
                           f"model.layers.{i}.eh_proj.weight": (D, 2 * D),
                           f"model.layers.{i}.shared_head.norm.weight": (D,)})
    shapes.update({"model.norm.weight": (D,), "lm_head.weight": (c.vocab_size, D)})
    return shapes


def validate_16b(model: Any) -> None:
    """Check a built model against the frozen 16B spec; raise ``ConfigError`` at the first mismatch.

    Order: config fields, layer count, dense/MoE layout and expert count per layer, every
    parameter name and shape, then the total parameter count (16,585,005,056, plus
    ``DSV3_16B_MTP_LAYER_PARAMS`` per MTP layer). The frozen model has no MTP; a model with
    ``num_nextn_predict_layers`` = D is that model plus D MTP layers (the field alone may differ).
    """
    mtp = model.config.num_nextn_predict_layers
    spec = DSV3_16B.replace(num_nextn_predict_layers=mtp)
    for f in fields(DSV3_16B):
        got, want = getattr(model.config, f.name), getattr(spec, f.name)
        if got != want:
            raise te_npu.ConfigError(f"validate_16b: config field {f.name} = {got!r}, the 16B spec has {want!r}")
    layers = model.model.layers
    if len(layers) != spec.num_hidden_layers + mtp:
        raise te_npu.ConfigError(f"validate_16b: {len(layers)} decoder layers, expected {spec.num_hidden_layers} "
                                 f"+ {mtp} MTP")
    for i, layer in enumerate(layers):
        is_moe = hasattr(layer.mlp, "experts")
        if is_moe != spec.is_moe_layer(i):
            raise te_npu.ConfigError(f"validate_16b: model.layers.{i}.mlp is {'MoE' if is_moe else 'dense'}, "
                                     f"expected {'MoE' if spec.is_moe_layer(i) else 'dense'}")
        if is_moe and layer.mlp.experts.num_experts != spec.n_routed_experts:
            raise te_npu.ConfigError(f"validate_16b: model.layers.{i}.mlp.experts has "
                                     f"{layer.mlp.experts.num_experts} experts, expected {spec.n_routed_experts}")
    expected = expected_parameter_shapes(spec)
    actual = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, shape in expected.items():
        if actual.get(name) != shape:
            raise te_npu.ConfigError(f"validate_16b: parameter {name} has shape {actual.get(name)}, expected {shape}")
    for name in actual.keys() - expected.keys():
        raise te_npu.ConfigError(f"validate_16b: unexpected parameter {name}")
    total, want = sum(p.numel() for p in model.parameters()), DSV3_16B_NUM_PARAMS + mtp * DSV3_16B_MTP_LAYER_PARAMS
    if total != want:
        raise te_npu.ConfigError(f"validate_16b: {total:,} parameters, expected {want:,}")
