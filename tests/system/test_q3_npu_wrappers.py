"""The Q3 runs once more through the NPU wrappers: ``te_npu.ops.force_backend("npu")`` with the
vendor-faithful fake ``torch_npu`` installed in both spawned ranks (tests/npu_backend.py).

Same recipes, seed, data and phases as the emulation session runs (tiny DeepSeek-V3, 2 gloo
ranks, FSDP2; ``main``: 20 steps with a DCP save after step 17; ``variant``: no reshard after
forward + full recompute + gradient accumulation 2), then a DCP resume in fresh processes. Every
quantization and GEMM goes through te_npu/ops/npu.py into the fake's kernel models, and the run
equals the emulation run bitwise: each step's loss and global grad norm, and every FP32 master
(hence every optimizer update, hence every gradient) at the end of each phase. That holds
because each NPU route computes the emulation's numbers (the wrappers' contract, tested op by op
in tests/unit/ops/test_ops_npu.py) and the fake's GEMMs sum FP32-decoded operands in the same
order as the emulation's for these shapes (both are torch CPU FP32 matmuls on identically laid
out operands; the A5's cube-unit order is not published, see docs/numerics-and-limits.md, Limits).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.system import harness as H

PHASES = ("main", "variant")


@pytest.fixture(scope="module")
def npu_runs(tmp_path_factory, st_data_dir):
    """``fmt -> {"workdir", "ranks", "resumed"}`` of the NPU-wrapper runs (spawned on first use)."""
    cache = {}

    def run(fmt):
        if fmt not in cache:
            workdir = tmp_path_factory.mktemp(f"st_npu_{fmt}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ranks = H.spawn(H.run_main_worker, workdir, str(st_data_dir), fmt, PHASES, "npu")
                resumed = H.spawn(H.run_resume_worker, workdir, str(st_data_dir), fmt,
                                  H.MAIN_STEPS - H.SAVE_AT, "npu")
            cache[fmt] = {"workdir": workdir, "ranks": ranks, "resumed": resumed}
        return cache[fmt]

    return run


def _assert_phase_equal(npu_phase: dict, emu_phase: dict, what: str) -> None:
    for key in ("step", "lm_loss", "grad_norm", "updated"):
        assert H.per_step(npu_phase["records"], key) == H.per_step(emu_phase["records"], key), (what, key)
    assert set(npu_phase["masters"]) == set(emu_phase["masters"])
    for fqn, master in npu_phase["masters"].items():
        assert torch.equal(master, emu_phase["masters"][fqn]), (what, fqn)


def _assert_all_npu(probe) -> None:
    gemms = [e for _, e in probe.gemm_events]
    quants = [e for _, e in probe.quant_events]
    assert gemms and quants
    assert {e.backend for e in gemms} == {e.backend for e in quants} == {"npu"}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_q3_through_npu_wrappers_equals_emulation_bitwise(fmt, run_of, npu_runs):
    emulation, npu = run_of(fmt), npu_runs(fmt)
    for rank, (npu_rank, emu_rank) in enumerate(zip(npu["ranks"], emulation["ranks"])):
        for phase in PHASES:
            _assert_phase_equal(npu_rank[phase], emu_rank[phase], f"rank {rank} {phase}")
            _assert_all_npu(npu_rank[phase]["probe"])
        # DCP resume in fresh processes, still through the NPU wrappers: the continuous run's
        # steps 18-20 again, bitwise
        resumed = npu["resumed"][rank]
        assert resumed["step"] == H.SAVE_AT
        for key in ("step", "lm_loss", "grad_norm", "updated"):
            assert H.per_step(resumed["records"], key) == H.per_step(npu_rank["main"]["records"][H.SAVE_AT:], key)
        _assert_all_npu(resumed["probe"])
