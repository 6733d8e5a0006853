"""An HF export writes and deletes only its own files (issue 32), in one process (no process group)."""
from __future__ import annotations

import json

import pytest
import torch

from te_npu.distributed.storage.hf_checkpoint import EXPORT_RECORD, export_state, save_hf_weights
from te_npu.distributed.storage.hf_layout import HFKeyMap
from te_npu.errors import ConfigError

RUN = "run-a"


def _export(directory, step, **kwargs):
    sources = {"w": torch.full((4, 4), float(step))}
    return save_hf_weights(directory, sources, HFKeyMap(), {"model_type": "toy"}, dtype=torch.float32,
                           owner={"lineage": RUN, "step": step}, **kwargs)


def _value(directory):
    from safetensors.torch import load_file

    return float(load_file(str(directory / "model.safetensors"))["w"][0, 0])


def test_hf_export_record_lists_the_files_it_wrote(tmp_path):
    report = _export(tmp_path / "hf", 1)
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record == {"lineage": RUN, "step": 1, "files": ["config.json", "model.safetensors", EXPORT_RECORD]}
    assert report.kept == () and not report.completed
    assert export_state(tmp_path / "hf", {"lineage": RUN, "step": 1}) is None
    assert "holds the export of step 1" in export_state(tmp_path / "hf", {"lineage": RUN, "step": 2})


@pytest.mark.parametrize("legacy", [False, True], ids=["listed", "record-without-list"])
def test_hf_export_keeps_a_foreign_file_of_the_earlier_export(tmp_path, legacy):
    """The issue's probe: tokenizer.json put into the export after the first one was gone after the next."""
    out = tmp_path / "hf"
    _export(out, 4)
    if legacy:  # an export from before the record listed its files
        (out / EXPORT_RECORD).write_text(json.dumps({"lineage": RUN, "step": 4}))
    (out / "tokenizer.json").write_text('{"mine": 1}')
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("x")
    report = _export(out, 8)
    assert report.kept == ("notes", "tokenizer.json")
    assert (out / "tokenizer.json").read_text() == '{"mine": 1}' and (out / "notes" / "a.txt").read_text() == "x"
    assert _value(out) == 8.0 and not (tmp_path / "hf.replaced").exists()
    assert "tokenizer.json" not in json.loads((out / EXPORT_RECORD).read_text())["files"]  # still not the export's


def test_hf_export_refuses_to_overwrite_a_foreign_file_of_the_same_name(tmp_path):
    out, source = tmp_path / "hf", tmp_path / "source_tokenizer.json"
    source.write_text('{"source": 1}')
    _export(out, 4)
    (out / "tokenizer.json").write_text('{"mine": 1}')
    with pytest.raises(ConfigError, match=r"holds tokenizer.json, which the earlier export did not write and this "
                                          r"one would overwrite; refusing"):
        _export(out, 8, extra_files={"tokenizer.json": str(source)})
    assert (out / "tokenizer.json").read_text() == '{"mine": 1}' and _value(out) == 4.0


def test_hf_export_completes_an_interrupted_export(tmp_path):
    out = tmp_path / "hf"
    (tmp_path / "hf.tmp" / "sharded").mkdir(parents=True)
    (tmp_path / "hf.tmp" / "sharded" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"partial")
    assert "an interrupted export" in export_state(out, {"lineage": RUN, "step": 8})
    report = _export(out, 8)
    assert report.completed and _value(out) == 8.0 and not (tmp_path / "hf.tmp").exists()
    assert export_state(out, {"lineage": RUN, "step": 8}) is None


def test_hf_export_leaves_a_staging_folder_holding_other_files(tmp_path):
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "my_data.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"also holds my_data.bin; refusing to remove it"):
        _export(tmp_path / "hf", 1)
    assert (tmp_path / "hf.tmp" / "my_data.bin").exists()
