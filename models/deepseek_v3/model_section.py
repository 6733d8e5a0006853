"""The ``model`` section of a DeepSeek-V3 training config (``DeepseekV3Task.model_section``).

te_npu's generic config (``te_npu.training.config``) leaves this section to the model task;
this is DeepSeek-V3's: which model (a named preset or an HF ``config.json``), which
``DeepseekV3Config`` fields ``overrides`` may set, and whether the built model must be the
frozen 16B spec (``validate_16b``). It is checked when the config is loaded
(``load_config(..., model_section=DeepseekV3ModelSection)``) or, at the latest, first thing in
``Trainer.setup``: before any process group, data or model exists.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import te_npu
from models.deepseek_v3.config import DSV3_16B, DSV3_TINY, DeepseekV3Config, from_hf_config, to_hf_config_dict
from te_npu.training.schema import option, show

__all__ = ["DeepseekV3ModelSection", "LoadBalanceSection", "MTPSection", "HF_DEEPSEEK_V3_FIELDS", "PRESETS"]

PRESETS: Mapping[str, DeepseekV3Config] = MappingProxyType({"dsv3_16b": DSV3_16B, "dsv3_tiny": DSV3_TINY})
"""``model.preset`` name -> its ``DeepseekV3Config``."""

# DeepseekV3Config fields that ``model.overrides`` may set (transformers' keyword arguments
# plus the legacy rope keys found in published config.json files). A test cross-checks this
# list against the installed transformers, so the model code itself never imports transformers.
HF_DEEPSEEK_V3_FIELDS = frozenset(
    """
    vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers
    num_attention_heads num_key_value_heads n_shared_experts n_routed_experts
    routed_scaling_factor kv_lora_rank q_lora_rank qk_rope_head_dim v_head_dim
    qk_nope_head_dim n_group topk_group num_experts_per_tok first_k_dense_replace
    norm_topk_prob hidden_act max_position_embeddings initializer_range rms_norm_eps
    use_cache pad_token_id bos_token_id eos_token_id pretraining_tp tie_word_embeddings
    rope_parameters rope_interleave attention_bias attention_dropout num_mtp_layers
    output_router_logits rope_theta rope_scaling num_nextn_predict_layers
    """.split()
)


@dataclass(frozen=True)
class LoadBalanceSection:
    """``model.load_balance``: DeepSeek-V3's expert balancing (``models/deepseek_v3/load_balance.py``).

    ``bias_update_rate``: gamma of the auxiliary-loss-free rule, the step each router bias moves
    by against the sign of its expert's load error, once per optimizer step (DeepSeek-V3: 1e-3;
    0 switches it off). ``bias_update_until_step``: the last step that moves the biases (the
    report sets gamma to 0 for the last part of training); null: every step.
    ``seq_aux_loss_coeff``: alpha of the complementary sequence-wise balance loss (DeepSeek-V3:
    1e-4; 0 switches it off). ``idle_expert_warn_steps``: an expert that gets no token for this
    many steps in a row is named in a warning line (again every as many steps).
    """

    bias_update_rate: float = option(1e-3, ge=0.0)
    bias_update_until_step: int | None = option(None, ge=0)
    seq_aux_loss_coeff: float = option(1e-4, ge=0.0)
    idle_expert_warn_steps: int = option(50, ge=1)


@dataclass(frozen=True)
class MTPSection:
    """``model.mtp``: the MTP loss weight ``lambda`` and its one change.

    ``loss_scaling_factor`` holds through step ``change_step`` (1-based optimizer steps);
    from step ``change_step + 1`` on, ``loss_scaling_factor_after``. Both null: no change.
    Read only when ``num_nextn_predict_layers`` > 0.
    """

    loss_scaling_factor: float = option(0.3, ge=0.0)
    loss_scaling_factor_after: float | None = option(None, ge=0.0)
    change_step: int | None = option(None, ge=0)

    def __post_init__(self) -> None:
        if (self.change_step is None) != (self.loss_scaling_factor_after is None):
            set_one = "model.mtp.change_step" if self.change_step is not None else "model.mtp.loss_scaling_factor_after"
            raise te_npu.ConfigError(f"{set_one}: set together with model.mtp.change_step / "
                                     "model.mtp.loss_scaling_factor_after (both or neither)")

    def weight(self, step: int) -> float:
        """``lambda`` of 1-based optimizer step ``step``."""
        if self.change_step is None or step <= self.change_step:
            return self.loss_scaling_factor
        return self.loss_scaling_factor_after


@dataclass(frozen=True)
class DeepseekV3ModelSection:
    """What model to build: an HF ``config.json`` (file or directory) or a named preset.

    ``overrides`` sets DeepseekV3Config fields on top of it. ``validate_16b`` asks the task to
    check the built model against the frozen 16B spec (layers, dense/MoE layout, shapes,
    parameter count); omitted, it is true exactly for ``preset: dsv3_16b``. Construction checks
    all of it, including that the resulting ``DeepseekV3Config`` is one the model implements.
    ``load_balance``: how the routers are balanced in training (``LoadBalanceSection``; by
    default DeepSeek-V3's method and values).
    ``mtp``: the multi-token-prediction loss weight and its schedule (``MTPSection``,
    ``models/deepseek_v3/mtp.py``), for a model with ``num_nextn_predict_layers`` > 0.
    """

    preset: Literal["dsv3_16b", "dsv3_tiny"] | None = None
    hf_config: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    validate_16b: bool | None = None
    load_balance: LoadBalanceSection = field(default_factory=LoadBalanceSection)
    mtp: MTPSection = field(default_factory=MTPSection)

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.hf_config is None):
            raise te_npu.ConfigError(
                "model.preset / model.hf_config: set exactly one of them "
                f"(got preset={show(self.preset)}, hf_config={show(self.hf_config)})"
            )
        if self.hf_config is not None:
            path = Path(self.hf_config)
            if not (path.is_file() or (path / "config.json").is_file()):
                raise te_npu.ConfigError(
                    f"model.hf_config: {self.hf_config!r} is neither a config.json file nor a directory holding one"
                )
        unknown = sorted(set(self.overrides) - HF_DEEPSEEK_V3_FIELDS)
        if unknown:
            names = ", ".join(f"model.overrides.{k}" for k in unknown)
            raise te_npu.ConfigError(
                f"{names}: not a DeepseekV3Config field; allowed fields are {sorted(HF_DEEPSEEK_V3_FIELDS)}"
            )
        validate = self.preset == "dsv3_16b" if self.validate_16b is None else self.validate_16b
        if validate and self.preset == "dsv3_tiny":
            raise te_npu.ConfigError("model.validate_16b: true cannot hold for preset 'dsv3_tiny' (not the 16B spec)")
        object.__setattr__(self, "validate_16b", validate)  # the resolved flag (frozen dataclass)
        config = self.model_config()  # the preset / config.json + overrides must be a model this code implements
        if self.mtp != MTPSection() and not config.num_nextn_predict_layers:
            raise te_npu.ConfigError("model.mtp: set, but the model has num_nextn_predict_layers = 0 (no MTP layer "
                                     "to weigh); set model.overrides.num_nextn_predict_layers or drop model.mtp")

    def notes(self) -> tuple[str, ...]:
        """Lines the run prints once (rank 0) about this section: DeepSeek's balance fields of an HF
        ``config.json`` (``aux_loss_alpha``, ``seq_aux``, ``topk_method``), which its inference
        code carries, and what this run does instead."""
        if self.hf_config is None:
            return ()
        path = Path(self.hf_config)
        raw = json.loads((path if path.is_file() else path / "config.json").read_text(encoding="utf-8"))
        fields = {k: raw[k] for k in ("aux_loss_alpha", "seq_aux", "topk_method") if k in raw}
        if not fields:
            return ()
        lb = self.load_balance
        seen = ", ".join(f"{k}={show(v)}" for k, v in fields.items())
        return (f"model.hf_config carries DeepSeek's balance fields ({seen}): topk_method noaux_tc (top-k on the "
                f"bias-corrected scores) is what the router does; the balance itself is model.load_balance "
                f"(seq_aux_loss_coeff={lb.seq_aux_loss_coeff:g}, bias_update_rate={lb.bias_update_rate:g}), "
                "not aux_loss_alpha / seq_aux",)

    def model_config(self) -> DeepseekV3Config:
        """The ``DeepseekV3Config`` this section describes (preset or config.json, then overrides)."""
        source = to_hf_config_dict(PRESETS[self.preset]) if self.preset is not None else self.hf_config
        where = f"model.preset {self.preset!r}" if self.preset is not None else f"model.hf_config {self.hf_config!r}"
        if self.overrides:
            where += " + model.overrides"
        try:
            return from_hf_config(source, dict(self.overrides))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise te_npu.ConfigError(f"model.hf_config: cannot read {self.hf_config!r}: {exc}") from None
        except te_npu.ConfigError as exc:
            raise te_npu.ConfigError(f"model ({where}): {exc}") from None
        except (TypeError, ValueError) as exc:  # a field value of the wrong kind for the model
            raise te_npu.ConfigError(f"model ({where}): {type(exc).__name__}: {exc}") from None
