"""data.kind: hf: local files (parquet, jsonl, a save_to_disk folder) and a tokenizer trained here,
tokenized once into a cached Megatron indexed dataset; vocabulary, column and cache rules."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from te_npu import ConfigError
from te_npu.training.config import DataConfig
from te_npu.training.data import build_splits, check_token_ids
from te_npu.training.data.megatron.indexed_dataset import MegatronIndexedDataset

datasets = pytest.importorskip("datasets", reason="data.kind hf reads with `datasets` (the test extra installs it)")
tokenizers = pytest.importorskip("tokenizers", reason="the test trains a local tokenizer with `tokenizers`")
transformers = pytest.importorskip("transformers", reason="data.kind hf loads tokenizers with `transformers`")

TEXTS = [f"document {i}: the cat sat on mat number {i * 7} and the dog ran " * (1 + i % 3) for i in range(40)]


def write_tokenizer(directory: Path, texts: list[str], vocab_size: int = 200) -> Path:
    """A BPE tokenizer trained on ``texts`` (at most ``vocab_size`` ids: their characters and
    merges, ``</s>`` EOS), saved as a transformers folder: nothing downloaded."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(directory)
    return directory


def write_hf_corpus(root: Path, documents, kind: str = "parquet") -> tuple[Path, Path]:
    """``documents`` (texts, or byte arrays decoded as latin-1) as a local HF dataset of ``kind``
    (``parquet`` / ``jsonl``: two files in a folder; ``saved``: ``save_to_disk``) plus a tokenizer
    trained on them; returns ``(dataset path, tokenizer folder)``."""
    texts = [d if isinstance(d, str) else bytes(np.asarray(d, dtype=np.uint8)).decode("latin-1") for d in documents]
    table = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    path = root / f"corpus_{kind}"
    half = len(texts) // 2
    if kind == "saved":
        datasets.DatasetDict({"train": table}).save_to_disk(str(path))
    else:
        path.mkdir(parents=True)
        for n, part in enumerate((table.select(range(half)), table.select(range(half, len(texts))))):
            if kind == "parquet":
                part.to_parquet(str(path / f"part-{n}.parquet"))
            else:
                part.to_json(str(path / f"part-{n}.jsonl"), lines=True)
    return path, write_tokenizer(root / "tokenizer", texts)


def hf_cfg(tmp_path, data_path, tokenizer_dir, **fields) -> DataConfig:
    return DataConfig(**{"kind": "hf", "path": str(data_path), "tokenizer": str(tokenizer_dir),
                         "cache_dir": str(tmp_path / "cache"), **fields})


def expected_tokens(tokenizer_dir, texts):
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return [np.array(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in texts]


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "saved"])
def test_hf_dataset_tokenized_once_into_a_megatron_cache(tmp_path, kind):
    path, tokenizer = write_hf_corpus(tmp_path, TEXTS, kind)
    splits = build_splits(hf_cfg(tmp_path, path, tokenizer, split="90,10"), vocab_size=256)
    (idx,) = (tmp_path / "cache" / "hf").glob("*.idx")
    cache = MegatronIndexedDataset(idx.with_suffix(""))
    docs = expected_tokens(tokenizer, TEXTS)
    assert cache.num_documents == 40 and cache.dtype == np.uint16  # preprocess_data.py's choice below 65,500 ids
    offsets = cache.document_offsets()
    for k, doc in enumerate(docs):  # one document per row, EOS appended, in the dataset's order
        np.testing.assert_array_equal(cache.tokens[offsets[k]:offsets[k + 1]], doc)
    np.testing.assert_array_equal(splits.val.tokens, np.concatenate(docs[36:]))  # valid share: documents 36-39
    assert splits.train.vocab_size == len(transformers.AutoTokenizer.from_pretrained(str(tokenizer)))
    assert check_token_ids(splits.train, 256, splits.train_key) is None
    stamp = idx.stat().st_mtime_ns
    build_splits(hf_cfg(tmp_path, path, tokenizer, split="90,10"), vocab_size=256)
    assert idx.stat().st_mtime_ns == stamp and len(list(idx.parent.glob("*.idx"))) == 1  # cached


def test_hf_cache_key_follows_the_content(tmp_path):
    path, tokenizer = write_hf_corpus(tmp_path, TEXTS, "jsonl")
    build_splits(hf_cfg(tmp_path, path, tokenizer), vocab_size=256)
    part = path / "part-1.jsonl"
    part.write_text(part.read_text().replace("the dog ran", "the dog sat"))  # same size, new content
    build_splits(hf_cfg(tmp_path, path, tokenizer), vocab_size=256)
    assert len(list((tmp_path / "cache" / "hf").glob("*.idx"))) == 2


def test_hf_separate_validation_dataset(tmp_path):
    path, tokenizer = write_hf_corpus(tmp_path, TEXTS[:30], "parquet")
    val = tmp_path / "val.jsonl"
    datasets.Dataset.from_dict({"text": TEXTS[30:]}).to_json(str(val), lines=True)
    splits = build_splits(hf_cfg(tmp_path, path, tokenizer, val_path=str(val)), vocab_size=256)
    np.testing.assert_array_equal(splits.val.tokens, np.concatenate(expected_tokens(tokenizer, TEXTS[30:])))
    assert splits.val_key == "data.val_path"


def test_hf_tokenizer_larger_than_the_model_refused_before_reading(tmp_path):
    path, tokenizer = write_hf_corpus(tmp_path, TEXTS, "parquet")
    size = len(transformers.AutoTokenizer.from_pretrained(str(tokenizer)))
    with pytest.raises(ConfigError, match=rf"^data\.tokenizer: .* has {size} token ids, more than the model's vocab_size 32"):
        build_splits(hf_cfg(tmp_path, path, tokenizer), vocab_size=32)
    assert not (tmp_path / "cache").exists()  # nothing tokenized


@pytest.mark.parametrize(("case", "message"), [
    ("no_column", r"data\.text_key: 'body' is not a column of data\.path's dataset \(columns: \['id', 'text'\]\)"),
    ("missing", r"data\.path: '.*nowhere' does not exist"),
    ("no_tokenizer", r"data\.tokenizer: '.*nowhere' is not a folder"),
    ("empty_dir", r"data\.path: .* holds no \[.*\] file and is not a save_to_disk folder"),
])
def test_hf_bad_input_is_one_config_error(tmp_path, case, message):
    path, tokenizer = write_hf_corpus(tmp_path, TEXTS, "parquet")
    fields = {"no_column": dict(text_key="body"), "missing": dict(path=str(tmp_path / "nowhere")),
              "no_tokenizer": dict(tokenizer=str(tmp_path / "nowhere")), "empty_dir": dict(path=str(tmp_path / "e"))}
    (tmp_path / "e").mkdir()
    with pytest.raises(ConfigError, match=message) as err:
        build_splits(hf_cfg(tmp_path, path, tokenizer, **fields[case]), vocab_size=256)
    assert "\n" not in str(err.value)


# ---- data.streaming: true ------------------------------------------------------------------------


def stream_splits(tmp_path, **fields):
    """Train on ``TEXTS[:30]`` (two jsonl files), validate on the rest, in order; written once per test."""
    path, val = tmp_path / "corpus_jsonl", tmp_path / "val.jsonl"
    if not val.exists():
        write_hf_corpus(tmp_path, TEXTS[:30], "jsonl")
        datasets.Dataset.from_dict({"text": TEXTS[30:]}).to_json(str(val), lines=True)
    cfg = hf_cfg(tmp_path, path, tmp_path / "tokenizer", val_path=str(val), shuffle=False, **fields)
    return build_splits(cfg, vocab_size=256), cfg


def test_streamed_windows_are_the_cached_windows_in_file_order(tmp_path):
    from te_npu.training.data.sampling import make_batcher

    streamed, _ = stream_splits(tmp_path, streaming=True)
    cached, _ = stream_splits(tmp_path)
    a = make_batcher(streamed.train, 2, 16, seed=0, shuffle=False, vocab_size=256)
    b = make_batcher(cached.train, 2, 16, seed=0, shuffle=False, vocab_size=256)
    for _ in range(b.batches_per_epoch):
        x, y = next(a)
        x_ref, y_ref = next(b)
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert "is tokenized as it is read" in check_token_ids(streamed.train, 256, "data.path")


def test_streaming_writes_no_cache(tmp_path):
    stream_splits(tmp_path, streaming=True)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("saved", "resumed"), [((2, 2), (1, 4)), ((1, 3), (2, 1))], ids=["2x2->1x4", "1x3->2x1"])
def test_stream_batcher_resumes_exactly_on_any_layout_across_epochs(tmp_path, saved, resumed):
    from te_npu.training.data.hf_stream import StreamBatcher

    splits, _ = stream_splits(tmp_path, streaming=True)
    continuous = StreamBatcher(splits.train, 1, 16, seed=0)
    reference = [next(continuous)[0] for _ in range(400)]  # several passes: the corpus holds ~150 windows
    assert continuous.state_dict()["epoch"] >= 2
    (w0, b0), (w1, b1) = saved, resumed
    before = [StreamBatcher(splits.train, b0, 16, seed=0, rank=r, world_size=w0) for r in range(w0)]
    for _ in range(60):
        for b in before:
            next(b)
    state = json.loads(json.dumps(before[0].state_dict()))
    after = [StreamBatcher(splits.train, b1, 16, seed=0, rank=r, world_size=w1) for r in range(w1)]
    for b in after:
        b.load_state_dict(state)
    for step in range(30):
        rows = [next(b)[0] for b in after]
        start = state["consumed_samples"] + step * b1 * w1
        for k in range(b1 * w1):
            assert torch.equal(rows[k % w1][k // w1], reference[start + k][0])


def test_stream_state_refuses_other_data(tmp_path):
    from te_npu.training.data.hf_stream import StreamBatcher

    splits, _ = stream_splits(tmp_path, streaming=True)
    state = StreamBatcher(splits.train, 2, 16, seed=0).state_dict()
    with pytest.raises(ValueError, match="mismatch on 'source'"):
        StreamBatcher(splits.val, 2, 16, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="mismatch on 'seq_len'"):
        StreamBatcher(splits.train, 2, 8, seed=0).load_state_dict(state)


@pytest.mark.parametrize(("fields", "message"), [
    ({"streaming": True}, r"data\.shuffle: a streamed dataset is read in order"),
    ({"streaming": True, "shuffle": False}, r"data\.val_path: required with data\.streaming"),
])
def test_streaming_config_rules(fields, message):
    from te_npu.training.config import load_config

    data = {"kind": "hf", "path": "/d", "tokenizer": "/t", **fields}
    with pytest.raises(ConfigError, match=message):
        load_config({"data": data})
    with pytest.raises(ConfigError, match=r"data\.streaming: only used with data\.kind 'hf'"):
        load_config({"data": {"kind": "megatron", "path": "/a", "streaming": True}})
