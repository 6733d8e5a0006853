"""NPU backend: thin wrappers over torch_npu (Ascend 950 / "A5"), imported lazily.

The functions take plain tensors / ``QuantizedOperand`` and never check ``device.type``
themselves (the registry routes ``npu`` tensors here, or every tensor inside
``te_npu.ops.force_backend("npu")``), so tests drive them on CPU tensors through the
vendor-faithful fake ``tests/fakes``.

Scales stay in the kernels' own layouts (``te_npu.ops.layouts``): a quantization kernel's
``mxscale`` output is the operand's scale, and the GEMM kernels read it as is. Only canonical
operands that reach a GEMM (a persistent ``MXFP8Tensor`` weight, or an operand a test built
with the emulation) are converted, with ``layouts.to_npu``: a view for a row scale with an even
block count, one copy (``N * K / 32`` bytes) for a weight's col scale in dgrad.

Input dtypes: no kernel is ever given one it rejects, and no input is rounded on the way:
- ``npu_dynamic_mx_quant_with_dual_axis``, ``npu_grouped_dynamic_mx_quant`` and
  ``npu_dynamic_quant`` take FLOAT16 / BFLOAT16 only (ops-nn ``*_def.cpp`` and their aclnn docs);
- ``npu_dynamic_mx_quant`` (aclnnDynamicMxQuantV3) also takes FLOAT32 (blocksize 32 only):
  FP32 tensors (FP32 master weights at the optimizer refresh, the tiny CPU recipes'
  activations) are quantized as FP32 with two single-axis calls instead of the dual-axis op,
  and a ragged (grouped) FP32 col quantization runs that op on the rows placed at the grouped
  kernel's own pair rows (zero padding, exactly what the emulation's ragged blocks see);
- ``npu_quantize`` (aclnnQuantize) takes FP32 / FP16 / BF16, but "if x is not FP32, the
  scales' dtype must equal x's": a BF16 scale would round the FP32 HiF8 scale, so HiF8 with
  a given scale always sends FP32 (a BF16 / FP16 input is widened first, exactly), with an FP32
  scale of size 1 (per tensor) or E along axis 0 (per expert of a 3D weight: one call, no loop).
Each route computes what the emulation computes from the same high-precision values, bit for
bit: same block amax, same E8M0 scale, same ``x * 2**-e`` cast (MXFP8); same FP32 amax,
``amax * (1.0f / format_max)`` scale and ``x / scale`` round-half-away (HiF8).

HiF8 current scaling: BF16 / FP16 per-tensor goes through ``npu_dynamic_quant`` (pertensor,
``dst_type_max``); its kernel has no zero guard (an all-zero tensor gives scale 0 and NaN codes,
ops-nn ``dynamic_quant_regbase_full_load_pertensor.h``), so an all-zero tensor is fixed here
explicitly, on the device, without a host read: scale 1.0 and code 0x00, as the emulation. A
tensor holding NaN / Inf keeps the kernel's scale and codes (non-finite either way; the
emulation reports scale 1.0 there). Per-expert scales and FP32 inputs take an FP32 amax (torch
ops) and ``npu_quantize``. HiF8 GEMM scales are FP32.

Legend: T rows of a grouped operand, G groups, M/N/K GEMM dims.
"""
from __future__ import annotations

import importlib

import torch

from te_npu.formats import Format, spec
from te_npu.numerics import hif8
from te_npu.numerics.constants import MX_BLOCK_SIZE
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.ops import layouts
from te_npu.ops.operand import QuantizedOperand

__all__ = [
    "NAME",
    "SCALE_LAYOUT",
    "import_torch_npu",
    "matmul",
    "grouped_matmul",
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
]

NAME = "npu"
SCALE_LAYOUT = "npu"
"""Layout of the scales this backend's quantizations return (the kernels' own)."""

# te_npu scale rule -> torch_npu scale_alg. aclnnDynamicMxQuant(V2/V3).md: scaleAlg 0 is the OCP
# floor(log2(amax)) - emax, scaleAlg 1 ("cuBLAS", FP8 dst types only) rounds amax / dst_max up to
# a power of two; the dual-axis op documents the same choice, the grouped op has it from
# aclnnGroupedDynamicMxQuantV2 (CANN 9.1.0, ops-nn !3577 "scale_alg=1时,采用新增cuBLAS算法").
# Every MX quantization call below sends it explicitly (default "ceil" -> 1).
_SCALE_ALG = {"floor": 0, "ceil": 1}
_HALF = (torch.bfloat16, torch.float16)  # what the fused quantization kernels take
_MX_INPUTS = (torch.bfloat16, torch.float16, torch.float32)  # npu_dynamic_mx_quant (V3)
_E4M3 = torch.float8_e4m3fn


def import_torch_npu():
    """The torch_npu module (imported on first NPU use only, never at te_npu import)."""
    return importlib.import_module("torch_npu")


def _require_float(x: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if x.dtype not in allowed:
        raise TypeError(f"{what}: NPU quantization takes {[str(d) for d in allowed]}, got {x.dtype} {tuple(x.shape)}")


def _require_block(block_size: int) -> None:
    if block_size != MX_BLOCK_SIZE:
        raise ValueError(f"te_npu's MX operands use block_size {MX_BLOCK_SIZE} (the MX GEMM's group_k), got {block_size}")


# ---------------------------------------------------------------- GEMMs
def _operands(left: QuantizedOperand, right: QuantizedOperand, layout: str):
    """(x1, x2, x1 scale, x2 scale) in the kernel's [m,k] x [k,n] view, transposes as views;
    a block scale is transposed exactly when its operand is (the kernels check it)."""
    blocked = left.spec.blocked
    ls, rs = (left.scale, right.scale) if blocked else (left.scale.reshape(-1), right.scale.reshape(-1))
    if layout == "NT":  # X[M,K] . W[N,K]^T: x2 = W^T [K,N]; W row scale [N,K/64,2] -> [K/64,N,2]
        return left.data, right.data.transpose(-1, -2), ls, rs.transpose(-3, -2) if blocked else rs
    if layout == "NN":  # dY[M,N] . W[N,K]: W col scale is already [N/64, K, 2]
        return left.data, right.data, ls, rs
    # TN: dY^T[N,M] . X[M,K]: dY col scale [M/64,N,2] -> [N,M/64,2] (transposed like x1)
    return left.data.transpose(-1, -2), right.data, ls.transpose(-3, -2) if blocked else ls, rs


def _format_kwargs(tnpu, fmt: Format, *, grouped: bool) -> dict:
    """The format's torch_npu dtype arguments, from its spec (``te_npu.formats.NpuFormatArgs``)."""
    args, kwargs = spec(fmt).npu, {}
    if args.data_dtype is not None:
        names = ("x_dtype", "weight_dtype") if grouped else ("x1_dtype", "x2_dtype")
        kwargs.update({name: getattr(tnpu, args.data_dtype) for name in names})
    if args.scale_dtype is not None:
        token_scale = "per_token_scale_dtype" if grouped else "pertoken_scale_dtype"
        kwargs.update({"scale_dtype": getattr(tnpu, args.scale_dtype), token_scale: getattr(tnpu, args.scale_dtype)})
    if args.group_sizes is not None and not grouped:
        kwargs["group_sizes"] = list(args.group_sizes)
    return kwargs


def matmul(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> torch.Tensor:
    """Dense GEMM through ``npu_quant_matmul`` (validated operands)."""
    tnpu = import_torch_npu()
    x1, x2, x1_scale, x2_scale = _operands(layouts.to_npu(left), layouts.to_npu(right), layout)
    return tnpu.npu_quant_matmul(x1, x2, x2_scale, pertoken_scale=x1_scale, output_dtype=output_dtype,
                                 **_format_kwargs(tnpu, Format(left.format), grouped=False))


def grouped_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    layout: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Grouped GEMM through ``npu_grouped_matmul`` (validated operands): group_type 0 (m-axis
    groups) for fprop / dgrad, 2 (k-axis groups) for wgrad; ``group_list`` sent as the int64
    cumulative row counts (``group_list_type=0``)."""
    tnpu = import_torch_npu()
    x, weight, x_scale, weight_scale = _operands(layouts.to_npu(left), layouts.to_npu(right), layout)
    group_type = 2 if layout == "TN" else 0
    if not left.spec.blocked:
        num_groups = group_list.numel()
        x_scale = x_scale.expand(x.shape[0] if group_type == 0 else num_groups).contiguous()
        if group_type == 2:  # wgrad: both operands are 2D with one scale each
            weight_scale = weight_scale.expand(num_groups).contiguous()
    outputs = tnpu.npu_grouped_matmul(
        [x],
        [weight],
        scale=[weight_scale],
        per_token_scale=[x_scale],
        group_list=torch.cumsum(group_list, 0),
        group_type=group_type,
        group_list_type=0,
        split_item=3,
        output_dtype=output_dtype,
        **_format_kwargs(tnpu, Format(left.format), grouped=True),
    )
    return outputs[0]


# ---------------------------------------------------------------- MXFP8 quantization
def _dynamic_mx_quant(tnpu, x: torch.Tensor, axis: int, scale_alg: str):
    return tnpu.npu_dynamic_mx_quant(x, axis=axis, round_mode="rint", dst_type=_E4M3, block_size=MX_BLOCK_SIZE,
                                     scale_alg=_SCALE_ALG[scale_alg])


def mxfp8_quantize(x: torch.Tensor, axis: int, block_size: int, scale_alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, kernel-layout scale)`` blocked along ``axis`` (-1 row, -2 col) of ``x [..., M, K]``."""
    if axis not in (-1, -2, x.dim() - 1, x.dim() - 2):
        raise ValueError(f"NPU MX operands are blocked along one of the last two dims, got axis {axis} of {tuple(x.shape)}")
    _require_block(block_size)
    _require_float(x, _MX_INPUTS, "npu_dynamic_mx_quant")
    return _dynamic_mx_quant(import_torch_npu(), x, axis if axis < 0 else axis - x.dim(), scale_alg)


def mxfp8_quantize_dual(w: torch.Tensor, block_size: int, scale_alg: str):
    """(row data, row scale [..., N, K/64, 2], col data, col scale [..., N/64, K, 2]) of ``w [..., N, K]``:
    the dual-axis kernel for BF16 / FP16, two FP32 single-axis calls for FP32 (no BF16 rounding)."""
    _require_block(block_size)
    _require_float(w, _MX_INPUTS, "MXFP8 dual quantization")
    tnpu = import_torch_npu()
    if w.dtype in _HALF:
        return tnpu.npu_dynamic_mx_quant_with_dual_axis(w, round_mode="rint", dst_type=_E4M3,
                                                        scale_alg=_SCALE_ALG[scale_alg])
    row_data, row_scale = _dynamic_mx_quant(tnpu, w, -1, scale_alg)
    col_data, col_scale = _dynamic_mx_quant(tnpu, w, -2, scale_alg)
    return row_data, row_scale, col_data, col_scale


def _padded_rows(group_sizes: torch.Tensor) -> list[int]:
    """Row of each token in the grouped kernel's layout: group g's rows from ``64 * (start_g // 64 + g)``."""
    rows, start = [], 0
    for first_pair, size in zip(layouts.grouped_pair_starts(group_sizes), host_group_sizes(group_sizes)):
        base = layouts.PAIR * first_pair
        rows.extend(range(base, base + size))
        start += size
    return rows


def mxfp8_quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int, scale_alg: str):
    """Ragged col quantization of ``x [T, K]``: ``(data [T, K], scale [T // 64 + G, K, 2])`` in
    the grouped kernel's layout (group g from pair row ``start_g // 64 + g``; see ``layouts``)."""
    _require_block(block_size)
    _require_float(x, _MX_INPUTS, "grouped MXFP8 quantization")
    tnpu = import_torch_npu()
    if x.dtype in _HALF:
        group_index = torch.cumsum(group_sizes, 0).to(torch.int32)
        return tnpu.npu_grouped_dynamic_mx_quant(x, group_index, round_mode="rint", dst_type=_E4M3,
                                                 blocksize=MX_BLOCK_SIZE, scale_alg=_SCALE_ALG[scale_alg])
    # FP32 (no grouped kernel takes it): rows placed at the grouped layout's pair rows, zeros in
    # between (a zero never raises a block amax), then one FP32 col quantization: its scale is
    # already the grouped kernel's [T // 64 + G, K, 2], gaps holding zero blocks.
    index = torch.tensor(_padded_rows(group_sizes), dtype=torch.int64, device=x.device)
    padded = x.new_zeros((layouts.PAIR * layouts.grouped_num_pairs(group_sizes), x.shape[1]))
    padded.index_copy_(0, index, x)
    data, scale = _dynamic_mx_quant(tnpu, padded, -2, scale_alg)
    return data.view(torch.uint8).index_select(0, index).view(_E4M3), scale


# ---------------------------------------------------------------- HiF8 quantization
def hif8_quantize(x: torch.Tensor, format_max: float):
    """Current scaling: ``(codes uint8, scale fp32 [] or [E], amax)`` (amax None where the
    kernel computes it without reporting it)."""
    hif8_spec = spec(Format.HIF8)
    if x.dtype in _HALF and x.dim() >= 2 and hif8_spec.scale_groups(x.dim()) == 0 and x.numel() > 0:
        tnpu = import_torch_npu()
        codes, scale = tnpu.npu_dynamic_quant(x, dst_type=tnpu.hifloat8, quant_mode="pertensor",
                                              dst_type_max=float(format_max))
        # the kernel's all-zero case (scale 0, NaN codes) -> scale 1.0 and zero codes, on device
        zero = scale == 0
        return codes.view(torch.uint8).masked_fill_(zero, 0), scale.masked_fill(zero, 1.0).reshape(()), None
    _require_float(x, _MX_INPUTS, "HiF8 quantization")
    amax = hif8_spec.amax(x)
    scale = hif8.current_scale(amax, format_max)
    return hif8_quantize_with_scale(x, scale), scale, amax


def hif8_quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """HiF8 codes of ``x / scale`` through ``npu_quantize`` (FP32 input and FP32 scale: size 1, or
    ``[E]`` along axis 0 of a 3D ``x``)."""
    _require_float(x, _MX_INPUTS, "npu_quantize")
    tnpu = import_torch_npu()
    per_expert = spec(Format.HIF8).scale_groups(x.dim()) == 1 and scale.dim() == 1
    scales = scale.to(torch.float32).reshape(-1)
    x32 = x if x.dtype == torch.float32 else x.to(torch.float32)  # exact widening
    codes = tnpu.npu_quantize(x32, scales, None, tnpu.hifloat8, axis=0 if per_expert else -1, div_mode=True)
    return codes.view(torch.uint8)
