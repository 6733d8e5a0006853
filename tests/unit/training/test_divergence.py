"""Stop rules of a dead run: consecutive skipped steps, non-finite loss, the absolute loss ceiling,
a collapsed model, loss spikes; and when each says the divergence began."""
import math

import pytest

from te_npu.training.guards.divergence import SPIKE_WINDOW, DivergenceGuard, TrainingDiverged


LN_256 = math.log(256)


def _guard(skipped=3, nonfinite=True, spike=10.0, max_loss=0.0, collapse=0, vocab=None):
    return DivergenceGuard(max_consecutive_skipped_steps=skipped, stop_on_nonfinite_loss=nonfinite,
                           loss_spike_factor=spike, max_loss_factor=max_loss, collapse_steps=collapse,
                           vocab_size=vocab)


def test_divergence_consecutive_skips_stop_at_the_limit():
    guard = _guard(skipped=3)
    for step, updated in enumerate([False, False, True, False, False], start=1):  # a success resets the count
        guard.check(step, 2.0, updated)
    with pytest.raises(TrainingDiverged, match=r"iteration 6: 3 consecutive .*max_consecutive_skipped_steps=3"):
        guard.check(6, 2.0, False)


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_divergence_nonfinite_loss_stops(loss):
    with pytest.raises(TrainingDiverged, match="stop_on_nonfinite_loss"):
        _guard().check(1, loss, True)
    _guard(nonfinite=False).check(1, loss, True)  # rule off: the skip counter still applies


def test_divergence_loss_spike_against_the_median():
    guard = _guard()
    for step in range(1, SPIKE_WINDOW + 1):
        guard.check(step, 2.0 + 0.01 * (step % 3), True)
    guard.check(SPIKE_WINDOW + 1, 19.0, True)  # 9.5x the median: fine
    with pytest.raises(TrainingDiverged, match=r"loss_spike_factor=10.0"):
        guard.check(SPIKE_WINDOW + 2, 25.0, True)


def test_divergence_rules_off_never_stop():
    guard = _guard(skipped=0, nonfinite=False, spike=0.0)
    for step in range(1, 100):
        guard.check(step, math.nan if step % 2 else 1e9 * step, False)


def test_divergence_absolute_rule_stops_from_the_first_steps():
    """The issue's run: lr 1e4, the step-2 loss is 2.1e6; the spike rule would wait for 20 losses."""
    guard = _guard(max_loss=10.0, vocab=256)
    guard.check(1, 5.56, True, 6.4)
    guard.check(2, 10 * LN_256 - 0.01, True, 6.0)  # just under 10 x ln(256): fine
    with pytest.raises(TrainingDiverged, match=r"iteration 3: loss 2\.1e\+06 is above 10 x ln\(vocab\) = 55\.45") as info:
        guard.check(3, 2.1e6, True, 1e5)
    assert "training.max_loss_factor=10" in str(info.value) and info.value.began_at == 3


def test_divergence_collapse_rule_on_a_zero_grad_norm_or_a_loss_flat_at_ln_vocab():
    """The issue's run again: after the blow-up, loss = ln 256 exactly with grad norm 0, then NaN grads."""
    guard = _guard(skipped=10, collapse=3, vocab=256)
    guard.check(1, 5.5647, True, 6.415)
    guard.check(2, LN_256, True, 0.0)
    assert guard.suspect
    guard.check(3, LN_256, True, 0.0)
    with pytest.raises(TrainingDiverged, match=r"iteration 4: the model has collapsed for 3 steps in a row") as info:
        guard.check(4, LN_256, False, math.nan)  # skipped, but the flat loss says the same
    assert "training.collapse_steps=3" in str(info.value) and info.value.began_at == 2


def test_divergence_collapse_rule_ignores_a_healthy_start_near_ln_vocab():
    """A fresh model's loss sits near ln(vocab) but moves from batch to batch, with a real gradient."""
    guard = _guard(collapse=3, vocab=256)
    for step in range(1, 30):
        guard.check(step, LN_256 + 0.01 * math.sin(step), True, 1.0)
    assert not guard.suspect
    guard.check(30, LN_256, True, 0.5)
    guard.check(31, LN_256 + 1e-3, True, 0.5)  # not flat: 1e-3 apart
    assert not guard.suspect


def test_divergence_a_collapse_streak_that_recovers_closes():
    guard = _guard(collapse=3, vocab=256)
    guard.check(1, 3.0, True, 0.0)
    guard.check(2, 3.0, True, 0.0)
    assert guard.suspect and guard.collapsed_in_a_row == 2
    guard.check(3, 2.9, True, 0.8)
    assert not guard.suspect


def test_divergence_began_at_of_the_streak_rules():
    guard = _guard(skipped=2)
    guard.check(1, 2.0, True)
    guard.check(2, 2.0, False)
    with pytest.raises(TrainingDiverged) as info:
        guard.check(3, 2.0, False)
    assert info.value.began_at == 2
    with pytest.raises(TrainingDiverged) as info:
        _guard().check(7, math.nan, True)
    assert info.value.began_at == 7


def test_divergence_limits_are_validated():
    from te_npu import ConfigError
    from te_npu.training.config import TrainingConfig

    with pytest.raises(ConfigError, match=r"training\.max_loss_factor: 1\.0 must be 0 \(off\) or > 1"):
        TrainingConfig(max_loss_factor=1.0)
    TrainingConfig(max_loss_factor=0.0, collapse_steps=0)
