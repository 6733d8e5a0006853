"""Test instruments: tools that observe te_npu from the outside, for tests, benchmarks and
diagnostics. Production code never imports this package (a test checks it).

- ``STProbe``: the system tests' read-only recorder, a ``te_npu.events`` subscriber;
  ``phase_probe.PhaseProbe`` adds the trainer phase of every event.
- ``acceptance``: the acceptance run (cases Q3-01..Q3-11, docs/a5.md, acceptance matrix): its
  rules, phases, verdicts and report (``scripts/q3_acceptance.py`` launches it).
- ``owned_jobs``: one acceptance run per report folder, its jobs dying with it.
- ``count_host_syncs`` / ``HostSyncs``: count the host reads a block of code makes, by op.
- ``time_shares`` / ``trace_spans`` / ``step_profile``: profile training steps and split their
  time into quant / MM-GMM / all-gather / reduce-scatter / other (the acceptance report's time
  shares, docs/a5.md, "Time shares").
"""
from te_npu.testing.host_syncs import HostSyncs, count_host_syncs
from te_npu.testing.probe import STProbe

__all__ = ["STProbe", "HostSyncs", "count_host_syncs"]
