"""A recording fake of the torch_npu ops te_npu uses, computing with te_npu.numerics on CPU.

Every op call is appended to ``calls`` as ``Call(name, args, kwargs)``, so tests can assert each
argument the NPU wrappers send. ``fail(name, exc)`` makes the next calls of an op raise ``exc``.
The outputs follow the layouts documented by torch_npu (E8M0 scales in pairs, trailing dim 2);
they are NOT evidence about real kernel numerics.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch

from te_npu.numerics import hif8, mxfp8

BLOCK = 32


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple
    kwargs: dict


class _FakeDtype:
    """Stand-in for a torch_npu dtype object (``torch_npu.hifloat8`` ...)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name}"


_SCALE_ALG = {0: "floor", 1: "ceil"}


# ---------- npu scale layouts -> per-element fp32 scale factors (independent of te_npu.ops.npu)
def _pairs_last(npu_scale: torch.Tensor, length: int) -> torch.Tensor:
    """[..., P, 2] blocked along the dim before the pair -> codes [..., ceil(length/32)]."""
    return npu_scale.flatten(-2)[..., : math.ceil(length / BLOCK)]


def _pairs_rows(npu_scale: torch.Tensor, length: int) -> torch.Tensor:
    """[..., P, n, 2] (block pairs along rows) -> codes [..., ceil(length/32), n]."""
    return npu_scale.transpose(-1, -2).flatten(-3, -2)[..., : math.ceil(length / BLOCK), :]


def _expand(codes: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    return mxfp8.e8m0_to_float(codes).repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, length)


def _decode_x1(x1, scale):  # x1 [m, k], scale [m, P, 2] blocked along k
    return mxfp8.decode_e4m3(x1) * _expand(_pairs_last(scale, x1.shape[-1]), -1, x1.shape[-1])


def _decode_x2(x2, scale):  # x2 [k, n], scale [P, n, 2] blocked along k
    return mxfp8.decode_e4m3(x2) * _expand(_pairs_rows(scale, x2.shape[-2]), -2, x2.shape[-2])


def _to_npu_last(codes):  # [..., nb] -> [..., ceil(nb/2), 2]
    if codes.shape[-1] % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], -1)
    return codes.unflatten(-1, (codes.shape[-1] // 2, 2))


def _to_npu_rows(codes):  # [..., nb, n] -> [..., ceil(nb/2), n, 2]
    if codes.shape[-2] % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-2], 1, codes.shape[-1])], -2)
    return codes.unflatten(-2, (codes.shape[-2] // 2, 2)).transpose(-1, -2).contiguous()


class FakeTorchNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.__version__ = "fake"
        self.hifloat8 = _FakeDtype("hifloat8")
        self.float8_e8m0fnu = _FakeDtype("float8_e8m0fnu")
        self.calls: list[Call] = []
        self._failures: dict[str, BaseException] = {}

    # ---- test helpers
    def fail(self, name: str, exc: BaseException) -> None:
        """Make every later call of op ``name`` raise ``exc``."""
        self._failures[name] = exc

    def calls_of(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def _record(self, name, args, kwargs):
        self.calls.append(Call(name, args, dict(kwargs)))
        if name in self._failures:
            raise self._failures[name]

    # ---- quantization
    def npu_dynamic_mx_quant(self, input, *, axis=-1, round_mode="rint", dst_type=None, block_size=32,
                             scale_alg=0, dst_type_max=0.0):
        self._record("npu_dynamic_mx_quant", (input,), dict(axis=axis, round_mode=round_mode, dst_type=dst_type,
                     block_size=block_size, scale_alg=scale_alg, dst_type_max=dst_type_max))
        data, codes = mxfp8.quantize(input, axis=axis, block_size=block_size, scale_alg=_SCALE_ALG[scale_alg])
        last = axis in (-1, input.dim() - 1)
        return data, _to_npu_last(codes) if last else _to_npu_rows(codes)

    def npu_dynamic_mx_quant_with_dual_axis(self, input, *, round_mode="rint", dst_type=296, scale_alg=0,
                                            dst_type_max=0.0):
        self._record("npu_dynamic_mx_quant_with_dual_axis", (input,), dict(round_mode=round_mode, dst_type=dst_type,
                     scale_alg=scale_alg, dst_type_max=dst_type_max))
        rd, rs, cd, cs = mxfp8.quantize_dual(input, BLOCK, _SCALE_ALG[scale_alg])
        return rd, _to_npu_last(rs), cd, _to_npu_rows(cs)

    def npu_grouped_dynamic_mx_quant(self, x, group_index, *, round_mode="rint", dst_type=23, blocksize=32,
                                     scale_alg=0, dst_type_max=0.0):
        self._record("npu_grouped_dynamic_mx_quant", (x, group_index), dict(round_mode=round_mode,
                     dst_type=dst_type, blocksize=blocksize, scale_alg=scale_alg, dst_type_max=dst_type_max))
        sizes = torch.diff(group_index.to(torch.int64), prepend=group_index.new_zeros(1, dtype=torch.int64))
        data, codes = mxfp8.quantize_grouped(x, sizes, blocksize, _SCALE_ALG[scale_alg])
        pieces, start = [], 0
        for t in sizes.tolist():
            nb = math.ceil(t / BLOCK)
            piece = codes[start:start + nb]
            start += nb
            pieces.append(torch.cat([piece, piece.new_zeros(nb % 2, x.shape[1])]))
        rows = x.shape[0] // (2 * BLOCK) + sizes.numel()
        flat = torch.cat(pieces + [codes.new_zeros(0, x.shape[1])])
        flat = torch.cat([flat, flat.new_zeros(2 * rows - flat.shape[0], x.shape[1])])
        return data, _to_npu_rows(flat)

    def npu_dynamic_quant(self, input, *, smooth_scales=None, group_index=None, dst_type=None,
                          quant_mode="pertoken", dst_type_max=0.0):
        self._record("npu_dynamic_quant", (input,), dict(smooth_scales=smooth_scales, group_index=group_index,
                     dst_type=dst_type, quant_mode=quant_mode, dst_type_max=dst_type_max))
        scale = hif8.current_scale(input.detach().abs().float().amax(), dst_type_max)
        return hif8.quantize(input, scale), scale.reshape(1)

    def npu_quantize(self, input, scales, zero_points, dtype, axis=1, div_mode=True):
        self._record("npu_quantize", (input, scales, zero_points, dtype), dict(axis=axis, div_mode=div_mode))
        return hif8.quantize(input, scales.reshape(()))

    # ---- GEMMs (use the @ operator so tests may patch torch.mm / torch.matmul to fail)
    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                         x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                         group_sizes=None, y_scale=None):
        self._record("npu_quant_matmul", (x1, x2, scale), dict(offset=offset, pertoken_scale=pertoken_scale,
                     bias=bias, output_dtype=output_dtype, x1_dtype=x1_dtype, x2_dtype=x2_dtype,
                     pertoken_scale_dtype=pertoken_scale_dtype, scale_dtype=scale_dtype, group_sizes=group_sizes,
                     y_scale=y_scale))
        if x1_dtype is self.hifloat8:
            out = (hif8.decode(x1) @ hif8.decode(x2)) * scale.reshape(()) * pertoken_scale.reshape(())
        else:
            out = _decode_x1(x1, pertoken_scale) @ _decode_x2(x2, scale)
        return out.to(output_dtype)

    def npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                           activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                           group_list_type=0, act_type=0, output_dtype=None, tuning_config=None, x_dtype=None,
                           weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
        self._record("npu_grouped_matmul", (x, weight), dict(bias=bias, scale=scale, per_token_scale=per_token_scale,
                     group_list=group_list, split_item=split_item, group_type=group_type,
                     group_list_type=group_list_type, output_dtype=output_dtype, x_dtype=x_dtype,
                     weight_dtype=weight_dtype, scale_dtype=scale_dtype, per_token_scale_dtype=per_token_scale_dtype))
        (a,), (b,), (s,), (ps,) = x, weight, scale, per_token_scale
        counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
        sizes = counts.tolist()
        hifloat = x_dtype is self.hifloat8
        outs = []
        if group_type == 0:  # a [T,k] x b [G,k,n]
            a_val = hif8.decode(a) if hifloat else _decode_x1(a, ps)
            row_scales = torch.split(ps.reshape(-1, 1), sizes) if hifloat else [None] * len(sizes)
            for g, (chunk, row_scale) in enumerate(zip(torch.split(a_val, sizes), row_scales)):
                if hifloat:  # out = x @ w * per_token_scale * scale (kernel formula)
                    outs.append((chunk @ hif8.decode(b[g])) * row_scale * s[g])
                else:
                    outs.append(chunk @ _decode_x2(b[g], s[g]))
            return [torch.cat(outs).to(output_dtype)]
        # group_type 2: a [m,T] x b [T,n], groups along T; grouped scales in per-group block pairs
        start_pair = 0
        for g, (a_g, b_g) in enumerate(zip(torch.split(a, sizes, 1), torch.split(b, sizes, 0))):
            if hifloat:
                outs.append((hif8.decode(a_g) @ hif8.decode(b_g)) * ps[g] * s[g])
                continue
            pairs = math.ceil(sizes[g] / (2 * BLOCK))
            a_scale = ps[:, start_pair:start_pair + pairs]
            b_scale = s[start_pair:start_pair + pairs]
            start_pair += pairs
            outs.append(_decode_x1(a_g, a_scale) @ _decode_x2(b_g, b_scale))
        return [torch.stack(outs).to(output_dtype)]
