"""``scripts/compare_recipes.py`` writes the multi-token-prediction section itself from the
``mxfp8_mtp`` and ``mxfp8`` runs' metrics (validation lm loss side by side, each depth's loss)."""
from __future__ import annotations

from scripts import compare_recipes


def _run(val_lm: dict, mtp: dict | None = None) -> list[dict]:
    records = [{"kind": "config", "config": {"model": {"mtp": {"loss_scaling_factor": 0.3}}}}]
    for step in range(1, 21):
        records.append({"kind": "train", "step": step, "lm_loss": 3.0 - 0.05 * step,
                        **({"mtp_1_loss": 3.2 - 0.06 * step} if mtp else {})})
    for step, loss in val_lm.items():
        records.append({"kind": "val", "step": step, "lm_loss": loss, **({"mtp_1_loss": mtp[step]} if mtp else {})})
    return records


def test_the_mtp_section_compares_validation_lm_loss_with_the_run_without_mtp():
    runs = {"mxfp8": _run({10: 2.5, 20: 2.0}), "mxfp8_mtp": _run({10: 2.4, 20: 2.1}, mtp={10: 2.3, 20: 1.9})}
    summaries = {"mxfp8": {"step_ms": 800.0}, "mxfp8_mtp": {"step_ms": 1200.0}}
    lines = compare_recipes._mtp_section(runs, summaries)
    assert lines[1] == "## Multi-token prediction: mxfp8_mtp against mxfp8"
    assert "`recipes/dsv3_tiny_mxfp8_mtp.yaml`" in lines[3] and "loss_scaling_factor 0.3" in lines[3]
    rows = [line for line in lines if line.startswith("| 10 |") or line.startswith("| 20 |")]
    assert rows == ["| 10 | 2.5000 | 2.4000 | -4.00% | 2.3000 |", "| 20 | 2.0000 | 2.1000 | +5.00% | 1.9000 |"]
    assert "1200 ms against 800 ms" in lines[-1]


def test_no_mtp_section_without_both_runs():
    assert compare_recipes._mtp_section({"mxfp8": _run({10: 2.5})}, {}) == []
    assert compare_recipes._mtp_section({"mxfp8": _run({10: 2.5}), "mxfp8_mtp": _run({10: 2.4})}, {}) == []
