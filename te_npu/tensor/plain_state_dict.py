"""Quantized state dicts as plain tensors (for ``safetensors`` and other plain-tensor formats).

``safetensors.torch.save_file`` reads each tensor's storage directly, which a quantized weight
(a wrapper subclass whose storage is its inner tensors) does not have. :func:`to_plain_state_dict`
writes every ``MXFP8Tensor`` / ``HiF8Tensor`` entry ``key`` as its inner tensors
``key:<field>`` (MXFP8: ``row_data``, ``row_scale``, ``col_data``, ``col_scale``; HiF8:
``qdata``, ``scale``) plus one string entry ``metadata[key]`` (JSON: format, logical shape and
dtype, quantizer fields); every other entry passes through. :func:`from_plain_state_dict`
rebuilds the quantized weights from both, bit for bit::

    tensors, metadata = te_npu.tensor.to_plain_state_dict(model.state_dict())
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    with safetensors.safe_open(path, "pt") as f:
        state = te_npu.tensor.from_plain_state_dict({k: f.get_tensor(k) for k in f.keys()}, f.metadata())

The payload is saved, not re-derived: loading gives the same codes and scales (no re-quantization).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import torch

from te_npu.tensor.weight import QuantizedWeightTensor

__all__ = ["to_plain_state_dict", "from_plain_state_dict"]

_SEPARATOR = ":"  # never in a module path or parameter name
_MARKER = "te_npu.quantized_weight"


def to_plain_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)``: plain tensors only, and a JSON description per quantized entry."""
    tensors, metadata = {}, {}
    for key, value in state_dict.items():
        if not isinstance(value, QuantizedWeightTensor):
            tensors[key] = value
            continue
        value._require_weight_shape("to_plain_state_dict")
        for name in value.inner_field_names():
            tensors[f"{key}{_SEPARATOR}{name}"] = getattr(value, name).detach().contiguous()
        quantizer = value.quantizer
        metadata[key] = json.dumps({
            "kind": _MARKER,
            "format": value.format.value,
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "quantizer": {f.name: getattr(quantizer, f.name) for f in dataclasses.fields(quantizer)},
        })
    return tensors, metadata


def from_plain_state_dict(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> dict:
    """The state dict :func:`to_plain_state_dict` described: quantized entries rebuilt (no copy of
    their inner tensors), plain ones as given; other metadata entries are ignored."""
    out = {}
    described = {}
    for key, text in (metadata or {}).items():
        try:
            info = json.loads(text)
        except (TypeError, ValueError):
            continue
        if isinstance(info, dict) and info.get("kind") == _MARKER:
            described[key] = info
    classes = {cls.format.value: cls for cls in QuantizedWeightTensor.__subclasses__()}
    inner_keys = set()
    for key, info in described.items():
        cls = classes.get(info["format"])
        if cls is None:
            raise ValueError(f"{key}: no quantized weight class for format {info['format']!r}; known: {sorted(classes)}")
        names = cls.inner_field_names()
        missing = [f"{key}{_SEPARATOR}{n}" for n in names if f"{key}{_SEPARATOR}{n}" not in tensors]
        if missing:
            raise KeyError(f"{key}: the plain state dict lacks {missing}")
        inner = {n: tensors[f"{key}{_SEPARATOR}{n}"] for n in names}
        inner_keys.update(f"{key}{_SEPARATOR}{n}" for n in names)
        out[key] = cls._make(inner, shape=tuple(info["shape"]), logical_dtype=getattr(torch, info["dtype"]),
                             quantizer=cls.quantizer_type(**info["quantizer"]))
    for key, value in tensors.items():
        if key not in inner_keys:
            out[key] = value
    return out
