"""The run's guards: what refuses a bad start and what ends a run that can no longer succeed.

``preflight``: checks that need only the config, the filesystem and the device, run at the
start of ``Trainer.setup`` (device, writable folders, which step to resume, no save or export
over another run's files). ``divergence``: the rules that stop a dead run (non-finite or
exploding loss, collapse, skipped steps in a row; exit 3). ``stall``: every rank's heartbeat and
phase watch, which names a stalled rank in one line and ends the job (exit 4). Each module
stands alone: none imports another room of ``te_npu.training``.
"""
