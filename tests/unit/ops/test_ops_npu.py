"""NPU wrappers (te_npu/ops/npu.py) through the vendor-faithful fake torch_npu (tests/fakes).

The fake is written from Ascend's sources (it imports nothing of te_npu): it binds every call to
the wheel's schema, rejects what the kernels reject, computes as the kernels compute and returns
the kernels' layouts with never-written bytes poisoned. Against it, every quantization equals the
emulation bit for bit (codes, and scales once read through ``te_npu.ops.layouts``), and every
GEMM too (both sides multiply FP32-decoded operands with torch's CPU FP32 matmul on identically
laid-out operands, so for these shapes even the summation order agrees).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_npu
import te_npu.ops as ops
from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import Format
from te_npu.numerics import hif8
from te_npu.ops import emulation, layouts, npu, registry
from te_npu.testing import count_host_syncs
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer
from te_npu.tensor import HiF8Tensor, MXFP8Tensor
from tests.npu_backend import install_npu_backend

FORMATS = [Format.MXFP8_E4M3, Format.HIF8]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# splits with empty groups, groups not a multiple of 32 or 64, and [64, 64] (kernel pair rows 0, 2)
SPLITS = {"empty_uneven": [40, 0, 35], "pairs_64_64": [64, 64], "odd_blocks": [33, 31, 1], "all_in_last": [0, 0, 130]}
ORIENT = {"NT": ("row", "row"), "NN": ("row", "col"), "TN": ("col", "col")}


@pytest.fixture
def fake(monkeypatch):
    return install_npu_backend(monkeypatch)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def _rand(gen, *shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen) * 2).to(dtype)


def _quantizer(fmt, grad=False):
    return MXFP8Quantizer() if fmt == Format.MXFP8_E4M3 else HiF8Quantizer(224.0 if grad else 15.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.view(torch.uint8)


def assert_same_operand(npu_op, emu_op):
    """Codes bitwise, scales bitwise in the canonical layout (the kernel layout read back)."""
    assert npu_op.scale_layout == ("npu" if npu_op.spec.blocked else "canonical")
    canonical = layouts.to_canonical(npu_op)
    assert torch.equal(_bits(canonical.data), _bits(emu_op.data))
    assert torch.equal(_bits(canonical.scale), _bits(emu_op.scale)) and canonical.scale.shape == emu_op.scale.shape


def on_npu(fn, *args, **kwargs):
    with ops.force_backend("npu"):
        return fn(*args, **kwargs)


# ---------------------------------------------------------------- kernel layouts
def test_grouped_layout_places_group_g_at_pair_row_start_over_64_plus_g():
    """[64, 64]: group 1 starts at pair row 1 + 1 = 2 (ops-nn grouped_dynamic_mx_quant_combine.h
    ``groupStart / 64 + groupIdx``); te_npu's old back-to-back packing put it at 1."""
    sizes = torch.tensor([64, 64])
    assert layouts.grouped_pair_starts(sizes) == [0, 2] and layouts.grouped_num_pairs(sizes) == 4
    assert layouts.grouped_pair_starts(torch.tensor([40, 0, 35, 100])) == [0, 1, 2, 4]


@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
def test_grouped_layout_round_trips_and_never_reads_gaps(gen, sizes):
    group_sizes = torch.tensor(sizes)
    blocks = sum(-(-s // 32) for s in sizes)
    scale = torch.randint(1, 255, (blocks, 8), generator=gen, dtype=torch.uint8)
    for poison in (0, 0xFF):
        native = layouts.npu_grouped_scale(scale, group_sizes, fill=poison)
        assert native.shape == (sum(sizes) // 64 + len(sizes), 8, 2)
        assert torch.equal(layouts.canonical_grouped_scale(native, group_sizes), scale)


def test_grouped_kernel_output_read_back_only_from_owned_pair_rows(fake, gen):
    """The fake poisons the rows the kernel never writes; the canonical read-back never sees them."""
    x, sizes = _rand(gen, 130, 64), torch.tensor([64, 64, 2])
    op = on_npu(ops.quantize_mxfp8, x, "col", group_sizes=sizes)
    assert op.scale.shape == (130 // 64 + 3, 64, 2)
    assert torch.equal(layouts.to_canonical(op).scale, ops.quantize_mxfp8(x, "col", group_sizes=sizes).scale)
    # pair rows 1 (after group 0), 3 (after group 1) and group 2's second slot are not written:
    # whatever they hold, the GEMM reads group g from pair row start_g // 64 + g
    assert layouts.grouped_pair_starts(sizes) == [0, 2, 4]


@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
def test_dense_layouts_round_trip(gen, blocks):
    row = torch.randint(0, 255, (5, blocks), generator=gen, dtype=torch.uint8)
    assert layouts.npu_row_scale(row).shape == (5, (blocks + 1) // 2, 2)
    assert torch.equal(layouts.canonical_row_scale(layouts.npu_row_scale(row), 32 * blocks), row)
    col = torch.randint(0, 255, (2, blocks, 6), generator=gen, dtype=torch.uint8)
    native = layouts.npu_col_scale(col)
    assert native.shape == (2, (blocks + 1) // 2, 6, 2) and torch.equal(native[:, 0, :, 0], col[:, 0])
    assert torch.equal(layouts.canonical_col_scale(native, 32 * blocks), col)


# ---------------------------------------------------------------- quantization == emulation
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("orientation", ["row", "col"])
def test_mxfp8_quantize_equals_emulation(fake, gen, dtype, orientation):
    x = _rand(gen, 96, 160, dtype=dtype)
    assert_same_operand(on_npu(ops.quantize_mxfp8, x, orientation), ops.quantize_mxfp8(x, orientation))
    (call,) = fake.calls_of("npu_dynamic_mx_quant")
    assert call.bound["axis"] == (-1 if orientation == "row" else -2) and call.bound["dst_type"] == 24  # e4m3
    assert call.bound["block_size"] == 32 and call.bound["scale_alg"] == 1 and call.bound["round_mode"] == "rint"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp8_dual_equals_emulation_and_takes_fp32_through_single_axis_calls(fake, gen, dtype):
    """The dual-axis kernel takes FP16 / BF16 only: FP32 goes through two npu_dynamic_mx_quant
    calls (aclnnDynamicMxQuantV3 takes FLOAT32), never cast to BF16 first."""
    w = _rand(gen, 2, 96, 64, dtype=dtype)
    for got, want in zip(on_npu(ops.quantize_mxfp8_dual, w), ops.quantize_mxfp8_dual(w)):
        assert_same_operand(got, want)
    dual, single = fake.calls_of("npu_dynamic_mx_quant_with_dual_axis"), fake.calls_of("npu_dynamic_mx_quant")
    if dtype == torch.float32:
        assert not dual and [c.bound["axis"] for c in single] == [-1, -2]
        assert all(c.bound["input"].dtype == torch.float32 for c in single)
    else:
        assert len(dual) == 1 and not single and dual[0].bound["input"].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
def test_mxfp8_grouped_quantize_equals_emulation(fake, gen, dtype, sizes):
    x, group_sizes = _rand(gen, sum(sizes), 64, dtype=dtype), torch.tensor(sizes)
    got = on_npu(ops.quantize_mxfp8, x, "col", group_sizes=group_sizes)
    assert got.scale.shape == (sum(sizes) // 64 + len(sizes), 64, 2)  # the kernel's own layout
    assert_same_operand(got, ops.quantize_mxfp8(x, "col", group_sizes=group_sizes))
    grouped = fake.calls_of("npu_grouped_dynamic_mx_quant")
    if dtype == torch.float32:  # no grouped kernel takes FP32: rows placed at the pair rows, one col call
        assert not grouped and fake.calls_of("npu_dynamic_mx_quant")[0].bound["input"].dtype == torch.float32
    else:
        (call,) = grouped
        cumsum = torch.cumsum(group_sizes, 0)
        assert call.bound["group_index"].dtype == torch.int32 and torch.equal(call.bound["group_index"], cumsum.to(torch.int32))
        assert call.bound["blocksize"] == 32 and call.bound["dst_type"] == 24


def _scale_rule_stress(gen, rows: int, cols: int, dtype, *, tiny: bool = True) -> torch.Tensor:
    """[rows, cols] with blocks (both ways) whose amax is exactly 448 * 2**k, just above it, zero,
    and (``tiny``) below 448 * 2**-127 (scale code 0 under the ceil rule): where the rules part ways."""
    x = _rand(gen, rows, cols, dtype=torch.float32)
    x[0, :32], x[1, 32:64] = 448.0 * 2.0**-3, 449.0 * 2.0**5
    if tiny and dtype != torch.float16:  # fp16 cannot hold them
        x[32:64, 32:64] *= 2.0**-128
    x[2, 64:96] = 0.0
    x[3, 96:128], x[64:96, 0] = 448.0, 500.0
    return x.to(dtype)


def test_floor_rule_tiny_blocks_are_zeroed_by_the_kernel_not_by_the_emulation(fake, gen):
    """A known difference of the floor rule only (the ceil default has none): blocks whose floor
    exponent clamps to code 0 (amax < 2**-118) get zero elements from npu_dynamic_mx_quant (its zero
    mask on the shared exponent, tests/fakes/mx_block.py), x * 2**127 from the emulation."""
    x = _scale_rule_stress(gen, 64, 64, torch.bfloat16)
    for alg, differs in (("floor", True), ("ceil", False)):
        q = MXFP8Quantizer(scale_alg=alg)
        got, want = layouts.to_canonical(on_npu(q.quantize, x, orientation="row")), q.quantize(x, orientation="row")
        assert torch.equal(got.scale, want.scale)
        same = _bits(got.data) == _bits(want.data)
        assert bool(same[:32].all()) and bool(same[32:, :32].all()) and bool(same[32:, 32:].all()) != differs
        if differs:
            assert bool((got.data[32:, 32:].float() == 0).all())  # signed zeros


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale_alg, code", [(None, 1), ("ceil", 1), ("floor", 0)], ids=["default", "ceil", "floor"])
def test_every_mx_quantization_call_sends_the_recipe_scale_rule_and_equals_emulation(fake, gen, dtype, scale_alg, code):
    """Dense (row / col), dual-axis and grouped MX quantization: each vendor call carries
    ``scale_alg=1`` (round-up, the default) unless floor was chosen (0), and the fake -- which
    computes scale_alg 1 as the kernels do, S = amax * fp32(1/448) rounded up -- equals the
    emulation bit for bit on blocks where the two rules differ."""
    q = MXFP8Quantizer() if scale_alg is None else MXFP8Quantizer(scale_alg=scale_alg)
    x = _scale_rule_stress(gen, 128, 160, dtype, tiny=scale_alg != "floor")
    sizes = torch.tensor([40, 0, 88])
    for orientation in ("row", "col"):
        assert_same_operand(on_npu(q.quantize, x, orientation=orientation), q.quantize(x, orientation=orientation))
    for got, want in zip(on_npu(q.quantize_dual, x), q.quantize_dual(x)):
        assert_same_operand(got, want)
    assert_same_operand(on_npu(q.quantize, x, orientation="col", group_list=sizes),
                        q.quantize(x, orientation="col", group_list=sizes))
    names = ("npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis", "npu_grouped_dynamic_mx_quant")
    calls = [c for name in names for c in fake.calls_of(name)]
    assert len(calls) >= 4 and {c.bound["scale_alg"] for c in calls} == {code}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(96, 160), (3, 32, 160)], ids=["dense", "experts"])
@pytest.mark.parametrize("format_max", [15.0, 224.0])
def test_hif8_quantize_equals_emulation(fake, gen, dtype, shape, format_max):
    x = _rand(gen, *shape, dtype=dtype)
    got = on_npu(ops.quantize_hif8, x, format_max)
    assert_same_operand(got, ops.quantize_hif8(x, format_max))
    assert got.scale.dtype == torch.float32 and got.scale.shape == shape[:len(shape) - 2]
    if dtype != torch.float32 and len(shape) == 2:
        (call,) = fake.calls_of("npu_dynamic_quant")
        assert call.bound["quant_mode"] == "pertensor" and call.bound["dst_type_max"] == format_max
        assert call.bound["dst_type"] == fake.hifloat8 and not fake.calls_of("npu_quantize")
    else:  # FP32 or per-expert: FP32 amax + one npu_quantize with an FP32 scale (no loop over experts)
        (call,) = fake.calls_of("npu_quantize")
        b = call.bound
        x_arg, scales, dtype_code, axis, div_mode = b["input"], b["scales"], b["dtype"], b["axis"], b["div_mode"]
        assert x_arg.dtype == scales.dtype == torch.float32 and dtype_code == fake.hifloat8
        assert scales.shape == ((shape[0],) if len(shape) == 3 else (1,))
        assert axis == (0 if len(shape) == 3 else -1) and div_mode is True
        assert not fake.calls_of("npu_dynamic_quant")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hif8_all_zero_tensor_gets_scale_one_and_zero_codes(fake, dtype):
    """The per-tensor kernel has no zero guard (scale 0, codes 0/0 = NaN); te_npu fixes it on the
    device, with no host read, to the emulation's scale 1.0 and code 0x00."""
    zeros = torch.zeros(64, 64, dtype=dtype)
    got = on_npu(ops.quantize_hif8, zeros, 15.0)
    assert got.scale.item() == 1.0 and torch.all(got.data == 0)
    assert_same_operand(got, ops.quantize_hif8(zeros, 15.0))
    if dtype != torch.float32:  # what the kernel alone returns
        codes, scale = fake.npu_dynamic_quant(zeros, dst_type=fake.hifloat8, quant_mode="pertensor", dst_type_max=15.0)
        assert scale.item() == 0.0 and torch.all(codes == 0x80)
    with count_host_syncs() as syncs:
        on_npu(ops.quantize_hif8, zeros, 15.0)
    assert syncs.total == 0, syncs.calls


def test_hif8_quantize_with_scale_widens_bf16_to_fp32(fake, gen):
    """aclnnQuantize: a non-FP32 x needs a scale of x's dtype (a BF16 scale would round it): x is
    widened to FP32 (exact) and the scale stays FP32."""
    x = _rand(gen, 32, 64)
    scale = hif8.current_scale(x.float().abs().amax(), 15.0)
    got = on_npu(ops.quantize_hif8_with_scale, x, scale)
    assert torch.equal(got.data, ops.quantize_hif8_with_scale(x, scale).data)
    (call,) = fake.calls_of("npu_quantize")
    assert call.bound["input"].dtype == torch.float32 and call.bound["scales"].dtype == torch.float32


# ---------------------------------------------------------------- GEMMs == emulation
SHAPES = {"NT": ((64, 128), (96, 128)), "NN": ((64, 96), (96, 128)), "TN": ((64, 96), (64, 128))}


def _dense(gen, fmt, layout, dtype=torch.bfloat16):
    (ls, rs), (lo, ro) = SHAPES[layout], ORIENT[layout]
    a, b = _rand(gen, *ls, dtype=dtype), _rand(gen, *rs, dtype=dtype)
    q = _quantizer(fmt)

    def make():
        return q.quantize(a, orientation=lo), q.quantize(b, orientation=ro)

    return make


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_gemm_equals_emulation(fake, gen, fmt, layout, out_dtype):
    make = _dense(gen, fmt, layout)
    want = ops.low_precision_matmul(*make(), layout=layout, output_dtype=out_dtype)
    got = on_npu(lambda: ops.low_precision_matmul(*make(), layout=layout, output_dtype=out_dtype))
    assert torch.equal(got, want)
    (call,) = fake.calls_of("npu_quant_matmul")
    x1, x2 = call.bound["x1"], call.bound["x2"]
    assert (layout == "NT") == (not x2.is_contiguous()) and (layout == "TN") == (not x1.is_contiguous())
    if fmt == Format.MXFP8_E4M3:
        assert call.bound["group_sizes"] == [1, 1, 32]
        assert call.bound["scale_dtype"] == call.bound["pertoken_scale_dtype"] == fake.float8_e8m0fnu
    else:
        assert call.bound["x1_dtype"] == call.bound["x2_dtype"] == fake.hifloat8
        assert call.bound["scale"].shape == (1,) and call.bound["pertoken_scale"].shape == (1,)


def _grouped(gen, fmt, layout, sizes, dtype=torch.bfloat16):
    q, gq = _quantizer(fmt), _quantizer(fmt, grad=True)
    group_list, tokens = torch.tensor(sizes), sum(sizes)
    if layout == "TN":
        dy, x = _rand(gen, tokens, 64, dtype=dtype), _rand(gen, tokens, 96, dtype=dtype)
        return lambda: (gq.quantize(dy, orientation="col", group_list=group_list),
                        q.quantize(x, orientation="col", group_list=group_list)), group_list
    x = _rand(gen, tokens, 96 if layout == "NT" else 64, dtype=dtype)
    w = _rand(gen, len(sizes), 64, 96, dtype=dtype)
    return lambda: (q.quantize(x, orientation="row"), q.quantize(w, orientation=ORIENT[layout][1])), group_list


@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_grouped_gemm_equals_emulation(fake, gen, fmt, layout, sizes):
    """fprop / dgrad / wgrad: the wgrad reads group g's block scales at pair row cumK_g / 64 + g,
    exactly where the grouped quantization wrote them."""
    make, group_list = _grouped(gen, fmt, layout, sizes)
    want = ops.low_precision_grouped_matmul(*make(), group_list, layout=layout, output_dtype=torch.float32)
    got = on_npu(lambda: ops.low_precision_grouped_matmul(*make(), group_list, layout=layout,
                                                          output_dtype=torch.float32))
    rows = slice(None) if layout == "TN" else slice(0, sum(sizes))
    assert torch.equal(got[rows], want[rows])
    (call,) = fake.calls_of("npu_grouped_matmul")
    kw = call.bound
    assert torch.equal(kw["group_list"], torch.cumsum(group_list, 0)) and kw["group_list_type"] == 0
    assert kw["group_type"] == (2 if layout == "TN" else 0) and kw["split_item"] == 3


def test_kernel_scale_goes_into_the_gemm_without_a_round_trip(fake, gen):
    """The wgrad GEMM receives the grouped quantization kernel's own mxscale tensors (same storage)."""
    make, group_list = _grouped(gen, Format.MXFP8_E4M3, "TN", [40, 0, 35])
    with ops.force_backend("npu"):
        left, right = make()
        ops.low_precision_grouped_matmul(left, right, group_list, layout="TN", output_dtype=torch.float32)
    (call,) = fake.calls_of("npu_grouped_matmul")
    kernel_scales = [c for c in fake.calls_of("npu_grouped_dynamic_mx_quant")]
    assert len(kernel_scales) == 2
    assert call.bound["per_token_scale"][0].data_ptr() == left.scale.data_ptr()
    assert call.bound["scale"][0].data_ptr() == right.scale.data_ptr()


# ---------------------------------------------------------------- refresh from FP32 masters
@pytest.mark.parametrize("shape", [(96, 64), (2, 64, 96)], ids=["dense", "experts"])
def test_mxfp8_refresh_from_fp32_master_equals_emulation(fake, gen, shape):
    master = _rand(gen, *shape, dtype=torch.float32)
    w_npu = MXFP8Tensor.from_high_precision(_rand(gen, *shape))
    w_emu = MXFP8Tensor.from_high_precision(_rand(gen, *shape))
    fake.calls.clear()
    on_npu(w_npu.refresh_from_master, master)
    w_emu.refresh_from_master(master)
    for name in MXFP8Tensor._inner_fields:
        assert torch.equal(_bits(getattr(w_npu, name)), _bits(getattr(w_emu, name))), name
    assert [c.name for c in fake.calls] == ["npu_dynamic_mx_quant"] * 2  # FP32: never the dual-axis kernel


@pytest.mark.parametrize("shape", [(96, 64), (3, 64, 96)], ids=["dense", "experts"])
def test_hif8_refresh_from_fp32_master_equals_emulation(fake, gen, shape):
    master = _rand(gen, *shape, dtype=torch.float32)
    master[0] = 0.0  # an all-zero expert: scale 1.0 on both
    w_npu, w_emu = (HiF8Tensor.from_high_precision(_rand(gen, *shape)) for _ in range(2))
    fake.calls.clear()
    on_npu(w_npu.refresh_from_master, master)
    w_emu.refresh_from_master(master)
    assert torch.equal(w_npu.qdata, w_emu.qdata) and torch.equal(w_npu.scale, w_emu.scale)
    assert [c.name for c in fake.calls] == ["npu_quantize"]  # one call, even per expert


def test_optimizer_refresh_runs_through_the_npu_wrappers(fake, gen):
    """refresh_low_precision_weights (the optimizer step's refresh), both formats, no rejected input."""
    from te_npu.distributed.optim import refresh_low_precision_weights

    for cls, shape in ((MXFP8Tensor, (64, 96)), (HiF8Tensor, (64, 96)), (HiF8Tensor, (2, 64, 96))):
        master = _rand(gen, *shape, dtype=torch.float32)
        w_npu, w_emu = cls.from_high_precision(_rand(gen, *shape)), cls.from_high_precision(_rand(gen, *shape))
        on_npu(refresh_low_precision_weights, [w_npu], [master])
        refresh_low_precision_weights([w_emu], [master])
        assert all(torch.equal(_bits(getattr(w_npu, n)), _bits(getattr(w_emu, n))) for n in cls._inner_fields)


# ---------------------------------------------------------------- failure semantics
def _forbid_high_precision(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("high-precision GEMM ran")

    for target, name in ((torch, "mm"), (torch, "matmul"), (F, "linear"), (torch, "_grouped_mm")):
        monkeypatch.setattr(target, name, boom)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_kernel_error_propagates_without_fallback(fake, gen, monkeypatch, fmt):
    make = _dense(gen, fmt, "NT")
    grouped, group_list = _grouped(gen, fmt, "NN", [10, 20, 3])
    with ops.force_backend("npu"):
        (left, right), (gl, gr) = make(), grouped()
        _forbid_high_precision(monkeypatch)
        fake.fail("npu_quant_matmul", RuntimeError("aclnnQuantMatmulV5 failed: 561103"))
        fake.fail("npu_grouped_matmul", RuntimeError("aclnnGroupedMatmulV4 failed"))
        with pytest.raises(RuntimeError, match="561103"):
            ops.low_precision_matmul(left, right, layout="NT", output_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="aclnnGroupedMatmulV4"):
            ops.low_precision_grouped_matmul(gl, gr, group_list, layout="NN", output_dtype=torch.bfloat16)


def test_npu_backend_is_reported_in_events(fake, gen):
    make = _dense(gen, Format.HIF8, "NN")
    events = []
    with te_npu.events.subscribe(events.append), ops.force_backend("npu"):
        ops.low_precision_matmul(*make(), layout="NN", output_dtype=torch.float32)
    assert [(type(e).__name__, e.backend) for e in events] == [("QuantEvent", "npu")] * 2 + [("GemmEvent", "npu")]


def test_force_backend_nests_and_restores():
    assert registry.backend_for("cpu") is emulation and registry.backend_for("npu:0") is npu
    with ops.force_backend("npu"):
        assert registry.backend_for("cpu") is npu
        with ops.force_backend("emulation"):
            assert registry.backend_for("npu:0") is emulation
        assert registry.forced_backend() == "npu"
    assert registry.forced_backend() is None and registry.backend_for("cpu", override="npu") is npu
    with pytest.raises(ValueError, match="unknown backend"), ops.force_backend("gpu"):
        pass


# ---------------------------------------------------------------- capability gate
def test_capability_without_torch_npu_is_false_and_never_raises(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # import raises ImportError
    ok, reason = ops.is_mxfp8_available(return_reason=True)
    assert not ok and "torch_npu" in reason and ops.is_hif8_available() is False
    assert ops.require_low_precision("hif8", "cpu") == "emulation"
    with pytest.raises(LowPrecisionUnavailableError, match="not importable"):
        ops.require_low_precision(Format.MXFP8_E4M3, "npu")


def test_capability_on_an_ascend_950dt_with_cann_9_2(fake):
    assert ops.is_mxfp8_available(return_reason=True) == (True, "mxfp8_e4m3 NPU kernels available")
    assert ops.is_hif8_available()
    assert ops.require_low_precision("mxfp8_e4m3", "npu:0") == "npu"
    with ops.force_backend("npu"):
        assert ops.require_low_precision("hif8", "cpu") == "npu"  # the forced backend is gated too


@pytest.mark.parametrize("options, fmt, match", [
    (dict(chip="Ascend910B3"), "hif8", "needs an Ascend950 .*Ascend910B3 \\(SoC version 223\\)"),
    (dict(chip="Ascend910B3"), "mxfp8_e4m3", "needs an Ascend950DT"),
    (dict(chip="Ascend950PR_9579"), "mxfp8_e4m3", "950DT only.*Ascend950PR_9579"),
    (dict(cann_version="9.0.0"), "mxfp8_e4m3", "CANN >= 9.1.0 for FP32 input to npu_dynamic_mx_quant.*9.0.0"),
    (dict(without_kernels=["aclnnDynamicQuantV4"]), "hif8", "lack the aclnn kernel\\(s\\) aclnnDynamicQuantV4"),
    (dict(without_kernels=["aclnnGroupedDynamicMxQuantV2"]), "mxfp8_e4m3", "aclnnGroupedDynamicMxQuantV2"),
    (dict(device_count=0), "hif8", "no NPU device is visible"),
], ids=["hif8_on_910b", "mxfp8_on_910b", "mxfp8_on_950pr", "mxfp8_cann_9_0", "no_dynamic_quant_v4",
        "no_grouped_mx_quant_v2", "no_device"])
def test_capability_names_the_missing_chip_cann_or_kernel(monkeypatch, options, fmt, match):
    install_npu_backend(monkeypatch, **options)
    ok, reason = (ops.is_mxfp8_available if fmt == "mxfp8_e4m3" else ops.is_hif8_available)(return_reason=True)
    assert not ok
    with pytest.raises(LowPrecisionUnavailableError, match=match):
        ops.require_low_precision(fmt, "npu:0")


def test_hif8_runs_on_an_ascend_950pr(monkeypatch):
    install_npu_backend(monkeypatch, chip="Ascend950PR_9579")
    assert ops.is_hif8_available() and not ops.is_mxfp8_available()


def test_te_module_raises_at_first_use_when_the_gate_fails(monkeypatch):
    install_npu_backend(monkeypatch, chip="Ascend910B3")
    lin = te_npu.TELinear(64, 64, bias=False, params_dtype=torch.bfloat16)
    with ops.force_backend("npu"), te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
        with pytest.raises(LowPrecisionUnavailableError, match="Ascend910B3"):
            lin(torch.randn(32, 64, dtype=torch.bfloat16))
