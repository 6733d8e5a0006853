"""Emulation backend (CPU / CUDA): emulation = numerics reference, not a kernel.

Every GEMM decodes both 8-bit operands exactly, multiplies with FP32 accumulation and casts
to the output dtype; quantization calls ``te_npu.numerics``. Nothing here runs for an ``npu``
tensor (the registry routes those to ``te_npu.ops.npu``).

Why the decode targets differ by device (both are exact, so results match the reference up
to FP32 summation order):
- FP32 plan (CPU): an FP32 matmul is several times faster than a BF16 one there, so operands
  decode to FP32. MXFP8 folds the E8M0 block scale in while decoding (``value * 2**e`` is exact
  in FP32 for every E4M3 code and every exponent, subnormal results included).
- BF16 plan (device types in :data:`BF16_GEMM_DEVICES`, i.e. CUDA): operands decode to BF16 and
  multiply with an FP32 output. HiF8 values (<= 3 mantissa bits, 2**-22 .. 2**15) are always
  exact in BF16. E4M3 values (3 mantissa bits) times ``2**e`` are exact in BF16 unless the
  result falls below BF16's subnormal quantum ``2**-133`` (scale codes < 3), so MXFP8 operands
  decode with their scales raised by a fixed ``2**3`` and the product is multiplied by
  ``2**-6`` (both exact; the product is FP32, or BF16 for a grouped GEMM into BF16, see
  :func:`_grouped_mm`): no scale inspection, hence no host sync in any GEMM. The price is
  headroom at the top of the range: a block code above 243 (block amax >= 2**125) decodes to
  inf, and a product above 2**122 overflows, where the FP32 plan would stay finite. Enabling
  TF32 (``torch.backends.cuda.matmul.allow_tf32``) would make FP32 paths inexact.
HiF8 scales multiply the FP32 product in the kernels' documented order, the right (x2 / weight)
scale first: ``(P * right.scale) * left.scale`` (aclnnQuantMatmulV5 / aclnnGroupedMatmulV4:
``y = (x1 @ x2) * x2Scale * x1Scale``); the last multiply writes the output dtype directly (one
pass, one rounding).

Quantization and decode run the active kernel variant (``te_npu.ops.kernels``: ``eager``
``te_npu.numerics`` by default, or the bit-identical ``compiled`` / ``native`` kernels a run
chose once with ``te_npu.ops.use_quant_kernel``); this module reads no setting per call.

Legend: T tokens (rows of a grouped operand), G groups, M/N/K GEMM dims.
"""
from __future__ import annotations

import torch

from te_npu import compat
from te_npu.formats import Format, spec
from te_npu.ops.group_sizes import host_group_sizes, with_mirror_of
from te_npu.ops.kernels import active_quant_kernels
from te_npu.ops.layouts import to_canonical
from te_npu.ops.operand import QuantizedOperand

__all__ = [
    "NAME",
    "matmul",
    "grouped_matmul",
    "decode",
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
]

NAME = "emulation"
SCALE_LAYOUT = "canonical"
"""Layout of the scales this backend's quantizations return (and its GEMMs read)."""

BF16_GEMM_DEVICES = frozenset({"cuda"})
"""Device types whose emulated GEMMs take BF16 operands (the BF16 plan); others decode to FP32."""

BF16_MXFP8_SCALE_SHIFT = 3
"""log2 of the factor MXFP8 block scales are raised by in the BF16 plan: the smallest E4M3 value
2**-9 times the smallest scale 2**-127, raised by 2**3, is 2**-133, BF16's subnormal quantum."""


# ---------------------------------------------------------------- decode (exact)
def uses_bf16_plan(device: torch.device) -> bool:
    """Whether emulated GEMMs on ``device`` decode to BF16 (see the module docstring)."""
    return device.type in BF16_GEMM_DEVICES


def decode(op: QuantizedOperand, dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
    """Exact high-precision values of an operand, by the active kernel variant. MXFP8: scales
    folded in, each raised by ``2**scale_shift`` (exact; the BF16 plan uses 3); HiF8: codes only
    (the FP32 tensor scale is applied to the GEMM product, as the kernel does). An operand in the
    kernels' ``npu`` scale layout is read through its canonical conversion."""
    op = to_canonical(op)
    kernels = active_quant_kernels()
    if not op.spec.blocked:  # per-tensor scale: applied to the product, not here
        return kernels.hif8_decode(op.data, dtype)
    if op.group_sizes is not None:  # ragged col: blocks restart at each group boundary
        group_sizes = with_mirror_of(op.group_sizes.to(op.data.device), op.group_sizes)
        return kernels.mxfp8_decode_grouped(op.data, op.scale, group_sizes, dtype, scale_shift)
    return kernels.mxfp8_decode(op.data, op.scale, -1 if op.orientation == "row" else -2, dtype, scale_shift)


def _decode_pair(left: QuantizedOperand, right: QuantizedOperand) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Both operands decoded for the device's plan, plus the factor that undoes the MXFP8 scale
    raise on the FP32 product (1.0 in the FP32 plan and for HiF8)."""
    if not uses_bf16_plan(left.data.device):
        return decode(left), decode(right), 1.0
    shift = BF16_MXFP8_SCALE_SHIFT if left.spec.blocked else 0
    a, b = decode(left, torch.bfloat16, shift), decode(right, torch.bfloat16, shift)
    return a, b, 2.0 ** (-2 * shift)


# ---------------------------------------------------------------- matmul helpers
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32-accumulated product with an FP32 result (BF16 operands: ``mm.dtype`` on CUDA; widened
    to FP32 elsewhere, the same exact products)."""
    if a.dtype == torch.bfloat16:
        if a.device.type == "cuda":
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a.float(), b.float())
    return torch.mm(a, b)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, kind: str,
                bf16_product: bool = False) -> torch.Tensor:
    """Per-group products, FP32-accumulated. kind "m": a [T,k] row groups x b [G,k,n] -> [T,n];
    kind "k": a [m,T] x b [T,n], groups along T -> [G,m,n] (empty group -> zeros).
    ``counts``: the group list (its host mirror sizes the per-group loop). BF16 operands give an
    FP32 product, or with ``bf16_product`` one rounded once to BF16 (callers that round to BF16
    anyway): the only form CUDA's fused kernel takes. CUDA runs FP32 products as a per-group
    loop after reading the offsets on the host, so those go straight to the loop here, which
    reads the mirror instead."""
    offs = torch.cumsum(counts.to(a.device), 0).to(torch.int32)
    out_dtype = None
    if a.dtype == torch.bfloat16:
        out_dtype = torch.bfloat16 if bf16_product else torch.float32
    fused = compat.grouped_mm_available() and not (a.device.type == "cuda" and out_dtype == torch.float32)
    if fused:
        try:
            product = compat.grouped_mm(a, b, offs=offs, out_dtype=out_dtype)
            if kind == "k":  # an empty reduction group is zero by contract; not every build writes it
                for g, size in enumerate(host_group_sizes(counts)):
                    if size == 0:
                        product[g].zero_()
            return product
        except torch.OutOfMemoryError:
            raise  # a real failure: the per-group loop would only allocate more
        except (RuntimeError, NotImplementedError):
            # operands the fused op refuses (strides not multiples of 16 bytes, bf16 -> fp32 on
            # CPU, GPU arch): the per-group loop below is the same math, FP32-accumulated
            pass
    sizes = list(host_group_sizes(counts))
    if kind == "m":
        chunks = torch.split(a, sizes, dim=0)
        return torch.cat([_mm(chunk, b[g]) for g, chunk in enumerate(chunks)], dim=0)
    a_chunks, b_chunks = torch.split(a, sizes, dim=1), torch.split(b, sizes, dim=0)
    return torch.stack([_mm(x, y) for x, y in zip(a_chunks, b_chunks)], dim=0)


def _epilogue(product: torch.Tensor, factor: torch.Tensor | float, output_dtype: torch.dtype) -> torch.Tensor:
    """``(product * factor).to(output_dtype)`` in one pass (FP32 multiply, one rounding)."""
    if isinstance(factor, float) and factor == 1.0:
        return product.to(output_dtype)
    if output_dtype == product.dtype:
        return product.mul_(factor)
    return torch.mul(product, factor, out=torch.empty_like(product, dtype=output_dtype))


# ---------------------------------------------------------------- GEMMs
def matmul(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> torch.Tensor:
    """Dense GEMM on validated operands: NT X.W^T, NN dY.W, TN dY^T.X."""
    a, b, unraise = _decode_pair(left, right)
    if layout == "NT":
        product = _mm(a, b.t())
    elif layout == "NN":
        product = _mm(a, b)
    else:
        product = _mm(a.t(), b)
    if left.spec.blocked:  # block scales were folded into the decode
        return _epilogue(product, unraise, output_dtype)
    return _epilogue(product.mul_(right.scale.reshape(())), left.scale.reshape(()), output_dtype)


def grouped_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    layout: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Grouped GEMM on validated operands; ``group_list`` = int64 [G] row counts."""
    a, b, unraise = _decode_pair(left, right)
    counts = with_mirror_of(group_list.to(torch.int64), group_list)
    # MXFP8 into BF16: rounding the raised product to BF16, then the exact power-of-two unraise,
    # equals rounding the product once (HiF8's arbitrary scales must multiply the FP32 product)
    bf16_product = left.spec.blocked and output_dtype == torch.bfloat16
    if layout == "NT":
        product = _grouped_mm(a, b.transpose(-1, -2), counts, "m", bf16_product)  # [T,K] x [G,K,N] -> [T,N]
    elif layout == "NN":
        product = _grouped_mm(a, b, counts, "m", bf16_product)  # [T,N] x [G,N,K] -> [T,K]
    else:
        product = _grouped_mm(a.t(), b, counts, "k", bf16_product)  # [N,T] x [T,K] -> [G,N,K]
    if left.spec.blocked:
        return _epilogue(product, unraise, output_dtype)
    if layout == "TN":
        product = product.mul_(right.scale.reshape(()))
    else:  # per-expert weight scale [G] -> one factor per token row
        row_scale = torch.repeat_interleave(right.scale, counts.to(right.scale.device), output_size=a.shape[0])
        product = product.mul_(row_scale.unsqueeze(-1))
    return _epilogue(product, left.scale.reshape(()), output_dtype)


# ---------------------------------------------------------------- quantization
def mxfp8_quantize(x: torch.Tensor, axis: int, block_size: int, scale_alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    return active_quant_kernels().mxfp8_quantize(x, axis, block_size, scale_alg)


def mxfp8_quantize_dual(w: torch.Tensor, block_size: int, scale_alg: str):
    return active_quant_kernels().mxfp8_quantize_dual(w, block_size, scale_alg)


def mxfp8_quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int, scale_alg: str):
    return active_quant_kernels().mxfp8_quantize_grouped(x, group_sizes, block_size, scale_alg)


def hif8_quantize(x: torch.Tensor, format_max: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: returns (codes uint8, scale fp32 [] or [E], amax); ``[E]`` for a 3D weight."""
    per_group = spec(Format.HIF8).scale_groups(x.dim()) == 1
    return active_quant_kernels().hif8_quantize(x, format_max, per_group)


def hif8_quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return active_quant_kernels().hif8_quantize_with_scale(x, scale)
