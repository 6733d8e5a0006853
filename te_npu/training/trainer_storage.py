"""The Trainer's side of what is on disk: the checkpoint folder, the resume step, DCP saves and
loads, the Hugging Face start and export, and what a divergence does to the saved steps.

``TrainerStorage`` is a part of ``Trainer`` (its base class), kept apart so that ``trainer.py``
reads as the build order and the step loop. Its methods run on the Trainer's state: ``cfg``,
``task``, ``rank``, ``world_size``, ``model``, ``optimizer``, ``batcher``, ``recipe``,
``global_step``, ``skipped_iterations``, ``lineage`` and the bookkeeping of the folder's history
(``_lock``, ``_resume_path``, ``_resume_step``, ``_parent_step``, ``_saved``, ``_unconfirmed``),
and its helpers (``_print``, ``_print_rank0``, ``_barrier``, ``_kernels``, ``_watch``). The files
themselves are written and read by ``te_npu.distributed.storage``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from te_npu.compat import local_tensor
from te_npu.distributed.storage import dcp as checkpoint
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.distributed.storage.hf_checkpoint import export_state
from te_npu.distributed.storage.lock import acquire_folder_lock, describe_holder
from te_npu.errors import ConfigError
from te_npu.recipe import recipe_change_note, recipe_record
from te_npu.training.config import TrainConfig
from te_npu.training.guards import preflight
from te_npu.training.guards.divergence import TrainingDiverged
from te_npu.training.hf import weights as hf_weights

__all__ = ["TrainerStorage"]


class TrainerStorage:
    """The checkpoint folder, resume, saves / loads and the HF start / export of a ``Trainer``."""

    # ---- at setup: the HF start, the folder, the resume step ---------------------------------
    def _open_hf_start(self, cfg: TrainConfig):
        """The HF checkpoint to start from (opened and checked against the config; None when there is
        none or a DCP step is resumed); an HF export the task cannot write fails now, not after training."""
        c = cfg.checkpoint
        hf_start = self._open_initial_hf(cfg) if c.initial_load_path and self._resume_path is None else None
        if c.last_save_format == "hf":
            hf_weights.hf_adapter_of(self.task, cfg, where="checkpoint.last_save_format: hf")
        return hf_start

    def _claim_folders(self) -> None:
        """Rank 0 (the only writer of logs and of the folder's top level) proves ``logging.dir``
        writable, locks ``checkpoint.dir`` and completes a save that died after it was published
        (``checkpoint_folder.finish_interrupted_save``); its ``ConfigError`` is raised on every rank."""
        cfg, error = self.cfg, None
        if self.rank == 0:
            try:
                preflight.check_writable(cfg.logging.dir, "logging.dir")
                self._lock = acquire_folder_lock(cfg.checkpoint.dir)  # also proves the folder writable
            except ConfigError as exc:
                error = str(exc)
            else:
                if self._lock.stale_holder is not None:
                    self._print(f" note: took over the lock of {cfg.checkpoint.dir}, left by a job that ended "
                                f"without releasing it ({describe_holder(self._lock.stale_holder)})")
                note = checkpoint_folder.finish_interrupted_save(cfg.checkpoint.dir)
                if note:
                    self._print(f" note: {note}")
        self._agree(error)

    def _agree(self, error: str | None) -> None:
        """Raise rank 0's ``ConfigError`` message (if any) on every rank; a sync point either way."""
        if self.world_size > 1:
            errors: list = [None] * self.world_size
            dist.all_gather_object(errors, error)
            error = errors[0]
        if error is not None:
            raise ConfigError(error)

    def _check_resume(self) -> None:
        """Verify the step to resume (collective) and that its data position maps onto this run;
        then, on rank 0, make it the head of the folder's history (``_settle_history``) and refuse
        a save or export plan that would overwrite what is not this run's (``_check_outputs``)."""
        c, t = self.cfg.checkpoint, self.cfg.training
        start = 0
        if self._resume_path is not None:
            checkpoint.verify_step(self._resume_path, checksums=c.verify_checksums)
            info = checkpoint.step_info(self._resume_path)
            extra = torch.load(os.path.join(self._resume_path, "extra_rank0.pt"), weights_only=True)
            try:
                if extra["data"] is not None:  # None: a converted step 0 (weights only), data from the start
                    self.batcher.position_for(extra["data"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"checkpoint.dir: cannot resume {self._resume_path} (saved by {info.get('world_size')} ranks) on "
                    f"{self.world_size} rank(s) with this data config: {exc}"
                ) from None
            start, self.lineage = int(info["step"]), info.get("lineage")
            self._resume_step = start
            note = None if extra["data"] is None else recipe_change_note(info, self.recipe, os.path.basename(self._resume_path))
            if note is not None:  # a legitimate change between runs, never a silent one
                self._print_rank0(f" note: {note}")
        self.lineage = self.lineage or checkpoint.new_lineage()
        error = None
        if self.rank == 0:
            try:
                self._settle_history()
                self._check_outputs(start)
            except ConfigError as exc:
                error = str(exc)
        self._agree(error)

    def _settle_history(self) -> None:
        """Rank 0: resuming step K of this folder makes K its lineage's head: ``latest`` names it
        and the lineage's newer steps (a rollback's, or a restart's that redoes steps) move to
        ``abandoned/``, so no save of this run ever meets an old step directory."""
        if self._resume_path is None:
            return
        moved = checkpoint_folder.roll_back(self.cfg.checkpoint.dir, self._resume_path)
        if moved:
            names = ", ".join(os.path.basename(m) for m in moved)
            self._print(f" continuing from {os.path.basename(self._resume_path)}: this run's newer steps ({names}) "
                        f"were moved to {os.path.dirname(moved[0])} (kept; delete them when no longer needed)")

    def _check_outputs(self, start: int) -> None:
        """Rank 0: no planned save may replace another run's step; the HF export (if any) may
        replace only an earlier export of this run, and its folder must be writable."""
        c, t = self.cfg.checkpoint, self.cfg.training
        planned = preflight.planned_saves(start, t.train_steps, c.interval)
        preflight.check_step_collisions(c.dir, planned, self.lineage if self._resume_path else None,
                                        resuming=self._resume_path is not None)
        if c.last_save_format == "hf":
            preflight.check_export_dir(self._export_dir(t.train_steps), self.lineage,
                                       "checkpoint.export_dir" if c.export_dir else "checkpoint.last_save_format: hf")

    def _open_initial_hf(self, cfg: TrainConfig):
        self._hf_adapter = hf_weights.hf_adapter_of(self.task, cfg, where="checkpoint.initial_load_path")
        return hf_weights.open_initial_checkpoint(cfg.checkpoint.initial_load_path, self._hf_adapter)

    def _load_initial_hf(self, checkpoint) -> None:
        with self._kernels():  # re-quantizes the 8-bit weights from the loaded masters
            report = hf_weights.load_initial_weights(checkpoint, self.model, self.optimizer, self._hf_adapter,
                                                     progress=self.rank == 0)
        self.hf_read_report = report
        self._print_rank0(f" started from Hugging Face weights {checkpoint.path}: rank 0 read "
                          f"{report.bytes_read / 2**20:.1f} of {report.checkpoint_bytes / 2**20:.1f} MiB (its shards)")
        note = hf_weights.left_out_note(checkpoint, self._hf_adapter)
        if note:
            self._print_rank0(f" note: {note}")

    # ---- saves and loads ---------------------------------------------------------------------
    def save_dcp(self, directory: str | None = None, *, prune: bool = True) -> str:
        """Atomic DCP save of BF16 weights, FP32 masters/moments, step, data position, RNG and the recipe
        (``te_npu.json`` ``low_precision``: format and MXFP8 scale rule, compared on resume).

        Refuses (``TrainingDiverged``) to save non-finite masters over the good checkpoints.
        ``prune``: apply ``checkpoint.keep_last`` now; ``train`` passes False and prunes once a
        later healthy loss vouches for the saved weights.
        """
        self._require_finite_masters()
        extra = {
            "data": self.batcher.state_dict(),
            "skipped_iterations": self.skipped_iterations,
            "rng": torch.get_rng_state(),
        }
        keep_last = (self.cfg.checkpoint.keep_last or None) if prune else None
        with self._watch.phase("checkpoint save", self.global_step, bounded=False):
            path = checkpoint.save(directory or self.cfg.checkpoint.dir, self.model, self.optimizer, self.global_step,
                                   extra, keep_last=keep_last, lineage=self.lineage, parent=self._parent_step,
                                   meta={"low_precision": recipe_record(self.recipe)})
        self._parent_step = self.global_step
        if directory is None or os.path.abspath(directory) == os.path.abspath(self.cfg.checkpoint.dir):
            self._saved.append(self.global_step)
            if not prune:
                self._unconfirmed.append(self.global_step)
        self._print_rank0(f" saved checkpoint at iteration {self.global_step} to {path}")
        return path

    def load_dcp(self, directory: str | None = None, *, verified: bool = False) -> int:
        """Restore the latest checkpoint (or a step dir): masters, moments, step, data position,
        skipped count, RNG; rebuild 8-bit shards. ``verified``: the manifest was checked already."""
        path = checkpoint.latest_checkpoint(directory or self.cfg.checkpoint.dir)
        with self._kernels():  # rebuilds the 8-bit shards from the loaded masters
            step, extra = checkpoint.load(path, self.model, self.optimizer, verify=not verified,
                                          checksums=self.cfg.checkpoint.verify_checksums)
        self.global_step = int(step)
        self.lineage = checkpoint.step_info(path).get("lineage") or self.lineage
        self._parent_step = self.global_step
        if extra["data"] is not None:  # None: a converted step 0 (weights only): data and RNG as a fresh run
            self.batcher.load_state_dict(extra["data"])
        self.skipped_iterations = int(extra["skipped_iterations"])
        if extra["rng"] is not None:
            torch.set_rng_state(extra["rng"])
        self._print_rank0(f" resumed from checkpoint at iteration {self.global_step} ({path}, consumed samples "
                          f"{self.batcher.consumed_samples})")
        return self.global_step

    def save_hf(self, directory: str | None = None) -> str:
        """Export the FP32 masters (cast to ``checkpoint.export_dtype``) and buffers as a Hugging
        Face directory (default ``checkpoint.export_dir`` or ``<checkpoint.dir>/hf/step_<N>``),
        carrying ``checkpoint.initial_load_path``'s config fields and tokenizer files; it replaces
        only an earlier export of this run (``hf_weights.export_weights``)."""
        c = self.cfg.checkpoint
        directory = directory or self._export_dir(self.global_step)
        adapter = hf_weights.hf_adapter_of(self.task, self.cfg, where="checkpoint.last_save_format: hf")
        with self._watch.phase("HF export", self.global_step, bounded=False):
            report = hf_weights.export_weights(directory, self.model, self.optimizer, adapter, dtype=c.export_dtype,
                                               max_shard_mb=c.export_max_shard_mb, progress=self.rank == 0,
                                               owner={"lineage": self.lineage, "step": self.global_step},
                                               source=c.initial_load_path)
        self._print_rank0(f" exported Hugging Face weights at iteration {self.global_step} to {report.directory} "
                          f"({len(report.files)} file(s), {report.total_bytes / 2**20:.1f} MiB, {c.export_dtype})"
                          f"{'; it replaces the interrupted export left in ' + report.directory + '.tmp' if report.completed else ''}")
        if report.kept:
            self._print_rank0(f" note: kept {', '.join(report.kept)} in {report.directory}: not written by the earlier "
                              "export of this run it replaces, so left as it was")
        return report.directory

    def _unfinished_export(self) -> str | None:
        """What is wrong with the HF export of this step (rank 0's view, on every rank), or None:
        complete, or no export configured."""
        if self.cfg.checkpoint.last_save_format != "hf":
            return None
        state = [export_state(self._export_dir(self.global_step), {"lineage": self.lineage, "step": self.global_step})
                 if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(state, src=0)
        return state[0]

    def _export_dir(self, step: int) -> str:
        c = self.cfg.checkpoint
        return c.export_dir or os.path.join(c.dir, "hf", f"step_{step}")

    # ---- what the loop's health does to the saved steps --------------------------------------
    def _confirm_saves(self) -> None:
        """The saved steps so far are good: prune their history down to ``keep_last``."""
        if self._unconfirmed:
            newest = self._unconfirmed[-1]
            self._unconfirmed.clear()
            checkpoint.prune(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep_last, self.lineage, newest)

    def _diverged(self, exc: TrainingDiverged) -> TrainingDiverged:
        """The run stops: steps this run saved at or after ``began_at - 1`` (their weights gave
        the first bad loss or came after it) move to ``diverged/``, ``latest`` goes back to the
        newest good step; returns the error to raise, saying what happened (same on every rank)."""
        c, began = self.cfg.checkpoint, exc.began_at
        bad = [k for k in self._unconfirmed if began is not None and k >= began - 1]
        notes = ["nothing saved, no checkpoint pruned"]
        if bad:
            good = [k for k in self._saved if k not in bad]
            head = good[-1] if good else self._resume_step
            if self.rank == 0:
                checkpoint_folder.set_latest(c.dir, None if head is None else f"step_{head}")
                checkpoint_folder.set_aside(c.dir, [f"step_{k}" for k in bad], checkpoint_folder.DIVERGED)
            self._barrier()  # every rank raises this same error at this step; rank 0 has moved the steps
            notes.append(f"{', '.join(f'step_{k}' for k in bad)} (saved after the divergence began at iteration "
                         f"{began}) moved to {os.path.join(c.dir, checkpoint_folder.DIVERGED)}")
        if began is not None and self._resume_step is not None and self._resume_step >= began - 1:
            notes.append(f"the step this run resumed from (step_{self._resume_step}) already leads to it: resume "
                         "from an earlier step (checkpoint.load_step=N)")
        notes.append(self._latest_note())
        return TrainingDiverged(f"{exc}; {'; '.join(notes)}", began)

    def _require_finite_masters(self) -> None:
        bad = [fqn for fqn, m in self.optimizer.masters.items() if not bool(torch.isfinite(local_tensor(m)).all())]
        count = torch.tensor(float(len(bad)))
        if self.world_size > 1:
            count = count.to(self._collective_device())
            dist.all_reduce(count)
        if count.item():
            example = f" (e.g. {bad[0]})" if bad else ""
            raise TrainingDiverged(
                f"iteration {self.global_step}: {int(count.item())} FP32 master shard(s) hold NaN/Inf{example}; "
                f"refusing to save them over the good checkpoints ({self._latest_note()})"
            )

    def _latest_note(self) -> str:
        try:
            return f"latest complete checkpoint: {checkpoint.latest_checkpoint(self.cfg.checkpoint.dir)}"
        except ConfigError:
            return f"no checkpoint in {self.cfg.checkpoint.dir} yet"
