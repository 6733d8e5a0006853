"""Hugging Face DeepseekV3ForCausalLM state dicts and safetensors checkpoints <-> ours.

Our parameter names are HF's in-memory names (transformers 5.x keeps routed experts stacked:
``mlp.experts.gate_up_proj [E, 2F, D]`` with gate rows first, ``mlp.experts.down_proj [E, D, F]``).
On disk, ``save_pretrained`` (checked with transformers 5.24) writes one tensor per expert:
``mlp.experts.{e}.gate_proj.weight [F, D]``, ``.up_proj.weight [F, D]``, ``.down_proj.weight [D, F]``;
``from_pretrained`` re-stacks them (the "qwen2_moe" conversion in ``conversion_mapping.py``).
Both layouts are accepted here; checkpoints are written in the on-disk one.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Mapping

import torch
from torch import nn

import te_npu
from models.deepseek_v3.config import to_hf_config_dict

__all__ = ["to_hf_state_dict", "from_hf_state_dict", "load_hf_checkpoint", "save_hf_checkpoint"]

_PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], *, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """Our state dict -> HF keys: stacked (in-memory, the identity) or per-expert (on-disk)."""
    if not per_expert:
        return dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, F = name[: -len(".gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :F]
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, F:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def from_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict in either layout -> our (stacked) names. Per-expert keys must cover experts
    ``0..E-1`` with all three projections; a gap raises ``ConfigError`` listing the missing keys."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    for name, tensor in hf_state_dict.items():
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


def _read_safetensors_dir(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index_path = os.path.join(directory, _INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, _SINGLE_FILE)):
        files = [_SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{directory}: neither {_INDEX_FILE} nor {_SINGLE_FILE}")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(os.path.join(directory, file)))
    return state_dict


def load_hf_checkpoint(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load an HF safetensors directory (single file or sharded with an index) into ``model``."""
    load_state_dict_strict_(model, from_hf_state_dict(_read_safetensors_dir(os.fspath(directory))))


def save_hf_checkpoint(model: nn.Module, directory: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and per-expert safetensors (sharded past ``max_shard_bytes``, with
    ``model.safetensors.index.json``) that HF ``DeepseekV3ForCausalLM.from_pretrained`` loads."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_hf_config_dict(model.config, dtype=dtype), f, indent=2)
    tensors = to_hf_state_dict(model.state_dict(), per_expert=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        tensor = tensor.detach().to("cpu")
        if tensor.untyped_storage().nbytes() != size:  # a view into an expert stack: own its storage
            tensor = tensor.clone()
        shards[-1][name] = tensor
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, _SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, _INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
