"""Fakes for what cannot run here (torch_npu). Install with ``install_fake_torch_npu(monkeypatch)``."""
from __future__ import annotations

import sys

import torch

from tests.fakes.capability import FakeNpuConfig, kernels_of_cann
from tests.fakes.torch_npu import Call, FakeTorchNpu

__all__ = ["install_fake_torch_npu", "FakeTorchNpu", "FakeNpuConfig", "Call"]


def install_fake_torch_npu(monkeypatch, *, chip: str = "Ascend950DT_9571", cann_version: str = "9.2.0",
                           kernels=None, without_kernels=(), device_count: int = 1,
                           features=()) -> FakeTorchNpu:
    """Put a fresh recording ``torch_npu`` in ``sys.modules`` (with ``torch_npu.npu``,
    ``torch_npu.npu.utils``, ``torch_npu.version``) and set ``torch.npu`` to its device module, as
    the real wheel's ``torch._register_device_module("npu", torch_npu.npu)`` does; monkeypatch
    undoes it all after the test.

    chip: the SoC name ``torch.npu.get_device_name()`` returns (e.g. "Ascend950PR_9579",
        "Ascend910B3"); ``get_soc_version()`` follows from it.
    cann_version: what ``torch_npu.npu.utils.get_cann_version()`` returns; the aclnn kernels the
        ops may use are those that release ships (capability.KERNEL_SINCE) unless ``kernels`` (an
        explicit set of aclnn names) is given; ``without_kernels`` removes names from that set.
    features: extra capability flags (capability.FEATURE_SINCE) to force on.
    """
    base = kernels_of_cann(cann_version) if kernels is None else frozenset(kernels)
    config = FakeNpuConfig(chip=chip, cann_version=cann_version, kernels=base - frozenset(without_kernels),
                           device_count=device_count, extra_features=frozenset(features))
    fake = FakeTorchNpu(config)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", fake.npu)
    monkeypatch.setitem(sys.modules, "torch_npu.npu.utils", fake.npu.utils)
    monkeypatch.setitem(sys.modules, "torch_npu.npu.aclnn", fake.npu.aclnn)
    monkeypatch.setitem(sys.modules, "torch_npu.version", fake.version)
    monkeypatch.setattr(torch, "npu", fake.npu, raising=False)
    return fake
