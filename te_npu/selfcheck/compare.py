"""How a device result is compared with the emulation's, and the verdicts.

Quantization: codes and scales bit for bit, both in te_npu's canonical layout (the device's
kernel-layout scales read back through ``te_npu.ops.layouts``). GEMMs: NRMSE against the
emulation (the cube unit's FP32 summation order may differ), the largest distance in units in
the last place of the output dtype, the number of differing elements, and non-finite values at
the same places. A case tagged with a Limits line may differ inside its ``allowed`` mask only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AGREES", "KNOWN", "DIFFERS", "ERROR", "GEMM_NRMSE_TOLERANCE", "Outcome", "compare_bits", "compare_gemm"]

AGREES, KNOWN, DIFFERS, ERROR = "agrees", "known difference", "differs", "error"

GEMM_NRMSE_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""NRMSE a GEMM may show against the emulation: FP32 sums in another order (FP32 output), or that
plus the output rounding flipping by one unit in the last place (BF16 / FP16: 2**-8 / 2**-11)."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass
class Outcome:
    """One comparison: verdict, a one-line detail, and the numbers behind it."""

    verdict: str
    detail: str = ""
    metrics: dict = field(default_factory=dict)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in (mask.nonzero()[0] if mask.any() else ()))


def compare_bits(device: dict[str, torch.Tensor], emulation: dict[str, torch.Tensor],
                 allowed: dict[str, torch.Tensor] | None = None, limit: str | None = None) -> Outcome:
    """Bitwise comparison of named outputs; ``allowed[name]`` (bool, same shape) marks where a
    documented difference (Limits ``limit``) may show; a missing name allows none."""
    allowed = allowed or {}
    counts, outside = {}, []
    for name, want in emulation.items():
        got = device[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            return Outcome(DIFFERS, f"{name}: device {tuple(got.shape)} {got.dtype}, emulation {tuple(want.shape)} "
                                    f"{want.dtype}")
        diff = _bits(got) != _bits(want)
        counts[name] = int(diff.sum())
        mask = allowed.get(name)
        out = diff if mask is None else diff & ~mask
        if out.any():
            at = _first(out)
            g, w = _bits(got)[at].item(), _bits(want)[at].item()
            outside.append(f"{name}: {int(out.sum())} of {diff.numel()} differ (first at {list(at)}: device "
                           f"{g & 0xFFFFFFFF:#x}, emulation {w & 0xFFFFFFFF:#x})")
    metrics = {"differing": counts}
    if outside:
        where = " outside the documented place" if limit else ""
        return Outcome(DIFFERS, "; ".join(outside) + where, metrics)
    if any(counts.values()):
        shown = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
        return Outcome(KNOWN, f"differs only where documented ({shown} elements)", metrics)
    note = " (the documented difference did not show here)" if limit else ""
    return Outcome(AGREES, "bitwise" + note, metrics)


def _ordered(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Sign-magnitude float bits -> integers ordered like the values (ulp distance = difference)."""
    b = bits.to(torch.int64) & ((1 << width) - 1)
    sign = 1 << (width - 1)
    return torch.where(b >= sign, sign - b, b)


def compare_gemm(device: torch.Tensor, emulation: torch.Tensor, output_dtype: torch.dtype,
                 limit: str | None = None) -> Outcome:
    """NRMSE / max ulp / differing count of a GEMM output; non-finite values must sit at the same
    places. A ``limit`` case (no mask: the whole output) reports a difference as known."""
    if device.shape != emulation.shape or device.dtype != emulation.dtype:
        return Outcome(DIFFERS, f"device {tuple(device.shape)} {device.dtype}, emulation {tuple(emulation.shape)} "
                                f"{emulation.dtype}")
    width = 8 * emulation.element_size()
    got_bits, want_bits = _bits(device), _bits(emulation)
    differing = int((got_bits != want_bits).sum())
    got, want = device.double(), emulation.double()
    finite = torch.isfinite(got) & torch.isfinite(want)
    nonfinite_mismatch = int(((~torch.isfinite(got) | ~torch.isfinite(want)) & (got_bits != want_bits)).sum())
    err = (got - want)[finite]
    ref = want[finite]
    nrmse = float(err.norm() / ref.norm()) if ref.numel() and float(ref.norm()) > 0 else float(err.norm())
    ulps = (_ordered(got_bits, width) - _ordered(want_bits, width)).abs()[finite]
    max_ulp = int(ulps.max()) if ulps.numel() else 0
    tol = GEMM_NRMSE_TOLERANCE[output_dtype]
    metrics = dict(nrmse=nrmse, max_ulp=max_ulp, differing=differing, elements=emulation.numel(),
                   nonfinite_mismatch=nonfinite_mismatch, tolerance=tol)
    detail = (f"NRMSE {nrmse:.3g} (tolerance {tol:.3g}), max {max_ulp} ulp, {differing} of {emulation.numel()} "
              f"elements differ" + (f", {nonfinite_mismatch} non-finite at other places" if nonfinite_mismatch else ""))
    if limit is not None and differing:
        return Outcome(KNOWN, detail, metrics)
    if nonfinite_mismatch or not nrmse <= tol:
        return Outcome(DIFFERS, detail, metrics)
    return Outcome(AGREES, ("bitwise" if not differing else "within tolerance") + f": {detail}", metrics)
