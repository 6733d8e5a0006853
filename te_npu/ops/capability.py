"""Capability gate: can the NPU kernels of a format run here?

``is_mxfp8_available`` / ``is_hif8_available`` report on the NPU path, checking, in order and
naming the first thing missing:

1. torch_npu importable and an NPU device visible (``torch.npu.device_count()``);
2. the chip: ``torch_npu.npu.get_soc_version()`` is Ascend 950 (the ``c10_npu::SocVersion``
   enum, ``Ascend950 = 260`` in torch_npu's ``NpuVariables.h``; the MX / HiF8 quant matmul and
   quant kernels are built for ascend950 only, ops-nn ``op_host/config/ascend950``). MXFP8 also
   needs an Ascend 950**DT** (``torch.npu.get_device_name()``, e.g. ``"Ascend950DT_9571"``):
   torch_npu's docs of ``npu_dynamic_mx_quant_with_dual_axis`` and
   ``npu_grouped_dynamic_mx_quant`` say "该接口仅在Ascend 950DT上支持";
3. the CANN release: MXFP8 refreshes FP32 master weights through ``npu_dynamic_mx_quant``,
   whose FP32 input came with CANN 9.1.0 (ops-nn ``dynamic_mx_quant_def.cpp`` DT_FLOAT on the
   9.1.0 branch) -- ``torch_npu.npu.utils.get_cann_version()``;
4. every torch_npu op and dtype attribute the format's wrappers call (``REQUIRED_NPU_ATTRS``);
5. every aclnn kernel those ops dispatch to for te_npu's arguments (``REQUIRED_ACLNN_KERNELS``):
   op-plugin picks the kernel at call time with ``check_aclnn_kernel_available`` (a dlsym of
   ``aclnn<Name>`` and ``aclnn<Name>GetWorkspaceSize`` in the CANN op libraries) and would fail
   mid-run without it; :func:`aclnn_kernel_available` makes the same lookup (torch_npu has no
   Python API for it).

They never raise and never import torch_npu at te_npu import time (only when called). Inside
``te_npu.ops.force_backend("npu")`` the gate checks the NPU path whatever the device.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import re
import warnings
from dataclasses import dataclass, field

import torch

from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import Format
from te_npu.ops.registry import device_type, forced_backend

__all__ = [
    "is_mxfp8_available",
    "is_hif8_available",
    "require_low_precision",
    "aclnn_kernel_available",
    "REQUIRED_NPU_ATTRS",
    "REQUIRED_ACLNN_KERNELS",
    "REQUIRED_CHIP",
    "ASCEND950_SOC_VERSION",
    "MIN_CANN_VERSION",
    "GateReading",
    "read_gate",
    "failed_checks",
    "capability_waived",
    "CAPABILITY_CHECKS",
]

ASCEND950_SOC_VERSION = 260  # torch_npu include/torch_npu/csrc/core/npu/NpuVariables.h SocVersion::Ascend950

REQUIRED_NPU_ATTRS: dict[Format, tuple[str, ...]] = {
    Format.MXFP8_E4M3: (
        "float8_e8m0fnu",
        "npu_dynamic_mx_quant",
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_grouped_dynamic_mx_quant",
        "npu_quant_matmul",
        "npu_grouped_matmul",
    ),
    Format.HIF8: ("hifloat8", "npu_dynamic_quant", "npu_quantize", "npu_quant_matmul", "npu_grouped_matmul"),
}

REQUIRED_ACLNN_KERNELS: dict[Format, tuple[str, ...]] = {
    # npu_dynamic_mx_quant -> V3 / V2 / V1 (op-plugin DynamicMxQuantKernelNpuOpApi.cpp; any does)
    # npu_grouped_dynamic_mx_quant: V2 (V1 refuses an explicit scale_alg, which te_npu sends)
    Format.MXFP8_E4M3: ("aclnnDynamicMxQuant", "aclnnDynamicMxQuantWithDualAxis", "aclnnGroupedDynamicMxQuantV2",
                        "aclnnQuantMatmulV5", "aclnnGroupedMatmulV4"),
    # npu_dynamic_quant with dst_type_max != 0 -> V4 (op-plugin DynamicQuantKernelNpuOpApi.cpp select_version)
    Format.HIF8: ("aclnnDynamicQuantV4", "aclnnQuantize", "aclnnQuantMatmulV5", "aclnnGroupedMatmulV4"),
}

MIN_CANN_VERSION: dict[Format, tuple[tuple[int, ...], str]] = {
    Format.MXFP8_E4M3: ((9, 1, 0), "FP32 input to npu_dynamic_mx_quant (the FP32-master weight refresh)"),
}

# The chip name each format needs (``torch.npu.get_device_name()`` prefix), with why.
REQUIRED_CHIP: dict[Format, tuple[str, str]] = {
    Format.MXFP8_E4M3: ("Ascend950DT", "torch_npu supports npu_dynamic_mx_quant_with_dual_axis and "
                                       "npu_grouped_dynamic_mx_quant on Ascend 950DT only"),
    Format.HIF8: ("Ascend950", "the HiFloat8 quant / quant-matmul kernels are built for ascend950 only"),
}

_OPAPI_LIBRARIES = ("libopapi.so", "libaclnn_ops_infer.so", "libaclnn_ops_train.so", "libaclnn_math.so")


def _load_library(library: str):
    home = os.environ.get("ASCEND_HOME_PATH")
    for path in (library, os.path.join(home, "lib64", library) if home else None):
        if path is None:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def aclnn_kernel_available(name: str) -> bool:
    """Whether CANN's op libraries export ``name`` and ``name + "GetWorkspaceSize"`` -- the lookup
    op-plugin's ``check_aclnn_kernel_available`` makes (``op_plugin/utils/op_api_common.cpp``:
    dlsym in libopapi.so, then the other aclnn libraries), found through the loader path
    CANN's ``set_env.sh`` sets, or ``$ASCEND_HOME_PATH/lib64``."""
    for library in _OPAPI_LIBRARIES:
        handle = _load_library(library)
        if handle is not None and hasattr(handle, name) and hasattr(handle, name + "GetWorkspaceSize"):
            return True
    return False


@dataclass(frozen=True)
class GateReading:
    """What the gate read on this machine (every field None / empty where it could not be read).

    torch_npu: its ``__version__``, or None when not importable (``import_error`` says why);
    device_count: ``torch.npu.device_count()``; device_name: ``torch.npu.get_device_name()``;
    soc_version: ``torch_npu.npu.get_soc_version()``; cann_version: the raw
    ``get_cann_version()`` text; attrs / kernels: each torch_npu attribute and aclnn kernel of
    every format -> whether it was found."""

    torch: str
    torch_npu: str | None = None
    import_error: str | None = None
    device_count: int | None = None
    device_error: str | None = None
    device_name: str | None = None
    soc_version: int | None = None
    cann_version: str | None = None
    attrs: dict[str, bool] = field(default_factory=dict)
    kernels: dict[str, bool] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: ``read: torch_npu 2.13.0, 1 device(s), Ascend950DT_9571 (SoC 260), CANN 9.2.0``."""
        if self.torch_npu is None:
            return f"read: torch {self.torch}, torch_npu not importable"
        return (f"read: torch {self.torch}, torch_npu {self.torch_npu}, {self.device_count} device(s), "
                f"{self.device_name} (SoC version {self.soc_version}), CANN {self.cann_version}")


def read_gate() -> GateReading:
    """Everything the gate checks, read once (never raises; imports torch_npu when called)."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a broken CANN install raising at import
        return GateReading(torch=torch.__version__, import_error=f"{type(exc).__name__}: {exc}")
    reading = dict(torch=torch.__version__, torch_npu=str(getattr(torch_npu, "__version__", "?")))
    names = sorted({n for attrs in REQUIRED_NPU_ATTRS.values() for n in attrs})
    reading["attrs"] = {n: hasattr(torch_npu, n) for n in names}
    kernels = sorted({k for ks in REQUIRED_ACLNN_KERNELS.values() for k in ks})
    reading["kernels"] = {k: aclnn_kernel_available(k) for k in kernels}
    try:
        reading["cann_version"] = str(torch_npu.npu.utils.get_cann_version())
    except Exception:  # noqa: BLE001 - an old wheel without the query: unknown
        pass
    npu = getattr(torch, "npu", None)
    try:
        reading["device_count"] = npu.device_count() if npu is not None else 0
    except Exception as exc:
        return GateReading(**reading, device_error=f"torch.npu.device_count() failed ({type(exc).__name__}: {exc})")
    if reading["device_count"] < 1:
        return GateReading(**reading)
    try:
        reading["soc_version"] = torch_npu.npu.get_soc_version()
        reading["device_name"] = str(torch.npu.get_device_name())
    except Exception as exc:
        return GateReading(**reading, device_error=f"the chip could not be queried ({type(exc).__name__}: {exc})")
    return GateReading(**reading)


def _parse_cann(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    parts = []
    for piece in str(text).split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts) or None


def failed_checks(fmt: Format | str, reading: GateReading | None = None) -> list[str]:
    """Every check of the NPU path for ``fmt`` that fails, each as one clause saying what was read
    and what was expected; empty when the path is usable. The first two (torch_npu importable,
    an NPU visible) stop the list: nothing else can be read without them."""
    fmt = Format(fmt)
    r = read_gate() if reading is None else reading
    if r.torch_npu is None:
        return [f"torch_npu is not importable ({r.import_error}); expected an installed torch_npu"]
    if r.device_error is not None:
        return [r.device_error]
    if not r.device_count:
        return ["no NPU device is visible (torch.npu.device_count() = 0); expected at least 1"]
    failures = []
    chip, why = REQUIRED_CHIP[fmt]
    if r.soc_version != ASCEND950_SOC_VERSION or not str(r.device_name).startswith(chip):
        failures.append(f"{fmt.value} needs an {chip} ({why}); this chip is {r.device_name} (SoC version "
                        f"{r.soc_version}; expected a name starting with {chip!r} and SoC version "
                        f"{ASCEND950_SOC_VERSION})")
    if fmt in MIN_CANN_VERSION:
        need, why = MIN_CANN_VERSION[fmt]
        have = _parse_cann(r.cann_version)
        if have is None or have < need:
            shown = "unknown" if have is None else ".".join(map(str, have))
            failures.append(f"{fmt.value} needs CANN >= {'.'.join(map(str, need))} for {why}; this CANN is {shown}")
    missing = [n for n in REQUIRED_NPU_ATTRS[fmt] if not r.attrs.get(n, False)]
    if missing:
        failures.append(f"torch_npu {r.torch_npu} lacks {', '.join(missing)} (expected all of "
                        f"{', '.join(REQUIRED_NPU_ATTRS[fmt])})")
    kernels = [k for k in REQUIRED_ACLNN_KERNELS[fmt] if not r.kernels.get(k, False)]
    if kernels:
        failures.append(f"the CANN op libraries lack the aclnn kernel(s) {', '.join(kernels)} that {fmt.value} "
                        f"needs (looked up as op-plugin does, in {', '.join(_OPAPI_LIBRARIES)})")
    return failures


def _missing_reason(fmt: Format) -> str | None:
    """None when the NPU path for ``fmt`` is usable, else every failed check and what was read."""
    reading = read_gate()
    failures = failed_checks(fmt, reading)
    return None if not failures else f"{'; '.join(failures)} [{reading.summary()}]"


def _available(fmt: Format, return_reason: bool):
    reason = _missing_reason(fmt)
    ok = reason is None
    if not return_reason:
        return ok
    return ok, f"{fmt.value} NPU kernels available" if ok else reason


def is_mxfp8_available(return_reason: bool = False):
    """Whether the MXFP8 NPU kernels can run here; ``(bool, reason)`` with ``return_reason``."""
    return _available(Format.MXFP8_E4M3, return_reason)


def is_hif8_available(return_reason: bool = False):
    """Whether the HiF8 NPU kernels can run here; ``(bool, reason)`` with ``return_reason``."""
    return _available(Format.HIF8, return_reason)


CAPABILITY_CHECKS = ("strict", "warn")
"""``low_precision.capability_check``: ``strict`` refuses a device that fails a check; ``warn``
runs anyway with a loud warning naming each failed check (the self-check,
``python -m te_npu.selfcheck``, then tells whether the kernels agree with the emulation)."""

_FATAL = ("torch_npu is not importable", "no NPU device is visible", "torch.npu.device_count() failed",
          "the chip could not be queried")
_WAIVED: list[Format] = []


@contextlib.contextmanager
def capability_waived(recipe_format: Format | str):
    """Inside the block the gate lets ``recipe_format`` run whatever the checks read (a run that
    chose ``capability_check: warn`` and was warned once, see :func:`require_low_precision`)."""
    _WAIVED.append(Format(recipe_format))
    try:
        yield
    finally:
        _WAIVED.pop()


def require_low_precision(recipe_format: Format | str, device: torch.device | str, *,
                          capability_check: str = "strict") -> str:
    """Startup gate: the backend name ("npu" or "emulation") that will run ``recipe_format``
    on ``device`` (or the ``force_backend`` one); raises ``LowPrecisionUnavailableError`` with
    every failed check (what it read, what it expected). ``capability_check="warn"`` warns
    instead, naming each failed check, unless torch_npu or the device is missing altogether
    (nothing could run); inside :func:`capability_waived` the format passes unchecked."""
    if capability_check not in CAPABILITY_CHECKS:
        raise ValueError(f"capability_check must be one of {CAPABILITY_CHECKS}, got {capability_check!r}")
    fmt = Format(recipe_format)
    backend = forced_backend() or ("npu" if device_type(device) == "npu" else "emulation")
    if backend != "npu":
        return "emulation"
    if fmt in _WAIVED:
        return "npu"
    reading = read_gate()
    failures = failed_checks(fmt, reading)
    if not failures:
        return "npu"
    fatal = any(f.startswith(_FATAL) for f in failures)
    if capability_check == "strict" or fatal:
        hint = "" if fatal else " (low_precision.capability_check: warn runs anyway)"
        raise LowPrecisionUnavailableError(f"{fmt.value} on {device}: {'; '.join(failures)} "
                                           f"[{reading.summary()}]{hint}")
    lines = "\n".join(f"  - {f}" for f in failures)
    warnings.warn(f"!!! low_precision.capability_check: warn -- {fmt.value} runs on {device} although "
                  f"{len(failures)} capability check(s) failed [{reading.summary()}]:\n{lines}\n"
                  f"!!! run `python -m te_npu.selfcheck` to see whether the kernels agree with the emulation",
                  RuntimeWarning, stacklevel=2)
    return "npu"
