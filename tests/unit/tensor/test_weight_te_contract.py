"""Quantized weights keep Transformer Engine's ``QuantizedTensor`` contract
(``transformer_engine/pytorch/quantized_tensor.py``): conversions give high-precision tensors, an
op without a handler runs on the dequantized values (and says so with an event), writes and
views that the 8-bit storage cannot honour raise at the call."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import te_npu
from te_npu import events
from te_npu.tensor import HiF8Tensor, MXFP8Tensor
from tests.distributed.harness import run_ranks


def _fallbacks():
    seen = []
    return seen, events.subscribe(seen.append, events.DequantizeFallbackEvent)


@pytest.mark.parametrize("logical", [torch.float32, torch.bfloat16], ids=["fp32_logical", "bf16_logical"])
def test_weight_conversions_give_high_precision_tensors(weight_kind, make_weight, logical):
    cls, shape = weight_kind
    w = cls.from_high_precision(make_weight(*shape, dtype=logical))
    value = w.dequantize()
    assert type(value) is torch.Tensor and value.dtype == logical
    for name, out, dtype in (("float", w.float(), torch.float32), ("to", w.to(torch.float32), torch.float32),
                             ("to_kw", w.to(dtype=logical), logical), ("cpu", w.cpu(), logical),
                             ("bfloat16", w.bfloat16(), torch.bfloat16)):
        assert type(out) is torch.Tensor and out.dtype == dtype, name
        assert torch.equal(out, w.dequantize(dtype)), name
    assert torch.equal(torch.from_numpy(w.float().cpu().numpy()), w.dequantize(torch.float32))
    assert torch.equal(torch.from_numpy(w.float().numpy()), w.dequantize(torch.float32))
    assert torch.equal(w.float().transpose(-1, -2), w.dequantize(torch.float32).transpose(-1, -2))  # the w.float().t()
    moved = w.to("cpu", copy=True)  # a device move alone keeps the payload and the class
    assert type(moved) is cls


def test_weight_float_is_differentiable_like_te(make_weight):
    w = nn.Parameter(MXFP8Tensor.from_high_precision(make_weight(64, 64, dtype=torch.float32)))
    (w.float() ** 2).sum().backward()
    assert type(w.grad) is torch.Tensor and torch.equal(w.grad, 2 * w.dequantize())


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda t: t.exp(), id="exp"),
        pytest.param(lambda t: torch.cat([t, t], dim=-1), id="cat_along_k"),
        pytest.param(lambda t: torch.stack([t, t]), id="stack"),
        pytest.param(lambda t: torch.mm(t, torch.ones(t.shape[-1], 3, dtype=t.dtype)) if t.dim() == 2
                     else torch.bmm(t, torch.ones(t.shape[0], t.shape[-1], 3, dtype=t.dtype)), id="mm"),
        pytest.param(lambda t: t.clamp(-1.0, 1.0), id="clamp"),
        pytest.param(lambda t: torch.where(t > 0, t, 0.0), id="where"),
    ],
)
def test_weight_unhandled_op_dequantizes_and_emits_an_event(weight_kind, make_weight, op):
    cls, shape = weight_kind
    w = cls.from_high_precision(make_weight(*shape))
    seen, subscription = _fallbacks()
    with subscription:
        out = op(w)
    assert type(out) is torch.Tensor
    assert torch.equal(out, op(w.dequantize()))
    assert seen and all(e.tensor_type == cls.__name__ for e in seen)
    assert all(shape in [tuple(s) for s in e.shapes] for e in seen)


def test_weight_torch_cat_of_weights_along_rows(make_weight):
    a, b = (MXFP8Tensor.from_high_precision(make_weight(64, 32)) for _ in range(2))
    out = torch.cat([a, b])
    assert type(out) is torch.Tensor and torch.equal(out, torch.cat([a.dequantize(), b.dequantize()]))


def test_weight_flat_view_is_honoured_as_a_read(weight_kind, make_weight):
    """``w.view(-1)`` / ``w.flatten()`` (FSDP2, ``parameters_to_vector``) read as the flattened values."""
    cls, shape = weight_kind
    w = cls.from_high_precision(make_weight(*shape))
    for flat in (w.view(-1), w.flatten(), w.reshape(-1)):
        assert list(flat.shape) == [w.numel()]
        assert torch.equal(flat.dequantize(), w.dequantize().flatten())
        assert torch.equal(flat.sum(), w.dequantize().flatten().sum())


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda t: t.view(2, -1), id="view_other_shape"),
        pytest.param(lambda t: t.flatten().view(4, -1), id="flat_then_other_shape"),
        pytest.param(lambda t: t.t() if t.dim() == 2 else t.transpose(1, 2), id="transpose"),
        pytest.param(lambda t: t.expand(2, *t.shape), id="expand"),
        pytest.param(lambda t: t.unbind(0), id="unbind"),
        pytest.param(lambda t: t.diagonal(), id="diagonal"),
    ],
)
def test_weight_view_it_cannot_honour_raises_at_the_call(weight_kind, make_weight, op):
    cls, shape = weight_kind
    w = cls.from_high_precision(make_weight(*shape))
    with pytest.raises(NotImplementedError, match=rf"{cls.__name__} does not support aten\."):
        op(w)


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda t: t.exp_(), id="exp_"),
        pytest.param(lambda t: t.index_fill_(0, torch.tensor([0]), 1.0), id="index_fill_"),
        pytest.param(lambda t: torch.add(torch.ones(t.shape), 1.0, out=t), id="add_out"),
    ],
)
def test_weight_write_without_a_handler_raises_naming_the_op(weight_kind, make_weight, op):
    cls, shape = weight_kind
    w = cls.from_high_precision(make_weight(*shape))
    before = {n: t.clone() for n, t in w._inner().items()}
    with pytest.raises(NotImplementedError, match=r"does not support aten\.\w+\.\w+: it writes into the quantized"):
        op(w)
    assert all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8)) if t.element_size() == 1
               else torch.equal(before[n], t) for n, t in w._inner().items())


def test_weight_read_into_a_plain_out_tensor_is_a_read(make_weight):
    w = HiF8Tensor.from_high_precision(make_weight(64, 64))
    out = torch.empty(64, 64, dtype=w.dtype)
    torch.exp(w, out=out)
    assert torch.equal(out, w.dequantize().exp())


def _model() -> nn.Module:
    with te_npu.quantized_model_init(recipe=te_npu.MXFP8BlockRecipe()):
        dense = te_npu.TELinear(64, 64, bias=False)
    with te_npu.quantized_model_init(recipe=te_npu.HiF8CurrentScalingRecipe()):
        grouped = te_npu.TEGroupedLinear(2, 64, 32, bias=False)
    return nn.ModuleDict({"dense": dense, "grouped": grouped})


def test_parameters_to_vector_of_quantized_weights(gen):
    torch.manual_seed(0)
    model = _model()
    vector = nn.utils.parameters_to_vector(model.parameters())
    assert type(vector) is torch.Tensor
    assert torch.equal(vector, torch.cat([p.dequantize().flatten() for p in model.parameters()]))


def _ddp_worker(rank, world_size, workdir):
    torch.manual_seed(10 + rank)  # each rank starts elsewhere: DDP broadcasts rank 0's weights
    model = _model()
    ddp = DistributedDataParallel(model)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
        dense = ddp.module["dense"](x)
    with te_npu.autocast(recipe=te_npu.HiF8CurrentScalingRecipe()):
        out = ddp.module["grouped"](dense, [16, 16])
    out.float().square().sum().backward()
    return {name: (type(p).__name__, p.dequantize(), p.grad) for name, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_ddp_wraps_quantized_weights_and_syncs_them(tmp_path, world_size):
    """DistributedDataParallel(model): its bucket flattening and rank-0 broadcast work on quantized
    weights; every rank holds rank 0's values, the weights stay quantized."""
    results = run_ranks(_ddp_worker, world_size, tmp_path)
    for name, (kind, value, grad) in results[0].items():
        assert kind in ("MXFP8Tensor", "HiF8Tensor")
        assert grad is not None and torch.isfinite(grad).all()
        for other in results[1:]:
            assert other[name][0] == kind and torch.equal(other[name][1], value), name
