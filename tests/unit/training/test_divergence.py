"""Stop rules of a dead run: consecutive skipped steps, non-finite loss, loss spikes."""
import math

import pytest

from te_npu.training.divergence import SPIKE_WINDOW, DivergenceGuard, TrainingDiverged


def _guard(skipped=3, nonfinite=True, spike=10.0):
    return DivergenceGuard(max_consecutive_skipped_steps=skipped, stop_on_nonfinite_loss=nonfinite,
                           loss_spike_factor=spike)


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
