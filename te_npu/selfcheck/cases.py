"""The self-check's cases: one te_npu call on named inputs, and what may differ (the Limits of
docs/numerics-and-limits.md).

Every case runs a public ``te_npu.ops`` call (which routes to ``te_npu/ops/npu.py`` on the device
and to the emulation on CPU) and returns its outputs by name in te_npu's canonical layouts:
E4M3 codes as uint8, E8M0 scales, HiF8 codes and FP32 scales, GEMM outputs. GEMM operands are
quantized once by the emulation on CPU and given to both sides, so a GEMM case checks the GEMM
kernel alone. Every MX quantization runs under both scale rules (``ceil``: torch_npu
``scale_alg=1``, ``floor``: ``scale_alg=0``), whatever te_npu's default.

Legend: M tokens, N / K weight dims, T routed rows, E / G experts (groups).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

import te_npu.ops as ops
from te_npu.formats import Format
from te_npu.numerics import hif8
from te_npu.numerics.constants import E4M3_MAX, HIF8_GRAD_MAX, HIF8_INPUT_MAX, MX_BLOCK_SIZE
from te_npu.ops import layouts
from te_npu.ops.operand import QuantizedOperand
from te_npu.selfcheck.shapes import ShapeSet

__all__ = ["Case", "OPS", "SCALE_ALGS", "build_cases", "block_mask", "move"]

SCALE_ALGS = ("ceil", "floor")
OPS = ("npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis", "npu_grouped_dynamic_mx_quant",
       "npu_dynamic_quant", "npu_quantize", "npu_quant_matmul", "npu_grouped_matmul")
"""The torch_npu ops te_npu's wrappers call (``te_npu/ops/npu.py``), each with cases here."""
_BF16, _FP32 = torch.bfloat16, torch.float32
_DTYPE_NAME = {_BF16: "bf16", _FP32: "fp32"}


@dataclass(frozen=True)
class Case:
    """op: the torch_npu op the wrapper calls; kind: ``quantization`` or ``gemm``; inputs: CPU
    tensors / operands, moved to the device for the device side; fn: the te_npu call -> named
    outputs; limit: a ``limits.LIMITS`` id where a documented difference may show; allowed: per
    output, the bool mask where it may (a missing output: nowhere; ``None`` for a GEMM: anywhere)."""

    op: str
    kind: str
    name: str
    inputs: tuple
    fn: Callable[..., dict[str, torch.Tensor]]
    limit: str | None = None
    allowed: dict[str, torch.Tensor] | None = None
    output_dtype: torch.dtype | None = None


# ---------------------------------------------------------------- the te_npu calls
def _mx(x, orientation, scale_alg, group_sizes=None):
    op = layouts.to_canonical(ops.quantize_mxfp8(x, orientation, group_sizes=group_sizes, scale_alg=scale_alg))
    return {"codes": op.data.view(torch.uint8), "scale": op.scale}


def _mx_dual(w, scale_alg):
    row, col = (layouts.to_canonical(o) for o in ops.quantize_mxfp8_dual(w, scale_alg=scale_alg))
    return {"row codes": row.data.view(torch.uint8), "row scale": row.scale,
            "col codes": col.data.view(torch.uint8), "col scale": col.scale}


def _hif8(x, format_max):
    op = ops.quantize_hif8(x, format_max)
    return {"codes": op.data, "scale": op.scale}


def _hif8_with_scale(x, scale):
    return {"codes": ops.quantize_hif8_with_scale(x, scale).data}


def _gemm(left, right, layout, output_dtype):
    return {"out": ops.low_precision_matmul(left, right, layout=layout, output_dtype=output_dtype)}


def _grouped_gemm(left, right, group_list, layout, output_dtype):
    return {"out": ops.low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=output_dtype)}


# ---------------------------------------------------------------- inputs
def _rand(gen, shape, dtype):
    """Normal values, each row scaled by its own power of two (2**-12 .. 2**11): many scale codes."""
    x = torch.randn(shape, generator=gen)
    rows = torch.randint(-12, 12, (*shape[:-1], 1), generator=gen).float()
    return (x * torch.exp2(rows)).to(dtype)


def _ragged(total, groups, gen, empty=False):
    """``groups`` uneven counts summing to ``total`` (every third group empty with ``empty``)."""
    weights = torch.rand(groups, generator=gen) + 0.1
    if empty:
        weights[::3] = 0.0
    counts = torch.floor(weights / weights.sum() * total).to(torch.int64)
    counts[int(weights.argmax())] += total - int(counts.sum())
    return counts


def block_mask(special: torch.Tensor, orientation: str, rule: str = "any",
               group_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Elements of the 32-blocks (along K for ``row``, M for ``col``; restarting at each group of a
    ragged col operand) in which ``any`` / ``all`` elements are ``special``."""
    if group_sizes is not None:
        parts = torch.split(special, [int(s) for s in group_sizes], dim=0)
        return torch.cat([block_mask(p, "col", rule) for p in parts], dim=0)
    s = special if orientation == "row" else special.transpose(-1, -2)
    n = s.shape[-1]
    pad = s.new_full((*s.shape[:-1], (-n) % MX_BLOCK_SIZE), rule == "all")
    blocks = torch.cat([s, pad], dim=-1).reshape(*s.shape[:-1], -1, MX_BLOCK_SIZE)
    hit = blocks.any(-1) if rule == "any" else blocks.all(-1)
    mask = hit.unsqueeze(-1).expand_as(blocks).reshape(*s.shape[:-1], -1)[..., :n]
    return mask if orientation == "row" else mask.transpose(-1, -2)


# ---------------------------------------------------------------- quantization cases
def _mx_cases(tag, x, w, group_sizes, special=None, limit=None, rule="any", dual_limit=None):
    """Row, col, dual and ragged col MX quantization of ``x [M, K]`` / ``w [..., N, K]`` / ragged ``x``,
    under both scale rules. ``special`` (bool, like x and w) with ``limit``: the Limits line whose
    difference may show in the blocks ``rule`` picks (``dual_limit``: the dual-axis kernel's)."""
    cases = []
    dname = _DTYPE_NAME[x.dtype]
    half = x.dtype != _FP32
    single, dual = "npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis" if half else "npu_dynamic_mx_quant"
    grouped = "npu_grouped_dynamic_mx_quant" if half else "npu_dynamic_mx_quant"
    sx, sw = special if special is not None else (None, None)

    def allow(mask_of):
        return None if sx is None or limit is None else mask_of()

    for alg in SCALE_ALGS:
        for orientation in ("row", "col"):
            cases.append(Case(single, "quantization", f"MX {orientation} {dname} {list(x.shape)} {alg} {tag}",
                              (x, orientation, alg), _mx, limit,
                              allow(lambda o=orientation: {"codes": block_mask(sx, o, rule)})))
        lim = dual_limit if half else limit
        cases.append(Case(dual, "quantization", f"MX dual {dname} {list(w.shape)} {alg} {tag}", (w, alg), _mx_dual,
                          lim if sx is not None else None,
                          None if sx is None or lim is None else
                          {"row codes": block_mask(sw, "row", rule), "col codes": block_mask(sw, "col", rule)}))
        if group_sizes is not None:
            sizes = [int(s) for s in group_sizes]
            cases.append(Case(grouped, "quantization", f"MX grouped col {dname} {list(x.shape)} groups {sizes} {alg} {tag}",
                              (x, "col", alg, group_sizes), _mx, limit,
                              allow(lambda: {"codes": block_mask(sx, "col", rule, group_sizes)})))
    return cases


def _hif8_cases(tag, x, w3=None, allowed=None, limit=None, with_scale_limit=None):
    """Current scaling of ``x`` at both maxima, per expert of ``w3 [E, N, K]``, and with a given scale."""
    cases, dname = [], _DTYPE_NAME[x.dtype]
    op = "npu_dynamic_quant" if x.dtype != _FP32 else "npu_quantize"
    for fmax in (HIF8_INPUT_MAX, HIF8_GRAD_MAX):
        cases.append(Case(op, "quantization", f"HiF8 current {dname} {list(x.shape)} max {fmax:g} {tag}",
                          (x, fmax), _hif8, limit, allowed))
    if w3 is not None:
        cases.append(Case("npu_quantize", "quantization", f"HiF8 per expert {_DTYPE_NAME[w3.dtype]} {list(w3.shape)} "
                          f"max {HIF8_INPUT_MAX:g} {tag}", (w3, HIF8_INPUT_MAX), _hif8))
    finite = x.float()[torch.isfinite(x.float())]
    scale = hif8.current_scale(finite.abs().amax() if finite.numel() else torch.tensor(0.0), HIF8_INPUT_MAX)
    wl, wa = with_scale_limit if with_scale_limit is not None else (None, None)
    cases.append(Case("npu_quantize", "quantization", f"HiF8 given scale {dname} {list(x.shape)} {tag}",
                      (x, scale), _hif8_with_scale, wl, wa))
    return cases


def _quantization_cases(shapes: ShapeSet, gen) -> list[Case]:
    cases = []
    for name, N, K in shapes.dense:
        for dtype in (_BF16, _FP32):
            x, w = _rand(gen, (shapes.tokens, K), dtype), _rand(gen, (N, K), dtype)
            cases += _mx_cases(name, x, w, None)
            if dtype == _BF16:
                cases += _hif8_cases(name, x)
    for name, E, N, K in shapes.grouped:
        for dtype in (_BF16, _FP32):
            x, w = _rand(gen, (shapes.routed, K), dtype), _rand(gen, (E, N, K), dtype)
            for kind, sizes in _group_lists(shapes.routed, E, gen).items():
                cases += [c for c in _mx_cases(f"{name} {kind}", x, w, sizes) if "grouped" in c.name]
            cases += [c for c in _mx_cases(name, x, w, None) if " dual " in c.name]
            cases += [Case("npu_quantize", "quantization", f"HiF8 per expert {_DTYPE_NAME[dtype]} {list(w.shape)} "
                           f"max {HIF8_INPUT_MAX:g} {name}", (w, HIF8_INPUT_MAX), _hif8)]
    return cases


def _group_lists(total, groups, gen) -> dict[str, torch.Tensor]:
    """ragged (uneven, none a multiple of 32 by design), with empty groups, one single group."""
    return {"ragged": _ragged(total, groups, gen), "with empty groups": _ragged(total, groups, gen, empty=True),
            "single group": torch.tensor([total])}


def _limit_cases(gen) -> list[Case]:
    """One input for each Limits line about quantization kernels (small shapes; the Limits of
    docs/numerics-and-limits.md)."""
    M, K, sizes = 96, 128, torch.tensor([40, 0, 56])
    cases = []
    for dtype in (_BF16, _FP32):
        # blocks with amax < 2**-118: a 32 x 32 square of values below 2**-119
        x, w = _rand(gen, (M, K), dtype), _rand(gen, (M, K), dtype)
        tiny = torch.zeros(M, K, dtype=torch.bool)
        tiny[:32, :32] = True
        tiny_values = (torch.randn(32, 32, generator=gen).clamp(-3.9, 3.9) * 2.0**-121).to(dtype)
        x[:32, :32], w[:32, :32] = tiny_values, tiny_values
        cases += _mx_cases("tiny-amax blocks", x, w, sizes, (tiny, tiny), "mx-tiny-amax", "all", dual_limit=None)
        # NaN / +-Inf elements: their blocks
        x, w = _rand(gen, (M, K), dtype), _rand(gen, (M, K), dtype)
        special = torch.zeros(M, K, dtype=torch.bool)
        for (r, c), v in (((3, 40), float("nan")), ((50, 100), float("inf")), ((70, 5), float("-inf"))):
            x[r, c], w[r, c], special[r, c] = v, v, True
        cases += _mx_cases("NaN / Inf blocks", x, w, sizes, (special, special), "mx-nonfinite-block", "any",
                           dual_limit="mx-nonfinite-block")
        # all-zero tensors: no Limits line, they must agree
        zeros = torch.zeros(M, K, dtype=dtype)
        cases += _mx_cases("all zero", zeros, zeros, sizes)
        experts = _rand(gen, (3, 64, K), dtype)
        experts[1] = 0.0
        cases += _hif8_cases("all zero", zeros, experts)
    # HiF8 with NaN / Inf: npu_dynamic_quant (BF16) keeps the kernel's scale and codes
    x = _rand(gen, (M, K), _BF16)
    x[7, 9], x[60, 3] = float("inf"), float("nan")
    everything = {"codes": torch.ones(M, K, dtype=torch.bool), "scale": torch.ones((), dtype=torch.bool)}
    cases += [c for c in _hif8_cases("NaN / Inf", x, allowed=everything, limit="hif8-dynamic-nonfinite")
              if c.op == "npu_dynamic_quant"]
    # npu_quantize (FP32) with +-Inf: the SAT cast clamps them
    x = _rand(gen, (M, K), _FP32)
    inf = torch.zeros(M, K, dtype=torch.bool)
    for r, c, v in ((7, 9, float("inf")), (60, 3, float("-inf"))):
        x[r, c], inf[r, c] = v, True
    cases += _hif8_cases("+-Inf", x, allowed={"codes": inf}, limit="hif8-quantize-sat-inf",
                         with_scale_limit=("hif8-quantize-sat-inf", {"codes": inf}))
    return cases


# ---------------------------------------------------------------- GEMM cases
def _operands(gen, fmt, layout, M, N, K):
    """(left, right) of one dense GEMM direction: fprop X.W^T, dgrad dY.W, wgrad dY^T.X (emulation, CPU)."""
    with ops.force_backend("emulation"):
        x, w, dy = _rand(gen, (M, K), _BF16), _rand(gen, (N, K), _BF16), _rand(gen, (M, N), _BF16)
        if fmt == Format.MXFP8_E4M3:
            q = {"NT": ((x, "row"), (w, "row")), "NN": ((dy, "row"), (w, "col")), "TN": ((dy, "col"), (x, "col"))}
            return tuple(ops.quantize_mxfp8(t, o) for t, o in q[layout])
        left = dy if layout != "NT" else x
        right = {"NT": w, "NN": w, "TN": x}[layout]
        return (ops.quantize_hif8(left, HIF8_GRAD_MAX if layout != "NT" else HIF8_INPUT_MAX),
                ops.quantize_hif8(right, HIF8_INPUT_MAX))


def _grouped_operands(gen, fmt, layout, T, E, N, K, group_list):
    with ops.force_backend("emulation"):
        x, w, dy = _rand(gen, (T, K), _BF16), _rand(gen, (E, N, K), _BF16), _rand(gen, (T, N), _BF16)
        if fmt == Format.MXFP8_E4M3:
            if layout == "TN":
                return (ops.quantize_mxfp8(dy, "col", group_sizes=group_list),
                        ops.quantize_mxfp8(x, "col", group_sizes=group_list))
            left = ops.quantize_mxfp8(x if layout == "NT" else dy, "row")
            return left, ops.quantize_mxfp8(w, "row" if layout == "NT" else "col")
        grad = HIF8_GRAD_MAX
        if layout == "TN":
            return ops.quantize_hif8(dy, grad), ops.quantize_hif8(x, HIF8_INPUT_MAX)
        left = ops.quantize_hif8(x, HIF8_INPUT_MAX) if layout == "NT" else ops.quantize_hif8(dy, grad)
        return left, ops.quantize_hif8(w, HIF8_INPUT_MAX)


_DIRECTION = {"NT": "fprop", "NN": "dgrad", "TN": "wgrad"}


def _gemm_cases(shapes: ShapeSet, gen, output_dtypes) -> Iterator[Case]:
    """GEMM cases, made one at a time (the 16B's operands are large: only one case's live at once)."""
    for fmt in (Format.MXFP8_E4M3, Format.HIF8):
        fname = "MXFP8" if fmt == Format.MXFP8_E4M3 else "HiF8"
        for name, N, K in shapes.dense:
            for layout, direction in _DIRECTION.items():
                left, right = _operands(gen, fmt, layout, shapes.tokens, N, K)
                for out in output_dtypes:
                    yield Case("npu_quant_matmul", "gemm", f"{fname} {direction} M={shapes.tokens} N={N} K={K} "
                                      f"-> {_DTYPE_NAME[out]} {name}", (left, right, layout, out), _gemm,
                                      output_dtype=out)
        for name, E, N, K in shapes.grouped:
            for kind, sizes in _group_lists(shapes.routed, E, gen).items():
                groups = E if kind != "single group" else 1
                for layout, direction in _DIRECTION.items():
                    left, right = _grouped_operands(gen, fmt, layout, shapes.routed, groups, N, K, sizes)
                    for out in output_dtypes:
                        yield Case("npu_grouped_matmul", "gemm", f"{fname} grouped {direction} T={shapes.routed} "
                                          f"E={groups} N={N} K={K} {kind} -> {_DTYPE_NAME[out]} {name}",
                                          (left, right, sizes, layout, out), _grouped_gemm, output_dtype=out)
    # MX operands beyond the FP32 range: every element 448 x 2**127
    data = torch.full((64, 128), E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.full((64, 128 // MX_BLOCK_SIZE), 254, dtype=torch.uint8)
    big = QuantizedOperand(data, scale, _BF16, Format.MXFP8_E4M3, "row")
    yield Case("npu_quant_matmul", "gemm", "MXFP8 fprop, operands 448 x 2**127 -> bf16",
                      (big, big, "NT", _BF16), _gemm, "mx-gemm-range", None, _BF16)


def build_cases(shapes: ShapeSet, seed: int = 2026) -> Iterator[Case]:
    """Every case for one shape set: quantization (both scale rules), the Limits inputs, GEMMs
    (those made as they are consumed)."""
    gen = torch.Generator().manual_seed(seed)
    out = (_BF16,) if shapes.name == "16b" else (_BF16, _FP32)
    yield from _quantization_cases(shapes, gen)
    yield from _limit_cases(gen)
    yield from _gemm_cases(shapes, gen, out)


def move(obj, device):
    """Inputs on ``device`` (tensors and operands; other values as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, QuantizedOperand):
        return dataclasses.replace(obj, data=obj.data.to(device), scale=obj.scale.to(device),
                                   group_sizes=None if obj.group_sizes is None else obj.group_sizes.to(device))
    return obj
