"""Test instruments: tools that observe te_npu from the outside, for tests, benchmarks and
diagnostics. Production code never imports this package (a test checks it).

- ``STProbe``: the Q3 system tests' read-only recorder, a ``te_npu.events`` subscriber.
- ``count_host_syncs`` / ``HostSyncs``: count the host reads a block of code makes, by op.
- ``time_shares`` / ``trace_spans`` / ``step_profile``: profile training steps and split their
  time into quant / MM-GMM / all-gather / reduce-scatter / other (spec section 17.4).
"""
from te_npu.testing.host_syncs import HostSyncs, count_host_syncs
from te_npu.testing.probe import STProbe

__all__ = ["STProbe", "HostSyncs", "count_host_syncs"]
