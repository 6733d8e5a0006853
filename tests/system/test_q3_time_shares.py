"""Time shares (``te_npu.testing.time_shares``) on a real profile: one rank of the tiny model
through the production ``Trainer``, two steps under ``te_npu.testing.step_profile.profile_steps``
(the profiled job of ``scripts/q3_acceptance.py`` and of ``scripts/compare_recipes.py``). The
8-bit formats show quant and MM-GMM time under te_npu's own ranges; BF16 shows MM-GMM (aten
GEMMs) and no quant; the ranges cost nothing unprofiled."""
from __future__ import annotations

import json

import pytest

from te_npu.ops.profiling import op_range, ranges_forced
from te_npu.testing.step_profile import profile_steps
from tests.system import harness as H


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8", "bf16"])
def test_a_one_rank_tiny_profile_shows_quant_and_mm_gmm_time(fmt, st_data_dir, tmp_path):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.trainer import Trainer

    cfg = H.st_config(fmt, tmp_path / "run", st_data_dir, "fsdp_config.dp_shard_size=1")
    trainer = Trainer(DeepseekV3Task(), print_fn=lambda *_: None)
    trainer.setup(cfg)
    try:
        trainer.train_step()  # warm-up
        result = profile_steps(trainer.train_step, 2, tmp_path / "profile")
    finally:
        trainer.close()
    shares = result["shares"]
    assert shares["basis"] == "host" and len(result["step_wall_ms"]) == 2
    assert shares["wall_ms"] == pytest.approx(sum(result["step_wall_ms"]), abs=0.01)
    assert shares["percent"]["mm_gmm"] > 0.0  # sizes vary with the machine's load: nonzero is the claim
    if fmt == "bf16":
        assert shares["ms"]["quant"] == 0.0
        assert not any(name.startswith("te_npu::") for name, _ in shares["by_label"]["mm_gmm"])
    else:
        assert shares["percent"]["quant"] > 0.0
        assert {name.split()[0] for name, _ in shares["by_label"]["quant"]} == {"te_npu::quantize"}
        assert any(name.startswith("te_npu::gemm grouped") for name, _ in shares["by_label"]["mm_gmm"])
    assert shares["ms"]["all_gather"] == shares["ms"]["reduce_scatter"] == 0.0  # one rank: FSDP2 gathers nothing
    assert sum(shares["percent"].values()) + shares["unattributed_percent"] == pytest.approx(100.0, abs=0.1)
    assert {"trace.json", "table.txt"} <= set(result["files"])
    json.loads((tmp_path / "profile" / "trace.json").read_text())


def test_op_ranges_open_only_while_a_profiler_records():
    from torch.profiler import profile

    assert type(op_range("te_npu::gemm x")).__name__ == "nullcontext"
    with ranges_forced():
        assert type(op_range("te_npu::gemm x")).__name__ == "record_function"
    assert type(op_range("te_npu::gemm x")).__name__ == "nullcontext"
    with profile():
        assert type(op_range("te_npu::gemm x")).__name__ == "record_function"
