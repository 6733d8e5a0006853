"""DCP checkpoints: bitwise resume in fresh processes, no 8-bit payload saved, resharding, atomicity."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing import ProcessExitedException

from te_npu import ConfigError
from te_npu.distributed import MasterWeightOptimizer, checkpoint, shard_model
from tests.distributed.harness import batch, build, loss_of, run_ranks

SAVE_AT, MORE = 2, 5


def _setup(fmt, world, seed=0):
    model, init = build(fmt, seed=seed)
    if world > 1:
        shard_model(model, init_device_mesh("cpu", (world,)), reshard_after_forward=True)
    return model, MasterWeightOptimizer(model, init, lr=1e-2, max_grad_norm=1.0)


def _train(model, opt, fmt, steps):
    losses = []
    for step in steps:
        loss = loss_of(model, fmt, batch(step))
        loss.backward()
        assert opt.step().updated
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _continuous_worker(rank, world, workdir, fmt):
    model, opt = _setup(fmt, world)
    _train(model, opt, fmt, range(SAVE_AT))
    checkpoint.save(workdir + "/ckpt", model, opt, SAVE_AT, extra={"data_position": SAVE_AT}, keep_last=2)
    masters = {k: _full(m).clone() for k, m in opt.masters.items()}
    return {"losses": _train(model, opt, fmt, range(SAVE_AT, SAVE_AT + MORE)), "masters": masters}


def _resume_worker(rank, world, workdir, fmt):
    model, opt = _setup(fmt, world, seed=123)  # different init: everything must come from the checkpoint
    step, extra = checkpoint.load(workdir + "/ckpt", model, opt)
    masters = {k: _full(m).clone() for k, m in opt.masters.items()}
    return {"step": step, "extra": extra, "masters": masters,
            "losses": _train(model, opt, fmt, range(step, step + MORE))}


def _killed_save_worker(rank, world, workdir, fmt):
    model, opt = _setup(fmt, world)
    checkpoint.load(workdir + "/ckpt", model, opt)
    _train(model, opt, fmt, [SAVE_AT])
    if rank == 1:
        original = dcp.save

        def save_then_die(*args, **kwargs):
            original(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.dcp.save = save_then_die
    checkpoint.save(workdir + "/ckpt", model, opt, SAVE_AT + 1)


@pytest.mark.parametrize("fmt", ["mxfp8", pytest.param("hif8", marks=pytest.mark.slow)])
def test_checkpoint_resume_in_fresh_processes_is_bitwise(fmt, tmp_path):
    work = os.fspath(tmp_path)
    continuous = run_ranks(_continuous_worker, 2, work, fmt)
    resumed = run_ranks(_resume_worker, 2, work, fmt)
    for rank in range(2):
        assert resumed[rank]["step"] == SAVE_AT
        assert resumed[rank]["extra"] == {"data_position": SAVE_AT}
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank]["losses"], continuous[rank]["losses"]))
    # the checkpoint holds BF16 model weights + FP32 optimizer state under parameter FQNs, no 8-bit payload
    path = checkpoint.latest_checkpoint(work + "/ckpt")
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    dtypes = {key: meta.properties.dtype for key, meta in metadata.items()}
    assert set(dtypes.values()) <= {torch.bfloat16, torch.float32}, dtypes
    assert "model.up.weight" in dtypes and dtypes["model.up.weight"] == torch.bfloat16
    assert dtypes["optim.up.weight.master"] == torch.float32
    assert not any(k.endswith(("data", "scale", "_extra_state")) for k in dtypes), sorted(dtypes)


@pytest.mark.slow
def test_checkpoint_reshards_two_ranks_to_one(tmp_path):
    work = os.fspath(tmp_path)
    saved = run_ranks(_continuous_worker, 2, work, "mxfp8")
    loaded = run_ranks(_resume_worker, 1, work, "mxfp8")
    assert loaded[0]["step"] == SAVE_AT
    for fqn, master in saved[0]["masters"].items():
        assert torch.equal(loaded[0]["masters"][fqn], master), fqn


@pytest.mark.slow
def test_checkpoint_killed_save_leaves_previous_loadable(tmp_path):
    work = os.fspath(tmp_path)
    run_ranks(_continuous_worker, 2, work, "hif8")
    with pytest.raises(ProcessExitedException):
        run_ranks(_killed_save_worker, 2, work, "hif8")
    assert os.path.isdir(os.path.join(work, "ckpt", f"step_{SAVE_AT + 1}.tmp"))
    assert checkpoint.latest_checkpoint(work + "/ckpt").endswith(f"step_{SAVE_AT}")
    resumed = run_ranks(_resume_worker, 2, work, "hif8")
    assert resumed[0]["step"] == SAVE_AT


def test_checkpoint_rejects_non_dcp_paths(tmp_path):
    model, opt = _setup("mxfp8", 1)
    torch.save({}, tmp_path / "model.pt")
    with pytest.raises(ConfigError, match="model.pt"):
        checkpoint.load(tmp_path / "model.pt", model, opt)
    with pytest.raises(ConfigError, match="not a te_npu DCP checkpoint"):
        checkpoint.load(tmp_path, model, opt)
