"""Transformer Engine's module keywords that te_npu does not implement as options of its own.

te_npu runs with tensor parallelism 1. Every keyword of TE's ``Linear`` / ``GroupedLinear``
constructors and forwards (read from ``transformer_engine/pytorch/module/{linear,grouped_linear}.py``)
is therefore one of:

- implemented by the module itself (``bias``, ``init_method``, ``params_dtype``, ``device``,
  ``return_bias``, ``fuse_wgrad_accumulation``, ``get_rng_state_tracker``, ``rng_tracker_name``,
  ``name``): a parameter of its constructor;
- a tensor-parallel option that TE itself ignores at ``tp_size == 1`` (TE sets
  ``sequence_parallel = tp_size > 1 and sequence_parallel``, and every Userbuffers overlap
  needs sequence parallelism): accepted here, with TE's TP = 1 meaning, no effect;
- refused, with the reason, when its value would ask for something te_npu does not do.

``check_te_options`` applies one table; an unknown keyword is a ``TypeError`` as in Python, a
refused value a ``ConfigError`` naming the keyword, the value and why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from te_npu.errors import ConfigError

__all__ = ["TEOption", "LINEAR_OPTIONS", "GROUPED_LINEAR_OPTIONS", "LINEAR_FORWARD_OPTIONS",
           "GROUPED_LINEAR_FORWARD_OPTIONS", "check_te_options", "refuse_positional"]


@dataclass(frozen=True)
class TEOption:
    """One TE keyword: ``accepts(value)`` says whether te_npu can honour it; ``reason`` says why
    an accepted value changes nothing here, or why another value is refused."""

    accepts: Callable[[Any], bool]
    reason: str


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is v or (type(value) is type(v) and value == v) for v in values)


def _any_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _single_rank_group(group: Any) -> bool:
    if group is None:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) == 1


_TP1 = "te_npu has no tensor parallelism (TP = 1)"
_NO_OP_AT_TP1 = "a tensor-parallel option: TE ignores it at tp_size = 1, and TP is 1 here"
_SHARED = {
    "sequence_parallel": TEOption(_any_bool, _NO_OP_AT_TP1 + " (TE: sequence_parallel = tp_size > 1 and ...)"),
    "tp_group": TEOption(_single_rank_group, _TP1 + "; only None or a one-rank group"),
    "tp_size": TEOption(_is(1), _TP1),
    "parallel_mode": TEOption(_is(None, "column", "row"), _NO_OP_AT_TP1 + "; TE's modes are None, 'column', 'row'"),
    "ub_name": TEOption(lambda value: value is None or isinstance(value, str), _NO_OP_AT_TP1),
    "delay_wgrad_compute": TEOption(_is(False), "the wgrad GEMM runs in backward; there is no deferred "
                                                "backward_dw()"),
    "save_original_input": TEOption(_is(False), "the 8-bit path saves the col-quantized input for wgrad "
                                                "(0.5x of BF16), never the original input"),
}

LINEAR_OPTIONS: Mapping[str, TEOption] = {
    **_SHARED,
    **{flag: TEOption(_any_bool, _NO_OP_AT_TP1 + " (Userbuffers overlap needs sequence parallelism)")
       for flag in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")},
    "symmetric_ar_type": TEOption(_is(None, "multimem_all_reduce", "two_shot", "one_shot"),
                                  _NO_OP_AT_TP1 + " (no row-parallel all-reduce)"),
    "parameters_split": TEOption(_is(None), "one weight parameter per TELinear; split its output instead"),
}
"""``TELinear``'s TE-only keywords (TE ``Linear.__init__``)."""

GROUPED_LINEAR_OPTIONS: Mapping[str, TEOption] = {
    **_SHARED,
    # TE's GroupedLinear raises ValueError("GroupedLinear doesn't support Userbuffer overlap.") for True
    "ub_overlap_rs": TEOption(_is(False), "GroupedLinear does not support Userbuffers overlap (TE raises too)"),
    "ub_overlap_ag": TEOption(_is(False), "GroupedLinear does not support Userbuffers overlap (TE raises too)"),
    "single_grouped_weight": TEOption(_any_bool, "te_npu always holds one stacked weight [G, out, in] (TE's "
                                                 "weight0..weightN state-dict keys load into it)"),
    "single_grouped_bias": TEOption(_any_bool, "te_npu always holds one stacked bias [G, out] (TE's "
                                               "bias0..biasN state-dict keys load into it)"),
    "use_grouped_tensor": TEOption(lambda value: value is None or isinstance(value, bool),
                                   "an implementation choice in TE; te_npu always runs one grouped GEMM call"),
}
"""``TEGroupedLinear``'s TE-only keywords (TE ``GroupedLinear.__init__``)."""

LINEAR_FORWARD_OPTIONS: Mapping[str, TEOption] = {
    "fp8_output": TEOption(_is(False), "TE modules here return high-precision activations, never FP8 tensors"),
    "fp8_grad": TEOption(_is(False), "the input gradient is returned in high precision, never as an FP8 tensor"),
}
"""``TELinear.forward``'s TE-only keywords."""

GROUPED_LINEAR_FORWARD_OPTIONS: Mapping[str, TEOption] = {
    "out": TEOption(_is(None), "preallocated output buffers are not supported; the output is a new tensor"),
    "dgrad_out": TEOption(_is(None), "preallocated gradient buffers are not supported"),
}
"""``TEGroupedLinear.forward``'s TE-only keywords."""


def check_te_options(where: str, given: Mapping[str, Any], table: Mapping[str, TEOption]) -> None:
    """Raise for the first keyword of ``given`` that ``table`` does not know (``TypeError``) or
    does not accept (``ConfigError`` with the reason)."""
    for name, value in given.items():
        option = table.get(name)
        if option is None:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
        if not option.accepts(value):
            raise ConfigError(f"{where}: {name}={_describe(value)} is not supported: {option.reason}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<{value.dtype} tensor {list(value.shape)}>"
    return repr(value)


def refuse_positional(where: str, extra: tuple, leading: str, te_third: str) -> None:
    """TE's constructors take many arguments positionally in another order than te_npu once did
    (TE's third is ``sequence_parallel``, not ``bias``); anything after ``leading`` must be a keyword."""
    if extra:
        raise TypeError(f"{where}({leading}, ...): pass every other argument by keyword (got {len(extra)} more "
                        f"positional); in TE's order the next one would be {te_third}, not bias")
