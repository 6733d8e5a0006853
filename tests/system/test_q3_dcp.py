"""Q3-09: DCP resume in NEW processes reproduces the continuous run bitwise (CPU emulation).

The continuous run is the format's ``main`` phase (20 steps, ``save_dcp`` after step 17). A new
pair of spawned processes builds a fresh Trainer, ``setup``, ``load_dcp`` and runs steps 18-20.
"""
from __future__ import annotations

import os

import pytest
from te_npu.testing.acceptance import rules as R
from tests.system import harness as H

def _check_resume(run, resumed):
    for rank, res in zip(run["ranks"], resumed):
        problems, measured = R.check_resume(rank["main"], res, H.SAVE_AT)
        assert not problems
        assert measured["bitwise"], measured  # on CPU the resumed run is the continuous run, bit for bit
        assert res["probe"].dequantize_fallbacks == []  # the DCP load and the resumed steps: no dequantizing fallback


def _check_checkpoint_contents(run):
    path = os.path.join(run["workdir"], "dcp", f"step_{H.SAVE_AT}")
    main = run["ranks"][0]["main"]
    assert main["buffer_names"] and all(b.endswith(".mlp.gate.e_score_correction_bias") for b in main["buffer_names"])
    assert not R.check_checkpoint_contents(path, main, H.WORLD)


def test_q3_09_mxfp8_resume_in_new_processes_is_bitwise(mxfp8_run, resume_runs):
    _check_checkpoint_contents(mxfp8_run)
    _check_resume(mxfp8_run, resume_runs(mxfp8_run))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "hif8"])
def test_q3_09_resume_in_new_processes_is_bitwise_slow(run_of, resume_runs, fmt):
    run = run_of(fmt)
    _check_checkpoint_contents(run)
    _check_resume(run, resume_runs(run))


def test_router_biases_move_every_step_and_resume_bitwise_on_every_rank(mxfp8_run, resume_runs):
    """The shipped balancing moves DeepSeek-V3's router biases (20 steps at the recipe's rate: every
    bias off 0, within 20 x rate of it); every rank holds the bitwise same biases, and the resumed
    processes end with the continuous run's biases, bit for bit (``check_resume`` counts buffers in
    ``bitwise``)."""
    import torch

    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.config import load_config

    rate = load_config(H.RECIPES["mxfp8"], [], model_section=DeepseekV3Task.model_section).model.load_balance.bias_update_rate
    ranks = [r["main"] for r in mxfp8_run["ranks"]]
    biases = {f: b for f, b in ranks[0]["buffers"].items() if f.endswith("e_score_correction_bias")}
    assert biases and all(b.abs().min() > 0 and b.abs().max() <= H.MAIN_STEPS * rate * (1 + 1e-5) for b in biases.values())
    assert all(torch.equal(r["buffers"][f], b) for r in ranks[1:] for f, b in biases.items())
    for rank, res in zip(ranks, resume_runs(mxfp8_run)):
        assert all(torch.equal(res["buffers"][f], b) for f, b in biases.items())
