"""DeepSeek-V3's multi-token prediction (technical report section 2.2): depths, loss, schedule.

D = ``num_nextn_predict_layers`` sequential MTP layers (``model.MTPLayer``) follow the main
layers. Depth k (1-based) combines, at position i, the previous depth's hidden state
``h_{k-1}[i]`` with the embedding of token ``t[i + k]``; its logits at i predict token
``t[i + k + 1]``. The last k positions have no token ``t[i + k]`` (nor a target): their input is
token id 0 (as Megatron's ``roll_tensor`` fills) and their loss is ignored.

Which hidden state each depth reads: depth 1 reads the main model's output after its final
norm (what the main head reads; Megatron-core's MTP block and vLLM's DeepSeek MTP both do);
depth k > 1 reads depth k - 1's block output before its ``shared_head.norm`` (the report's
``h^{k-1}``, and vLLM's chaining). The embedding and output head are the main model's, shared.

Loss: ``lm + lambda / D * sum_k mtp_k`` with ``lambda`` from ``model_section.MTPSection`` (the report: 0.3
for the first 10T tokens, then 0.1); ``lm loss`` stays the main next-token loss alone.

Shape legend: B batch, S sequence, D hidden, O vocabulary.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["shift_left", "mtp_depths", "mtp_cross_entropy", "mtp_loss_name"]

_IGNORE_INDEX = -100
_FILL_TOKEN = 0  # the input id of the last k positions of depth k (Megatron's roll_tensor zero-fills)


def mtp_loss_name(depth: int) -> str:
    """The loss part's name (step line ``mtp 1 loss``, metrics.jsonl ``mtp_1_loss``)."""
    return f"mtp_{depth}_loss"


def shift_left(x_BS: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``x[:, i + k]`` at position i; the last k positions ``fill``."""
    return F.pad(x_BS[:, k:], (0, k), value=fill)


def mtp_depths(layers: Sequence[nn.Module], embed_tokens: nn.Module, lm_head: nn.Module, input_ids_BS: torch.Tensor,
               h_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Logits ``[B, S, O]`` of each MTP depth, in order. ``layers``: ``model.MTPLayer``s,
    ``layer(h, emb, cos, sin) -> (h_k, shared_head.norm(h_k))``; ``h_BSD``: the main model's
    normed output; ``rope``: the main layers' (cos, sin) (the MTP blocks see the same positions)."""
    logits = []
    for k, layer in enumerate(layers, start=1):
        emb_BSD = embed_tokens(shift_left(input_ids_BS, k, _FILL_TOKEN))
        h_BSD, normed_BSD = layer(h_BSD, emb_BSD, *rope)
        logits.append(lm_head(normed_BSD))
    return tuple(logits)


def mtp_cross_entropy(logits_BSO: torch.Tensor, next_labels_BS: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth ``depth``'s loss: FP32 cross-entropy of ``logits[:, i]`` against ``next_labels[:, i + depth]``
    (``next_labels[:, i]`` is token i + 1), mean over the targets that exist and are not -100."""
    target_BS = shift_left(next_labels_BS, depth, _IGNORE_INDEX)
    return F.cross_entropy(logits_BSO.float().flatten(0, 1), target_BS.flatten(), ignore_index=_IGNORE_INDEX)
