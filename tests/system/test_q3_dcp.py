"""Q3-09: DCP resume in NEW processes reproduces the continuous run bitwise (CPU emulation).

The continuous run is the format's ``main`` phase (20 steps, ``save_dcp`` after step 17). A new
pair of spawned processes builds a fresh Trainer, ``setup``, ``load_dcp`` and runs steps 18-20.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.system import harness as H

OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq", "step")


def _check_resume(run, resumed):
    more = H.MAIN_STEPS - H.SAVE_AT
    for rank, res in zip(run["ranks"], resumed):
        main = rank["main"]
        assert res["step"] == H.SAVE_AT
        continuous = main["records"][H.SAVE_AT:]
        assert len(res["records"]) == more
        for key in ("step", "lm_loss", "grad_norm", "lr", "updated"):
            assert H.per_step(res["records"], key) == H.per_step(continuous, key), key  # bitwise
        assert all(math.isfinite(r["lm_loss"]) for r in res["records"])
        # masters / moments FP32; every master came from the checkpoint (fresh init differs)
        assert set(res["optimizer_dtypes"].values()) == {("torch.float32",) * 4}
        assert res["masters_changed_by_load"] == sorted(res["optimizer_dtypes"])
        # load rebuilt each 8-bit shard once from its master, and the rebuilt storage matches
        weights = set(main["weights"])
        assert res["load_refreshes"] == dict.fromkeys(weights, 1)
        assert {f: (i["cls"], i["local_shape"]) for f, i in res["weights"].items()} == {
            f: (i["cls"], i["local_shape"]) for f, i in main["weights"].items()}
        probe = res["probe"]
        for step in range(H.SAVE_AT, H.MAIN_STEPS):
            assert sum(probe.refresh_counts(step).values()) == len(weights)
        assert probe.dequantize_fallbacks == []  # the DCP load and the resumed steps: no dequantizing fallback


def _check_checkpoint_contents(run):
    path = os.path.join(run["workdir"], "dcp", f"step_{H.SAVE_AT}")
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    params = run["ranks"][0]["main"]["param_names"]
    weights = run["ranks"][0]["main"]["weights"]
    masters = run["ranks"][0]["main"]["optimizer_dtypes"]
    buffers = run["ranks"][0]["main"]["buffer_names"]
    assert buffers and all(b.endswith(".mlp.gate.e_score_correction_bias") for b in buffers)
    expected = {f"model.{p}" for p in [*params, *buffers]} | {f"optim.{f}.{k}" for f in masters for k in OPTIM_KEYS}
    assert set(metadata) == expected  # model parameters and buffers + optimizer state, nothing derived
    for key, entry in metadata.items():
        assert isinstance(entry, TensorStorageMetadata), key
        assert entry.properties.dtype in (torch.bfloat16, torch.float32), (key, entry.properties.dtype)
        assert not any(part in key for part in ("row_data", "col_data", "qdata", "scale", "_extra_state"))
    for fqn, info in weights.items():  # the 8-bit weights are saved as BF16 logical weights
        entry = metadata[f"model.{fqn}"]
        assert entry.properties.dtype == torch.bfloat16 and tuple(entry.size) == info["shape"]
        assert metadata[f"optim.{fqn}.master"].properties.dtype == torch.float32
    # per-rank extras: data position, RNG, counters only (weights_only-loadable)
    for rank in range(H.WORLD):
        extra = torch.load(os.path.join(path, f"extra_rank{rank}.pt"), weights_only=True)
        assert set(extra) == {"data", "skipped_iterations", "rng"}


def test_q3_09_mxfp8_resume_in_new_processes_is_bitwise(mxfp8_run, resume_runs):
    _check_checkpoint_contents(mxfp8_run)
    _check_resume(mxfp8_run, resume_runs(mxfp8_run))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "hif8"])
def test_q3_09_resume_in_new_processes_is_bitwise_slow(run_of, resume_runs, fmt):
    run = run_of(fmt)
    _check_checkpoint_contents(run)
    _check_resume(run, resume_runs(run))
