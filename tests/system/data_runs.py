"""The tiny job on the data users already have: Megatron indexed datasets (one, or a blend of two)
and a local Hugging Face dataset, all written here from real text (this interpreter's stdlib
sources, byte-level: token = byte, vocab 256, like the default corpus).

Workers are module-level so ``tests.system.harness.spawn`` can start them on 2 gloo ranks; they
return plain dicts (step records, the data position) for the tests to compare.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.system import harness as H
from tests.system.megatron_files import write_megatron

STEPS, SAVE_AT = 6, 4


def stdlib_documents(start: int, count: int) -> list[np.ndarray]:
    """Byte tokens of ``count`` stdlib files (sorted order from ``start``), each ending in EOD 0."""
    from te_npu.training.data import stdlib_sources

    files = stdlib_sources(4 << 20)[start : start + count]
    return [np.append(np.frombuffer(path.read_bytes(), dtype=np.uint8), 0) for _, path in files]


def write_corpora(directory) -> dict[str, Path]:
    """Two Megatron datasets from different stdlib files: ``web`` in uint16 (code 8, what
    preprocess_data.py writes for small vocabularies), ``code`` in int32 (code 4)."""
    directory = Path(directory)
    return {"web": write_megatron(directory / "web_text_document", stdlib_documents(0, 40), 8),
            "code": write_megatron(directory / "code_text_document", stdlib_documents(40, 40), 4)}


def data_config(workdir, data_overrides: list[str], *extra: str):
    """The Q3 tiny configuration (2 layers, seq 64, micro batch 2) reading ``data_overrides``."""
    return H.st_config("mxfp8", workdir, Path(workdir) / "data_cache", f"training.train_steps={STEPS}",
                       *data_overrides, *extra)


def train_worker(rank, world, workdir, data_overrides, steps=STEPS, save_at=SAVE_AT):
    """Set up, train ``steps`` steps, save after ``save_at``; records and the data state."""
    cfg = data_config(workdir, data_overrides)
    lines: list[str] = []
    trainer, _ = H._trainer(cfg, lines)
    try:
        trainer.setup(cfg)
        records = []
        for _ in range(steps):
            records.append(H._record(trainer.train_step()))
            if trainer.global_step == save_at:
                trainer.save_dcp(str(Path(workdir) / "dcp"))
        return {"records": records, "data_state": trainer.batcher.state_dict(), "lines": lines}
    finally:
        trainer.close()


def resume_worker(rank, world, workdir, data_overrides, steps=STEPS - SAVE_AT):
    """Fresh processes: set up, ``load_dcp`` the step saved by ``train_worker``, train ``steps`` more."""
    cfg = data_config(Path(workdir) / "resume", data_overrides)
    lines: list[str] = []
    trainer, _ = H._trainer(cfg, lines)
    try:
        trainer.setup(cfg)
        step = trainer.load_dcp(str(Path(workdir) / "dcp"))
        records = [H._record(trainer.train_step()) for _ in range(steps)]
        return {"step": step, "records": records, "data_state": trainer.batcher.state_dict()}
    finally:
        trainer.close()
