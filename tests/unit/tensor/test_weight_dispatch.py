"""Aten ops on quantized weights: each handled op keeps every inner tensor consistent; views and
writes without a handler raise ``NotImplementedError`` naming the op; other ops run on the
dequantized values (TE's fallback: tests/unit/tensor/test_weight_te_contract.py)."""
import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from te_npu.tensor import HiF8Tensor, MXFP8Tensor


def test_weight_split_then_cat_restores_inner_tensors(weight_kind, make_weight, inner_bits):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    chunks = torch.chunk(t, 2)
    for name, whole in inner_bits(t).items():
        parts = [inner_bits(c)[name] for c in chunks]
        if whole.dim() == 0:  # HiF8 dense: the shared scalar scale
            assert all(torch.equal(p, whole) for p in parts)
        else:
            assert torch.equal(torch.cat(parts), whole), name


def test_weight_new_zeros_equals_quantized_zeros(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    padded_shape = (shape[0] * 2, *shape[1:])
    z = t.new_zeros(padded_shape)
    assert type(z) is cls and z.shape == padded_shape and z.dtype == t.dtype
    assert_same_payload(z, cls.from_high_precision(torch.zeros(padded_shape, dtype=torch.bfloat16)))


def test_weight_new_zeros_of_other_trailing_dims_equals_quantized_zeros(weight_kind, make_weight, assert_same_payload):
    """FSDP2 pads a Shard(1) shard with new_zeros of the shard's [N, K_local]: any shape of the rank."""
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    other = (shape[0], *[d * 2 for d in shape[1:]])
    assert_same_payload(t.new_zeros(other), cls.from_high_precision(torch.zeros(other, dtype=torch.bfloat16)))


def test_weight_new_zeros_rejects_another_rank(weight_kind, make_weight):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    with pytest.raises(NotImplementedError, match="stays"):
        t.new_zeros((2, *shape))


def test_weight_empty_on_meta_has_the_inner_layout_and_allocates_nothing(weight_kind, make_weight):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    meta = cls.empty(shape, logical_dtype=torch.bfloat16, quantizer=t.quantizer, device="meta")
    assert meta.is_meta and meta.shape == t.shape and meta.dtype == t.dtype
    for name in cls.inner_field_names():
        got, want = getattr(meta, name), getattr(t, name)
        assert got.is_meta and got.shape == want.shape and got.dtype == want.dtype, name


def test_weight_to_empty_from_meta_gives_zeroed_weight_on_device(weight_kind, make_weight, assert_same_payload):
    """nn.Module.to_empty sends empty_like(t, device=...) for a meta-built weight."""
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    meta = cls.empty(shape, logical_dtype=torch.bfloat16, quantizer=t.quantizer, device="meta")
    real = torch.empty_like(meta, device="cpu")
    assert type(real) is cls and real.device.type == "cpu"
    assert_same_payload(real, cls.from_high_precision(torch.zeros(shape, dtype=torch.bfloat16)))


def test_weight_dim1_split_then_cat_restores_inner_tensors(make_weight, inner_bits):
    """FSDP2 Shard(1) of a 2D weight: every inner tensor is cut along its last dim (MXFP8 row_scale at
    K_local / 32 codes; HiF8's scalar scale shared)."""
    for cls in (MXFP8Tensor, HiF8Tensor):
        t = cls.from_high_precision(make_weight(96, 256))
        chunks = torch.chunk(t, 4, dim=1)
        assert all(list(c.shape) == [96, 64] for c in chunks)
        for name, whole in inner_bits(t).items():
            parts = [inner_bits(c)[name] for c in chunks]
            if whole.dim() == 0:
                assert all(torch.equal(p, whole) for p in parts)
            else:
                assert torch.equal(torch.cat(parts, dim=-1), whole), (cls.__name__, name)


def test_weight_dim1_slice_of_a_shard_equals_quantizing_its_columns(make_weight, assert_same_payload):
    """MXFP8 blocks along K lie inside a 32-aligned column range, so a K shard's payload is the
    full weight's for those columns: quantizing the columns alone gives the same bytes."""
    w = make_weight(96, 256)
    t = MXFP8Tensor.from_high_precision(w)
    assert_same_payload(t[:, 64:128], MXFP8Tensor.from_high_precision(w[:, 64:128].contiguous()))


def test_mxfp8_dim1_slice_refuses_a_boundary_inside_a_block(make_weight):
    t = MXFP8Tensor.from_high_precision(make_weight(64, 128))
    with pytest.raises(ValueError, match="32-column blocks"):
        t.narrow(1, 16, 32)


def test_weight_3d_refuses_slicing_along_k(make_weight):
    t = MXFP8Tensor.from_high_precision(make_weight(2, 64, 64))
    with pytest.raises(NotImplementedError, match="only dim 0"):
        torch.chunk(t, 2, dim=2)


def test_weight_fsdp2_shard_sequence_keeps_payload(weight_kind, make_weight, assert_same_payload):
    """FSDP2 _init_sharded_param on rank 1 of 2: chunk, pad with new_zeros, narrow + copy_, view(-1)."""
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    chunks = _chunk_with_empty(t, 2, dim=0)
    padded = t.new_zeros(chunks[0].size())
    padded.narrow(0, 0, chunks[1].size(0)).copy_(chunks[1])
    flat = padded.view(-1)
    assert type(flat) is cls and list(flat.shape) == [padded.numel()]
    local = padded.narrow(0, 0, chunks[1].size(0))
    assert_same_payload(local, chunks[1])
    assert flat.view(padded.shape).shape == padded.shape
    with pytest.raises(NotImplementedError, match="flat view"):
        flat.select("row")


def test_weight_fsdp2_dim1_shard_sequence_keeps_payload(make_weight, assert_same_payload):
    """FSDP2 _init_sharded_param with Shard(1) on rank 1 of 4: chunk dim 1, pad with new_zeros,
    narrow(1, ...) + copy_, view(-1)."""
    for cls in (MXFP8Tensor, HiF8Tensor):
        t = cls.from_high_precision(make_weight(64, 256))
        chunks = _chunk_with_empty(t, 4, dim=1)
        padded = t.new_zeros(chunks[0].size())
        padded.narrow(1, 0, chunks[1].size(1)).copy_(chunks[1])
        assert type(padded.view(-1)) is cls
        assert_same_payload(padded.narrow(1, 0, chunks[1].size(1)), chunks[1])


def test_weight_copy_from_same_class_copies_inner_in_place(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    dst = cls.from_high_precision(make_weight(*shape))
    src = cls.from_high_precision(make_weight(*shape))
    ptrs = [x.data_ptr() for x in dst._inner().values()]
    dst.copy_(src)
    assert [x.data_ptr() for x in dst._inner().values()] == ptrs
    assert_same_payload(dst, src)


def test_weight_copy_from_high_precision_requantizes(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    dst = cls.from_high_precision(make_weight(*shape))
    w = make_weight(*shape)
    with torch.no_grad():
        dst.copy_(w)
    assert_same_payload(dst, cls.from_high_precision(w))


@pytest.mark.parametrize("src_cls, dst_cls", [(MXFP8Tensor, HiF8Tensor), (HiF8Tensor, MXFP8Tensor)],
                         ids=["mxfp8_to_hif8", "hif8_to_mxfp8"])
def test_weight_copy_from_other_format_goes_through_logical_values(src_cls, dst_cls, make_weight, assert_same_payload):
    w = make_weight(64, 64)
    src, dst = src_cls.from_high_precision(w), dst_cls.from_high_precision(make_weight(64, 64))
    dst.copy_(src)
    assert_same_payload(dst, dst_cls.from_high_precision(src.dequantize()))


def test_weight_copy_into_high_precision_takes_dequantized_values(weight_kind, make_weight):
    cls, shape = weight_kind
    src = cls.from_high_precision(make_weight(*shape))
    for dtype in (torch.bfloat16, torch.float32):
        dst = torch.zeros(shape, dtype=dtype)
        dst.copy_(src)
        assert type(dst) is torch.Tensor and torch.equal(dst, src.dequantize(dtype))


def test_weight_clone_and_device_move_keep_subclass(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    for copy in (t.clone(), t.to("cpu", copy=True), t.to(device=torch.device("cpu"), copy=True)):
        assert type(copy) is cls
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(copy._inner().values(), t._inner().values()))
        assert_same_payload(copy, t)


def test_weight_dtype_cast_returns_dequantized_plain_tensor(weight_kind, make_weight):
    """Every dtype conversion is a read (TE's QuantizedTensor), the logical dtype included."""
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    for cast, dtype in ((lambda q: q.float(), torch.float32), (lambda q: q.to(torch.float16), torch.float16),
                        (lambda q: q.double(), torch.float64), (lambda q: q.bfloat16(), torch.bfloat16),
                        (lambda q: q.to(torch.bfloat16), torch.bfloat16),
                        (lambda q: q.to("cpu", torch.bfloat16, copy=True), torch.bfloat16)):
        out = cast(t)
        assert type(out) is torch.Tensor and out.dtype == dtype
        assert torch.equal(out, t.dequantize(dtype))
    wide = cls.from_high_precision(make_weight(*shape, dtype=torch.float32))
    assert type(wide.float()) is torch.Tensor and torch.equal(wide.float(), wide.dequantize(torch.float32))


@pytest.mark.parametrize(
    "op, pattern",
    [
        pytest.param(lambda t: t[0], r"aten\.select\.int", id="index"),
        pytest.param(lambda t: t.unsqueeze(0), r"aten\.unsqueeze\.default", id="unsqueeze"),
        pytest.param(lambda t: t.t() if t.dim() == 2 else t.transpose(1, 2), r"aten\.(t\.default|transpose\.int)", id="transpose"),
        pytest.param(lambda t: t.reshape(-1, 8), r"aten\.view\.default", id="reshape"),
        pytest.param(lambda t: torch.split(t.unsqueeze(0) if t.dim() == 2 else t, 16, dim=-1), r"(along dim 2|unsqueeze)",
                     id="split_along_k_of_3d"),
        pytest.param(lambda t: t.masked_fill_(torch.ones(t.shape, dtype=torch.bool), 0), r"aten\.masked_fill_.*writes",
                     id="masked_fill_"),
        pytest.param(lambda t: torch.exp(torch.zeros(t.shape), out=t), r"aten\.exp\.out.*argument out", id="out="),
    ],
)
def test_weight_unsupported_op_raises_naming_it(weight_kind, make_weight, op, pattern):
    """Views and writes without a handler raise at the call (the read-only rest dequantizes)."""
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    with pytest.raises(NotImplementedError, match=rf"{cls.__name__} does not support .*{pattern}"):
        op(t)


def test_weight_equal_and_is_same_size(weight_kind, make_weight):
    cls, shape = weight_kind
    w = make_weight(*shape)
    a, b = cls.from_high_precision(w), cls.from_high_precision(w)
    assert torch.equal(a, b) and a.is_same_size(b)
    assert not torch.equal(a, cls.from_high_precision(w * 2 + 1))


def test_weight_zero_makes_quantized_zeros(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    t.zero_()
    assert_same_payload(t, cls.from_high_precision(torch.zeros(shape, dtype=torch.bfloat16)))


def test_weight_repr_shows_format_and_shapes(weight_kind, make_weight):
    cls, shape = weight_kind
    text = repr(cls.from_high_precision(make_weight(*shape)))
    assert text.startswith(f"{cls.__name__}(format=") and str(list(shape)) in text and "uint8" in text


def test_weight_rejects_1d_weight(weight_kind):
    cls, _ = weight_kind
    with pytest.raises(ValueError, match="2D"):
        cls.from_high_precision(torch.zeros(64))


def test_weight_as_strided_identity_only(weight_kind, make_weight, assert_same_payload):
    """FSDP2 init_unsharded_param: as_strided(post-all-gather tensor, orig size, contiguous stride, 0)."""
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    same = torch.as_strided(t, t.shape, t.stride(), 0)
    assert type(same) is cls
    assert_same_payload(same, t)
    with pytest.raises(NotImplementedError, match="as_strided"):
        torch.as_strided(t, (shape[0] // 2, *shape[1:]), t.stride(), 0)


def test_weight_empty_like_is_quantized_zeros(weight_kind, make_weight, assert_same_payload):
    cls, shape = weight_kind
    t = cls.from_high_precision(make_weight(*shape))
    assert_same_payload(torch.empty_like(t), cls.from_high_precision(torch.zeros(shape, dtype=torch.bfloat16)))
