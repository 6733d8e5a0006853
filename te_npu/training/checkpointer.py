"""The Trainer's side of what is on disk: the checkpoint folder, the resume step, DCP saves and
loads, the Hugging Face start and export, and what a divergence does to the saved steps.

A ``Checkpointer`` is a part the ``Trainer`` holds (``trainer.checkpointer``), built once the
rank and the world size are known. It owns the folder's lock and this run's history in the
folder: the step it resumed from (``resume_path``, ``resume_step``), its ``lineage``, the step
its next save follows (its ``parent``), every step it saved and those no later healthy loss has
vouched for yet. The state to save is handed to each call (model, optimizer, step, data
position, skipped count, recipe); nothing is read off the Trainer. The folder's rules (what a
step folder is, ``latest``, rollback, pruning) are ``te_npu.distributed.storage.folder``'s; the
files are written and read by ``te_npu.distributed.storage``.

Rank 0 is the only process that changes the folder's top level; a check rank 0 makes there is
agreed on by every rank (``agree``: one ``all_gather_object``), so every rank raises the same
``ConfigError``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from te_npu.distributed import MasterWeightOptimizer
from te_npu.distributed.storage import dcp
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.distributed.storage.hf_checkpoint import HFCheckpoint, export_state
from te_npu.distributed.storage.lock import FolderLock, acquire_folder_lock, describe_holder
from te_npu.errors import ConfigError
from te_npu.recipe import recipe_change_note, recipe_record
from te_npu.training.config import TrainConfig
from te_npu.training.guards import preflight
from te_npu.training.guards.divergence import TrainingDiverged
from te_npu.training.guards.stall import StallWatch
from te_npu.training.hf import weights as hf_weights

__all__ = ["Checkpointer", "Loaded", "agree"]


@dataclass(frozen=True)
class Loaded:
    """What ``Checkpointer.load`` restored besides the model and optimizer (both restored in place)."""

    step: int
    data: Any
    """The data position to hand the batcher (``load_state_dict``); None: a converted step 0
    (weights only), the data starts from the beginning."""
    skipped_iterations: int
    path: str


def agree(error: str | None, world_size: int) -> None:
    """Raise rank 0's ``ConfigError`` message (if any) on every rank; a sync point either way."""
    if world_size > 1:
        errors: list = [None] * world_size
        dist.all_gather_object(errors, error)
        error = errors[0]
    if error is not None:
        raise ConfigError(error)


class Checkpointer:
    """The checkpoint folder, resume, saves / loads and the HF start / export of one run."""

    def __init__(self, cfg: TrainConfig, task: Any, *, resume_path: str | None, rank: int, world_size: int,
                 print_fn: Callable[[str], None] = print, watch: StallWatch | None = None) -> None:
        """``resume_path``: the step directory to resume (``preflight.resume_target``), or None.
        ``task``: the model family, asked for its Hugging Face adapter (``hf_adapter(cfg)``) when
        the run starts from or exports to Hugging Face. ``watch``: the rank's stall watch (saves
        and exports are marked as unbounded phases)."""
        self.cfg = cfg
        self.task = task
        self.rank = rank
        self.world_size = world_size
        self._print = print_fn
        self._watch = watch if watch is not None else StallWatch()
        self.resume_path = resume_path
        self.resume_step: int | None = None  # the step this run resumed from (set by check_resume)
        self.lineage: str | None = None  # the run the checkpoints belong to (kept across resumes)
        self.lock: FolderLock | None = None
        self._hf_adapter: hf_weights.HFAdapter | None = None
        self._parent_step: int | None = None  # the step this run resumed from or last saved (its history)
        self._saved: list[int] = []  # every step this run saved, in order
        self._unconfirmed: list[int] = []  # steps this run saved whose weights no later loss has vouched for yet

    # ---- at setup: the HF start, the folder, the resume step ---------------------------------
    def open_hf_start(self) -> HFCheckpoint | None:
        """The HF checkpoint to start from (opened and checked against the config; None when there is
        none or a DCP step is resumed); an HF export the task cannot write fails now, not after training."""
        c = self.cfg.checkpoint
        hf_start = None
        if c.initial_load_path and self.resume_path is None:
            self._hf_adapter = hf_weights.hf_adapter_of(self.task, self.cfg, where="checkpoint.initial_load_path")
            hf_start = hf_weights.open_initial_checkpoint(c.initial_load_path, self._hf_adapter)
        if c.last_save_format == "hf":
            hf_weights.hf_adapter_of(self.task, self.cfg, where="checkpoint.last_save_format: hf")
        return hf_start

    def check_hf_start_keys(self, hf_start: HFCheckpoint, model: nn.Module) -> None:
        """Every key and shape of the HF start against ``model`` (meta is fine), before any allocation."""
        hf_weights.check_initial_keys(hf_start, model, self._hf_adapter)

    def claim_folder(self) -> None:
        """Rank 0 (the only writer of the folder's top level): lock ``checkpoint.dir`` (which also
        proves it writable) and complete a save that died after it was published
        (``checkpoint_folder.finish_interrupted_save``). Raises ``ConfigError``; the caller agrees
        on it over the ranks."""
        directory = self.cfg.checkpoint.dir
        self.lock = acquire_folder_lock(directory)
        if self.lock.stale_holder is not None:
            self._print(f" note: took over the lock of {directory}, left by a job that ended "
                        f"without releasing it ({describe_holder(self.lock.stale_holder)})")
        note = checkpoint_folder.finish_interrupted_save(directory)
        if note:
            self._print(f" note: {note}")

    def release(self, *, discard: bool = False) -> None:
        """Release the folder's lock, if held (``discard``: also remove a lock file or folder that
        this run created: a refused start leaves nothing)."""
        if self.lock is not None:
            self.lock.release(discard=discard)
            self.lock = None

    def check_resume(self, position_for: Callable[[Any], Any], recipe) -> None:
        """Verify the step to resume (collective) and that its data position maps onto this run
        (``position_for``: the batcher's check of a saved data position); then, on rank 0, make it
        the head of the folder's history (``_settle_history``) and refuse a save or export plan
        that would overwrite what is not this run's (``_check_outputs``). ``recipe``: this run's,
        compared with the step's (a change is said once, never silent)."""
        c = self.cfg.checkpoint
        start = 0
        if self.resume_path is not None:
            dcp.verify_step(self.resume_path, checksums=c.verify_checksums)
            info = dcp.step_info(self.resume_path)
            extra = torch.load(os.path.join(self.resume_path, "extra_rank0.pt"), weights_only=True)
            try:
                if extra["data"] is not None:  # None: a converted step 0 (weights only), data from the start
                    position_for(extra["data"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"checkpoint.dir: cannot resume {self.resume_path} (saved by {info.get('world_size')} ranks) on "
                    f"{self.world_size} rank(s) with this data config: {exc}"
                ) from None
            start, self.lineage = int(info["step"]), info.get("lineage")
            self.resume_step = start
            note = None if extra["data"] is None else recipe_change_note(info, recipe, os.path.basename(self.resume_path))
            if note is not None and self.rank == 0:  # a legitimate change between runs, never a silent one
                self._print(f" note: {note}")
        self.lineage = self.lineage or dcp.new_lineage()
        error = None
        if self.rank == 0:
            try:
                self._settle_history()
                self._check_outputs(start)
            except ConfigError as exc:
                error = str(exc)
        agree(error, self.world_size)

    def _settle_history(self) -> None:
        """Rank 0: resuming step K of this folder makes K its lineage's head: ``latest`` names it
        and the lineage's newer steps (a rollback's, or a restart's that redoes steps) move to
        ``abandoned/``, so no save of this run ever meets an old step directory."""
        if self.resume_path is None:
            return
        moved = checkpoint_folder.roll_back(self.cfg.checkpoint.dir, self.resume_path)
        if moved:
            names = ", ".join(os.path.basename(m) for m in moved)
            self._print(f" continuing from {os.path.basename(self.resume_path)}: this run's newer steps ({names}) "
                        f"were moved to {os.path.dirname(moved[0])} (kept; delete them when no longer needed)")

    def _check_outputs(self, start: int) -> None:
        """Rank 0: no planned save may replace another run's step; the HF export (if any) may
        replace only an earlier export of this run, and its folder must be writable."""
        c, t = self.cfg.checkpoint, self.cfg.training
        planned = preflight.planned_saves(start, t.train_steps, c.interval)
        preflight.check_step_collisions(c.dir, planned, self.lineage if self.resume_path else None,
                                        resuming=self.resume_path is not None)
        if c.last_save_format == "hf":
            preflight.check_export_dir(self.export_dir(t.train_steps), self.lineage,
                                       "checkpoint.export_dir" if c.export_dir else "checkpoint.last_save_format: hf")

    def load_hf_start(self, hf_start: HFCheckpoint, model: nn.Module, optimizer: MasterWeightOptimizer):
        """Load the HF start's tensors into the masters (each rank its shards); returns the read
        report. The caller runs it inside its kernel context (the 8-bit weights are re-quantized)."""
        report = hf_weights.load_initial_weights(hf_start, model, optimizer, self._hf_adapter, progress=self.rank == 0)
        self._print_rank0(f" started from Hugging Face weights {hf_start.path}: rank 0 read "
                          f"{report.bytes_read / 2**20:.1f} of {report.checkpoint_bytes / 2**20:.1f} MiB (its shards)")
        note = hf_weights.left_out_note(hf_start, self._hf_adapter)
        if note:
            self._print_rank0(f" note: {note}")
        return report

    # ---- saves and loads ---------------------------------------------------------------------
    def save(self, model: nn.Module, optimizer: MasterWeightOptimizer, step: int, *, data: Any,
             skipped_iterations: int, recipe, directory: str | None = None, prune: bool = True) -> str:
        """Atomic DCP save of BF16 weights, FP32 masters/moments, ``step``, the data position
        (``data``: the batcher's state), the skipped count, this process's RNG and the recipe
        (``te_npu.json`` ``low_precision``: format and MXFP8 scale rule, compared on resume).

        ``prune``: apply ``checkpoint.keep_last`` now; the step loop passes False and prunes once
        a later healthy loss vouches for the saved weights (``confirm_saves``). A save into
        ``checkpoint.dir`` joins this run's history there.
        """
        extra = {"data": data, "skipped_iterations": skipped_iterations, "rng": torch.get_rng_state()}
        c = self.cfg.checkpoint
        keep_last = (c.keep_last or None) if prune else None
        with self._watch.phase("checkpoint save", step, bounded=False):
            path = dcp.save(directory or c.dir, model, optimizer, step, extra, keep_last=keep_last,
                            lineage=self.lineage, parent=self._parent_step,
                            meta={"low_precision": recipe_record(recipe)})
        self._parent_step = step
        if directory is None or os.path.abspath(directory) == os.path.abspath(c.dir):
            self._saved.append(step)
            if not prune:
                self._unconfirmed.append(step)
        self._print_rank0(f" saved checkpoint at iteration {step} to {path}")
        return path

    def load(self, model: nn.Module, optimizer: MasterWeightOptimizer, directory: str | None = None, *,
             verified: bool = False) -> Loaded:
        """Restore the latest checkpoint of ``directory`` (default ``checkpoint.dir``; or a step
        dir) into ``model`` and ``optimizer`` and this process's RNG; the step's lineage becomes
        this run's. ``verified``: the manifest was checked already. The caller runs it inside its
        kernel context (the 8-bit shards are rebuilt from the loaded masters) and hands the data
        position to its batcher."""
        path = dcp.latest_checkpoint(directory or self.cfg.checkpoint.dir)
        step, extra = dcp.load(path, model, optimizer, verify=not verified,
                               checksums=self.cfg.checkpoint.verify_checksums)
        step = int(step)
        self.lineage = dcp.step_info(path).get("lineage") or self.lineage
        self._parent_step = step
        if extra["rng"] is not None:
            torch.set_rng_state(extra["rng"])
        return Loaded(step, extra["data"], int(extra["skipped_iterations"]), path)

    def save_hf(self, model: nn.Module, optimizer: MasterWeightOptimizer, step: int,
                directory: str | None = None) -> str:
        """Export the FP32 masters (cast to ``checkpoint.export_dtype``) and buffers as a Hugging
        Face directory (default ``checkpoint.export_dir`` or ``<checkpoint.dir>/hf/step_<N>``),
        carrying ``checkpoint.initial_load_path``'s config fields and tokenizer files; it replaces
        only an earlier export of this run (``hf_weights.export_weights``)."""
        c = self.cfg.checkpoint
        directory = directory or self.export_dir(step)
        adapter = hf_weights.hf_adapter_of(self.task, self.cfg, where="checkpoint.last_save_format: hf")
        with self._watch.phase("HF export", step, bounded=False):
            report = hf_weights.export_weights(directory, model, optimizer, adapter, dtype=c.export_dtype,
                                               max_shard_mb=c.export_max_shard_mb, progress=self.rank == 0,
                                               owner={"lineage": self.lineage, "step": step},
                                               source=c.initial_load_path)
        self._print_rank0(f" exported Hugging Face weights at iteration {step} to {report.directory} "
                          f"({len(report.files)} file(s), {report.total_bytes / 2**20:.1f} MiB, {c.export_dtype})"
                          f"{'; it replaces the interrupted export left in ' + report.directory + '.tmp' if report.completed else ''}")
        if report.kept:
            self._print_rank0(f" note: kept {', '.join(report.kept)} in {report.directory}: not written by the earlier "
                              "export of this run it replaces, so left as it was")
        return report.directory

    def unfinished_export(self, step: int) -> str | None:
        """What is wrong with the HF export of ``step`` (rank 0's view, on every rank), or None:
        complete, or no export configured."""
        if self.cfg.checkpoint.last_save_format != "hf":
            return None
        state = [export_state(self.export_dir(step), {"lineage": self.lineage, "step": step})
                 if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(state, src=0)
        return state[0]

    def export_dir(self, step: int) -> str:
        """Where the HF export of ``step`` goes: ``checkpoint.export_dir``, else ``<checkpoint.dir>/hf/step_<N>``."""
        c = self.cfg.checkpoint
        return checkpoint_folder.export_dir(c.dir, step, c.export_dir)

    # ---- what the loop's health does to the saved steps --------------------------------------
    def confirm_saves(self) -> None:
        """The saved steps so far are good: prune their history down to ``keep_last``."""
        if self._unconfirmed:
            newest = self._unconfirmed[-1]
            self._unconfirmed.clear()
            dcp.prune(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep_last, self.lineage, newest)

    def end_of_run(self) -> None:
        """The run's last save pruned its history (``keep_last``): nothing is left to vouch for."""
        self._unconfirmed.clear()

    def diverged(self, exc: TrainingDiverged) -> TrainingDiverged:
        """The run stops: steps this run saved at or after ``began_at - 1`` (their weights gave
        the first bad loss or came after it) move to ``diverged/``, ``latest`` goes back to the
        newest good step; returns the error to raise, saying what happened (same on every rank)."""
        c, began = self.cfg.checkpoint, exc.began_at
        bad = [k for k in self._unconfirmed if began is not None and k >= began - 1]
        notes = ["nothing saved, no checkpoint pruned"]
        if bad:
            good = [k for k in self._saved if k not in bad]
            head = good[-1] if good else self.resume_step
            if self.rank == 0:
                checkpoint_folder.set_latest(c.dir, None if head is None else checkpoint_folder.step_name(head))
                checkpoint_folder.set_aside(c.dir, [checkpoint_folder.step_name(k) for k in bad],
                                            checkpoint_folder.DIVERGED)
            if self.world_size > 1:
                dist.barrier()  # every rank raises this same error at this step; rank 0 has moved the steps
            notes.append(f"{', '.join(checkpoint_folder.step_name(k) for k in bad)} (saved after the divergence "
                         f"began at iteration {began}) moved to {os.path.join(c.dir, checkpoint_folder.DIVERGED)}")
        if began is not None and self.resume_step is not None and self.resume_step >= began - 1:
            notes.append(f"the step this run resumed from (step_{self.resume_step}) already leads to it: resume "
                         "from an earlier step (checkpoint.load_step=N)")
        notes.append(self.latest_note())
        return TrainingDiverged(f"{exc}; {'; '.join(notes)}", began)

    def latest_note(self) -> str:
        """``latest complete checkpoint: <path>``, or that the folder holds none yet."""
        try:
            return f"latest complete checkpoint: {dcp.latest_checkpoint(self.cfg.checkpoint.dir)}"
        except ConfigError:
            return f"no checkpoint in {self.cfg.checkpoint.dir} yet"

    def _print_rank0(self, line: str) -> None:
        if self.rank == 0:
            self._print(line)
