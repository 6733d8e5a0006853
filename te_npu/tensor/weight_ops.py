"""Aten handlers that let quantized weights meet ordinary PyTorch code (as TE's float8 tensors do).

Registered into ``QuantizedWeightTensor``'s table (``te_npu.tensor.weight``), one small
handler per kind of op, each for an explicit list of overloads; an op in no list takes TE's
fallback (``te_npu.tensor.weight_fallback``: dequantized, with a ``DequantizeFallbackEvent``;
views and writes raise naming the op).

==============  ==================================================================  ===========
kind            what runs                                                           who sends it
==============  ==================================================================  ===========
read            the op on the logical values (``dequantize()``); high-precision     ``w.norm()``, ``w.abs().max()``, SGD weight decay (``grad + wd * w``)
                result
update          dequantize, apply the op, re-quantize in place; warns once          ``torch.optim`` (AdamW, SGD, RMSprop, Adagrad, foreach and fused too)
                (``QuantizedWeightUpdateWarning``)
re-initialise   the same, without the warning                                        ``nn.init.*_`` on ``param.data``, ``fill_``
new-like        a plain high-precision tensor of the logical shape / dtype          optimizer state (``torch.zeros_like(param)``)
convert         ``.to(dtype)`` / ``.float()`` / ``.bfloat16()``: ``dequantize(dtype)``    users, ``module.to(dtype)``
                (Python-level methods of the weight class, as TE's)
copy            ``_foreach_copy_``: each pair as ``copy_`` (re-quantize / same-class  optimizers' ``foreach`` state copies,
                payload copy / dequantize into a plain tensor)                       checkpoint loaders
broadcast       ``c10d.broadcast_``: every inner tensor broadcast from the root, so  ``dist.broadcast(param, src)`` (DDP's
                every rank holds the root's payload bit for bit                      initial sync, user code)
==============  ==================================================================  ===========

Re-quantizing after every update loses updates smaller than half an 8-bit step (and MXFP8's
col copy is re-quantized from the row copy's values); hence the warning: train quantized
weights with ``te_npu.distributed.MasterWeightOptimizer`` (FP32 master, one refresh per step).
Under FSDP2 (not tested) an in-place update would re-quantize each rank's shard alone; for a
dense HiF8 weight that gives per-rank scales, which the FSDP2 extension refuses to gather.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from te_npu.compat import tree_map
from te_npu.tensor.weight import QuantizedWeightTensor, implements

__all__ = ["QuantizedWeightUpdateWarning"]

aten = torch.ops.aten
_table = QuantizedWeightTensor._handlers


class QuantizedWeightUpdateWarning(UserWarning):
    """A quantized weight was updated in place by ordinary PyTorch code (e.g. a plain optimizer)."""


_UPDATE_MESSAGE = (
    "te_npu: a quantized weight (MXFP8Tensor / HiF8Tensor) was updated in place (e.g. by a torch.optim "
    "optimizer): it is dequantized, updated and re-quantized, as Transformer Engine's float8 tensors are, "
    "which loses updates smaller than the 8-bit step. Train quantized weights with "
    "te_npu.distributed.MasterWeightOptimizer (FP32 master weights, one refresh per step)."
)

_READS = (
    aten.abs.default, aten.neg.default, aten.sign.default, aten.sqrt.default,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.amax.default, aten.amin.default, aten.max.default, aten.min.default,
    aten.std.correction, aten.var.correction, aten.count_nonzero.default, aten.count_nonzero.dim_IntList,
    aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
    aten.isnan.default, aten.isinf.default, aten.isfinite.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar,
    aten.allclose.default, aten.isclose.default,
    aten._foreach_add.List, aten._foreach_add.Scalar, aten._foreach_mul.Scalar, aten._foreach_mul.List,
    aten._foreach_norm.Scalar,
)
_UPDATES = (
    aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar,
    aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar,
    aten.addcdiv_.default, aten.addcmul_.default,
    aten.lerp_.Scalar, aten.lerp_.Tensor, aten.clamp_.default, aten.clamp_.Tensor,
    aten._foreach_add_.List, aten._foreach_add_.Scalar, aten._foreach_add_.ScalarList,
    aten._foreach_sub_.List, aten._foreach_sub_.Scalar,
    aten._foreach_mul_.Scalar, aten._foreach_mul_.List, aten._foreach_mul_.ScalarList, aten._foreach_mul_.Tensor,
    aten._foreach_div_.Scalar, aten._foreach_div_.List, aten._foreach_div_.ScalarList,
    aten._foreach_addcdiv_.Scalar, aten._foreach_addcdiv_.ScalarList, aten._foreach_addcdiv_.Tensor,
    aten._foreach_addcmul_.Scalar, aten._foreach_addcmul_.ScalarList, aten._foreach_addcmul_.Tensor,
    aten._foreach_lerp_.Scalar, aten._foreach_lerp_.List,
    # torch.optim(..., fused=True): the fused kernels update params (args[0]) and plain state in place
    aten._fused_adam_.default, aten._fused_adam_.tensor_lr, aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr,
    aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr,
)
_REINITIALISATIONS = (aten.fill_.Scalar, aten.fill_.Tensor, aten.normal_.default, aten.uniform_.default)
_NEW_LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)


def _dequantized(value: Any) -> Any:
    return value._values() if isinstance(value, QuantizedWeightTensor) else value


@implements(_table, *_READS)
def _read(func, args, kwargs):
    # Reading a weight: the op sees its logical values and returns a high-precision tensor.
    return func(*tree_map(_dequantized, args), **tree_map(_dequantized, kwargs))


def _written(args: tuple) -> list:
    """The tensors an in-place op writes: ``self``, or the ``self`` list of a ``_foreach_`` op."""
    return list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]


def _update_in_place(func, args, kwargs):
    # Every quantized tensor written becomes its logical value, takes the op, and is
    # re-quantized into its own storage; quantized operands that are only read are dequantized
    # (``ema.add_(param)`` runs on the plain ``ema``).
    values = {id(t): t._values() for t in _written(args) if isinstance(t, QuantizedWeightTensor)}

    def substitute(value):
        if isinstance(value, QuantizedWeightTensor):
            return values[id(value)] if id(value) in values else value._values()
        return value

    func(*tree_map(substitute, args), **tree_map(substitute, kwargs))
    for target in _written(args):
        if isinstance(target, QuantizedWeightTensor):
            target._require_weight_shape(func)
            target._requantize_(values[id(target)])
    return args[0] if func._schema.returns else None  # _foreach_ in-place ops return nothing


@implements(_table, *_UPDATES)
def _update(func, args, kwargs):
    if any(isinstance(t, QuantizedWeightTensor) for t in _written(args)):
        warnings.warn(_UPDATE_MESSAGE, QuantizedWeightUpdateWarning, stacklevel=2)
    return _update_in_place(func, args, kwargs)


@implements(_table, *_REINITIALISATIONS)
def _reinitialise(func, args, kwargs):
    # nn.init on param.data: the new values are quantized into the storage.
    return _update_in_place(func, args, kwargs)


@implements(_table, *_NEW_LIKE)
def _new_like(func, args, kwargs):
    # torch.zeros_like(param) for optimizer state: a plain tensor of the logical shape and dtype.
    self, rest = args[0], args[1:]
    kwargs = {"dtype": self.dtype, "device": self.device, **{k: v for k, v in kwargs.items() if v is not None}}
    kwargs.pop("memory_format", None)
    return func(torch.empty(self.shape, dtype=self.dtype, device=self.device), *rest, **kwargs)


@implements(_table, aten._foreach_copy_.default)
def _foreach_copy(func, args, kwargs):
    # torch._foreach_copy_(dsts, srcs): each pair through copy_ (the quantized rules above).
    call = {**dict(zip(("self", "src", "non_blocking"), args)), **kwargs}
    for dst, src in zip(call["self"], call["src"], strict=True):
        dst.copy_(src, non_blocking=call.get("non_blocking", False))


@implements(_table, torch.ops.c10d.broadcast_.default)
def _broadcast(func, args, kwargs):
    # dist.broadcast(param, src): broadcast each inner tensor (one call each, waited), so every
    # rank ends with the root's 8-bit payload; an async caller gets an already completed work.
    # FP8 payloads travel as their bytes (uint8 views): gloo has no float8 dtypes.
    tensors, rest = list(args[0]), args[1:]
    work = None
    for tensor in tensors:
        inners = [getattr(tensor, n) for n in tensor.inner_field_names()] if isinstance(
            tensor, QuantizedWeightTensor) else [tensor]
        for inner in inners:
            if inner.element_size() == 1 and inner.dtype != torch.uint8:
                inner = inner.view(torch.uint8)
            _, work = func([inner], *rest, **kwargs)
            work.wait()
    return tensors, work

