"""TE 2.x's ``is_*_available`` probes: TE's return shape (a bool; ``(bool, reason)`` with
``return_reason=True``) and the A5's answer (te_npu's capability gate through the fake torch_npu)."""
import pytest

import te_npu
from tests.npu_backend import install_npu_backend

TE_PROBES = ["is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available",
             "is_bf16_available"]
"""Every ``is_*_available`` ``transformer_engine.pytorch`` exports (TE 2.x ``__init__.py``)."""


@pytest.mark.parametrize("name", TE_PROBES)
def test_te_probe_has_te_s_return_shape(monkeypatch, name):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    probe = getattr(te_npu, name)
    plain, with_reason = probe(), probe(return_reason=True)
    assert type(plain) is bool
    assert isinstance(with_reason, tuple) and len(with_reason) == 2
    assert with_reason[0] is plain and isinstance(with_reason[1], str)
    assert plain or with_reason[1]  # unavailable always says why


def test_te_probes_on_an_ascend_950dt(monkeypatch):
    install_npu_backend(monkeypatch)
    assert te_npu.is_fp8_available() and te_npu.is_mxfp8_available() and te_npu.is_hif8_available()
    assert te_npu.is_bf16_available(return_reason=True) == (True, "")
    ok, reason = te_npu.is_fp8_block_scaling_available(return_reason=True)
    assert not ok and "Float8BlockScaling" in reason and "MXFP8BlockScaling" in reason
    ok, reason = te_npu.is_nvfp4_available(return_reason=True)
    assert not ok and "FP4" in reason


def test_fp8_is_available_where_only_hif8_runs(monkeypatch):
    """An Ascend 950PR runs HiF8 but not MXFP8: TE's FP8 gate is open (an 8-bit recipe runs)."""
    install_npu_backend(monkeypatch, chip="Ascend950PR_9579")
    assert te_npu.is_fp8_available() and not te_npu.is_mxfp8_available()


def test_fp8_unavailable_names_the_missing_chip(monkeypatch):
    install_npu_backend(monkeypatch, chip="Ascend910B3")
    ok, reason = te_npu.is_fp8_available(return_reason=True)
    assert not ok and "Ascend910B3" in reason and "MXFP8:" in reason and "HiF8:" in reason
