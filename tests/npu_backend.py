"""Run te_npu's NPU backend on CPU: the vendor-faithful fake ``torch_npu`` plus its kernel lookup.

``install_npu_backend(monkeypatch, **fake_options)`` installs ``tests.fakes`` (options: ``chip``,
``cann_version``, ``kernels``, ``without_kernels``, ``device_count``) and points te_npu's aclnn
kernel lookup (``te_npu.ops.capability.aclnn_kernel_available``, a dlsym in CANN's libraries on
a real machine) at the fake's kernel set. Then ``te_npu.ops.force_backend("npu")`` routes every
quantization and GEMM through ``te_npu/ops/npu.py`` for CPU tensors.

``npu_backend_process(**fake_options)`` does the same for a whole spawned process (a worker of
``tests.distributed.harness.run_ranks``), undone when the context exits.
"""
from __future__ import annotations

import contextlib

import pytest

from te_npu.ops import capability, force_backend
from tests.fakes import install_fake_torch_npu

__all__ = ["install_npu_backend", "npu_backend_process"]


def install_npu_backend(monkeypatch, **fake_options):
    """Install the fake and its kernel lookup; returns the fake (``calls``, ``calls_of``, ``fail``)."""
    fake = install_fake_torch_npu(monkeypatch, **fake_options)
    monkeypatch.setattr(capability, "aclnn_kernel_available", fake.aclnn_kernel_available)
    return fake


@contextlib.contextmanager
def npu_backend_process(**fake_options):
    """Fake installed and ``force_backend("npu")`` entered for the block (spawned ranks)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake = install_npu_backend(monkeypatch, **fake_options)
        with force_backend("npu"):
            yield fake
