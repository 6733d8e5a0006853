"""``models.deepseek_v3.pretrain`` with one injected fault, for the process-level failure tests.

    python -m te_npu.training.launch ... -m tests.system.faulty_pretrain --config ... [overrides]

``FAULT`` (environment, read here only, never by te_npu) selects the fault:

- ``raise:R:S``: rank R raises ``ValueError`` inside optimizer step S (the others are then
  waiting for it in a collective);
- ``slow_save:T:N``: every rank sleeps T seconds in the save of step N, between writing its
  DCP shards and the manifest (a window in which to signal a save);
- ``step_marker:PATH``: each rank appends ``<rank> <step> <pid>`` to PATH after each step
  (so a test knows training is under way, and which process is which rank, before it signals);
- ``save_marker:PATH``: each rank creates PATH when a save has written its shards (with
  ``slow_save``: the save is then in its window).
- ``die_after_publish:N``: rank 0 kills itself (SIGKILL) in the save of step N right after
  ``latest`` names it, before the directory is renamed (the publication window).
- ``slow_export:T``: every rank sleeps T seconds in the HF export, after the staging shards are
  written (with ``save_marker``: the marker is created then; a window in which to signal);
- ``busy:R:S:T:HOW``: rank R stays busy T seconds at the start of optimizer step S, alive:
  ``sleep`` (time.sleep), ``gil`` (libc ``sleep`` called holding the GIL: a long pure-C call,
  so its heartbeat thread cannot run), ``spin`` (a pure-Python busy loop);
  ``busy_save:R:S:T``: rank R sleeps T seconds inside the save of step S (its peers wait in the
  save's collective, an unbounded phase).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import torch.distributed as dist

from models.deepseek_v3 import pretrain
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.distributed.storage import dcp
from te_npu.training.trainer import Trainer


_marker: list[str] = []


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _install(fault: str) -> None:
    kind, _, arg = fault.partition(":")
    if kind == "raise":
        rank, step = (int(x) for x in arg.split(":"))
        original = Trainer.optimizer_step

        def failing_step(self):
            if _rank() == rank and self.global_step + 1 == step:
                raise ValueError(f"injected fault on rank {rank} at iteration {step}")
            return original(self)

        Trainer.optimizer_step = failing_step
    elif kind == "slow_save":
        seconds, step = float(arg.split(":")[0]), int(arg.split(":")[1])
        original_hash = dcp.hash_files

        def slow_hash(directory, names):
            if os.path.basename(directory) == f"step_{step}.tmp":
                if _marker:
                    open(_marker[0], "a").close()
                time.sleep(seconds)
            return original_hash(directory, names)

        dcp.hash_files = slow_hash
    elif kind == "slow_export":
        from te_npu.distributed.storage import hf_checkpoint

        original_consolidate = hf_checkpoint.consolidate_safetensors_files

        def slow_consolidate(*args, **kwargs):
            if _marker:
                open(_marker[0], "a").close()
            time.sleep(float(arg))
            return original_consolidate(*args, **kwargs)

        hf_checkpoint.consolidate_safetensors_files = slow_consolidate
    elif kind == "busy":
        rank, step, seconds, how = arg.split(":")
        original_step = Trainer.optimizer_step

        def busy_step(self):
            if _rank() == int(rank) and self.global_step + 1 == int(step):
                _stay_busy(float(seconds), how)
            return original_step(self)

        Trainer.optimizer_step = busy_step
    elif kind == "busy_save":
        rank, step, seconds = arg.split(":")
        original_hash_files = dcp.hash_files

        def busy_hash(directory, names):
            if _rank() == int(rank) and os.path.basename(directory) == f"step_{step}.tmp":
                _stay_busy(float(seconds), "sleep")
            return original_hash_files(directory, names)

        dcp.hash_files = busy_hash
    elif kind == "save_marker":
        _marker.append(arg)
    elif kind == "die_after_publish":
        original_set_latest = checkpoint_folder.set_latest

        def set_latest_then_die(directory, name):
            original_set_latest(directory, name)
            if name == f"step_{int(arg)}" and _rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint_folder.set_latest = set_latest_then_die
    elif kind == "step_marker":
        original_train_step = Trainer.train_step

        def marked(self, *args, **kwargs):
            record = original_train_step(self, *args, **kwargs)
            with open(arg, "a") as f:
                f.write(f"{_rank()} {record.step} {os.getpid()}\n")
            return record

        Trainer.train_step = marked
    elif kind:
        raise SystemExit(f"faulty_pretrain: unknown FAULT {fault!r}")


def _stay_busy(seconds: float, how: str) -> None:
    print(f"faulty_pretrain: rank {_rank()} busy for {seconds:g} s ({how})", flush=True)
    if how == "sleep":
        time.sleep(seconds)
    elif how == "gil":
        ctypes.PyDLL(None).sleep(int(seconds))  # PyDLL keeps the GIL for the call
    elif how == "spin":
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    else:
        raise SystemExit(f"faulty_pretrain: unknown busy kind {how!r}")


if __name__ == "__main__":
    for item in filter(None, os.environ.get("FAULT", "").split(",")):
        _install(item)
    sys.exit(pretrain.main())
