"""NPU backend: thin wrappers over torch_npu (Ascend 950 / "A5"), imported lazily.

The functions take plain tensors / ``QuantizedOperand`` and never check ``device.type``
themselves (the registry routes ``npu`` tensors here), so tests drive them on CPU tensors
through the recording fake ``tests/fakes/torch_npu.py``.

Sources (Ascend/op-plugin docs, torch_npu API reference for Ascend 950PR/950DT):
- ``npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=..., block_size=32,
  scale_alg=0, dst_type_max=0.0)`` -> (y, mxscale uint8); mxscale has rank+1, the blocked
  axis holds ceil(ceil(n/32)/2) pairs and a trailing dim of 2 (zero-padded to even).
  ``dst_type`` code 24 = ``torch.float8_e4m3fn`` (the docs' examples pass the torch dtype).
  ``scale_alg`` 0 = OCP floor (our "floor"), 1 = cuBLAS-style ceil (our "ceil").
- ``npu_dynamic_mx_quant_with_dual_axis(input, *, round_mode, dst_type, scale_alg,
  dst_type_max)`` -> (y1, mxscale1, y2, mxscale2): y1/mxscale1 blocked along -1
  ([..., M, ceil(K/64), 2]), y2/mxscale2 along -2 ([..., ceil(M/64), N, 2], two block rows
  interleaved in the trailing pair).
- ``npu_grouped_dynamic_mx_quant(x, group_index int32 cumsum, *, round_mode, dst_type,
  blocksize=32, scale_alg)`` (note: ``blocksize`` here, ``block_size`` above) -> (y, mxscale
  [m/64 + g, n, 2]); each group's blocks are padded to an even count, groups follow each other,
  trailing pairs are zero.
- ``npu_quant_matmul(x1, x2, scale, *, pertoken_scale, output_dtype, x1_dtype, x2_dtype,
  pertoken_scale_dtype, scale_dtype, group_sizes)``: MX mode = e4m3 x1 [m,k], x2 [k,n],
  ``scale`` (x2) [ceil(k/64), n, 2], ``pertoken_scale`` (x1) [m, ceil(k/64), 2], both with
  ``*_dtype=torch_npu.float8_e8m0fnu`` and ``group_sizes=[1, 1, 32]``; a scale's transpose
  must match its operand's. HiF8 T-T mode: uint8 data with ``x1_dtype=x2_dtype=
  torch_npu.hifloat8``, fp32 ``scale``/``pertoken_scale`` of shape (1,);
  out = x1 @ x2 * scale * pertoken_scale.
- ``npu_grouped_matmul(x, weight, *, scale, per_token_scale, group_list, group_type,
  group_list_type, split_item, output_dtype, scale_dtype, per_token_scale_dtype, x_dtype,
  weight_dtype)``: group_type 0 groups the m axis (fprop/dgrad), 2 the k axis (wgrad,
  usage seen in torchao-npu / MindSpeed, not in the op-plugin doc version we found);
  group_list_type 0 = cumsum (the default, used by every reference), 1 = counts. We always
  send cumsum with group_list_type=0. split_item=3 -> one output tensor.
- ``npu_dynamic_quant(input, *, dst_type=torch_npu.hifloat8, quant_mode="pertensor",
  dst_type_max=<15 or 224>)`` -> (y, scale [1]); scale = amax / dst_type_max.
- ``npu_quantize(input, scales, zero_points, dtype, axis, div_mode=True)`` for a given
  scale; hifloat8 support on 950 is assumed (not stated in the docs we found).
Assumption: for an all-zero (or non-finite) tensor the kernel's pertensor scale is replaced by
1.0 as our numerics require (data of an all-zero tensor is zero whatever the scale).
"""
from __future__ import annotations

import importlib
import math

import torch

from te_npu.formats import Format
from te_npu.numerics.constants import MX_BLOCK_SIZE
from te_npu.numerics.groups import host_group_sizes
from te_npu.tensor.operand import QuantizedOperand

__all__ = [
    "NAME",
    "import_torch_npu",
    "to_npu_row_scale",
    "from_npu_row_scale",
    "to_npu_col_scale",
    "from_npu_col_scale",
    "to_npu_grouped_scale",
    "from_npu_grouped_scale",
    "matmul",
    "grouped_matmul",
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
]

NAME = "npu"
MX_GROUP_SIZES = [1, 1, MX_BLOCK_SIZE]  # [group_m, group_n, group_k] of the MX quant-matmul mode
_SCALE_ALG = {"floor": 0, "ceil": 1}


def import_torch_npu():
    """The torch_npu module (imported on first NPU use only, never at te_npu import)."""
    return importlib.import_module("torch_npu")


# ---------------------------------------------------------------- scale layouts
# Ours: uint8 E8M0 codes with the blocked axis divided by 32 (``[..., M, K/32]`` row,
# ``[..., M/32, N]`` col). torch_npu: block pairs ``(2p, 2p+1)`` in a trailing dim of 2.
def _pad_even(scale: torch.Tensor, dim: int) -> torch.Tensor:
    if scale.shape[dim] % 2 == 0:
        return scale
    pad_shape = list(scale.shape)
    pad_shape[dim] = 1
    return torch.cat([scale, scale.new_zeros(pad_shape)], dim=dim)


def to_npu_row_scale(scale: torch.Tensor) -> torch.Tensor:
    """``[..., M, nb]`` -> ``[..., M, ceil(nb/2), 2]`` (odd nb padded with a zero code)."""
    padded = _pad_even(scale, -1)
    return padded.unflatten(-1, (padded.shape[-1] // 2, 2))


def from_npu_row_scale(npu_scale: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of ``to_npu_row_scale`` for a blocked axis of ``length`` elements."""
    return npu_scale.flatten(-2).narrow(-1, 0, math.ceil(length / MX_BLOCK_SIZE))


def to_npu_col_scale(scale: torch.Tensor) -> torch.Tensor:
    """``[..., nb, N]`` -> ``[..., ceil(nb/2), N, 2]`` with ``out[..., p, n, j] = in[..., 2p+j, n]``."""
    padded = _pad_even(scale, -2)
    pairs = padded.unflatten(-2, (padded.shape[-2] // 2, 2))  # [..., P, 2, N]
    return pairs.transpose(-1, -2).contiguous()


def from_npu_col_scale(npu_scale: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of ``to_npu_col_scale`` for a blocked axis of ``length`` elements."""
    blocks = npu_scale.transpose(-1, -2).flatten(-3, -2)  # [..., 2P, N]
    return blocks.narrow(-2, 0, math.ceil(length / MX_BLOCK_SIZE)).contiguous()


def _group_blocks(group_sizes: torch.Tensor) -> list[int]:
    return [math.ceil(t / MX_BLOCK_SIZE) for t in host_group_sizes(group_sizes)]


def to_npu_grouped_scale(scale: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Ragged col ``[num_blocks, K]`` -> ``[T // 64 + G, K, 2]`` (per-group even padding)."""
    total_rows = sum(host_group_sizes(group_sizes)) // (2 * MX_BLOCK_SIZE) + group_sizes.numel()
    pieces, start = [], 0
    for blocks in _group_blocks(group_sizes):
        pieces.append(_pad_even(scale[start : start + blocks], 0))
        start += blocks
    flat = torch.cat(pieces, dim=0) if pieces else scale[:0]
    flat = torch.cat([flat, flat.new_zeros(2 * total_rows - flat.shape[0], scale.shape[1])], dim=0)
    return to_npu_col_scale(flat)


def from_npu_grouped_scale(npu_scale: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_npu_grouped_scale``."""
    flat = npu_scale.transpose(-1, -2).flatten(-3, -2)  # [2 * rows, K]
    pieces, start = [], 0
    for blocks in _group_blocks(group_sizes):
        pieces.append(flat[start : start + blocks])
        start += blocks + blocks % 2
    return torch.cat(pieces, dim=0).contiguous() if pieces else flat[:0].contiguous()


def _npu_scale(op: QuantizedOperand) -> torch.Tensor:
    if op.group_sizes is not None:
        return to_npu_grouped_scale(op.scale, op.group_sizes)
    return to_npu_row_scale(op.scale) if op.orientation == "row" else to_npu_col_scale(op.scale)


# ---------------------------------------------------------------- GEMMs
def _operands(left: QuantizedOperand, right: QuantizedOperand, layout: str):
    """(x1, x2, x1 scale, x2 scale) in the kernel's [m,k] x [k,n] view, transposes as views."""
    if Format(left.format) == Format.HIF8:
        ls, rs = left.scale.reshape(-1), right.scale.reshape(-1)
    else:
        ls, rs = _npu_scale(left), _npu_scale(right)
    if layout == "NT":  # X[M,K] . W[N,K]^T: x2 = W^T [K,N]; W row scale [N,K/64,2] -> [K/64,N,2]
        x2_scale = rs if Format(left.format) == Format.HIF8 else rs.transpose(-3, -2)
        return left.data, right.data.transpose(-1, -2), ls, x2_scale
    if layout == "NN":  # dY[M,N] . W[N,K]: W col scale is already [N/64, K, 2]
        return left.data, right.data, ls, rs
    # TN: dY^T[N,M] . X[M,K]: dY col scale [M/64,N,2] -> [N,M/64,2] (transposed like x1)
    x1_scale = ls if Format(left.format) == Format.HIF8 else ls.transpose(-3, -2)
    return left.data.transpose(-1, -2), right.data, x1_scale, rs


def _format_kwargs(tnpu, fmt: Format, *, grouped: bool) -> dict:
    if fmt == Format.HIF8:
        names = ("x_dtype", "weight_dtype") if grouped else ("x1_dtype", "x2_dtype")
        return {names[0]: tnpu.hifloat8, names[1]: tnpu.hifloat8}
    token_scale = "per_token_scale_dtype" if grouped else "pertoken_scale_dtype"
    return {"scale_dtype": tnpu.float8_e8m0fnu, token_scale: tnpu.float8_e8m0fnu}


def matmul(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> torch.Tensor:
    """Dense GEMM through ``npu_quant_matmul`` (validated operands)."""
    tnpu = import_torch_npu()
    fmt = Format(left.format)
    x1, x2, x1_scale, x2_scale = _operands(left, right, layout)
    kwargs = _format_kwargs(tnpu, fmt, grouped=False)
    if fmt == Format.MXFP8_E4M3:
        kwargs["group_sizes"] = list(MX_GROUP_SIZES)
    return tnpu.npu_quant_matmul(x1, x2, x2_scale, pertoken_scale=x1_scale, output_dtype=output_dtype, **kwargs)


def grouped_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    layout: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Grouped GEMM through ``npu_grouped_matmul`` (validated operands)."""
    tnpu = import_torch_npu()
    fmt = Format(left.format)
    counts = group_list.to(torch.int64)
    x, weight, x_scale, weight_scale = _operands(left, right, layout)
    group_type = 2 if layout == "TN" else 0
    if fmt == Format.HIF8:
        num_groups = counts.numel()
        x_scale = x_scale.expand(x.shape[0] if group_type == 0 else num_groups).contiguous()
        if group_type == 2:  # wgrad: both operands are 2D with one scale each
            weight_scale = weight_scale.expand(num_groups).contiguous()
    outputs = tnpu.npu_grouped_matmul(
        [x],
        [weight],
        scale=[weight_scale],
        per_token_scale=[x_scale],
        group_list=torch.cumsum(counts, 0),
        group_type=group_type,
        group_list_type=0,
        split_item=3,
        output_dtype=output_dtype,
        **_format_kwargs(tnpu, fmt, grouped=True),
    )
    return outputs[0]


# ---------------------------------------------------------------- quantization
def mxfp8_quantize(x: torch.Tensor, axis: int, block_size: int, scale_alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    tnpu = import_torch_npu()
    data, npu_scale = tnpu.npu_dynamic_mx_quant(
        x, axis=axis, round_mode="rint", dst_type=torch.float8_e4m3fn, block_size=block_size, scale_alg=_SCALE_ALG[scale_alg]
    )
    if axis in (-1, x.dim() - 1):
        return data, from_npu_row_scale(npu_scale, x.shape[-1]).contiguous()
    return data, from_npu_col_scale(npu_scale, x.shape[-2])


def mxfp8_quantize_dual(w: torch.Tensor, block_size: int, scale_alg: str):
    if block_size != MX_BLOCK_SIZE:
        raise ValueError(f"npu_dynamic_mx_quant_with_dual_axis supports block_size 32 only, got {block_size}")
    tnpu = import_torch_npu()
    row_data, row_npu, col_data, col_npu = tnpu.npu_dynamic_mx_quant_with_dual_axis(
        w, round_mode="rint", dst_type=torch.float8_e4m3fn, scale_alg=_SCALE_ALG[scale_alg]
    )
    row_scale = from_npu_row_scale(row_npu, w.shape[-1]).contiguous()
    return row_data, row_scale, col_data, from_npu_col_scale(col_npu, w.shape[-2])


def mxfp8_quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int, scale_alg: str):
    tnpu = import_torch_npu()
    group_index = torch.cumsum(group_sizes.to(torch.int64), 0).to(torch.int32)
    data, npu_scale = tnpu.npu_grouped_dynamic_mx_quant(
        x, group_index, round_mode="rint", dst_type=torch.float8_e4m3fn, blocksize=block_size, scale_alg=_SCALE_ALG[scale_alg]
    )
    return data, from_npu_grouped_scale(npu_scale, group_sizes)


def _safe_scale(scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float()
    return torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))


def _dynamic_quant_2d(tnpu, x: torch.Tensor, format_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = tnpu.npu_dynamic_quant(
        x, dst_type=tnpu.hifloat8, quant_mode="pertensor", dst_type_max=float(format_max)
    )
    return codes.view(torch.uint8), _safe_scale(scale).reshape(())


def hif8_quantize(x: torch.Tensor, format_max: float):
    """Current scaling: (codes uint8, scale fp32 [] or [E], amax=None: the kernel does not report it)."""
    tnpu = import_torch_npu()
    if x.dim() == 3:  # one pertensor quantization per expert
        pairs = [_dynamic_quant_2d(tnpu, x[e], format_max) for e in range(x.shape[0])]
        return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs]), None
    codes, scale = _dynamic_quant_2d(tnpu, x, format_max)
    return codes, scale, None


def hif8_quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    tnpu = import_torch_npu()
    if x.dim() == 3 and scale.numel() == x.shape[0] and scale.dim() == 1:
        return torch.stack([hif8_quantize_with_scale(x[e], scale[e]) for e in range(x.shape[0])])
    codes = tnpu.npu_quantize(x, scale.reshape(1).float(), None, tnpu.hifloat8, axis=-1, div_mode=True)
    return codes.view(torch.uint8)
