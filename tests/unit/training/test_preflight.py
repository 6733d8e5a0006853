"""Checks before the build: device, writable folders, which step to resume, save collisions."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from te_npu import ConfigError
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.training.guards import preflight


def _ckpt(directory, resume="auto", load_step=None):
    return SimpleNamespace(dir=str(directory), resume=resume, load_step=load_step)


def _fake_step(directory, step, lineage="run"):
    path = directory / f"step_{step}"
    path.mkdir(parents=True)
    (path / "te_npu.json").write_text(json.dumps({"step": step, "world_size": 1, "lineage": lineage}))
    (path / ".metadata").write_bytes(b"")
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_preflight_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match=r"training\.device: 'cuda' is not available"):
        preflight.check_device("cuda", 0, 1)
    preflight.check_device("cpu", 0, 8)


def test_preflight_unwritable_dir_names_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"logging\.dir: .* is not writable"):
        preflight.check_writable(str(tmp_path / "file" / "logs"), "logging.dir")
    preflight.check_writable(str(tmp_path / "logs"), "logging.dir")
    assert os.listdir(tmp_path / "logs") == []  # the probe file is gone


@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="needs Linux's /proc (a filesystem that "
                                                                   "refuses new entries with ENOENT)")
def test_preflight_unwritable_virtual_filesystem_says_why(tmp_path):
    """``export_dir=/proc/x``: not "No such file or directory" for a folder that exists."""
    for directory, what in (("/proc", "no file can be created in it"), ("/proc/x", "it cannot be created")):
        with pytest.raises(ConfigError) as info:
            preflight.check_writable(directory, "checkpoint.export_dir")
        message = str(info.value)
        assert message.startswith(f"checkpoint.export_dir: {directory!r} is not writable: {what} (") and (
            "its filesystem refuses new entries in '/proc', which exists" in message  # root: ENOENT
            or "Permission denied" in message), message  # others: EACCES
        assert "No such file or directory" not in message
        assert "proc filesystem mounted at /proc" in message and "\n" not in message


def test_preflight_resume_auto_empty_folder_starts_fresh(tmp_path):
    assert preflight.resume_target(_ckpt(tmp_path / "none")) is None
    assert preflight.resume_target(_ckpt(tmp_path, resume=False)) is None


def test_preflight_resume_auto_refuses_steps_without_latest(tmp_path):
    _fake_step(tmp_path, 18)
    _fake_step(tmp_path, 20)
    with pytest.raises(ConfigError) as info:
        preflight.resume_target(_ckpt(tmp_path))
    message = str(info.value)
    assert "step_18, step_20 but no 'latest' marker" in message
    assert "checkpoint.load_step=N (newest: 20)" in message and "checkpoint.resume=false" in message
    assert preflight.resume_target(_ckpt(tmp_path, load_step=18)).endswith("step_18")
    with pytest.raises(ConfigError, match=r"checkpoint\.load_step: .*step_7 does not exist"):
        preflight.resume_target(_ckpt(tmp_path, load_step=7))


STEP_FILES = {"complete": ("te_npu.json", ".metadata"), "record_only": ("te_npu.json",),
              "metadata_only": (".metadata",), "neither": ()}


@pytest.mark.parametrize("held", list(STEP_FILES))
def test_preflight_resume_auto_follows_the_folders_step_rule(tmp_path, held):
    """``checkpoint.dir`` pointed at a step folder itself. A completed save leaves both files, and
    only that folder resumes; one holding either file alone is a step folder whose save did not
    complete (or a partial copy): refused naming the missing file, never a new run written inside
    it. ``record_only`` is where the old preflight rule (``te_npu.json`` alone) and the folder's rule
    (both) disagreed; ``metadata_only`` is what an interrupted save leaves in ``step_N.tmp`` (DCP's
    ``.metadata`` is written before ``te_npu.json``), which the old rule took for an empty folder."""
    step = tmp_path / "step_4"
    step.mkdir()
    for name in STEP_FILES[held]:
        (step / name).write_text(json.dumps({"step": 4, "world_size": 1, "lineage": "run"}))
    assert checkpoint_folder.is_step_dir(step) == (held == "complete")
    assert checkpoint_folder.holds_step_files(step) == (held != "neither")
    if held == "complete":
        assert preflight.resume_target(_ckpt(step)) == str(step)
    elif held == "neither":
        assert preflight.resume_target(_ckpt(step)) is None  # an empty folder: a new run
    else:
        missing = ({"te_npu.json", ".metadata"} - set(STEP_FILES[held])).pop()
        with pytest.raises(ConfigError) as info:
            preflight.resume_target(_ckpt(step))
        message = str(info.value)
        assert message.startswith("checkpoint.dir (checkpoint.resume: auto): ")
        assert f"incomplete step folder (no {missing} in it" in message and "\n" not in message
        with pytest.raises(ConfigError, match="incomplete step folder"):
            checkpoint_folder.latest_checkpoint(step)  # loading asks the same rule


def test_preflight_step_names_say_the_newest_four(tmp_path):
    for step in (2, 4, 6, 8, 10):
        _fake_step(tmp_path, step)
    assert checkpoint_folder.step_names(checkpoint_folder.list_steps(tmp_path)) == "..., step_4, step_6, step_8, step_10"
    assert checkpoint_folder.step_names([]) == "no step_N directory"
    with pytest.raises(ConfigError, match=r"step_7 does not exist; the folder holds \.\.\., step_4, .*step_10$"):
        preflight.resume_target(_ckpt(tmp_path, load_step=7))


def test_preflight_latest_marker_is_followed(tmp_path):
    _fake_step(tmp_path, 4)
    (tmp_path / "latest").write_text("step_4")
    assert preflight.resume_target(_ckpt(tmp_path, resume=True)).endswith("step_4")
    (tmp_path / "latest").write_text("step_6")
    with pytest.raises(ConfigError, match=r"latest names 'step_6', but .*step_6 does not exist"):
        preflight.resume_target(_ckpt(tmp_path))


def test_preflight_planned_saves():
    assert preflight.planned_saves(0, 10, 4) == [4, 8, 10]
    assert preflight.planned_saves(8, 10, 4) == [10]
    assert preflight.planned_saves(0, 5, 0) == [5]
    assert preflight.planned_saves(10, 10, 4) == []


def test_preflight_collisions_with_another_runs_steps(tmp_path):
    _fake_step(tmp_path, 4, lineage="old")
    preflight.check_step_collisions(str(tmp_path), [2, 6], None)
    preflight.check_step_collisions(str(tmp_path), [4], "old")  # resuming that run: its own step
    with pytest.raises(ConfigError, match=r"already holds step_4 of another run"):
        preflight.check_step_collisions(str(tmp_path), [2, 4], None)
    message = _error(lambda: preflight.check_step_collisions(str(tmp_path), [4], "new", resuming=True))
    assert "checkpoint.resume=auto" not in message and "move those steps out of the folder" in message, message
    assert "resume that run (checkpoint.resume=auto)" in _error(
        lambda: preflight.check_step_collisions(str(tmp_path), [4], None))


def _error(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


def test_preflight_latest_outside_its_folder_is_refused(tmp_path):
    _fake_step(tmp_path / "other", 16)
    mine = tmp_path / "mine"
    _fake_step(mine, 4)
    (mine / "latest").write_text("../other/step_16")
    assert "which is not a step of this folder" in _error(lambda: preflight.resume_target(_ckpt(mine)))


def test_preflight_a_step_published_but_not_renamed_is_the_resume_target(tmp_path):
    """A save killed between moving latest and the rename: its files are complete in step_8.tmp."""
    from te_npu.distributed.storage.manifest import hash_files, write_manifest

    _fake_step(tmp_path, 4)
    tmp = _fake_step(tmp_path, 8).rename(tmp_path / "step_8.tmp")
    write_manifest(str(tmp), 8, hash_files(str(tmp), os.listdir(tmp)))
    (tmp_path / "latest").write_text("step_8")
    assert preflight.resume_target(_ckpt(tmp_path)) == str(tmp_path / "step_8")
    assert preflight.resume_target(_ckpt(tmp_path, load_step=8)) == str(tmp_path / "step_8")
    (tmp / "manifest.json").unlink()  # not complete: not a step to resume
    assert "step_8 does not exist" in _error(lambda: preflight.resume_target(_ckpt(tmp_path)))


def _hf_like(directory):
    directory.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        (directory / name).write_text("{}")
    return directory


def test_preflight_export_dir_refuses_what_is_not_an_earlier_export_of_this_run(tmp_path):
    from te_npu.distributed.storage.hf_checkpoint import EXPORT_RECORD

    source = _hf_like(tmp_path / "hf_source")  # e.g. the run's own checkpoint.initial_load_path
    message = _error(lambda: preflight.check_export_dir(str(source), "run", "checkpoint.export_dir"))
    assert message.startswith("checkpoint.export_dir: ") and "config.json, generation_config.json" in message, message
    assert "files that are not an export of this run" in message
    assert sorted(os.listdir(source)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    (source / EXPORT_RECORD).write_text(json.dumps({"lineage": "another", "step": 3}))
    assert "holds another run's export" in _error(lambda: preflight.check_export_dir(str(source), "run", "k"))
    (source / EXPORT_RECORD).write_text(json.dumps({"lineage": "run", "step": 3}))
    preflight.check_export_dir(str(source), "run", "k")  # an earlier export of this run: replaced
    preflight.check_export_dir(str(tmp_path / "new"), "run", "k")
    (tmp_path / "empty").mkdir()
    preflight.check_export_dir(str(tmp_path / "empty"), "run", "k")
    (tmp_path / "a_file").write_text("x")
    assert "is not a directory" in _error(lambda: preflight.check_export_dir(str(tmp_path / "a_file"), "run", "k"))
    assert "not writable" in _error(lambda: preflight.check_export_dir(str(tmp_path / "a_file" / "hf"), "run", "k"))
