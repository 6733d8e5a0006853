"""Megatron-style step lines, metrics.jsonl records, rank-0-only writing, optional TensorBoard."""
import json
import math
import re
import sys

import pytest

from te_npu.training.metrics.log import MetricsLogger, format_step_line, peak_memory_mb, read_metrics
from tests.recording_writer import RecordingWriter

STEP = dict(lm_loss=5.123, lr=3e-4, grad_norm=1.2345, elapsed_ms=812.46, global_batch_size=8,
            consumed_samples=40, tokens_per_s=2520.7, skipped_iterations=0, peak_mem_mb=1234.5)


def test_metrics_step_line_format():
    line = format_step_line(step=5, train_steps=300, **STEP)
    assert line.startswith(" iteration        5/     300 | consumed samples:")
    for part in ("elapsed time per iteration (ms): 812.5", "learning rate: 3.000E-04", "global batch size:     8",
                 "lm loss: 5.123000E+00", "grad norm: 1.234", "skipped iterations:   0", "tokens/s: 2520.7",
                 "peak mem (MB): 1234.5"):
        assert f"| {part} |" in line, part
    assert re.fullmatch(r" iteration +\d+/ +\d+( \| [^|]+: [^|]+)+ \|", line)
    assert "grad norm: n/a" in format_step_line(step=1, train_steps=1, **{**STEP, "grad_norm": None})


def test_metrics_logger_jsonl_records(tmp_path):
    printed = []
    with MetricsLogger(tmp_path / "run", train_steps=300, print_fn=printed.append) as log:
        log.log_config({"training": {"lr": 3e-4}})
        line = log.log_step(5, **STEP, extra={"step_time_breakdown": {"fwd": 1.0}})
        log.log_step(6, **{**STEP, "lm_loss": float("nan")})
        log.log_validation(5, lm_loss=2.0)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]  # strict JSON, even with a NaN loss
    assert [r["kind"] for r in records] == ["config", "train", "train", "val"]
    assert records[1]["step"] == 5 and records[1]["lm_loss"] == 5.123 and records[1]["step_time_breakdown"] == {"fwd": 1.0}
    assert records[2]["lm_loss"] == "nan" and records[3]["ppl"] == pytest.approx(math.exp(2.0))
    assert printed[0] == line and "validation loss at iteration 5" in printed[-1]
    restored = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert math.isnan(next(r for r in restored if r.get("step") == 6)["lm_loss"])


def test_metrics_read_keeps_last_record_per_step(tmp_path):
    for loss in (4.0, 3.0):  # a resumed run appends and re-logs step 2
        with MetricsLogger(tmp_path, train_steps=3, print_fn=lambda _: None) as log:
            log.log_step(2, **{**STEP, "lm_loss": loss})
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["lm_loss"]) for r in train] == [(2, 3.0)]


def test_metrics_logger_nonzero_rank_is_silent(tmp_path):
    printed = []
    with MetricsLogger(tmp_path / "run", train_steps=3, rank=1, print_fn=printed.append) as log:
        assert log.log_step(1, **STEP) is None and log.log_validation(1, lm_loss=1.0) is None
    assert not (tmp_path / "run").exists() and printed == []


def test_metrics_tensorboard_missing_prints_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    printed = []
    with MetricsLogger(tmp_path, train_steps=3, tensorboard=True, print_fn=printed.append) as log:
        log.log_step(1, **STEP)
    assert printed[0].startswith("note: TensorBoard logging requested but unavailable")


def test_metrics_peak_memory_cpu():
    assert peak_memory_mb("cpu") > 1.0
    with pytest.raises(RuntimeError, match="max_memory_allocated"):
        peak_memory_mb("meta")


def test_metrics_resume_moves_the_redone_steps_aside_so_each_step_appears_once(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, train_steps=12) as log:  # the first attempt: 12 steps, then a rollback to 4
        log.log_config({"attempt": 1})
        for step in range(1, 13):
            log.log_step(step, **{**STEP, "lm_loss": float(step)})
            if step % 4 == 0:
                log.log_validation(step, lm_loss=float(step))
    with MetricsLogger(run, train_steps=12) as log:
        log.log_config({"attempt": 2})
        assert log.resume_at(4) == 8 + 2  # steps 5..12 and the validations at 8 and 12
        for step in range(5, 13):
            log.log_step(step, **{**STEP, "lm_loss": 100.0 + step})
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["step"] for r in records if r["kind"] == "train"]
    assert train == list(range(1, 13)), train  # no step twice
    assert [r["lm_loss"] for r in records if r["kind"] == "train"][4:] == [100.0 + s for s in range(5, 13)]
    assert [r["step"] for r in records if r["kind"] == "val"] == [4]
    assert [r["kind"] for r in records].count("config") == 2
    assert any(r["kind"] == "resume" and r["step"] == 4 and r["redone"] == 10 for r in records)
    redone = [json.loads(x) for x in (run / "metrics.redone.jsonl").read_text().splitlines()]
    assert [r["lm_loss"] for r in redone if r["kind"] == "train"] == [float(s) for s in range(5, 13)]  # kept


def test_metrics_resume_at_the_last_step_moves_nothing(tmp_path):
    with MetricsLogger(tmp_path, train_steps=3) as log:
        for step in (1, 2, 3):
            log.log_step(step, **STEP)
        assert log.resume_at(3) == 0
    assert not (tmp_path / "metrics.redone.jsonl").exists()
    assert MetricsLogger(tmp_path, train_steps=3, rank=1).resume_at(1) == 0  # other ranks write nothing


def test_metrics_fresh_run_in_a_used_dir_starts_clean_and_names_the_old_file(tmp_path):
    """Issue 32: a fresh restart into the same logging.dir wrote the same steps into metrics.jsonl twice."""
    run, notes = tmp_path / "run", []
    for attempt in (1, 2, 3):
        with MetricsLogger(run, train_steps=2, fresh=True, print_fn=notes.append) as log:
            log.log_config({"attempt": attempt})
            for step in (1, 2):
                log.log_step(step, **STEP)
            if attempt == 1:
                log.resume_at(1)  # the first run has redone records too: they move with it
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["config"]["attempt"] for r in records if r["kind"] == "config"] == [3]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert sorted(p.name for p in run.iterdir()) == ["metrics.1.jsonl", "metrics.1.redone.jsonl", "metrics.2.jsonl",
                                                     "metrics.jsonl"]
    moved = [n for n in notes if n.startswith(" note:")]
    assert moved == [f" note: {run / 'metrics.jsonl'} held an earlier run's records (this run starts fresh): moved to "
                     f"metrics.1.jsonl and metrics.1.redone.jsonl in {run}",
                     f" note: {run / 'metrics.jsonl'} held an earlier run's records (this run starts fresh): moved to "
                     f"metrics.2.jsonl in {run}"], moved



def test_metrics_loss_parts_and_task_report_reach_line_record_and_tensorboard(tmp_path, monkeypatch):
    import te_npu.training.metrics.log as log_module

    writer = RecordingWriter()
    monkeypatch.setattr(log_module, "_open_tensorboard", lambda path, print_fn: writer)
    printed = []
    with MetricsLogger(tmp_path, train_steps=10, print_fn=printed.append, tensorboard=True) as log:
        line = log.log_step(3, **STEP, losses={"balance_loss": 1.25e-4},
                            extra={"moe/layer_1/load_cv": 0.5, "note": "text", "flag": True},
                            summary="routing: layer 1 cv 0.50")
        val = log.log_validation(3, lm_loss=2.0, losses={"mtp_1_loss": 3.0})
    assert "| lm loss: 5.123000E+00 | balance loss: 1.250000E-04 | grad norm:" in line
    assert line.endswith("| routing: layer 1 cv 0.50 |")
    assert val.endswith("| mtp 1 loss value: 3.000000E+00 |")
    train, valid = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert train["balance_loss"] == 1.25e-4 and train["moe/layer_1/load_cv"] == 0.5 and train["note"] == "text"
    assert valid["mtp_1_loss"] == 3.0 and valid["lm_loss"] == 2.0
    assert writer.scalars[("balance_loss/train", 3)] == 1.25e-4
    assert writer.scalars[("moe/layer_1/load_cv", 3)] == 0.5
    assert writer.scalars[("mtp_1_loss/validation", 3)] == 3.0
    assert ("note", 3) not in writer.scalars and ("flag", 3) not in writer.scalars  # only plain numbers
