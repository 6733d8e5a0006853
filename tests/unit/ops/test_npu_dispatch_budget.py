"""Launch budget of the NPU path (scripts/bench_npu_dispatch.py): host-side torch ops per
TELinear / TEGroupedLinear fwd+bwd, counted outside the torch_npu kernels, views excluded."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_npu_dispatch.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_npu_dispatch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_telinear_fwd_bwd_stays_within_the_launch_budget(bench, fmt):
    launches = bench.measure("TELinear", fmt, 1, tokens=64, hidden=64, ffn=128)
    assert launches.total <= bench.LIMITS["TELinear"], launches.ops
    assert sum(launches.npu_calls.values()) == 5  # 2 quantizations (X, dY) + 3 GEMMs


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_grouped_linear_launches_do_not_grow_with_the_expert_count(bench, fmt):
    """Ragged routing (empty groups, sizes not multiples of 32) at G = 8 and G = 64."""
    counts = {g: bench.measure("TEGroupedLinear", fmt, g, tokens=256, hidden=64, ffn=128) for g in (8, 64)}
    assert counts[8].ops == counts[64].ops and counts[8].npu_calls == counts[64].npu_calls
    assert counts[64].total <= bench.LIMITS["TEGroupedLinear"], counts[64].ops
