"""Q3-09: DCP resume in NEW processes reproduces the continuous run bitwise (CPU emulation).

The continuous run is the format's ``main`` phase (20 steps, ``save_dcp`` after step 17). A new
pair of spawned processes builds a fresh Trainer, ``setup``, ``load_dcp`` and runs steps 18-20.
"""
from __future__ import annotations

import os

import pytest
from te_npu.testing import q3_rules as R
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
