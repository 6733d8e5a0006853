"""DCP checkpoints: bitwise resume in fresh processes, no 8-bit payload saved, resharding, atomicity."""
from __future__ import annotations

import os
import pickle
import signal

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing import ProcessExitedException

from te_npu import ConfigError
from te_npu.distributed import MasterWeightOptimizer, shard_model
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.distributed.storage import dcp
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
    dcp.save(workdir + "/ckpt", model, opt, SAVE_AT, extra={"data_position": SAVE_AT}, keep_last=2)
    masters = {k: _full(m).clone() for k, m in opt.masters.items()}
    return {"losses": _train(model, opt, fmt, range(SAVE_AT, SAVE_AT + MORE)), "masters": masters}


def _resume_worker(rank, world, workdir, fmt):
    model, opt = _setup(fmt, world, seed=123)  # different init: everything must come from the checkpoint
    step, extra = dcp.load(workdir + "/ckpt", model, opt)
    masters = {k: _full(m).clone() for k, m in opt.masters.items()}
    return {"step": step, "extra": extra, "masters": masters,
            "losses": _train(model, opt, fmt, range(step, step + MORE))}


def _killed_save_worker(rank, world, workdir, fmt):
    model, opt = _setup(fmt, world)
    dcp.load(workdir + "/ckpt", model, opt)
    _train(model, opt, fmt, [SAVE_AT])
    if rank == 1:
        original = torch_dcp.save

        def save_then_die(*args, **kwargs):
            original(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.dcp.save = save_then_die
    dcp.save(workdir + "/ckpt", model, opt, SAVE_AT + 1)


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
    path = dcp.latest_checkpoint(work + "/ckpt")
    metadata = dcp.read_metadata(path).state_dict_metadata
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
    assert dcp.latest_checkpoint(work + "/ckpt").endswith(f"step_{SAVE_AT}")
    resumed = run_ranks(_resume_worker, 2, work, "hif8")
    assert resumed[0]["step"] == SAVE_AT


def test_checkpoint_rejects_non_dcp_paths(tmp_path):
    model, opt = _setup("mxfp8", 1)
    torch.save({}, tmp_path / "model.pt")
    with pytest.raises(ConfigError, match="model.pt"):
        dcp.load(tmp_path / "model.pt", model, opt)
    with pytest.raises(ConfigError, match="not a te_npu DCP checkpoint"):
        dcp.load(tmp_path, model, opt)


# ---- one process: lineage-scoped pruning, interrupted saves, manifests --------------------------


def _save(directory, step, *, lineage=None, parent=None, keep_last=None, fmt="mxfp8"):
    model, opt = _setup(fmt, 1)
    return dcp.save(directory, model, opt, step, extra={"step": step}, keep_last=keep_last,
                           lineage=lineage, parent=parent)


def _steps(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("step_"))


def test_checkpoint_prune_keeps_an_older_runs_steps(tmp_path):
    # the case: a new run (resume=false) in a folder holding an older run's step_18, step_20
    _save(tmp_path, 18, lineage="old")
    _save(tmp_path, 20, lineage="old", parent=18)
    parent = None
    for step in (2, 4, 6):
        _save(tmp_path, step, lineage="new", parent=parent, keep_last=2)
        parent = step
    assert _steps(tmp_path) == ["step_18", "step_20", "step_4", "step_6"]
    assert dcp.latest_checkpoint(tmp_path).endswith("step_6")


def test_checkpoint_prune_spares_abandoned_and_newer_steps(tmp_path):
    for step, parent in ((2, None), (4, 2), (6, 4)):
        _save(tmp_path, step, lineage="run", parent=parent)
    _save(tmp_path, 8, lineage="run", parent=2, keep_last=2)  # resumed from step_2: 4 and 6 were abandoned
    assert _steps(tmp_path) == ["step_2", "step_4", "step_6", "step_8"]
    _save(tmp_path, 10, lineage="run", parent=8, keep_last=2)  # history 10 <- 8 <- 2: only step_2 goes
    assert _steps(tmp_path) == ["step_10", "step_4", "step_6", "step_8"]
    assert not any(n.endswith(".pruning") for n in os.listdir(tmp_path))


def test_checkpoint_save_refuses_to_replace_another_runs_step(tmp_path):
    _save(tmp_path, 4, lineage="theirs")
    with pytest.raises(RuntimeError, match="belongs to another run"):
        _save(tmp_path, 4, lineage="ours")
    assert dcp.step_info(tmp_path / "step_4")["lineage"] == "theirs"


class _Interrupted(BaseException):
    """Stands for the signal handler's exception (a BaseException, as ``JobInterrupted``)."""


@pytest.mark.parametrize("where", ["dcp.save", "hash_files", "write_manifest", "set_latest", "rename", "prune"])
def test_checkpoint_interrupted_save_keeps_previous_latest_or_finishes_the_published_one(tmp_path, monkeypatch, where):
    _save(tmp_path, 2, lineage="run", keep_last=1)
    targets = {"dcp.save": (dcp.dcp, "save"), "hash_files": (dcp, "hash_files"),
               "write_manifest": (dcp, "write_manifest"), "set_latest": (checkpoint_folder, "set_latest"),
               "rename": (checkpoint_folder.os, "rename"), "prune": (checkpoint_folder, "prune")}
    owner, name = targets[where]
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        if where == "rename" and not str(args[0]).endswith("step_4.tmp"):
            return original(*args, **kwargs)  # DCP's own .metadata rename
        raise _Interrupted(where)

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(_Interrupted):
        _save(tmp_path, 4, lineage="run", parent=2, keep_last=1)
    monkeypatch.undo()
    if where == "rename":  # published (latest names step_4), directory not yet renamed: nothing is lost
        with pytest.raises(ConfigError, match=r"names 'step_4', whose save was interrupted after it was published"):
            dcp.latest_checkpoint(tmp_path)
        assert checkpoint_folder.resolve_latest(tmp_path, pending=True) == os.path.join(tmp_path, "step_4")
        assert "finished the interrupted save of step_4" in checkpoint_folder.finish_interrupted_save(str(tmp_path))
        assert checkpoint_folder.finish_interrupted_save(str(tmp_path)) is None
    latest = dcp.latest_checkpoint(tmp_path)
    # before publication the old latest survives; from the publication on, the new step is the one
    assert latest.endswith("step_4" if where in ("rename", "prune") else "step_2")
    dcp.verify_step(latest)
    model, opt = _setup("mxfp8", 1, seed=5)
    step, extra = dcp.load(tmp_path, model, opt)
    assert extra == {"step": step}
    _save(tmp_path, 4, lineage="run", parent=2, keep_last=1)  # the redo (or the next save) never collides
    assert dcp.latest_checkpoint(tmp_path).endswith("step_4")


def test_checkpoint_saving_an_existing_step_of_this_run_sets_the_old_one_aside(tmp_path):
    _save(tmp_path, 2, lineage="run")
    (tmp_path / "step_2" / "marker").write_text("the first save")  # to recognise it after the move
    _save(tmp_path, 2, lineage="run")  # a redone step: no Errno 39, no crash loop
    assert dcp.latest_checkpoint(tmp_path).endswith("step_2")
    assert not (tmp_path / "step_2" / "marker").exists()
    assert (tmp_path / "abandoned" / "step_2" / "marker").read_text() == "the first save"


def test_checkpoint_roll_back_points_latest_and_moves_only_this_runs_newer_steps(tmp_path):
    for step, parent in ((4, None), (8, 4), (12, 8)):
        _save(tmp_path, step, lineage="run", parent=parent)
    _save(tmp_path, 10, lineage="other")  # another run's step in the same folder is never touched
    checkpoint_folder.set_latest(str(tmp_path), "step_12")
    moved = checkpoint_folder.roll_back(str(tmp_path), str(tmp_path / "step_4"))
    assert sorted(os.path.basename(m) for m in moved) == ["step_12", "step_8"]
    assert dcp.latest_checkpoint(tmp_path).endswith("step_4")
    assert _steps(tmp_path) == ["step_10", "step_4"] and _steps(tmp_path / "abandoned") == ["step_12", "step_8"]
    assert checkpoint_folder.roll_back(str(tmp_path), str(tmp_path / "step_4")) == []  # nothing newer: no-op
    _save(tmp_path, 8, lineage="run", parent=4)
    assert dcp.step_info(tmp_path / "step_8")["parent"] == 4


@pytest.mark.parametrize("content", ["../../other/checkpoints/step_16", "/abs/step_3", "step_4/../step_4", ""])
def test_checkpoint_latest_must_name_a_step_of_its_folder(tmp_path, content):
    other = tmp_path / "other" / "checkpoints"
    _save(other, 16, lineage="theirs")
    mine = tmp_path / "runs" / "x"
    _save(mine, 4, lineage="run")
    (mine / "latest").write_text(content)
    with pytest.raises(ConfigError, match=r"which is not a step of this folder"):
        dcp.latest_checkpoint(mine)


def _crafted_metadata(step_dir, payload) -> None:
    """What whoever can write the folder can do: replace .metadata, then re-hash it in the manifest."""
    import json

    from te_npu.distributed.storage.manifest import file_entry

    with open(os.path.join(step_dir, ".metadata"), "wb") as f:
        pickle.dump(payload, f)
    manifest = os.path.join(step_dir, "manifest.json")
    record = json.loads(open(manifest).read())
    record["files"][".metadata"] = file_entry(os.path.join(step_dir, ".metadata"))
    open(manifest, "w").write(json.dumps(record))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    step = _save(tmp_path / "ckpt", 2, lineage="run")
    marker = tmp_path / "code_ran"
    _crafted_metadata(step, _RunsCode(marker))
    model, opt = _setup("mxfp8", 1)
    for attempt in (lambda: dcp.verify_step(step), lambda: dcp.load(tmp_path / "ckpt", model, opt)):
        with pytest.raises(ConfigError) as info:
            attempt()
        message = str(info.value)
        assert ".metadata: refused: it names the global posix.system" in message and "\n" not in message, message
    assert not marker.exists()


def test_checkpoint_metadata_with_a_bytes_entry_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    step = _save(tmp_path, 2, lineage="run")
    metadata = dcp.read_metadata(step)
    key = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()  # DCP would torch.load(weights_only=False) its bytes
    _crafted_metadata(step, metadata)
    with pytest.raises(ConfigError, match=rf"entry '{key}' is a BytesStorageMetadata, not a tensor"):
        dcp.verify_step(step)


def test_checkpoint_metadata_pointing_outside_the_step_is_refused(tmp_path):
    step = _save(tmp_path, 2, lineage="run")
    metadata = dcp.read_metadata(step)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    _crafted_metadata(step, metadata)
    with pytest.raises(ConfigError, match=r"points at '../../etc/passwd', not a __R_I.distcp file"):
        dcp.verify_step(step)


def test_checkpoint_save_without_room_fails_before_writing(tmp_path, monkeypatch):
    _save(tmp_path, 2, lineage="run")
    monkeypatch.setattr(dcp, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(dcp.DiskFullError) as info:
        _save(tmp_path, 4, lineage="run", parent=2)
    message = str(info.value)
    assert f"step 4 to {tmp_path}: {tmp_path} has 1.0 MiB free, the step needs about" in message, message
    assert "nothing was written" in message and "\n" not in message
    assert _steps(tmp_path) == ["step_2"] and dcp.latest_checkpoint(tmp_path).endswith("step_2")


def test_checkpoint_disk_full_while_writing_is_named(tmp_path, monkeypatch):
    """torch's zip writer says "unexpected pos" on ENOSPC: the folder's free space tells the cause."""
    _save(tmp_path, 2, lineage="run")

    from te_npu.distributed.storage import disk_space

    def full(*args, **kwargs):
        monkeypatch.setattr(disk_space, "free_bytes", lambda path: 4096)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp.dcp, "save", full)
    with pytest.raises(dcp.DiskFullError, match=r"no space left on the device of .* \(4.0 KiB free now\); the write needs about"):
        _save(tmp_path, 4, lineage="run", parent=2)
    assert dcp.latest_checkpoint(tmp_path).endswith("step_2")


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_extra", "delete_manifest", "delete_metadata"])
def test_checkpoint_damaged_step_names_file_and_previous_step(tmp_path, damage):
    _save(tmp_path, 2, lineage="run")
    step4 = _save(tmp_path, 4, lineage="run", parent=2)
    shard = next(n for n in os.listdir(step4) if n.endswith(".distcp"))
    victim = {"flip_byte": shard, "truncate": shard, "delete_extra": "extra_rank0.pt",
              "delete_manifest": "manifest.json", "delete_metadata": ".metadata"}[damage]
    path = os.path.join(step4, victim)
    if damage == "flip_byte":
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(path, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.remove(path)
    model, opt = _setup("mxfp8", 1)
    with pytest.raises(ConfigError) as info:
        dcp.load(tmp_path, model, opt)
    message = str(info.value)
    assert (victim in message or "not a te_npu DCP checkpoint step" in message), message
    if damage != "delete_metadata":  # .metadata gone: the directory no longer looks like a step at all
        assert "checkpoint.load_step=2" in message, message
    if damage == "flip_byte":  # only the checksum sees a flipped byte; sizes alone do not
        dcp.verify_step(step4, checksums=False)
    step, _ = dcp.load(tmp_path / "step_2", model, opt)
    assert step == 2


def test_checkpoint_latest_naming_a_missing_step_names_both(tmp_path):
    _save(tmp_path, 2, lineage="run")
    (tmp_path / "latest").write_text("step_9")
    with pytest.raises(ConfigError, match=r"latest names 'step_9', but .*step_9 does not exist.*step_2"):
        dcp.latest_checkpoint(tmp_path)


def test_checkpoint_step_without_manifest_is_refused_until_adopted(tmp_path):
    from te_npu.distributed.storage import manifest as checkpoint_manifest

    step2 = _save(tmp_path, 2, lineage="run")
    os.remove(os.path.join(step2, "manifest.json"))  # as a step saved before manifests existed
    model, opt = _setup("mxfp8", 1)
    with pytest.raises(ConfigError, match="storage.manifest adopt"):
        dcp.load(tmp_path, model, opt)
    assert checkpoint_manifest._main(["adopt", step2]) == 0
    assert checkpoint_manifest._main(["adopt", step2]) == 2  # never overwrites a manifest
    step, extra = dcp.load(tmp_path, model, opt)
    assert (step, extra) == (2, {"step": 2})


def _weights_only_load_worker(rank, world, workdir, fmt):
    """Save with an optimizer, load into a sharded quantized model *without* one: the BF16 model
    view is read into DTensors laid out like each 8-bit shard (``_high_precision_like``) and the
    8-bit shards re-quantized from it."""
    from te_npu.compat import local_tensor

    model, opt = _setup(fmt, world)
    _train(model, opt, fmt, range(1))
    dcp.save(workdir + "/ckpt", model, opt, 1, extra={})
    fresh, _ = _setup(fmt, world, seed=123)
    step, _ = dcp.load(workdir + "/ckpt", fresh, None)
    same = {}
    for (fqn, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        a, b = local_tensor(p), local_tensor(q)
        names = a.inner_field_names() if hasattr(a, "inner_field_names") else ()
        if names:  # re-quantized from bf16(master): the same payload as the trained model's refresh
            reference = type(a).from_high_precision(local_tensor(opt.masters[fqn]).to(p.dtype), a.quantizer)
            same[fqn] = all(torch.equal(getattr(b, n).view(torch.uint8), getattr(reference, n).view(torch.uint8))
                            for n in names)
        else:
            same[fqn] = torch.equal(a, b)
    return {"step": step, "same": same}


def test_checkpoint_load_without_optimizer_into_sharded_quantized_model(tmp_path):
    for res in run_ranks(_weights_only_load_worker, 2, os.fspath(tmp_path), "mxfp8"):
        assert res["step"] == 1 and res["same"] and all(res["same"].values()), res["same"]
