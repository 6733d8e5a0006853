"""Token permute / unpermute around a grouped (per-expert) GEMM.

Legend: T tokens, H hidden, k experts per token, E experts, P = T * k (token, choice) pairs.
A *pair* ``j = t * k + c`` is token ``t``'s ``c``-th choice (row-major over ``topk_ids``).

``permute`` sorts the pairs by expert with a stable sort, so rows of one expert keep token
order and the result is deterministic. ``row_map[j]`` is the permuted row that holds pair
``j``; it is a permutation of ``range(P)``.

Both directions are pure gathers, forward and backward: the backward of a gather by a
permutation is a gather by the inverse permutation, and the k copies of a token are summed
with a ``view(T, k, H).sum(1)``. No ``index_add_`` / atomics, so results are bitwise
reproducible on CUDA as well as on CPU.

Tensors without data (meta, or the fake tensors of a capacity estimate) hold no expert ids to
count: ``permute`` then assumes balanced routing (``T * k / E`` rows per expert, the remainder
to the first experts), with the counts mirrored on the host so nothing reads a value.

Precision of ``unpermute``: the k expert outputs are multiplied by their routing weights and
summed in FP32, then cast to ``expert_out.dtype`` (the same order of operations as Hugging
Face's ``grouped_mm`` experts path, whose routing weights are FP32).
"""
from __future__ import annotations

import torch

from te_npu import compat
from te_npu.ops.group_sizes import group_sizes_tensor

__all__ = ["permute", "unpermute"]


def _inverse_permutation(perm_P: torch.Tensor) -> torch.Tensor:
    """perm: int64 ``[P]`` permutation -> its inverse ``[P]`` (``inv[perm[i]] = i``)."""
    inv_P = torch.empty_like(perm_P)
    inv_P[perm_P] = torch.arange(perm_P.numel(), device=perm_P.device, dtype=perm_P.dtype)
    return inv_P


class _ExpandGather(torch.autograd.Function):
    """``out[r] = x[source[r] // k]``; backward gathers by ``row_map`` and sums the k copies."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, token_of_row_P: torch.Tensor, row_map_P: torch.Tensor, k: int):
        ctx.save_for_backward(row_map_P)
        ctx.k = k
        return x_TH.index_select(0, token_of_row_P)

    @staticmethod
    def backward(ctx, grad_PH: torch.Tensor):
        (row_map_P,) = ctx.saved_tensors
        grad_TkH = grad_PH.index_select(0, row_map_P).view(-1, ctx.k, grad_PH.shape[-1])
        grad_TH = grad_TkH.sum(dim=1, dtype=torch.float32).to(grad_PH.dtype) if ctx.k > 1 else grad_TkH[:, 0]
        return grad_TH, None, None, None


class _PermutationGather(torch.autograd.Function):
    """``out = x[index]`` for a permutation ``index``; backward ``grad[inverse]``."""

    @staticmethod
    def forward(ctx, x_PH: torch.Tensor, index_P: torch.Tensor, inverse_P: torch.Tensor):
        ctx.save_for_backward(inverse_P)
        return x_PH.index_select(0, index_P)

    @staticmethod
    def backward(ctx, grad_PH: torch.Tensor):
        (inverse_P,) = ctx.saved_tensors
        return grad_PH.index_select(0, inverse_P), None, None


def permute(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token copies by expert.

    hidden: ``[T, H]``; topk_ids: integer ``[T, k]`` in ``[0, num_experts)``.
    Returns ``permuted [T*k, H]`` (rows of expert 0, then expert 1, ...; token order kept
    inside an expert), ``m_splits`` int64 ``[E]`` (rows per expert, zeros for idle experts)
    and ``row_map`` int64 ``[T*k]`` (pair ``t*k+c`` -> its permuted row).
    """
    if hidden.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"permute: expected hidden [T, H] and topk_ids [T, k], got {tuple(hidden.shape)} "
                         f"and {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"permute: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    k = topk_ids.shape[1]
    expert_of_pair_P = topk_ids.reshape(-1).long()
    if compat.holds_no_data(topk_ids):  # nothing to count (module doc): balanced, mirrored on the host
        m_splits_E = group_sizes_tensor(_balanced(expert_of_pair_P.numel(), num_experts), hidden.device)
    else:
        m_splits_E = _count_per_expert(expert_of_pair_P, num_experts)
    pair_of_row_P = torch.argsort(expert_of_pair_P, stable=True)
    row_map_P = _inverse_permutation(pair_of_row_P)
    permuted_PH = _ExpandGather.apply(hidden, pair_of_row_P // k, row_map_P, k)
    return permuted_PH, m_splits_E, row_map_P


def _count_per_expert(expert_of_pair_P: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert, int64 ``[E]``.

    Counts in E + 1 bins, the last for ids outside [0, E): no data-dependent output size, so no
    host sync on an accelerator (bincount reads the max id). Out-of-range ids raise here on CPU;
    on an accelerator they are left out of m_splits, whose sum the experts check.
    """
    in_range_P = (expert_of_pair_P >= 0) & (expert_of_pair_P < num_experts)
    bins_P = torch.where(in_range_P, expert_of_pair_P, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_of_pair_P.device)
    counts.scatter_add_(0, bins_P, torch.ones_like(bins_P))
    if counts.device.type == "cpu" and counts[num_experts] > 0:
        raise ValueError(f"permute: topk_ids holds an expert id outside [0, num_experts={num_experts})")
    return counts[:num_experts]


def _balanced(pairs: int, num_experts: int) -> list[int]:
    """``pairs`` rows over ``num_experts`` experts as evenly as possible (the first get one more)."""
    base, extra = divmod(pairs, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


def unpermute(expert_out: torch.Tensor, row_map: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs.

    expert_out: ``[T*k, H]`` in ``permute`` order; row_map: int64 ``[T*k]`` from ``permute``;
    topk_weights: ``[T, k]`` (any float dtype). Returns ``[T, H]`` in ``expert_out.dtype``:
    ``out[t] = sum_c topk_weights[t, c] * expert_out[row_map[t*k + c]]``, products and sum in FP32.
    """
    T, k = topk_weights.shape
    if expert_out.dim() != 2 or expert_out.shape[0] != T * k or row_map.shape != (T * k,):
        raise ValueError(f"unpermute: expected expert_out [{T * k}, H] and row_map [{T * k}], got "
                         f"{tuple(expert_out.shape)} and {tuple(row_map.shape)}")
    pair_of_row_P = _inverse_permutation(row_map)
    by_pair_TkH = _PermutationGather.apply(expert_out, row_map, pair_of_row_P).view(T, k, -1)
    weights_Tk1 = topk_weights.to(torch.float32).unsqueeze(-1)
    return (by_pair_TkH.float() * weights_Tk1).sum(dim=1).to(expert_out.dtype)
