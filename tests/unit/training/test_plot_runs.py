"""scripts/plot_runs.py writes one PNG comparing runs from their metrics.jsonl."""
import math

from te_npu.training.metrics.log import MetricsLogger
from te_npu.training.metrics.plots import read_run, series


def fake_run(path, scale):
    with MetricsLogger(path, train_steps=20, print_fn=lambda _: None) as log:
        for step in range(1, 21):
            log.log_step(step, lm_loss=scale * (5 - math.log(step)), lr=1e-3 * min(1, step / 5), grad_norm=1 / step,
                         elapsed_ms=100.0, global_batch_size=8, consumed_samples=8 * step, tokens_per_s=2000 + step)
            if step % 10 == 0:
                log.log_validation(step, lm_loss=scale * (5.2 - math.log(step)))


def test_plot_runs_writes_png(tmp_path, load_script):
    fake_run(tmp_path / "bf16", 1.0)
    fake_run(tmp_path / "mxfp8", 1.02)
    plot = load_script("plot_runs")
    out = tmp_path / "plots" / "runs.png"
    assert plot.main([str(tmp_path / "bf16"), str(tmp_path / "mxfp8" / "metrics.jsonl"), "--out", str(out), "--smooth", "0.5"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    steps, values = series(read_run(tmp_path / "bf16", "metrics.jsonl"), "val", "lm_loss")
    assert steps == [10, 20] and len(values) == 2


def test_plot_families_draws_each_per_part_metric_family(tmp_path):
    from te_npu.training.metrics.plots import metric_families, plot_families

    with MetricsLogger(tmp_path, train_steps=3, print_fn=lambda _: None) as log:
        for step in (1, 2, 3):
            log.log_step(step, lm_loss=1.0, lr=1e-3, grad_norm=1.0, elapsed_ms=1.0, global_batch_size=8,
                         consumed_samples=8 * step, tokens_per_s=1.0,
                         extra={"moe/layer_1/load_cv": 1.0 / step, "moe/layer_2/load_cv": 0.5,
                                "moe/layer_1/load_min": 0.1, "note": "not a family", "a/b": 1.0})
    records = read_run(tmp_path)
    assert metric_families(records) == {"moe": {"load_cv": ["layer_1", "layer_2"], "load_min": ["layer_1"]}}
    (out,) = plot_families(records, tmp_path / "plots", "run")
    assert out.name == "moe.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
