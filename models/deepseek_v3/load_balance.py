"""DeepSeek-V3's expert load balancing (technical report, section 2.1.2) and the routing figures.

Two mechanisms, both DeepSeek-V3's, both configured by the ``model.load_balance`` YAML section
(``models.deepseek_v3.model_section.LoadBalanceSection``):

- **Auxiliary-loss-free balancing.** Every MoE router adds a per-expert bias ``b_i``
  (``e_score_correction_bias``, FP32) to its sigmoid scores for the top-k choice only (the
  combine weights use the scores without it). Each router counts the experts its top-k picks in
  training forwards (not in evaluation, not in an activation recompute's replay); once per
  optimizer step the counts of every micro-batch are summed over every data-parallel rank (one
  collective for all layers) and ``b_i += gamma * sign(mean_j c_j - c_i)``: an overloaded
  expert's bias falls, an idle one's rises. ``gamma`` is ``bias_update_rate`` (DeepSeek-V3's
  1e-3), 0 after ``bias_update_until_step``; a step the optimizer skipped (non-finite gradients)
  moves no bias, as it refreshes no weight. Every rank computes the same update from the same
  summed counts, so the biases stay bitwise equal across ranks. This is megatron-core's
  ``get_updated_expert_bias`` and torchtitan's ``load_balance_coeff`` rule.
- **The complementary sequence-wise balance loss** (``seq_aux_loss_coeff`` = alpha, 1e-4 in
  DeepSeek-V3): per sequence of T tokens, ``f_i = E / (K T) * #{t : i in TopK(s'_t, K)}`` and
  ``P_i = mean_t s'_{t,i}`` with ``s'_t = s_t / sum_j s_{t,j}`` the normalised sigmoid scores,
  ``L = alpha * sum_i f_i P_i``, averaged over the micro-batch's sequences. ``TopK`` is taken on
  the scores WITHOUT the bias and without the group limit, as the report writes it and as
  megatron-core's ``compute_routing_scores_for_aux_loss`` does (the counts f_i describe what the
  gate itself prefers; the bias only steers the dispatch). ``f_i`` is a count, so the gradient
  reaches the router weights through ``P_i`` only.

``routing_figures`` turns per-layer expert loads into what the logs show (busiest and idlest
expert over the mean, coefficient of variation, experts under 10 % of the mean). Pure functions;
the router (``model.py``) counts and computes the loss, ``balance_step.ExpertLoadBalancer`` does
the once-per-step part in training.

Legend: B batch, S sequence, E routed experts, K experts per token, L MoE layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["sequence_balance_loss", "updated_expert_bias", "routing_figures", "LayerRouting", "UNDERLOADED_SHARE"]

UNDERLOADED_SHARE = 0.1
"""An expert is "under 10 %" when its load is below this share of the layer's mean load."""


def sequence_balance_loss(scores_BSE: torch.Tensor, top_k: int, coeff: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one micro-batch (module docstring): FP32 scalar.

    scores: the router's sigmoid scores ``[B, S, E]`` (FP32, without the bias)."""
    B, S, E = scores_BSE.shape
    probs_BSE = scores_BSE / (scores_BSE.sum(dim=-1, keepdim=True) + 1e-20)
    picks_BSK = probs_BSE.detach().topk(top_k, dim=-1)[1]
    counts_BE = torch.zeros(B, E, dtype=probs_BSE.dtype, device=probs_BSE.device)
    counts_BE.scatter_add_(1, picks_BSK.flatten(1), torch.ones_like(picks_BSK.flatten(1), dtype=probs_BSE.dtype))
    f_BE = counts_BE * (E / (top_k * S))
    P_BE = probs_BSE.mean(dim=1)
    return coeff * (f_BE * P_BE).sum(dim=-1).mean()


def updated_expert_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean(counts) - counts)`` (``[..., E]``; counts integer or float).

    The sign is taken on ``sum(counts) - E * counts`` (exact for integer counts), the same sign
    as ``mean - counts``; the update itself is megatron-core's ``bias + sign * rate``."""
    counts = counts_E.to(torch.float64)
    offset = counts.sum(dim=-1, keepdim=True) - counts * counts.shape[-1]
    return bias_E + torch.sign(offset).to(bias_E.dtype) * rate


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's expert loads over a step: ``load_max`` / ``load_min`` (the busiest / idlest
    expert's load over the mean), ``load_cv`` (coefficient of variation: population standard
    deviation over mean), ``experts_under_10pct`` (experts below ``UNDERLOADED_SHARE`` of the mean).
    All 0 when the layer saw no token."""

    load_max: float
    load_min: float
    load_cv: float
    experts_under_10pct: int


def routing_figures(counts_LE: torch.Tensor) -> list[LayerRouting]:
    """Per layer of ``counts [L, E]`` (tokens per expert), its ``LayerRouting``."""
    counts = counts_LE.to(torch.float64)
    mean_L1 = counts.mean(dim=-1, keepdim=True)
    safe_L1 = torch.where(mean_L1 > 0, mean_L1, torch.ones_like(mean_L1))
    share_LE = counts / safe_L1
    seen_L = (mean_L1 > 0).squeeze(-1)
    rows = zip(share_LE.max(dim=-1)[0].tolist(), share_LE.min(dim=-1)[0].tolist(),
               (counts.std(dim=-1, unbiased=False) / safe_L1.squeeze(-1)).tolist(),
               (share_LE < UNDERLOADED_SHARE).sum(dim=-1).tolist(), seen_L.tolist())
    return [LayerRouting(hi, lo, cv, int(under)) if seen else LayerRouting(0.0, 0.0, 0.0, 0)
            for hi, lo, cv, under, seen in rows]
