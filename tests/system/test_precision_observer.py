"""The precision observer in a tiny DeepSeek-V3 run (one rank): per-layer, per-role figures in
``metrics.jsonl``, TensorBoard and the step line that equal a hand computation on the very
operands the GEMMs consumed (recorded from the event stream, decoded here without te_npu), and
nothing of it when off."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.deepseek_v3.pretrain import DeepseekV3Task
from te_npu import events
from te_npu.numerics.constants import HIF8_MAX
from te_npu.training.config import load_config
from te_npu.training.trainer import Trainer
from tests.recording_writer import RecordingWriter

pytestmark = pytest.mark.slow  # a Trainer setup per test: ~1 min each on a shared 2-core machine

REPO = Path(__file__).resolve().parents[2]
KEY = "model.layers.1.mlp.experts.down_proj/activation.fprop"  # a grouped GEMM (MoE layer)


def _config(tmp_path: Path, recipe: str, *extra: str):
    return load_config(REPO / "recipes" / f"dsv3_tiny_{recipe}.yaml", [
        "model.overrides={num_hidden_layers: 2, n_shared_experts: 2}",
        "fsdp_config.dp_shard_size=1", "training.seq_len=32", "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=2", "training.train_steps=2", "training.log_interval=10",
        "training.eval_interval=0", f"data.cache_dir={tmp_path / 'data'}", f"data.max_bytes={2**18}",
        f"logging.dir={tmp_path / 'logs'}", "logging.plot=true", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=0", "checkpoint.resume=false", *extra,
    ], model_section=DeepseekV3Task.model_section)


def _by_hand(operand, source) -> tuple[int, int, float, float]:
    """(non-zero, underflowed, error^2, signal^2) from codes and scales decoded here: MXFP8 row
    blocks of 32 along the last dim, value = e4m3 * 2**(code - 127); HiF8 via the FP32 scale
    (its element decode is the one table te_npu has, checked against en_dtypes elsewhere)."""
    x = source.double()
    if operand.data.dtype == torch.float8_e4m3fn:
        scale = torch.pow(2.0, operand.scale.double() - 127).repeat_interleave(32, dim=-1)
        q = operand.data.double() * scale
    else:
        from te_npu.numerics.hif8 import decode
        q = decode(operand.data).double() * operand.scale.double()
    nonzero = x != 0
    return int(nonzero.sum()), int((nonzero & (q == 0)).sum()), float(((q - x) ** 2).sum()), float((x ** 2).sum())



@pytest.mark.parametrize("recipe", ["mxfp8", "hif8"])
def test_tiny_run_writes_figures_equal_to_a_hand_computation(tmp_path, recipe):
    lines: list[str] = []
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append)
    trainer.setup(_config(tmp_path, recipe, "precision_observer.enabled=true", "precision_observer.freq=1",
                          "precision_observer.layers=[model.layers.1.mlp.experts.*, model.layers.0.self_attn.o_proj]"))
    trainer.logger._tb = writer = RecordingWriter()  # TensorBoard itself is not installed here
    seen: dict[int, list] = {}
    on_operand = lambda e: e.module + "/activation." + str(e.gemm) == KEY and seen.setdefault(trainer.global_step + 1, []).append(_by_hand(e.operand, e.source))
    try:
        with events.subscribe(on_operand, events.OperandEvent):
            trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]  # observed steps are logged (log_interval is 10)
    for record in train:
        parts = seen[record["step"]]
        assert len(parts) == 2  # two micro-batches, accumulated into the step
        nonzero, under, err, sig = (sum(p[i] for p in parts) for i in range(4))
        assert record[f"precision/{KEY}/underflow"] == under / nonzero
        # MXFP8 values are exact in FP32; a HiF8 value is decode * scale rounded to FP32 (here: exact in FP64)
        rel = 1e-9 if recipe == "mxfp8" else 1e-6
        assert record[f"precision/{KEY}/sqnr_db"] == pytest.approx(10 * math.log10(sig / err), rel=rel)
        assert writer.scalars[(f"precision/{KEY}/sqnr_db", record["step"])] == record[f"precision/{KEY}/sqnr_db"]
        keys = {k.rsplit("/", 1)[0] for k in record if k.startswith("precision/")}
        assert keys == {f"precision/{g}/{r}" for g in ("model.layers.1.mlp.experts.gate_up_proj",
                                                       "model.layers.1.mlp.experts.down_proj",
                                                       "model.layers.0.self_attn.o_proj")
                        for r in ("activation.fprop", "activation.wgrad", "weight.fprop", "weight.dgrad",
                                  "grad_output.dgrad", "grad_output.wgrad")}
        scale_max = record[f"precision/{KEY}/scale_max"]
        assert scale_max == int(scale_max) if recipe == "mxfp8" else 0 < scale_max < HIF8_MAX
    step_lines = [line for line in lines if "consumed samples" in line]
    assert len(step_lines) == 2 and all("precision: min SQNR " in line for line in step_lines)
    assert (tmp_path / "logs" / "precision.png").is_file()


def test_run_without_observer_logs_no_figures(tmp_path):
    trainer = Trainer(DeepseekV3Task(), print_fn=lambda line: None)
    trainer.setup(_config(tmp_path, "mxfp8", "training.train_steps=1", "logging.plot=false"))
    try:
        assert trainer._observer is None
        record = trainer.train_step()
    finally:
        trainer.close()
    assert record.precision is None
