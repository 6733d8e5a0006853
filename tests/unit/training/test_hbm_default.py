"""``scripts/estimate_memory.py --hbm-gb``: the default is the NPU's total memory on an NPU, else
the spec's Q3 card (Ascend A5, 96 GiB); the verdict is judged against it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from te_npu.training.capacity import A5_Q3_HBM_BYTES, FIT_MARGIN, CapacityReport, default_hbm_bytes
from tests.fakes import install_fake_torch_npu

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "estimate_memory.py"


@pytest.fixture
def estimate_memory():
    spec = importlib.util.spec_from_file_location("estimate_memory_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(peak_bytes: int, hbm_bytes: int) -> CapacityReport:
    step = SimpleNamespace(name="micro-batch 1 backward", peak_bytes=peak_bytes)  # a StageMemory's two fields read
    return CapacityReport(config="x", world_size=8, micro_batches=1, tokens_per_micro_batch=4096,
                          hbm_bytes=hbm_bytes, stages=[step], resting_bytes=0, resting_by_category={},
                          replicated_params={}, replicated_bytes=0, plan="")


def test_default_is_the_spec_a5_without_an_npu(monkeypatch, estimate_memory):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert A5_Q3_HBM_BYTES == 96 * 2**30
    hbm, source = estimate_memory.hbm_verdict_bytes(None)
    assert hbm == A5_Q3_HBM_BYTES and "96 GiB" in source
    assert estimate_memory.hbm_verdict_bytes(144.0) == (144 * 10**9, "--hbm-gb")


def test_default_is_the_devices_total_memory_on_an_npu(monkeypatch):
    fake = install_fake_torch_npu(monkeypatch)
    fake.config.total_memory = 64 * 2**30
    hbm, source = default_hbm_bytes()
    assert hbm == 64 * 2**30 and "Ascend950DT_9571" in source


def test_a_peak_that_fits_a_950dt_does_not_fit_the_default_a5():
    """100 GiB: under 90 % of 144 GB (120.7 GiB) but over 90 % of 96 GiB (86.4 GiB)."""
    peak = 100 * 2**30
    assert _report(peak, 144 * 10**9).fits
    assert not _report(peak, A5_Q3_HBM_BYTES).fits
    assert _report(int(FIT_MARGIN * A5_Q3_HBM_BYTES), A5_Q3_HBM_BYTES).fits
