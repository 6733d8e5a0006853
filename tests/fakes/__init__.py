"""Fakes for what cannot run here (torch_npu). Install with ``install_fake_torch_npu(monkeypatch)``."""
from __future__ import annotations

import sys
import types

import torch

from tests.fakes.torch_npu import Call, FakeTorchNpu

__all__ = ["install_fake_torch_npu", "FakeTorchNpu", "Call"]


def install_fake_torch_npu(monkeypatch, *, device_count: int = 1) -> FakeTorchNpu:
    """Put a fresh recording ``torch_npu`` in ``sys.modules`` and a ``torch.npu`` stub reporting
    ``device_count`` devices; monkeypatch undoes both after the test."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: device_count), raising=False)
    return fake
