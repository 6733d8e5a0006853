"""TEGroupedLinear (one GEMM per group of rows) and TEGroupedSwiGLUExperts (MoE experts).

Inside ``te_npu.autocast(recipe=...)`` every GEMM (fprop, dgrad, wgrad) runs in the recipe's
format through ``te_npu.functional.grouped_linear`` / ``grouped_swiglu``; outside, the plain
path below (``_grouped_linear_reference``) computes in high precision (the BF16 baseline),
with quantized weights entering as ``weight.dequantize()``. Both paths compute in TE's
activation dtype (``te_npu.functional.dtypes``) and check ``m_splits`` the same way
(``G`` sizes, non-negative, summing to the rows of ``x``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from te_npu import functional as te_functional
from te_npu.compat import grouped_mm, grouped_mm_available, grouped_mm_takes_dtype
from te_npu.functional.dtypes import activation_dtype
from te_npu.functional.main_grad import plain_gemm_into_main_grad, require_main_grad
from te_npu.functional.operands import group_list_tensor
from te_npu.modules.base import TEModule
from te_npu.modules.te_options import (
    GROUPED_LINEAR_FORWARD_OPTIONS,
    GROUPED_LINEAR_OPTIONS,
    check_te_options,
    refuse_positional,
)
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.tensor import QuantizedWeightTensor

__all__ = ["TEGroupedLinear", "TEGroupedSwiGLUExperts"]


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _checked_group_sizes(m_splits: Sequence[int] | torch.Tensor, num_groups: int, x: torch.Tensor) -> torch.Tensor:
    """int64 ``[G]`` row counts with their host mirror, checked exactly as the 8-bit path checks them."""
    return group_list_tensor(m_splits, num_groups, x.shape[0], x.device)


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    """``y`` whose incoming gradient gets contiguous strides: torch's CPU ``_grouped_mm`` backward
    rejects a stride-0 gradient (``y.sum().backward()`` sends an expanded scalar), also an empty
    one (which ``contiguous()`` leaves as it is)."""
    if y.requires_grad:
        y.register_hook(_with_contiguous_strides)
    return y


def _with_contiguous_strides(grad: torch.Tensor) -> torch.Tensor:
    if grad.is_contiguous() and grad.numel():
        return grad
    return torch.empty_like(grad, memory_format=torch.contiguous_format).copy_(grad)


def _grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: ``[T, K]`` sorted by group; weight: ``[G, N, K]`` (x's dtype); checked sizes ``[G]``;
    bias ``[G, N]`` or None -> ``[T, N]``: one ``F.linear(x_g, weight[g], bias[g])`` per group.

    Without bias, torch's grouped GEMM where it runs (the same values as the per-group loop);
    with bias (or a dtype torch's grouped GEMM lacks: float64, and FP32 / FP16 on tensors without
    data, whose meta kernel takes BF16 only), the loop, so the bias is added as ``F.linear`` adds
    it (one rounding)."""
    fused = (grouped_mm_available() and x.device.type in ("cuda", "cpu") and x.dtype in _GROUPED_MM_DTYPES
             and grouped_mm_takes_dtype(x))
    if bias is None and fused:
        offsets = torch.cumsum(group_sizes, 0).to(torch.int32)
        return _contiguous_grad(grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    chunks = torch.split(x, list(host_group_sizes(group_sizes)))
    biases = [None] * len(chunks) if bias is None else bias.unbind(0)
    # unbind, not weight[g]: the backward of G selects would materialise G zero-filled [G, N, K]
    # gradients (64 experts at 16B shapes: ~100 GB of memset per step); unbind's is one stack.
    return torch.cat([F.linear(chunk, w_g, b_g) for chunk, w_g, b_g in zip(chunks, weight.unbind(0), biases)])


class TEGroupedLinear(TEModule):
    """``num_gemms`` linear maps over consecutive row groups. weight: ``[num_gemms, out, in]``;
    bias: ``[num_gemms, out]``.

    Transformer Engine's ``GroupedLinear`` with TE's defaults: ``bias=True``,
    ``params_dtype=torch.get_default_dtype()``, each expert's weight ``normal_(0, 0.023)`` (or
    ``init_method(weight[g])`` on every ``[out, in]`` expert weight, TE's ``weight{g}``, in
    order) and zero biases. Only ``num_gemms, in_features, out_features`` are positional. The
    weights are one stacked parameter (TE: ``weight0..weight{G-1}``, one per GEMM): TE's
    per-GEMM state-dict keys ``weight{g}`` / ``bias{g}`` load into it, and
    :meth:`te_state_dict` writes them. ``return_bias=True`` returns ``(out, [bias_g, ...])`` as
    TE does; ``fuse_wgrad_accumulation=True`` writes the FP32 wgrad into ``weight.main_grad``
    ``[G, out, in]``; ``name`` as in ``TELinear``.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *positional: Any,
        bias: bool = True,
        init_method: Callable[[torch.Tensor], None] | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Callable[[], Any] | None = None,
        rng_tracker_name: str | None = None,
        name: str | None = None,
        **te_options: Any,
    ) -> None:
        refuse_positional("TEGroupedLinear", positional, "num_gemms, in_features, out_features", "sequence_parallel")
        check_te_options("TEGroupedLinear", te_options, GROUPED_LINEAR_OPTIONS)
        super().__init__()
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.fqn = name
        self._init_parameters({"weight": (num_gemms, out_features, in_features),
                               "bias": (num_gemms, out_features) if bias else None},
                              params_dtype=params_dtype, device=device, init_method=init_method,
                              get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name)

    def _init_units(self, weight: torch.Tensor) -> Sequence[torch.Tensor]:
        """TE's ``weight{g}``: ``init_method`` runs on each expert's ``[out, in]`` weight."""
        return weight.unbind(0)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None, **te_options: Any):
        """x: ``[T, in]`` rows sorted by group, ``m_splits`` ``[G]`` integers summing to T -> ``[T, out]``
        (``(out, [bias_g, ...])`` with ``return_bias``).

        ``is_first_microbatch``: TE's weight-caching flag (see ``TELinear.forward``). TE's
        ``out`` / ``dgrad_out`` buffers accept only None.
        """
        check_te_options("TEGroupedLinear.forward", te_options, GROUPED_LINEAR_FORWARD_OPTIONS)
        recipe = self.forward_recipe()
        dtype = activation_dtype(x, self.te_name, low_precision=recipe is not None)
        x = x if x.dtype == dtype else x.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        gemm_bias = None if self.return_bias else bias
        main_grad = self._main_grad_write("weight", is_first_microbatch)
        if recipe is not None:
            out = te_functional.grouped_linear(x, self.weight, m_splits, gemm_bias, main_grad=main_grad,
                                               **self._gemm_kwargs(recipe, "weight", is_first_microbatch))
        elif x.is_meta:  # shape inference: meta tensors hold no group sizes to read or check
            out = F.linear(x, self._plain_weight("weight", dtype)[0], None if gemm_bias is None else gemm_bias[0])
        else:
            group_sizes = _checked_group_sizes(m_splits, self.num_gemms, x)
            if main_grad is None:
                out = _grouped_linear_reference(x, self._plain_weight("weight", dtype), group_sizes, gemm_bias)
            else:
                require_main_grad(self.weight, self.te_name)
                weight = self._plain_weight("weight", dtype).detach()
                out = plain_gemm_into_main_grad(lambda x_, b_: _grouped_linear_reference(x_, weight, group_sizes, b_),
                                                x, gemm_bias, self.weight, main_grad, group_sizes)
        self._forward_done(out, recipe)
        if self.return_bias:  # TE: (out, one bias per GEMM in the activation dtype)
            return out, None if bias is None else list(bias.unbind(0))
        return out

    # ---- TE's per-GEMM state-dict keys ---------------------------------------------------------
    def _accept_te_keys(self, state_dict: dict, prefix: str) -> None:
        """TE's ``weight0..weight{G-1}`` (and ``bias0..``) ``[out, in]`` entries become this module's
        stacked ``weight`` (``bias``); TE's ``_extra_state`` is dropped."""
        super()._accept_te_keys(state_dict, prefix)
        for name in ("weight", "bias"):
            keys = [f"{prefix}{name}{g}" for g in range(self.num_gemms)]
            present = [key for key in keys if key in state_dict]
            if not present or prefix + name in state_dict:
                continue
            if len(present) != len(keys):
                missing = sorted(set(keys) - set(present))
                raise KeyError(f"{self.te_name}: a TE GroupedLinear state dict with {len(present)} of the "
                               f"{self.num_gemms} per-GEMM {name} entries; missing {missing}")
            state_dict[prefix + name] = torch.stack([_logical(state_dict.pop(key)) for key in keys])

    def te_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """This module's weights under TE ``GroupedLinear``'s keys: ``weight{g}`` ``[out, in]``,
        ``bias{g}`` ``[out]`` (when it has a bias) and TE's empty ``_extra_state``, for
        ``te.GroupedLinear.load_state_dict``. Views of the parameters (detached); a quantized
        weight gives its logical (dequantized) values."""
        weight = self.weight.detach()
        weight = weight.dequantize() if isinstance(weight, QuantizedWeightTensor) else weight
        out = {f"{prefix}weight{g}": w_g for g, w_g in enumerate(weight.unbind(0))}
        if self.bias is not None:
            out.update({f"{prefix}bias{g}": b_g for g, b_g in enumerate(self.bias.detach().unbind(0))})
        out[prefix + "_extra_state"] = torch.empty(0, dtype=torch.uint8)
        return out

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}" + (", return_bias=True" if self.return_bias else "")
                + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else ""))


def _logical(value: torch.Tensor) -> torch.Tensor:
    """A state-dict entry's values (a quantized weight dequantized, to be stacked)."""
    return value.dequantize() if isinstance(value, QuantizedWeightTensor) else value


class TEGroupedSwiGLUExperts(TEModule):
    """MoE routed experts: ``down(silu(gate(x)) * up(x))`` per expert, Hugging Face layout.

    Its two GEMMs are named ``<fqn>.gate_up_proj`` and ``<fqn>.down_proj`` (errors, events).

    gate_up_proj: ``[E, 2F, H]`` (gate rows first, then up rows); down_proj: ``[E, H, F]``.
    """

    _weight_names = ("gate_up_proj", "down_proj")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self._init_parameters(
            {"gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
             "down_proj": (num_experts, hidden_size, intermediate_size)},
            params_dtype=params_dtype, device=device, init_method=init_method,
        )

    def _default_init(self, weight: torch.Tensor) -> None:
        """normal(0, 0.02), for both stacks."""
        nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        """x: ``[T, H]`` rows sorted by expert, ``m_splits`` ``[E]`` -> ``[T, H]``.

        ``is_first_microbatch``: TE's weight-caching flag (see ``TELinear.forward``).
        """
        recipe = self.forward_recipe()
        dtype = activation_dtype(x, self.te_name, low_precision=recipe is not None)
        x = x if x.dtype == dtype else x.to(dtype)
        if recipe is None:
            group_sizes = _checked_group_sizes(m_splits, self.num_experts, x)  # read once for both GEMMs
            gate, up = _grouped_linear_reference(x, self._plain_weight("gate_up_proj", dtype),
                                                 group_sizes).chunk(2, dim=-1)
            out = _grouped_linear_reference(F.silu(gate) * up, self._plain_weight("down_proj", dtype), group_sizes)
        else:
            kwargs = self._gemm_kwargs(recipe, "gate_up_proj", is_first_microbatch)
            kwargs["weight_caches"] = (kwargs.pop("weight_cache"), self._weight_caches["down_proj"])
            out = te_functional.grouped_swiglu(x, self.gate_up_proj, self.down_proj, m_splits, **kwargs)
        self._forward_done(out, recipe)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}")
