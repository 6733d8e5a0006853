"""Quantized weights where ordinary PyTorch code writes or moves them (issue 20, items 2 and 5):
``param.data = t``, ``torch._foreach_copy_``, ``dist.broadcast``, and state dicts as plain tensors
for ``safetensors``. Every write lands in the quantized payload (compared bit for bit with a
freshly quantized reference), never silently ignored."""
from __future__ import annotations

import os

import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from te_npu.tensor import HiF8Tensor, MXFP8Tensor, from_plain_state_dict, to_plain_state_dict


def _param(cls, value):
    return nn.Parameter(cls.from_high_precision(value))


def test_weight_data_setter_quantizes_a_high_precision_tensor(weight_kind, make_weight, assert_same_payload):
    """TE's float8 tensors re-quantize in their ``.data`` setter; the value used to be ignored."""
    cls, shape = weight_kind
    param, value = _param(cls, make_weight(*shape)), make_weight(*shape)
    param.data = value
    assert type(param) is nn.Parameter or isinstance(param, cls)
    assert isinstance(param, cls) and param.requires_grad
    assert_same_payload(param, cls.from_high_precision(value))


def test_weight_data_setter_aliases_a_weight_of_its_class(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    param, other = _param(cls, make_weight(*shape)), cls.from_high_precision(make_weight(*shape))
    saved = param.data  # an EMA-style swap through .data: out and back
    param.data = other
    assert all(getattr(param, n) is getattr(other, n) for n in cls.inner_field_names())
    param.data = saved
    assert_same_payload(param, saved)


@pytest.mark.parametrize("src_cls, dst_cls", [(MXFP8Tensor, HiF8Tensor), (HiF8Tensor, MXFP8Tensor)])
def test_weight_data_setter_takes_another_format_through_its_values(src_cls, dst_cls, make_weight,
                                                                    assert_same_payload):
    src = src_cls.from_high_precision(make_weight(64, 64))
    param = _param(dst_cls, make_weight(64, 64))
    param.data = src
    assert_same_payload(param, dst_cls.from_high_precision(src.dequantize()))


def test_weight_data_setter_follows_shape_and_dtype_like_a_plain_tensor(weight_kind, make_weight):
    cls, shape = weight_kind
    param = _param(cls, make_weight(*shape))
    value = make_weight(*[2 * s for s in shape]).float()
    param.data = value
    assert param.shape == value.shape and param.dtype == torch.float32 and torch.equal(
        param.dequantize(), cls.from_high_precision(value).dequantize())


def test_vector_to_parameters_writes_quantized_weights(make_weight, assert_same_payload):
    module = nn.Module()
    module.a = _param(MXFP8Tensor, make_weight(64, 64))
    module.b = _param(HiF8Tensor, make_weight(32, 64))
    vector = make_weight(64 * 64 + 32 * 64)
    nn.utils.vector_to_parameters(vector, module.parameters())
    assert_same_payload(module.a, MXFP8Tensor.from_high_precision(vector[:4096].view(64, 64)))
    assert_same_payload(module.b, HiF8Tensor.from_high_precision(vector[4096:].view(32, 64)))


def test_weight_foreach_copy_writes_through_the_quantized_copy(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    params = [_param(cls, make_weight(*shape)) for _ in range(2)]
    values = [make_weight(*shape) for _ in range(2)]
    with torch.no_grad():
        torch._foreach_copy_(params, values)
    for param, value in zip(params, values):
        assert_same_payload(param, cls.from_high_precision(value))
    plain = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(2)]
    torch._foreach_copy_(plain, params)  # the other direction: the logical values
    assert all(torch.equal(p, q.dequantize()) for p, q in zip(plain, params))


def test_quantized_state_dict_round_trips_through_safetensors_bitwise(make_weight, tmp_path, assert_same_payload):
    state = {"dense.weight": MXFP8Tensor.from_high_precision(make_weight(64, 64)),
             "experts.weight": HiF8Tensor.from_high_precision(make_weight(4, 64, 32)),
             "dense.bias": make_weight(64)}
    tensors, metadata = to_plain_state_dict(state)
    assert all(type(t) is torch.Tensor for t in tensors.values())
    assert sorted(tensors) == ["dense.bias", "dense.weight:col_data", "dense.weight:col_scale", "dense.weight:row_data",
                               "dense.weight:row_scale", "experts.weight:qdata", "experts.weight:scale"]
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    with safetensors.safe_open(path, "pt") as f:
        loaded = from_plain_state_dict({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    assert sorted(loaded) == sorted(state) and torch.equal(loaded["dense.bias"], state["dense.bias"])
    for key in ("dense.weight", "experts.weight"):
        assert type(loaded[key]) is type(state[key]) and loaded[key].shape == state[key].shape
        assert loaded[key].quantizer == state[key].quantizer
        assert_same_payload(loaded[key], state[key])


def _broadcast_worker(rank: int, store_path: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(100 + rank)  # different weights on the two ranks
    weights = [MXFP8Tensor.from_high_precision(torch.randn(64, 64, generator=gen).bfloat16()),
               HiF8Tensor.from_high_precision(torch.randn(2, 64, 32, generator=gen).bfloat16())]
    dist.broadcast(weights[0], src=0)
    dist.broadcast(weights[1], src=0, async_op=True).wait()
    torch.save([{n: getattr(w, n) for n in w.inner_field_names()} for w in weights], f"{results}.{rank}")
    dist.destroy_process_group()


def test_weight_dist_broadcast_sends_the_root_s_payload(tmp_path, inner_bits):
    """dist.broadcast of a quantized weight used to raise NotImplementedError; every rank now holds
    rank 0's codes and scales bit for bit (2 gloo ranks)."""
    results = str(tmp_path / "inner")
    os.environ.pop("MASTER_ADDR", None)
    mp.spawn(_broadcast_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    ranks = [torch.load(f"{results}.{r}") for r in range(2)]
    for w0, w1 in zip(*ranks):
        for name in w0:
            bits = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (w0[name], w1[name])]
            assert torch.equal(*bits), name
    gen = torch.Generator().manual_seed(100)
    first = MXFP8Tensor.from_high_precision(torch.randn(64, 64, generator=gen).bfloat16())
    assert torch.equal(ranks[1][0]["row_scale"], first.row_scale)  # rank 1 holds rank 0's weight
