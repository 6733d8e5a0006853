"""TELinear: ``y = x @ weight.T + bias``; 8-bit inside ``te_npu.autocast``, else high precision."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from te_npu import functional as te_functional
from te_npu.functional.dtypes import activation_dtype
from te_npu.functional.main_grad import plain_gemm_into_main_grad, require_main_grad
from te_npu.modules.base import TEModule
from te_npu.modules.te_options import LINEAR_FORWARD_OPTIONS, LINEAR_OPTIONS, check_te_options, refuse_positional

__all__ = ["TELinear"]


class TELinear(TEModule):
    """Dense linear layer. weight: ``[out_features, in_features]``; bias: ``[out_features]``.

    Transformer Engine's ``Linear`` (``transformer_engine.pytorch.Linear``), with TE's defaults:
    ``bias=True``, ``params_dtype=torch.get_default_dtype()``, weights ``normal_(0, 0.023)``
    (``init_method(weight)`` when given) and the bias zero. Only ``in_features, out_features``
    are positional (TE's third positional argument is ``sequence_parallel``); every TE keyword
    is taken, see ``te_npu.modules.te_options`` for the tensor-parallel ones and the refused ones.

    Inside ``te_npu.autocast(recipe=...)`` fprop, dgrad and wgrad run in the recipe's format
    (``te_npu.functional.linear``); the bias stays high precision. Outside autocast it is
    ``F.linear`` in high precision (the BF16 baseline); a quantized weight
    (``quantized_model_init`` / ``quantize_weights_``) then enters as ``weight.dequantize()``.
    Both paths compute in TE's activation dtype (``torch.autocast``'s when it is on, else the
    input's; ``te_npu.functional.dtypes``) and return it.

    ``return_bias=True`` (TE's option, what Megatron's ``skip_bias_add`` uses): the bias is not
    added; forward returns ``(out, bias)`` with the bias in the activation dtype (``None`` when
    the layer has no bias). ``fuse_wgrad_accumulation=True`` (Megatron's
    ``gradient_accumulation_fusion``): the wgrad goes in FP32 into ``weight.main_grad``
    (``te_npu.functional.main_grad``). ``name``: TE's module name, used as the FQN in errors and
    events until :func:`te_npu.assign_fqns` sets one. ``state_dict`` keys: exactly ``weight``
    (and ``bias``); TE's empty ``_extra_state`` entry is accepted on load.
    """

    def __init__(
        self,
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
        refuse_positional("TELinear", positional, "in_features, out_features", "sequence_parallel")
        check_te_options("TELinear", te_options, LINEAR_OPTIONS)
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.fqn = name
        self._init_parameters({"weight": (out_features, in_features), "bias": (out_features,) if bias else None},
                              params_dtype=params_dtype, device=device, init_method=init_method,
                              get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None, **te_options: Any):
        """x: ``[..., in_features]`` -> ``[..., out_features]`` (``(out, bias)`` with ``return_bias``).

        ``is_first_microbatch`` (TE's flag) only matters for a high-precision weight inside
        autocast: None quantizes it now, True quantizes and keeps it, False reuses the kept copy
        (``te_npu.functional.weight_cache``); with ``fuse_wgrad_accumulation`` True also makes
        the wgrad overwrite ``main_grad``. TE's ``fp8_output`` / ``fp8_grad`` accept only False.
        """
        check_te_options("TELinear.forward", te_options, LINEAR_FORWARD_OPTIONS)
        recipe = self.forward_recipe()
        dtype = activation_dtype(x, self.te_name, low_precision=recipe is not None)
        x = x if x.dtype == dtype else x.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        gemm_bias = None if self.return_bias else bias
        main_grad = self._main_grad_write("weight", is_first_microbatch)
        if recipe is not None:
            out = te_functional.linear(x, self.weight, gemm_bias, main_grad=main_grad,
                                       **self._gemm_kwargs(recipe, "weight", is_first_microbatch))
        elif main_grad is None:
            out = F.linear(x, self._plain_weight("weight", dtype), gemm_bias)
        else:
            require_main_grad(self.weight, self.te_name)
            weight = self._plain_weight("weight", dtype).detach()
            out = plain_gemm_into_main_grad(lambda x_, b_: F.linear(x_, weight, b_), x, gemm_bias, self.weight,
                                            main_grad)
        self._forward_done(out, recipe)
        if not self.return_bias:
            return out
        # never the Parameter object itself: a reentrant checkpoint would re-root its history and loop
        return out, bias if bias is None or bias is not self.bias else bias.view_as(bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", return_bias=True" if self.return_bias else "")
                + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else ""))
