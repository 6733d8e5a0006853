"""Issue 22 end to end: the tiny job trains from a Megatron indexed dataset and from a blend of two,
resumes bitwise, refuses a corrupt ``.idx`` in one line (exit 2 through the launcher), and trains
from a local Hugging Face dataset offline.

Default suite: single-rank in-process runs (one Megatron dataset, a corrupt index, an HF
dataset). ``-m slow``: the 2-rank blend run with its bitwise resume in fresh processes, and the
corrupt index through ``scripts/pretrain_dsv3.sh``.
"""
from __future__ import annotations

import math
import os
import subprocess

import pytest

from te_npu.errors import ConfigError
from te_npu.training.data.blend import normalize_weights
from tests.distributed.harness import _free_port
from tests.system import data_runs as R
from tests.system import harness as H
from tests.system.megatron_files import write_megatron

ONE_RANK = ["fsdp_config.dp_shard_size=1", "training.quant_kernel=eager"]


@pytest.fixture
def single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_tiny_job_trains_from_a_megatron_indexed_dataset(tmp_path, single_process):
    corpora = R.write_corpora(tmp_path / "corpora")
    result = R.train_worker(0, 1, tmp_path / "run", ["data.kind=megatron", f"data.path={corpora['web']}",
                                                     "data.split=90,10", *ONE_RANK], steps=4, save_at=None)
    losses = [r["lm_loss"] for r in result["records"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]  # it learns the text
    assert result["data_state"]["kind"] == "megatron" and result["data_state"]["consumed_samples"] == 4 * 2


def test_corrupt_index_refused_before_the_model_is_built(tmp_path, single_process):
    from tests.system.test_q3_config import CountingTask

    corpora = R.write_corpora(tmp_path / "corpora")
    idx = corpora["code"].with_name(corpora["code"].name + ".idx")
    raw = bytearray(idx.read_bytes())
    raw[9] = 2  # version 2
    idx.write_bytes(bytes(raw))
    cfg = R.data_config(tmp_path / "run", ["data.kind=megatron", f"data.blend=0.5 {corpora['web']} 0.5 {corpora['code']}",
                                           *ONE_RANK])
    CountingTask.builds = 0
    trainer = H._trainer(cfg, [])[0]
    trainer.task = CountingTask()
    with pytest.raises(ConfigError) as err:
        trainer.setup(cfg)
    assert str(err.value).startswith("data.blend[1]: not a valid Megatron indexed dataset: ")
    assert "index version 2; only version 1 exists" in str(err.value) and "\n" not in str(err.value)
    assert CountingTask.builds == 0


def test_tiny_job_trains_offline_from_a_local_hf_dataset(tmp_path, single_process, monkeypatch):
    pytest.importorskip("datasets", reason="data.kind hf reads with `datasets` (the test extra installs it)")
    from tests.unit.training.test_hf_data import write_hf_corpus

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus, tokenizer = write_hf_corpus(tmp_path, R.stdlib_documents(0, 30), kind="parquet")
    overrides = ["data.kind=hf", f"data.path={corpus}", f"data.tokenizer={tokenizer}", "data.split=90,10", *ONE_RANK]
    result = R.train_worker(0, 1, tmp_path / "run", overrides, steps=3, save_at=None)
    losses = [r["lm_loss"] for r in result["records"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    caches = sorted((tmp_path / "run" / "data_cache" / "hf").glob("*.idx"))
    assert len(caches) == 1


@pytest.mark.slow
def test_tiny_job_trains_from_a_blend_of_two_and_resumes_bitwise(tmp_path):
    corpora = R.write_corpora(tmp_path / "corpora")
    data = ["data.kind=megatron", f"data.blend=[[0.3, {corpora['web']}], [0.7, {corpora['code']}]]",
            "data.split=969,30,1", "training.eval_interval=3", "training.eval_steps=2", "training.quant_kernel=eager"]
    ranks = H.spawn(R.train_worker, tmp_path, data)
    resumed = H.spawn(R.resume_worker, tmp_path, data)
    for run, again in zip(ranks, resumed):
        assert again["step"] == R.SAVE_AT
        for key in ("step", "lm_loss", "grad_norm", "lr", "updated"):
            assert H.per_step(again["records"], key) == H.per_step(run["records"][R.SAVE_AT:], key), key  # bitwise
        assert again["data_state"] == run["data_state"]
    state = ranks[0]["data_state"]
    consumed = R.STEPS * 2 * H.WORLD  # micro batch 2 x 2 ranks per step
    assert state["kind"] == "megatron" and state["consumed_samples"] == consumed  # Megatron's BlendedDataset order
    assert state["order"]["weights"] == normalize_weights(normalize_weights([0.3, 0.7]))


@pytest.mark.slow
def test_corrupt_index_through_the_launcher_is_one_line_exit_2(tmp_path):
    corpora = R.write_corpora(tmp_path / "corpora")
    bad = write_megatron(tmp_path / "bad", R.stdlib_documents(0, 3), 8, bin_bytes_cut=2)
    env = dict(os.environ, MASTER_PORT=str(_free_port()), PYTHONPATH=f"{H.REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        ["bash", "scripts/pretrain_dsv3.sh", H.TINY_MODEL_OVERRIDES, "training.seq_len=64", "logging.plot=false",
         "training.quant_kernel=eager", f"logging.dir={tmp_path / 'logs'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
         "data.kind=megatron", f"data.blend=0.5 {corpora['web']} 0.5 {bad}"],
        cwd=H.REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("ConfigError: data.blend[1]: not a valid Megatron indexed dataset: ")
    assert "a truncated or mismatched .bin/.idx pair" in lines[0]


@pytest.mark.slow
def test_resegmented_dataset_under_an_existing_cache_trains_as_a_fresh_cache(tmp_path, single_process):
    """Issue 38's repro: the .bin byte-identical, the .idx the same size, 10 tokens moved from
    document 0 to document 1; the cache built before is rebuilt (one note naming the data), and
    the losses equal a fresh cache's instead of the old data's."""
    import numpy as np

    corpora = R.write_corpora(tmp_path / "corpora")
    data = ["data.kind=megatron", f"data.path={corpora['web']}", "data.split=90,10", *ONE_RANK]
    old = R.train_worker(0, 1, tmp_path / "run", data, steps=3, save_at=None)
    docs = R.stdlib_documents(0, 40)
    write_megatron(corpora["web"], [docs[0][:-10], np.concatenate((docs[0][-10:], docs[1])), *docs[2:]], 8)
    again = R.train_worker(0, 1, tmp_path / "run", data, steps=3, save_at=None)
    fresh = R.train_worker(0, 1, tmp_path / "fresh", data, steps=3, save_at=None)
    losses = {name: [r["lm_loss"] for r in run["records"]] for name, run in
              (("old", old), ("again", again), ("fresh", fresh))}
    assert losses["again"] == losses["fresh"] != losses["old"], losses
    notes = [line for line in again["lines"] if "rebuilt the sample index cache" in line]
    assert len(notes) == 1 and f"data.path: {corpora['web']}.idx [train: sequences 0:36]" in notes[0], notes
    assert not any("rebuilt" in line for line in fresh["lines"])


# ---- a new data kind is one module and one registry line: a toy kind, defined here ----

TOY_PERIOD = 200  # toy token t at global offset i: (i * 7) % TOY_PERIOD, a sequence the model can learn


def _toy_windows(first_sample: int, count: int, seq_len: int):
    import numpy as np
    import torch

    offsets_BS1 = (first_sample + np.arange(count))[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    window_BS1 = torch.from_numpy((offsets_BS1 * 7) % TOY_PERIOD)
    return window_BS1[:, :-1].contiguous(), window_BS1[:, 1:].contiguous()


class ToyBatcher:
    """Rank r of W takes samples ``c + r * B .. c + (r + 1) * B`` of micro batch ``c``; the position is ``c``."""

    def __init__(self, split, micro_batch_size, seq_len, rank, world_size):
        self.split, self.micro_batch_size, self.seq_len = split, micro_batch_size, seq_len
        self.rank, self.world_size, self.consumed_samples = rank, world_size, 0

    def __iter__(self):
        return self

    def __next__(self):
        first = self.split.start + self.consumed_samples + self.rank * self.micro_batch_size
        self.consumed_samples += self.micro_batch_size * self.world_size
        return _toy_windows(first, self.micro_batch_size, self.seq_len)

    def state_dict(self):
        return {"kind": "toy", "consumed_samples": self.consumed_samples}

    def position_for(self, state):
        if state.get("kind") != "toy":
            raise ValueError("data state mismatch: not saved reading the toy kind")
        return int(state["consumed_samples"])

    def load_state_dict(self, state):
        self.consumed_samples = self.position_for(state)


class ToySplit:
    """A ``DataSplit`` (te_npu.training.data.kind) that records what the trainer asked of it."""

    def __init__(self, start: int):
        self.start, self.asked = start, []

    def check_token_ids(self, vocab_size, key):
        self.asked.append(("check_token_ids", key))
        if vocab_size < TOY_PERIOD:
            raise ConfigError(f"{key}: the toy kind needs vocab_size >= {TOY_PERIOD}")
        return f"{key}: toy tokens are below {TOY_PERIOD}"

    def batcher(self, micro_batch_size, seq_len, *, seed, rank=0, world_size=1, shuffle=True, vocab_size=None,
                run_samples=None, start_sample=None, train_samples=None, barrier=None):
        self.asked.append(("batcher", rank, world_size))
        return ToyBatcher(self, micro_batch_size, seq_len, rank, world_size)

    def validation_batches(self, micro_batch_size, seq_len, *, num_batches, rank=0, world_size=1, vocab_size=None,
                           seed=None):
        self.asked.append(("validation_batches", num_batches))
        for k in range(num_batches):
            yield _toy_windows(self.start + (k * world_size + rank) * micro_batch_size, micro_batch_size, seq_len)


def _build_toy(d, vocab_size, progress):
    from pathlib import Path

    from te_npu.training.data import DataSplits

    Path(d.cache_dir).mkdir(parents=True, exist_ok=True)
    (Path(d.cache_dir) / "toy_prepared").write_text("rank 0 prepares once")  # the kind's one-time preparation
    return DataSplits(ToySplit(0), ToySplit(10**6), "data.kind", "data.kind")


def test_a_registered_toy_kind_trains_through_the_trainer_with_no_other_change(tmp_path, single_process, monkeypatch):
    from types import MappingProxyType

    from te_npu.training import data as data_package
    from te_npu.training.data import DataKind

    # the one registry line a new kind adds (here patched in; in the package, a line of DATA_KINDS)
    monkeypatch.setattr(data_package, "DATA_KINDS",
                        MappingProxyType({**data_package.DATA_KINDS, "toy": DataKind(_build_toy, writes_cache=True)}))
    overrides = ["data.kind=toy", *ONE_RANK, "training.eval_steps=2"]
    lines: list[str] = []
    trainer, _ = H._trainer(R.data_config(tmp_path / "run", overrides), lines)
    try:
        trainer.setup(R.data_config(tmp_path / "run", overrides))
        losses = [trainer.train_step().lm_loss for _ in range(3)]
        val_loss = trainer.evaluate()
        trainer.save_dcp(str(tmp_path / "dcp"))
        train_split, val_split = trainer.train_data, trainer.val_data
    finally:
        trainer.close()
    assert isinstance(train_split, ToySplit) and isinstance(val_split, ToySplit)
    assert train_split.asked == [("check_token_ids", "data.kind"), ("batcher", 0, 1)]
    assert val_split.asked == [("check_token_ids", "data.kind"), ("validation_batches", 2)]
    assert (tmp_path / "run" / "data_cache" / "toy_prepared").is_file()
    assert any("toy tokens are below" in line for line in lines)  # the split's note, printed by the trainer
    assert all(math.isfinite(x) for x in [*losses, val_loss]) and losses[-1] < losses[0]

    resumed, _ = H._trainer(R.data_config(tmp_path / "resume", overrides), [])
    try:
        resumed.setup(R.data_config(tmp_path / "resume", overrides))
        assert resumed.load_dcp(str(tmp_path / "dcp")) == 3
        assert isinstance(resumed.batcher, ToyBatcher) and resumed.batcher.consumed_samples == 3 * 2
    finally:
        resumed.close()
