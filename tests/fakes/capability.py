"""The device and CANN the fake pretends to run on, and the queries a real program can make.

Real APIs behind each query (torch_npu 2.13.0 wheel, Python side):
* ``torch.npu`` is ``torch_npu.npu``: ``torch._register_device_module("npu", torch_npu.npu)`` in
  ``torch_npu/_init/registry/backend.py``.
* ``torch.npu.device_count()`` / ``is_available()`` / ``current_device()`` / ``set_device()``:
  ``torch_npu/npu/__init__.py``.
* ``torch.npu.get_device_name(device=None)``: checks the index against ``device_count()``
  (``AssertionError("Invalid device id")``), then returns ``torch_npu._C._npu_getDeviceName()``
  = ``aclrtGetSocName()`` (Ascend/pytorch ``torch_npu/csrc/npu/Module.cpp`` GetDeviceName),
  e.g. ``"Ascend950DT_9571"``; the names are the SoC table compiled into libtorch_npu.so.
* ``torch.npu.get_device_properties(i)``: ``.name`` (same SoC name), ``.total_memory``,
  ``.cube_core_num``, ``.vector_core_num``, ``.L2_cache_size`` (Module.cpp initDeviceProperty).
* ``torch_npu.npu.get_soc_version()`` (``torch_npu/npu/_backends.py``, re-exported by
  ``torch_npu/npu/__init__.py``): an int, the ``c10_npu::SocVersion`` enum of
  ``include/torch_npu/csrc/core/npu/NpuVariables.h`` (Ascend910B1 = 220 ... Ascend950 = 260);
  torch_npu itself gates Ascend 950 code on ``get_soc_version() >= 260``
  (``op_plugin/meta/_meta_registrations.py``, ``_inductor/config.py``).
* ``torch_npu.npu.utils.get_cann_version(module="CANN")`` -> str, and
  ``torch_npu.npu.utils._is_gte_cann_version(version, module="CANN")`` -> bool.
* ``torch.npu.get_device_capability()`` returns None (or ``TORCH_NPU_DEVICE_CAPABILITY``) with a
  warning that it "does not represent the actual capability of the NPU device", and
  ``torch.npu.aclnn.version()`` warns "isn't implemented!" and returns None
  (``torch_npu/npu/aclnn/backends.py``): neither can gate a kernel.
* Kernel availability has NO Python API. op-plugin decides with
  ``check_aclnn_kernel_available(name)`` = dlsym of ``name`` and ``name + "GetWorkspaceSize"`` in
  libopapi.so (then libaclnn_ops_infer.so, libaclnn_ops_train.so, ...), op-plugin
  ``op_plugin/utils/op_api_common.cpp``. A program can do the same with ctypes; the fake offers
  ``torch_npu.aclnn_kernel_available(name)`` as a test-only stand-in (not a real torch_npu API).
"""
from __future__ import annotations

import os
import re
import types
import warnings
from dataclasses import dataclass, field

# NpuVariables.h c10_npu::SocVersion
SOC_VERSION_BY_PREFIX = (
    ("Ascend910PremiumA", 100), ("Ascend910ProA", 101), ("Ascend910A", 102), ("Ascend910ProB", 103),
    ("Ascend910B1", 220), ("Ascend910B2C", 222), ("Ascend910B2", 221), ("Ascend910B3", 223),
    ("Ascend910B4-1", 225), ("Ascend910B4", 224),
    ("Ascend910_9391", 250), ("Ascend910_9392", 251), ("Ascend910_9381", 252), ("Ascend910_9382", 253),
    ("Ascend910_9372", 254), ("Ascend910_9362", 255), ("Ascend910_9363", 256),
    ("Ascend950", 260),  # every Ascend950DT_* / Ascend950PR_* name in libtorch_npu.so's SoC table
)
ASCEND950 = 260
UNSUPPORTED_SOC = -1

# The first CANN release whose op repositories ship each aclnn API: presence of
# docs/aclnn<Name>.md on the release branches 8.5.0 / 9.0.0 / 9.1.0 / 9.2.0(-beta.2) of
# hicann/ops-nn and cannmirror/ops-transformer (gmm/grouped_matmul). Releases before 8.5.0 are
# not in those repositories: the fake gives them none of these kernels.
KERNEL_SINCE = {
    "aclnnDynamicMxQuant": "8.5.0",
    "aclnnDynamicMxQuantV2": "9.1.0",
    "aclnnDynamicMxQuantV3": "9.2.0",
    "aclnnDynamicMxQuantWithDualAxis": "9.0.0",
    "aclnnDynamicMxQuantWithDualAxisV2": "9.1.0",
    "aclnnGroupedDynamicMxQuant": "8.5.0",
    "aclnnGroupedDynamicMxQuantV2": "9.1.0",
    "aclnnDynamicQuant": "8.5.0",
    "aclnnDynamicQuantV2": "8.5.0",
    "aclnnDynamicQuantV3": "8.5.0",
    "aclnnDynamicQuantV4": "9.1.0",
    "aclnnQuantize": "8.5.0",
    "aclnnQuantMax": "9.1.0",
    "aclnnGroupedQuantMax": "9.2.0",
    "aclnnQuantMatmulV5": "8.5.0",
    "aclnnQuantMatmulWeightNz": "8.5.0",
    "aclnnTransQuantParamV2": "8.5.0",
    "aclnnTransQuantParamV3": "8.5.0",
    "aclnnGroupedMatmul": "8.5.0",
    "aclnnGroupedMatmulV4": "8.5.0",
    "aclnnGroupedMatmulV5": "8.5.0",
    "aclnnGroupedMatmulWeightNz": "8.5.0",
}
# Kernel capabilities that came with a CANN release without a new aclnn version:
# ops-nn commit d496e976d "dynamic_mx_quant support fp32" (2026-06-18) is on 9.1.0, not 9.0.0
# (DT_FLOAT in quant/dynamic_mx_quant/op_host/dynamic_mx_quant_def.cpp per branch).
FEATURE_SINCE = {"dynamic_mx_quant_fp32_input": "9.1.0"}


def parse_cann_version(version: str) -> tuple[int, ...]:
    """'9.1.0', '9.2.0.beta.2', '8.5.RC1' -> comparable leading integers (RC/beta drop out)."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def kernels_of_cann(version: str) -> frozenset[str]:
    """The aclnn APIs a CANN release ships (KERNEL_SINCE)."""
    have = parse_cann_version(version)
    return frozenset(k for k, since in KERNEL_SINCE.items() if have >= parse_cann_version(since))


def soc_version_of(chip: str) -> int:
    """``get_soc_version()`` for a SoC name (NpuVariables.h enum), -1 when not in the table."""
    for prefix, value in SOC_VERSION_BY_PREFIX:
        if chip.startswith(prefix):
            return value
    return UNSUPPORTED_SOC


@dataclass
class FakeNpuConfig:
    """What the fake device reports. ``kernels=None`` derives the aclnn set from ``cann_version``."""

    chip: str = "Ascend950DT_9571"
    cann_version: str = "9.2.0"
    kernels: frozenset[str] | None = None
    device_count: int = 1
    total_memory: int = 128 * 1024**3
    extra_features: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.kernels is None:
            self.kernels = kernels_of_cann(self.cann_version)
        self.kernels = frozenset(self.kernels)

    @property
    def soc_version(self) -> int:
        return soc_version_of(self.chip)

    def has_kernel(self, api: str) -> bool:
        return api in self.kernels

    def has_feature(self, feature: str) -> bool:
        if feature in self.extra_features:
            return True
        since = FEATURE_SINCE[feature]
        return parse_cann_version(self.cann_version) >= parse_cann_version(since)

    def is_950(self) -> bool:
        return self.soc_version == ASCEND950

    def is_950dt(self) -> bool:
        return self.chip.startswith("Ascend950DT")


def device_module(config: FakeNpuConfig) -> types.ModuleType:
    """A stand-in for ``torch_npu.npu`` (= ``torch.npu``) answering the queries listed above."""
    mod = types.ModuleType("torch_npu.npu")
    state = {"device": 0}

    def _index(device) -> int:
        if device is None:
            return state["device"]
        if isinstance(device, int):
            return device
        index = getattr(device, "index", None)
        if index is None and isinstance(device, str):
            index = int(device.split(":")[1]) if ":" in device else None
        return state["device"] if index is None else index

    def _checked(device) -> int:
        index = _index(device)
        if index < 0 or index >= config.device_count:
            raise AssertionError("Invalid device id")  # torch_npu/npu/__init__.py get_device_name
        return index

    mod.device_count = lambda: config.device_count
    mod.is_available = lambda: config.device_count > 0
    mod.current_device = lambda: state["device"]
    mod.set_device = lambda device: state.__setitem__("device", _index(device))
    mod.synchronize = lambda device=None: None
    mod.get_device_name = lambda device_name=None: (_checked(device_name), config.chip)[1]
    mod.get_device_properties = lambda device_name=None: (
        _checked(device_name),
        types.SimpleNamespace(name=config.chip, total_memory=config.total_memory, cube_core_num=0,
                              vector_core_num=0, L2_cache_size=0),
    )[1]
    mod.get_soc_version = lambda: config.soc_version

    def get_device_capability(device=None):
        value = os.getenv("TORCH_NPU_DEVICE_CAPABILITY")
        warnings.warn("The return value of get_device_capability is only for compatibility with PyTorch "
                      "and does not represent the actual capability of the NPU device.")
        return tuple(int(p) for p in value.split(".")) if value else None

    mod.get_device_capability = get_device_capability
    aclnn = types.ModuleType("torch_npu.npu.aclnn")

    def version():
        warnings.warn("torch.npu.aclnn.version isn't implemented!")
        return None

    aclnn.version = version
    mod.aclnn = aclnn
    utils = types.ModuleType("torch_npu.npu.utils")
    utils.get_cann_version = lambda module="CANN": config.cann_version
    utils._is_gte_cann_version = lambda version, module="CANN": (
        parse_cann_version(config.cann_version) >= parse_cann_version(version))
    utils.get_soc_version = mod.get_soc_version
    mod.utils = utils
    return mod
