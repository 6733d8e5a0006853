"""Hugging Face DeepseekV3ForCausalLM state dicts and safetensors checkpoints <-> ours.

Our parameter names are HF's in-memory names (transformers 5.x keeps routed experts stacked:
``mlp.experts.gate_up_proj [E, 2F, D]`` with gate rows first, ``mlp.experts.down_proj [E, D, F]``).
On disk, ``save_pretrained`` (checked with transformers 5.24) writes one tensor per expert:
``mlp.experts.{e}.gate_proj.weight [F, D]``, ``.up_proj.weight [F, D]``, ``.down_proj.weight [D, F]``;
``from_pretrained`` re-stacks them (the "qwen2_moe" conversion in ``conversion_mapping.py``).
Both layouts are accepted here; checkpoints are written in the on-disk one. transformers keeps
the router (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``) in FP32 whatever the
model dtype (``_keep_in_fp32_modules_strict``), and so does an export.

``HF_KEY_MAP`` is the whole mapping, declared once; ``DeepseekV3HFAdapter`` hands it (and the
``config.json`` rules) to te_npu's sharded reader / writer through the Trainer's task, and the
single-process helpers below use the same declaration.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections import defaultdict
from typing import Any, Mapping

import torch
from torch import nn

import te_npu
from models.deepseek_v3.config import DeepseekV3Config, from_hf_config, to_hf_config_dict
from te_npu.distributed.storage.hf_checkpoint import load_hf_weights, open_hf_checkpoint, save_hf_weights
from te_npu.distributed.storage.hf_layout import HFKeyMap, StackedExperts

__all__ = [
    "HF_KEY_MAP", "DeepseekV3HFAdapter", "mtp_key_map", "to_hf_state_dict", "from_hf_state_dict", "load_hf_checkpoint",
    "save_hf_checkpoint",
]

_EXPERTS = r"(?P<experts>model\.layers\.\d+\.mlp\.experts)"
HF_KEY_MAP = HFKeyMap(
    stacked_experts=(
        StackedExperts(_EXPERTS + r"\.gate_up_proj",
                       ("{experts}.{expert}.gate_proj.weight", "{experts}.{expert}.up_proj.weight")),
        StackedExperts(_EXPERTS + r"\.down_proj", ("{experts}.{expert}.down_proj.weight",)),
    ),
    keep_fp32=(r"\.mlp\.gate\.weight$", r"\.mlp\.gate\.e_score_correction_bias$"),
)
"""Our FQN -> HF keys. Every other tensor's HF key is its own FQN."""

# Fields that do not change the weights' meaning: a checkpoint may differ from the model here.
# num_nextn_predict_layers: the main model is the same; the MTP tensors themselves decide (a
# model with MTP layers needs them, one without leaves them out, naming them).
_NON_ARCHITECTURE_FIELDS = frozenset({"initializer_range", "max_position_embeddings", "bos_token_id", "eos_token_id",
                                      "num_nextn_predict_layers"})
_PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class DeepseekV3HFAdapter:
    """te_npu's HF adapter (``te_npu.training.hf.weights.HFAdapter``) for one model config.

    ``check_config`` also learns how many MTP layers the checkpoint's config.json declares, so
    that a model built without them leaves those tensors out (``mtp_key_map``); an export
    writes the model's own ``num_nextn_predict_layers`` (``export_fields``): its tensors."""

    export_fields = frozenset({"num_nextn_predict_layers"})

    def __init__(self, config: DeepseekV3Config) -> None:
        self.config = config
        self.key_map = mtp_key_map(config)

    def config_json(self, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of an export in ``dtype``."""
        return to_hf_config_dict(self.config, dtype=str(dtype).removeprefix("torch."))

    def check_config(self, hf_config: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` naming each field where ``hf_config`` describes another model
        (unknown or unsupported fields fail in ``from_hf_config``, naming the field)."""
        theirs = from_hf_config(hf_config)
        diffs = [f"{f.name} = {getattr(theirs, f.name)!r} (the model has {getattr(self.config, f.name)!r})"
                 for f in dataclasses.fields(DeepseekV3Config)
                 if f.name not in _NON_ARCHITECTURE_FIELDS and getattr(theirs, f.name) != getattr(self.config, f.name)]
        if diffs:
            raise te_npu.ConfigError("config.json does not describe the model being trained: " + "; ".join(diffs))
        self.key_map = mtp_key_map(self.config, checkpoint_mtp_layers=theirs.num_nextn_predict_layers)


def mtp_key_map(config: DeepseekV3Config, checkpoint_mtp_layers: int = 0) -> HFKeyMap:
    """``HF_KEY_MAP`` for a model with ``num_nextn_predict_layers`` = D MTP layers.

    D > 0: layer ``num_hidden_layers + k``'s ``embed_tokens`` / ``shared_head.head`` (DeepSeek's
    copies of the shared embedding and head) are ``copies``: not read (the shared tensors are),
    written back by an export. D = 0 and a checkpoint declaring ``checkpoint_mtp_layers`` MTP
    layers: those layers ``model.layers.{num_hidden_layers + i}.*`` are left out, said in one line."""
    n, mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    if mtp:
        copies = tuple(pair for k in range(n, n + mtp) for pair in (
            (f"model.layers.{k}.embed_tokens.weight", "model.embed_tokens.weight"),
            (f"model.layers.{k}.shared_head.head.weight", "lm_head.weight")))
        layers = "|".join(str(k) for k in range(n, n + mtp))
        hint = (f"the model builds {mtp} MTP layer(s) (num_nextn_predict_layers={mtp}) the checkpoint does not hold: "
                "model.overrides.num_nextn_predict_layers=0 trains without MTP (transformers' DeepseekV3ForCausalLM "
                "writes no MTP tensors although its config.json says 1)")
        return dataclasses.replace(
            HF_KEY_MAP, copies=copies, missing_hints=((rf"^model\.layers\.({layers})\.", hint),),
            copies_reason=f"num_nextn_predict_layers={mtp}: the MTP layers' embed_tokens / shared_head.head are "
                          "DeepSeek's copies of model.embed_tokens / lm_head; the shared tensors are read, the copies "
                          "are not (an export writes them from the shared ones)")
    if not checkpoint_mtp_layers:
        return HF_KEY_MAP
    layers = "|".join(str(n + i) for i in range(checkpoint_mtp_layers))
    first = f"model.layers.{n}.*" if checkpoint_mtp_layers == 1 else f"model.layers.{n}..{n + checkpoint_mtp_layers - 1}.*"
    return dataclasses.replace(
        HF_KEY_MAP, left_out=(rf"^model\.layers\.({layers})\.",),
        left_out_reason=f"num_nextn_predict_layers={checkpoint_mtp_layers} in the checkpoint, 0 in the model: the MTP "
                        f"layer tensors ({first}) are not read, MTP is not trained (the main model is)")


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], *, per_expert: bool = False,
                     key_map: HFKeyMap = HF_KEY_MAP) -> dict[str, torch.Tensor]:
    """Our state dict -> HF keys: stacked (in-memory, the identity) or per-expert (on-disk).

    Per-expert (the layout an export writes) also writes ``key_map.copies``: with
    ``mtp_key_map(config)`` each MTP layer's ``embed_tokens`` / ``shared_head.head`` copies of the
    shared embedding and head, as ``save_hf_checkpoint`` does."""
    if not per_expert:
        return dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        pieces = key_map.pieces(name, tuple(tensor.shape))
        if pieces is None:
            out[name] = tensor
        for p in pieces or ():
            out[p.key] = tensor[p.expert, p.rows[0]: p.rows[1]]
    for copy_key, ours in key_map.copies:
        out[copy_key] = state_dict[ours]
    return out


def from_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor], *,
                       key_map: HFKeyMap = HF_KEY_MAP) -> dict[str, torch.Tensor]:
    """HF state dict in either layout -> our (stacked) names. Per-expert keys must cover experts
    ``0..E-1`` with all three projections; a gap raises ``ConfigError`` listing the missing keys.

    Keys ``key_map`` leaves out are skipped, as the sharded reader skips them: with
    ``mtp_key_map(config, checkpoint_mtp_layers)`` the MTP layers' copies of the shared embedding
    and head (the shared tensors are read), or a model without MTP the checkpoint's MTP layers."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    for name, tensor in hf_state_dict.items():
        if key_map.is_left_out(name):
            continue
        match = _PER_EXPERT_KEY.match(name)
        if match:
            experts[match["prefix"]][(int(match["e"]), match["proj"])] = tensor
        else:
            out[name] = tensor
    for prefix, parts in experts.items():
        num_experts = 1 + max(e for e, _ in parts)
        missing = [f"{prefix}.{e}.{p}_proj.weight" for e in range(num_experts) for p in ("gate", "up", "down")
                   if (e, p) not in parts]
        if missing:
            raise te_npu.ConfigError(f"HF checkpoint: missing per-expert keys {missing}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(num_experts)])
    return out


@torch.no_grad()
def load_state_dict_strict_(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` (our names) into a materialized model, casting to each tensor's dtype.
    Unknown, missing or mis-shaped keys raise ``ConfigError`` listing them."""
    targets = model.state_dict()
    unexpected = sorted(state_dict.keys() - targets.keys())
    missing = sorted(targets.keys() - state_dict.keys())
    if unexpected or missing:
        raise te_npu.ConfigError(f"HF checkpoint does not match the model: missing keys {missing}, "
                                 f"unexpected keys {unexpected}")
    wrong = [f"{k}: {tuple(state_dict[k].shape)} vs model {tuple(t.shape)}" for k, t in targets.items()
             if tuple(state_dict[k].shape) != tuple(t.shape)]
    if wrong:
        raise te_npu.ConfigError(f"HF checkpoint shape mismatch: {wrong}")
    for name, target in targets.items():
        if target.is_meta:
            raise te_npu.ConfigError(f"load: {name} is on the meta device; call materialize_ first")
        target.copy_(state_dict[name])


def load_hf_checkpoint(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load an HF safetensors directory (single file or sharded with an index, either expert
    layout) into a materialized, unsharded ``model``; its ``config.json`` must match the model."""
    where = f"load_hf_checkpoint({os.fspath(directory)!r})"
    checkpoint = open_hf_checkpoint(directory, where=where)
    adapter = DeepseekV3HFAdapter(model.config)
    try:
        adapter.check_config(checkpoint.config)
    except te_npu.ConfigError as exc:
        raise te_npu.ConfigError(f"{where}: {exc}") from None
    load_hf_weights(checkpoint, model.state_dict(), adapter.key_map, where=where)


def save_hf_checkpoint(model: nn.Module, directory: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
                       dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` and per-expert safetensors (sharded past ``max_shard_bytes``, with
    ``model.safetensors.index.json``) that HF ``DeepseekV3ForCausalLM.from_pretrained`` loads.
    dtype: on disk (default: the model's ``lm_head`` dtype); the router stays FP32."""
    dtype = dtype or model.lm_head.weight.dtype
    adapter = DeepseekV3HFAdapter(model.config)
    save_hf_weights(directory, model.state_dict(), adapter.key_map, adapter.config_json(dtype),
                    dtype=dtype, max_shard_bytes=max_shard_bytes)
