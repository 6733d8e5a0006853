"""A minimal 2-rank job for the shutdown loop (issue 32): what a training rank has at its exit --
the process group, the stall watch heartbeating through the job's store, a DCP save, the job's
signal watchdog -- and nothing else (no model), so one run takes seconds.

    python -m te_npu.training.launch --nproc_per_node 2 -m tests.system.shutdown_job OUT_DIR

``SHUTDOWN_STRAY_THREAD=1`` also leaves a daemon thread looping on store calls at exit (what a
stall watch that outlived its ``stop`` would do); ``SHUTDOWN_PLAIN_EXIT=1`` skips ``run_job``
and leaves by ``sys.exit`` (interpreter finalization), to show that the stray thread aborts it.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from te_npu.compat import default_store
from te_npu.training.job import run_job
from te_npu.training.runtime import StopRequest


def _stray(store) -> None:
    while True:
        store.set("stray", "x")
        store.get("stray")


def body(stop: StopRequest, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    stop.watch.start(1.0, store=default_store(), rank=rank, world=world)  # heartbeats every 0.2 s
    dcp.save({"w": torch.full((64,), float(rank))}, checkpoint_id=os.path.join(out, "step"))
    if os.environ.get("SHUTDOWN_STRAY_THREAD"):
        threading.Thread(target=_stray, args=(default_store(),), daemon=True).start()
    dist.barrier()  # Trainer.close's order: barrier, stop the watch, destroy the group
    stop.watch.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir = sys.argv[1]
    if os.environ.get("SHUTDOWN_PLAIN_EXIT"):
        from te_npu.training.guards.stall import StallWatch

        body(StopRequest(StallWatch(on_stall=print)), out_dir)
        sys.exit(0)
    sys.exit(run_job(lambda stop: body(stop, out_dir)))
