"""Quantized weights as ``nn.Parameter``: autograd, state dicts, deepcopy, pickling, FSDP2 init."""
import copy
import io
import socket

import pytest
import torch
from torch import nn

from te_npu.tensor import QuantizedWeightTensor


class _DequantLinear(torch.autograd.Function):
    """A stand-in for the TE autograd Functions: reads the weight payload, returns a plain dW."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        ctx.weight = weight
        return x @ weight.dequantize().transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return grad_out @ ctx.weight.dequantize(), grad_out.transpose(-1, -2) @ x


def _dense_kinds(weight_kind):
    cls, shape = weight_kind
    return cls, (shape[-2], shape[-1])


def test_parameter_wrapping_keeps_subclass(weight_kind, make_weight):
    cls, shape = weight_kind
    param = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    module = nn.Linear(shape[-1], shape[-2], bias=False)
    module.weight = param
    assert isinstance(module.weight, cls) and isinstance(module.weight, nn.Parameter)
    assert isinstance(module.weight, QuantizedWeightTensor) and module.weight.requires_grad
    assert list(dict(module.named_parameters())) == ["weight"]


def test_parameter_grad_accumulates_in_logical_dtype(weight_kind, make_weight, gen):
    cls, shape = _dense_kinds(weight_kind)
    param = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    x = torch.randn(8, shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
    _DequantLinear.apply(x, param).sum().backward()
    first = param.grad.clone()
    assert type(param.grad) is torch.Tensor and param.grad.dtype == torch.bfloat16
    assert param.grad.shape == param.shape and x.grad.shape == x.shape
    _DequantLinear.apply(x, param).sum().backward()
    assert torch.equal(param.grad, first * 2)


def test_parameter_state_dict_and_load_requantize(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    module = nn.Module()
    module.weight = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    ptr = module.weight._inner()[cls._inner_fields[0]].data_ptr()
    state = module.state_dict()
    assert type(state["weight"]) is cls and not state["weight"].requires_grad
    new_value = make_weight(*shape)
    module.load_state_dict({"weight": new_value})  # copy_ from high precision
    assert module.weight._inner()[cls._inner_fields[0]].data_ptr() == ptr
    assert_same_payload(module.weight, cls.from_high_precision(new_value))


def test_parameter_deepcopy_copies_payload(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    module = nn.Module()
    module.weight = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    twin = copy.deepcopy(module)
    assert type(twin.weight) is cls and isinstance(twin.weight, nn.Parameter) and twin.weight.requires_grad
    assert_same_payload(twin.weight, module.weight)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.weight._inner().values(), module.weight._inner().values()))


def test_parameter_torch_save_round_trip_needs_weights_only_false(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    module = nn.Module()
    module.weight = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="weights_only"):
        torch.load(buffer)  # the default safe loader refuses custom classes
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.weight) is cls and isinstance(loaded.weight, nn.Parameter)
    assert_same_payload(loaded.weight, module.weight)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parameter_fully_shard_init_single_rank(make_weight, assert_same_payload):
    """FSDP2 fully_shard (gloo, world size 1) wraps the quantized shard in a DTensor unchanged."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from te_npu.tensor import HiF8Tensor, MXFP8Tensor

    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for cls, shape in ((MXFP8Tensor, (64, 32)), (HiF8Tensor, (64, 32)), (HiF8Tensor, (2, 64, 32))):
            module = nn.Module()
            quantized = cls.from_high_precision(make_weight(*shape))
            module.weight = nn.Parameter(quantized)
            fully_shard(module)
            local = module.weight.to_local()
            assert type(local) is cls and local.shape == quantized.shape
            assert_same_payload(local, quantized)
    finally:
        dist.destroy_process_group()
