"""Training curves of one or several runs in one PNG (loss train + val, grad norm, tokens/s, lr),
and a run's families of per-part metrics (``<family>/<part>/<field>`` keys of its train records,
e.g. DeepSeek-V3's ``moe/layer_3/load_cv``): one PNG per family, a panel per field, a line per part."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from te_npu.training.metrics.log import read_metrics  # noqa: E402

__all__ = ["PANELS", "read_run", "series", "plot_runs", "metric_families", "plot_families", "plot_precision"]

PANELS = (  # (title, record kind, field, log-scale y)
    ("lm loss", "train", "lm_loss", False),
    ("grad norm", "train", "grad_norm", True),
    ("tokens/s", "train", "tokens_per_s", False),
    ("learning rate", "train", "lr", False),
)


def read_run(path: Path, jsonl_name: str = "metrics.jsonl") -> list[dict]:
    """Records of a run directory (or of a metrics.jsonl file itself)."""
    jsonl = path if path.is_file() else path / jsonl_name
    if not jsonl.is_file():
        raise FileNotFoundError(f"plot_runs: {jsonl} not found")
    return read_metrics(jsonl)


def series(records: list[dict], kind: str, key: str, smooth: float = 0.0) -> tuple[list[int], list[float]]:
    """(steps, values) of one field; EMA-smoothed when ``smooth`` in (0, 1)."""
    points = [(r["step"], r[key]) for r in records if r.get("kind") == kind and isinstance(r.get(key), (int, float))]
    steps, values = [p[0] for p in points], [float(p[1]) for p in points]
    if smooth > 0:
        ema, out = None, []
        for v in values:
            ema = v if ema is None or not math.isfinite(ema) else smooth * ema + (1 - smooth) * v
            out.append(ema)
        values = out
    return steps, values


def plot_runs(runs: list[tuple[str, list[dict]]], out: Path, smooth: float = 0.0, title: str | None = None) -> Path:
    """Draw ``[(name, records)]`` into a 2x2 PNG at ``out``; returns ``out``."""
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, records), color in zip(runs, colors * (len(runs) // len(colors) + 1)):
        for ax, (panel, kind, key, logy) in zip(axes.flat, PANELS):
            steps, values = series(records, kind, key, smooth if key == "lm_loss" else 0.0)
            ax.plot(steps, values, color=color, label=f"{name} (train)" if key == "lm_loss" else name, linewidth=1.2)
            if key == "lm_loss":
                vsteps, vvalues = series(records, "val", "lm_loss")
                ax.plot(vsteps, vvalues, color=color, linestyle="--", marker="o", markersize=3, label=f"{name} (val)")
            ax.set_title(panel)
            ax.set_xlabel("iteration")
            if logy and any(v > 0 for v in values):
                ax.set_yscale("log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def metric_families(records: list[dict]) -> dict[str, dict[str, list[str]]]:
    """``{family: {field: [part, ...]}}`` of the numeric ``<family>/<part>/<field>`` keys of the train records."""
    families: dict[str, dict[str, list[str]]] = {}
    for record in records:
        if record.get("kind") != "train":
            continue
        for key, value in record.items():
            parts = key.split("/")
            if len(parts) == 3 and isinstance(value, (int, float)) and not isinstance(value, bool):
                names = families.setdefault(parts[0], {}).setdefault(parts[2], [])
                if parts[1] not in names:
                    names.append(parts[1])
    return families


def plot_families(records: list[dict], out_dir: Path, title: str | None = None) -> list[Path]:
    """One PNG per metric family (``metric_families``) in ``out_dir``, ``<family>.png``; returns them."""
    written = []
    for family, fields in metric_families(records).items():
        cols = min(len(fields), 3)
        rows = math.ceil(len(fields) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
        for ax, (field, parts) in zip(axes.flat, fields.items()):
            for part in parts:
                steps, values = series(records, "train", f"{family}/{part}/{field}")
                ax.plot(steps, values, label=part, linewidth=1.0)
            ax.set_title(f"{family}: {field}")
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
            if len(parts) <= 12:
                ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(fields):]:
            ax.axis("off")
        if title:
            fig.suptitle(f"{title}: {family}")
        fig.tight_layout()
        out = Path(out_dir) / f"{family}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


PRECISION_PANELS = (("sqnr_db", "SQNR (dB), lowest tensors", False), ("underflow", "underflow fraction, highest", True))


def plot_precision(records: list[dict], out: Path, worst: int = 6, prefix: str = "precision/") -> Path | None:
    """The precision observer's worst tensors over the run (``te_npu.observer``): the ``worst``
    keys by lowest SQNR and by highest underflow (each at its worst observed step), one line per
    tensor over the observed steps. None (no file) when the records hold no observer figures."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    drew = False
    for ax, (stat, title, highest) in zip(axes, PRECISION_PANELS):
        suffix = f"/{stat}"
        keys = sorted({k for r in records if r.get("kind") == "train" for k in r if k.startswith(prefix) and k.endswith(suffix)})
        worst_of = {}
        for key in keys:
            values = [float(v) for v in series(records, "train", key)[1] if math.isfinite(float(v))]
            if values:
                worst_of[key] = max(values) if highest else min(values)
        chosen = sorted(worst_of, key=lambda k: -worst_of[k] if highest else worst_of[k])[:worst]
        for key in chosen:
            steps, values = series(records, "train", key)
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.2, label=key[len(prefix):-len(suffix)])
            drew = True
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if chosen:
            ax.legend(fontsize=7)
    if not drew:
        plt.close(fig)
        return None
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
