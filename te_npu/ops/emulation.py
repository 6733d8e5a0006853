"""Emulation backend (CPU / CUDA): emulation = numerics reference, not a kernel.

Every GEMM decodes both 8-bit operands exactly, multiplies with FP32 accumulation and casts
to the output dtype; quantization calls ``te_npu.numerics``. Nothing here runs for an ``npu``
tensor (the registry routes those to ``te_npu.ops.npu``).

Why the decode targets differ by device (both are exact, so results match the reference up
to FP32 summation order):
- CPU: an FP32 matmul is several times faster than a BF16 one, so operands decode to FP32.
  MXFP8 folds the E8M0 block scale in while decoding (``value * 2**e`` is exact in FP32 for
  every E4M3 code and every exponent, subnormal results included).
- CUDA: operands decode to BF16 and multiply with an FP32 output. E4M3 values (3 mantissa
  bits) times ``2**e`` are exact in BF16 unless the result falls below BF16's subnormal
  quantum ``2**-133``, i.e. for scale codes < 3; such operands decode to FP32 instead.
  HiF8 values (<= 3 mantissa bits, 2**-22 .. 2**15) are always exact in BF16.
  Enabling TF32 (``torch.backends.cuda.matmul.allow_tf32``) would make FP32 paths inexact.
HiF8 scales multiply the FP32 product: ``(P * left.scale) * right.scale``.

Quantization runs ``te_npu.numerics`` (eager torch) unless ``TE_NPU_QUANT_KERNEL`` picks one of
the bit-identical faster kernels (see :func:`quant_kernel`); a picked kernel that cannot be built
raises rather than running eager.

Legend: T tokens (rows of a grouped operand), G groups, M/N/K GEMM dims.
"""
from __future__ import annotations

import os

import torch

from te_npu.formats import Format
from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import MX_BLOCK_SIZE
from te_npu.tensor.operand import QuantizedOperand

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
_BF16_EXACT_MIN_SCALE_CODE = 3  # E4M3 quantum 2**-9 times 2**(code-127) >= bf16 quantum 2**-133


# ---------------------------------------------------------------- decode (exact)
def _block_expand(scale_f32: torch.Tensor, values: torch.Tensor, axis: int) -> torch.Tensor:
    """``values * scale`` with each scale entry covering 32 consecutive elements along ``axis``."""
    n = values.shape[axis]
    if n % MX_BLOCK_SIZE == 0:
        if axis == -1:
            blocks = values.unflatten(-1, (n // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
            return (blocks * scale_f32.unsqueeze(-1)).flatten(-2)
        blocks = values.unflatten(-2, (n // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
        return (blocks * scale_f32.unsqueeze(-2)).flatten(-3, -2)
    expanded = scale_f32.repeat_interleave(MX_BLOCK_SIZE, dim=axis).narrow(axis, 0, n)
    return values * expanded


def _decode_dtype(op: QuantizedOperand) -> torch.dtype:
    if op.data.device.type != "cuda":
        return torch.float32
    if Format(op.format) == Format.HIF8:
        return torch.bfloat16
    exact_in_bf16 = op.scale.numel() == 0 or int(op.scale.min().item()) >= _BF16_EXACT_MIN_SCALE_CODE
    return torch.bfloat16 if exact_in_bf16 else torch.float32


def decode(op: QuantizedOperand, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact high-precision values of an operand. MXFP8: scales folded in; HiF8: codes only
    (the FP32 tensor scale is applied to the GEMM product, as the kernel does). With
    ``TE_NPU_QUANT_KERNEL=compiled`` the decode runs compiled too (same values)."""
    compiled = None
    if quant_kernel(op.data) == "compiled":
        from te_npu.numerics import compiled
    if Format(op.format) == Format.HIF8:
        return hif8.decode(op.data).to(dtype) if compiled is None else compiled.hif8_decode_compiled(op.data, dtype)
    if op.group_sizes is not None:  # ragged col: blocks restart at each group boundary
        values = op.data.to(dtype)  # every E4M3 code is exactly representable in fp32 / bf16
        scale = mxfp8.e8m0_to_float(op.scale).to(dtype)  # 2**(code-127), NaN for 0xFF
        row_to_block, _ = mxfp8.group_block_index(op.group_sizes.to(op.data.device), MX_BLOCK_SIZE)
        return values * scale[row_to_block]
    axis = -1 if op.orientation == "row" else -2
    if compiled is not None and op.data.shape[axis] % MX_BLOCK_SIZE == 0:
        return compiled.mxfp8_dequantize_compiled(op.data, op.scale, axis, MX_BLOCK_SIZE, dtype)
    values = op.data.to(dtype)
    scale = mxfp8.e8m0_to_float(op.scale).to(dtype)
    return _block_expand(scale, values, axis)


def _decode_pair(left: QuantizedOperand, right: QuantizedOperand) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(_decode_dtype(left), _decode_dtype(right))
    return decode(left, dtype), decode(right, dtype)


# ---------------------------------------------------------------- matmul helpers
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32-accumulated product with an FP32 result."""
    if a.dtype == torch.bfloat16:  # CUDA path; mm.dtype exists for CUDA, not CPU
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-group products. kind "m": a [T,k] row groups x b [G,k,n] -> [T,n];
    kind "k": a [m,T] x b [T,n], groups along T -> [G,m,n] (empty group -> zeros)."""
    offs = torch.cumsum(counts.to(a.device), 0).to(torch.int32)
    out_dtype = torch.float32 if a.dtype == torch.bfloat16 else None
    if hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)
        except torch.OutOfMemoryError:
            raise  # a real failure: the per-group loop would only allocate more
        except (RuntimeError, NotImplementedError):
            # operands the fused op refuses (strides not multiples of 16 bytes, bf16 -> fp32 on
            # CPU, GPU arch): the per-group loop below is the same math, FP32-accumulated
            pass
    sizes = counts.tolist()
    if kind == "m":
        chunks = torch.split(a, sizes, dim=0)
        return torch.cat([_mm(chunk, b[g]) for g, chunk in enumerate(chunks)], dim=0)
    a_chunks, b_chunks = torch.split(a, sizes, dim=1), torch.split(b, sizes, dim=0)
    return torch.stack([_mm(x, y) for x, y in zip(a_chunks, b_chunks)], dim=0)


def _hif8_dense_scales(product: torch.Tensor, left: QuantizedOperand, right: QuantizedOperand) -> torch.Tensor:
    return product * left.scale.reshape(()) * right.scale.reshape(())


# ---------------------------------------------------------------- GEMMs
def matmul(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> torch.Tensor:
    """Dense GEMM on validated operands: NT X.W^T, NN dY.W, TN dY^T.X."""
    a, b = _decode_pair(left, right)
    if layout == "NT":
        product = _mm(a, b.t())
    elif layout == "NN":
        product = _mm(a, b)
    else:
        product = _mm(a.t(), b)
    if Format(left.format) == Format.HIF8:
        product = _hif8_dense_scales(product, left, right)
    return product.to(output_dtype)


def grouped_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    layout: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Grouped GEMM on validated operands; ``group_list`` = int64 [G] row counts."""
    a, b = _decode_pair(left, right)
    counts = group_list.to(torch.int64)
    if layout == "NT":
        product = _grouped_mm(a, b.transpose(-1, -2), counts, "m")  # [T,K] x [G,K,N] -> [T,N]
    elif layout == "NN":
        product = _grouped_mm(a, b, counts, "m")  # [T,N] x [G,N,K] -> [T,K]
    else:
        product = _grouped_mm(a.t(), b, counts, "k")  # [N,T] x [T,K] -> [G,N,K]
    if Format(left.format) == Format.HIF8:
        product = product * left.scale.reshape(())
        if layout == "TN":
            product = product * right.scale.reshape(())
        else:  # per-expert weight scale [G] -> one factor per token row
            row_scale = torch.repeat_interleave(right.scale, counts.to(right.scale.device), output_size=a.shape[0])
            product = product * row_scale.unsqueeze(-1)
    return product.to(output_dtype)


# ---------------------------------------------------------------- quantization
QUANT_KERNEL_ENV = "TE_NPU_QUANT_KERNEL"
QUANT_KERNELS = ("eager", "compiled", "native")


def quant_kernel(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE) -> str:
    """Which bit-identical quantization kernel runs for ``x``, from ``TE_NPU_QUANT_KERNEL``:
    ``eager`` (default, the reference), ``compiled`` (``te_npu.numerics.compiled``:
    torch.compile, CPU or CUDA; each new shape compiles once), or ``native``
    (``te_npu.numerics.native_cpu``, CPU tensors: MXFP8 row / col / dual and HiF8 current
    scaling; HiF8 with a given scale stays eager). The ragged grouped col quantization is always
    eager. A kernel that cannot be built raises."""
    choice = os.environ.get(QUANT_KERNEL_ENV, "eager")
    if choice not in QUANT_KERNELS:
        raise ValueError(f"{QUANT_KERNEL_ENV}={choice!r}: expected one of {QUANT_KERNELS}")
    if choice == "native" and (x.device.type != "cpu" or block_size != MX_BLOCK_SIZE):
        return "eager"
    return choice


def mxfp8_quantize(x: torch.Tensor, axis: int, block_size: int, scale_alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = quant_kernel(x, block_size)
    if kernel == "compiled":
        from te_npu.numerics import compiled

        return compiled.quantize_compiled(x, axis=axis, block_size=block_size, scale_alg=scale_alg)
    if kernel == "native" and x.dim() >= 2 and axis % x.dim() >= x.dim() - 2:
        from te_npu.numerics import native_cpu

        return native_cpu.quantize(x, axis=axis, block_size=block_size, scale_alg=scale_alg)
    return mxfp8.quantize(x, axis=axis, block_size=block_size, scale_alg=scale_alg)


def mxfp8_quantize_dual(w: torch.Tensor, block_size: int, scale_alg: str):
    kernel = quant_kernel(w, block_size)
    if kernel == "compiled":
        from te_npu.numerics import compiled

        return compiled.quantize_dual_compiled(w, block_size, scale_alg)
    if kernel == "native":
        from te_npu.numerics import native_cpu

        return native_cpu.quantize_dual(w, block_size, scale_alg)
    return mxfp8.quantize_dual(w, block_size, scale_alg)


def mxfp8_quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int, scale_alg: str):
    return mxfp8.quantize_grouped(x, group_sizes, block_size, scale_alg)


def amax(x: torch.Tensor) -> torch.Tensor:
    """FP32 amax: ``[]`` for 1D/2D, ``[E]`` per leading group of a 3D weight (NaN propagates)."""
    magnitude = x.detach().abs().float()
    return magnitude.amax(dim=(1, 2)) if x.dim() == 3 else magnitude.amax()


def hif8_quantize(x: torch.Tensor, format_max: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: returns (codes uint8, scale fp32 [] or [E], amax)."""
    if quant_kernel(x) == "native" and x.numel() > 0:
        from te_npu.numerics import native_cpu

        return native_cpu.hif8_current_quantize(x, format_max, per_group=x.dim() == 3)
    current_amax = amax(x)
    scale = hif8.current_scale(current_amax, format_max)
    return hif8_quantize_with_scale(x, scale), scale, current_amax


def hif8_quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if quant_kernel(x) == "compiled":
        from te_npu.numerics import compiled

        return compiled.hif8_quantize_compiled(x, scale)
    return hif8.quantize(x, scale)
