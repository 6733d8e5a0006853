"""Quantized weights with ordinary PyTorch code: plain optimizers (``foreach`` and ``fused`` too),
``torch.load`` (weights_only), state dicts across formats, read-only ops, ``nn.init`` (issue 14,
item 4; issue 20, item 5)."""
import io
import warnings

import pytest
import torch
from torch import nn

from te_npu.tensor import HiF8Tensor, MXFP8Tensor, QuantizedWeightTensor, QuantizedWeightUpdateWarning


def _module(weight: torch.Tensor) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(weight)
    return module


@pytest.mark.parametrize("make_optimizer", [
    pytest.param(lambda p: torch.optim.SGD([p], lr=0.5), id="sgd"),
    pytest.param(lambda p: torch.optim.SGD([p], lr=0.5, momentum=0.9, weight_decay=0.1), id="sgd_momentum_decay"),
    pytest.param(lambda p: torch.optim.SGD([p], lr=0.5, weight_decay=0.1, foreach=True), id="sgd_foreach"),
    pytest.param(lambda p: torch.optim.AdamW([p], lr=1.0, weight_decay=0.0), id="adamw"),
    pytest.param(lambda p: torch.optim.AdamW([p], lr=1.0, weight_decay=0.0, foreach=True), id="adamw_foreach"),
    pytest.param(lambda p: torch.optim.AdamW([p], lr=1.0, weight_decay=0.1, fused=True), id="adamw_fused"),
    pytest.param(lambda p: torch.optim.Adam([p], lr=1.0, fused=True), id="adam_fused"),
])
def test_weight_plain_optimizer_dequantizes_updates_requantizes(weight_kind, make_weight, make_optimizer,
                                                               assert_same_payload):
    """Each step equals the same optimizer on the dequantized values, re-quantized (these
    optimizers write the weight once per step), with its state in the logical dtype."""
    cls, shape = weight_kind
    param = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    reference = nn.Parameter(param.dequantize())
    optimizer, ref_optimizer = make_optimizer(param), make_optimizer(reference)
    for step in range(2):
        param.grad = make_weight(*shape)
        reference.grad = param.grad.clone()  # fused kernels may write their grads
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QuantizedWeightUpdateWarning)
            optimizer.step()
        ref_optimizer.step()
        assert isinstance(param, cls)
        assert_same_payload(param, cls.from_high_precision(reference.detach()))
        with torch.no_grad():  # the reference continues from the 8-bit values, as the weight does
            reference.copy_(param.dequantize())
    for name, value in optimizer.state[param].items():
        assert type(value) is torch.Tensor and torch.equal(value, ref_optimizer.state[reference][name]), name


def test_weight_fused_sgd_updates_the_quantized_payload(weight_kind, make_weight, assert_same_payload):
    """SGD(fused=True) writes through the quantized copy too, bitwise as on the dequantized values.
    FP32 logical weights: torch 2.13's CPU fused SGD leaves most bf16 parameters unchanged on its
    first momentum step (plain tensors too: it reads its new, uninitialised momentum buffer), so
    a bf16 reference is not defined."""
    cls, shape = weight_kind
    param = nn.Parameter(cls.from_high_precision(make_weight(*shape).float()))
    reference, start = nn.Parameter(param.dequantize()), param.dequantize()
    optimizer = torch.optim.SGD([param], lr=0.5, momentum=0.9, fused=True)
    ref_optimizer = torch.optim.SGD([reference], lr=0.5, momentum=0.9, fused=True)
    for _ in range(2):
        grad = make_weight(*shape).float()
        param.grad, reference.grad = grad.clone(), grad.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QuantizedWeightUpdateWarning)
            optimizer.step()
        ref_optimizer.step()
        assert_same_payload(param, cls.from_high_precision(reference.detach()))
        with torch.no_grad():
            reference.copy_(param.dequantize())
    assert not torch.equal(param.dequantize(), start)
    assert torch.equal(optimizer.state[param]["momentum_buffer"], ref_optimizer.state[reference]["momentum_buffer"])


def test_weight_plain_optimizer_warns_naming_master_weight_optimizer(make_weight):
    param = nn.Parameter(HiF8Tensor.from_high_precision(make_weight(64, 64)))
    param.grad = make_weight(64, 64)
    with pytest.warns(QuantizedWeightUpdateWarning, match="te_npu.distributed.MasterWeightOptimizer"):
        torch.optim.SGD([param], lr=0.1).step()


def test_weight_update_warning_is_shown_once_by_default(make_weight):
    params = [nn.Parameter(MXFP8Tensor.from_high_precision(make_weight(64, 64))) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")  # Python's default action: once per location
        for p in params:
            p.grad = torch.ones_like(p.dequantize())
            torch.optim.SGD([p], lr=0.1).step()
    assert [w.category for w in caught] == [QuantizedWeightUpdateWarning]


def test_weight_state_dict_loads_with_weights_only(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    module = _module(cls.from_high_precision(make_weight(*shape)))
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True, the default
    assert type(loaded["weight"]) is cls
    assert_same_payload(loaded["weight"], module.weight)
    params = io.BytesIO()
    torch.save({"p": module.weight}, params)  # a Parameter keeps its Parameter-ness
    params.seek(0)
    assert isinstance(torch.load(params)["p"], nn.Parameter)


def test_weight_safe_globals_stay_narrow():
    """Only the rebuild function is allowlisted: no te_npu class, quantizer or module."""
    from te_npu.tensor.weight import _rebuild_quantized_weight

    te_npu_globals = [g for g in torch.serialization.get_safe_globals()
                      if getattr(g, "__module__", "").startswith("te_npu")]
    assert te_npu_globals == [_rebuild_quantized_weight]


_FORMATS = {"bf16": None, "mxfp8": MXFP8Tensor, "hif8": HiF8Tensor}


@pytest.mark.parametrize("src", list(_FORMATS))
@pytest.mark.parametrize("dst", list(_FORMATS))
@pytest.mark.parametrize("shape", [(128, 64), (4, 64, 32)], ids=["dense", "grouped"])
def test_weight_state_dict_converts_between_formats_through_logical_values(src, dst, shape, make_weight,
                                                                          assert_same_payload):
    values = make_weight(*shape)
    source = _module(values if _FORMATS[src] is None else _FORMATS[src].from_high_precision(values))
    target = _module(torch.zeros(shape, dtype=torch.bfloat16) if _FORMATS[dst] is None
                     else _FORMATS[dst].from_high_precision(make_weight(*shape)))
    target.load_state_dict(source.state_dict())
    logical = values if _FORMATS[src] is None else source.weight.dequantize()
    if _FORMATS[dst] is None:
        assert type(target.weight.data) is torch.Tensor and torch.equal(target.weight.detach(), logical)
    elif src == dst:  # the same format: the payload itself (MXFP8's col copy stays the one made from high precision)
        assert_same_payload(target.weight, source.weight)
    else:
        assert_same_payload(target.weight, _FORMATS[dst].from_high_precision(logical))


@pytest.mark.parametrize("op, reads_as", [
    pytest.param(lambda w: w.norm(), None, id="norm"),
    pytest.param(lambda w: torch.linalg.vector_norm(w, ord=float("inf")), None, id="vector_norm_inf"),
    pytest.param(lambda w: w.abs().max(), None, id="abs_max"),
    pytest.param(lambda w: w.sum(), None, id="sum"),
    pytest.param(lambda w: w.std(), None, id="std"),
    pytest.param(lambda w: w.amax(), None, id="amax"),
    pytest.param(lambda w: torch.isfinite(w).all(), None, id="isfinite"),
    pytest.param(lambda w: w * 2 + 1, None, id="arith"),
    # a cast reads the exact decoded value in the new dtype (HiF8's FP32 scale products are
    # not all bf16 numbers), the value every GEMM of the emulation sees
    pytest.param(lambda w: w.to(torch.float32), torch.float32, id="to_float32"),
    pytest.param(lambda w: w.float().mean(), torch.float32, id="float_mean"),
])
def test_weight_read_only_ops_return_high_precision(weight_kind, make_weight, op, reads_as):
    cls, shape = weight_kind
    weight = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    got, want = op(weight), op(weight.dequantize(reads_as))
    assert type(got) is torch.Tensor and not isinstance(got, QuantizedWeightTensor)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_weight_zeros_like_is_plain_state(weight_kind, make_weight):
    cls, shape = weight_kind
    weight = cls.from_high_precision(make_weight(*shape))
    for like in (torch.zeros_like(weight), torch.ones_like(weight), torch.full_like(weight, 3.0)):
        assert type(like) is torch.Tensor and like.shape == weight.shape and like.dtype == weight.dtype
    assert torch.zeros_like(weight, dtype=torch.float32).dtype == torch.float32


def test_weight_nn_init_on_data_requantizes(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    param = nn.Parameter(cls.from_high_precision(make_weight(*shape)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedWeightUpdateWarning)  # re-initialising is not an update
        nn.init.constant_(param.data, 0.25)
    assert_same_payload(param, cls.from_high_precision(torch.full(shape, 0.25, dtype=torch.bfloat16)))
    gen = torch.Generator().manual_seed(3)
    nn.init.normal_(param.data, generator=gen)
    expected = torch.empty(shape, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(3))
    assert_same_payload(param, cls.from_high_precision(expected))


def test_weight_read_into_plain_in_place_op_leaves_weight_alone(make_weight, assert_same_payload):
    """An EMA copy updated from the weight (``ema.mul_(d).add_(w, alpha=1 - d)``) reads its values."""
    weight = MXFP8Tensor.from_high_precision(make_weight(64, 64))
    twin = MXFP8Tensor.from_high_precision(make_weight(64, 64))
    twin.copy_(weight)
    ema = torch.ones(64, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedWeightUpdateWarning)
        ema.mul_(0.5).add_(weight, alpha=0.5)
    assert torch.equal(ema, torch.ones(64, 64, dtype=torch.bfloat16).mul_(0.5).add_(weight.dequantize(), alpha=0.5))
    assert_same_payload(weight, twin)
