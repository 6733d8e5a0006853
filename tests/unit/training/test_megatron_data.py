"""Megatron indexed datasets (data.kind: megatron): read in place in every dtype, document
boundaries and Megatron's split, every malformed pair refused in one line naming the key."""

import numpy as np
import pytest

from te_npu import ConfigError
from te_npu.training.data import token_dataset
from te_npu.training.config import DataConfig, load_config
from te_npu.training.data import build_splits, check_token_ids
from te_npu.training.data.megatron.indexed_dataset import IndexFormatError, MegatronIndexedDataset, write_indexed_dataset
from te_npu.training.data.sampling import make_batcher
from tests.system.megatron_files import MEGATRON_CODES, random_documents, write_megatron


def megatron_cfg(**fields) -> DataConfig:
    return DataConfig(**{"kind": "megatron", **fields})


@pytest.mark.parametrize("code", sorted(MEGATRON_CODES), ids=[np.dtype(t).name for _, t in sorted(MEGATRON_CODES.items())])
def test_indexed_dataset_reads_every_megatron_dtype_in_place(tmp_path, code):
    docs = random_documents(code, 7, vocab=100)
    prefix = write_megatron(tmp_path / "d", docs, code)
    ds = MegatronIndexedDataset(prefix)
    assert ds.dtype == np.dtype(MEGATRON_CODES[code]) and isinstance(ds.tokens, np.memmap)
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    assert ds.num_documents == ds.num_sequences == 7 and ds.num_tokens == sum(map(len, docs))
    offsets = ds.document_offsets()
    for k, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.tokens[offsets[k]:offsets[k + 1]], doc)


def test_indexed_dataset_document_boundaries_with_split_sentences(tmp_path):
    docs = random_documents(1, 5, vocab=50)
    ds = MegatronIndexedDataset(write_megatron(tmp_path / "s", docs, 4, sentences_per_doc=3))
    assert (ds.num_sequences, ds.num_documents) == (15, 5)
    assert ds.document_offsets().tolist() == np.concatenate(([0], np.cumsum([len(d) for d in docs]))).tolist()
    assert ds.document_offsets([1, 5]).tolist() == [len(docs[0]), ds.num_tokens]


def test_indexed_writer_output_reads_back_as_megatron_lays_it_out(tmp_path):
    docs = random_documents(2, 4, vocab=70000)
    assert write_indexed_dataset(tmp_path / "w", docs, np.int32) == (4, sum(map(len, docs)))
    written = (tmp_path / "w.idx").read_bytes()
    write_megatron(tmp_path / "ref", docs, 4)
    assert written == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert not list(tmp_path.glob("*.tmp*"))


def _docs():
    return random_documents(3, 4, vocab=100, min_len=10, max_len=20)


def _lengths():
    return [len(d) for d in _docs()]


CORRUPT = {
    "magic": (dict(magic=b"NOTANIDX\x00"), r"not the Megatron index magic"),
    "version": (dict(version=2), r"index version 2; only version 1"),
    "dtype_code": (dict(code=9), r"dtype code 9 is not one of Megatron's"),
    "bin_truncated": (dict(bin_bytes_cut=2), r"\.bin: \d+ bytes, but its index .* describes \d+ uint16 tokens"),
    "idx_size": (dict(extra_idx_bytes=b"\0" * 8), r"but its header \(4 sequences, 5 document indices\) needs"),
    "multimodal": (dict(extra_idx_bytes=b"\0" * 4), r"multimodal index"),
    "pointers": (dict(pointers=[0, 2, 4, 6]), r"sequence 1 starts at byte 2 of the .bin, .*\(pointers disagree"),
    "negative_length": (dict(lengths=[-1, 5, 5, 5]), r"sequence 0 has negative length -1"),
    "doc_start": (dict(doc_index=[1, 2, 3, 4, 4]), r"document index must start at sequence 0"),
    "doc_end": (dict(doc_index=[0, 1, 2, 3, 3]), r"document index ends at sequence 3, but the index holds 4"),
    "doc_order": (dict(doc_index=[0, 3, 2, 3, 4]), r"document index decreases at document 2"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_malformed_index_refused_in_one_line_naming_the_key(tmp_path, case):
    corrupt, message = CORRUPT[case]
    if case == "negative_length":
        corrupt = dict(lengths=[-1, *_lengths()[1:]])
    prefix = write_megatron(tmp_path / "bad", _docs(), **corrupt)
    with pytest.raises(IndexFormatError, match=message):
        MegatronIndexedDataset(prefix)
    with pytest.raises(ConfigError, match=rf"^data\.path: not a valid Megatron indexed dataset: .*{message}") as err:
        build_splits(megatron_cfg(path=str(prefix)))
    assert "\n" not in str(err.value)


def test_short_or_missing_files_refused(tmp_path):
    (tmp_path / "short.idx").write_bytes(b"MMIDIDX\x00\x00\x01")
    (tmp_path / "short.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.path: .*10 bytes, shorter than the 34-byte Megatron index header"):
        build_splits(megatron_cfg(path=str(tmp_path / "short")))
    write_megatron(tmp_path / "nobin", _docs())
    (tmp_path / "nobin.bin").unlink()
    with pytest.raises(ConfigError, match=r"data\.path: .*nobin\.bin does not exist"):
        build_splits(megatron_cfg(path=str(tmp_path / "nobin")))
    write_megatron(tmp_path / "web", _docs())
    with pytest.raises(ConfigError, match=r"^data\.blend\[1\]: .*missing\.idx does not exist"):
        build_splits(megatron_cfg(blend=f"0.5 {tmp_path / 'web'} 0.5 {tmp_path / 'missing'}"))


def test_split_cuts_sequences_at_megatrons_bookends(tmp_path):
    docs = random_documents(4, 200, vocab=100, min_len=5, max_len=30)
    prefix = write_megatron(tmp_path / "d", docs, sentences_per_doc=2)  # 400 sequences
    splits = build_splits(megatron_cfg(path=str(prefix), split="969;30:1"))
    # Megatron (GPTDataset splits by sequence): [0, .969, .999, 1.0] x 400 rounded -> [0, 388), [388, 400)
    (train,), (val,) = splits.train.sources, splits.val.sources
    assert (train.begin, train.end, val.begin, val.end) == (0, 388, 388, 400)
    assert (splits.train_key, splits.val_key) == ("data.path", "data.split")
    with pytest.raises(ConfigError, match=r"data\.path / data\.split: .* has no sequences to sample \(valid share"):
        build_splits(megatron_cfg(path=str(write_megatron(tmp_path / "tiny", docs[:3])), split="98,2,0"))


def test_separate_validation_prefix_and_blend(tmp_path):
    docs = random_documents(5, 50, vocab=100)
    train, val = write_megatron(tmp_path / "train", docs[:40]), write_megatron(tmp_path / "val", docs[40:])
    splits = build_splits(megatron_cfg(path=str(train), val_path=str(val)))
    assert splits.train.sources[0].end == 40 and splits.val_key == "data.val_path"
    splits = build_splits(megatron_cfg(blend=[[1, str(train)], [3, str(val)]], val_blend=f"2 {val}"))
    assert splits.train.weights == (1.0, 3.0) and splits.val.weights is None  # one-prefix valid blend: a GPTDataset
    assert [s.key for s in splits.val.sources] == ["data.val_blend[0]"]


def test_token_ids_checked_before_training_in_every_dtype(tmp_path):
    ids = np.arange(300) % 200
    bad_high, bad_negative, bad_fraction = ids.copy(), ids.copy() - 0, ids.astype(np.float32)
    bad_high[123] = 256
    bad_negative[77] = -3
    bad_fraction[9] = 4.5
    for name, values, code, message in (
        ("high", bad_high, 8, r"token id 256 at token offset 123, which is >= the model's vocab_size 256$"),
        ("negative", bad_negative, 3, r"token id -3 at token offset 77, which is negative"),
        ("fraction", bad_fraction, 7, r"token id 4\.5 at token offset 9, which is not a whole number"),
    ):
        splits = build_splits(megatron_cfg(path=str(write_megatron(tmp_path / name, [values], code)),
                                           val_path=str(write_megatron(tmp_path / "ok", [ids]))))
        with pytest.raises(ConfigError, match=rf"^data\.path: .*{name}\.bin holds {message}"):
            check_token_ids(splits.train, 256, splits.train_key)
        assert check_token_ids(splits.val, 256, splits.val_key) is None


def test_large_split_sampled_at_startup_and_checked_exactly_per_batch(tmp_path, monkeypatch):
    train_doc, val_doc = np.arange(20_000) % 250, np.arange(20_000) % 250
    train_doc[10_011] = 300  # between two sampled chunks
    val_doc[19_990] = 301  # inside the last sampled chunk (file offset 39990)
    splits = build_splits(megatron_cfg(path=str(write_megatron(tmp_path / "big", [train_doc, val_doc])), split="1,1",
                                       cache_dir=str(tmp_path / "cache")))
    monkeypatch.setattr(token_dataset, "SCAN_LIMIT_BYTES", 1000)  # where TokenDataset.check_token_ids reads it
    monkeypatch.setattr(token_dataset, "SAMPLE_CHUNK_TOKENS", 100)
    with pytest.raises(ConfigError, match=r"token id 301 at token offset 39990"):
        check_token_ids(splits.val, 256, "data.split")
    note = check_token_ids(splits.train, 256, "data.path")  # 300 at 10011 is not sampled
    assert "sampled 6400 of its 20000 tokens; every batch is checked exactly" in note
    batcher = make_batcher(splits.train, 1, 100, seed=0, train_samples=199, vocab_size=256)
    for _ in range(199):
        try:
            next(batcher)
        except ValueError as exc:
            assert "token id 300 at position" in str(exc) and "is >= the model's vocab_size 256" in str(exc)
            break
    else:
        raise AssertionError("the per-batch check missed token 300")


BLEND_CONFIGS = {
    "pairs": ([[0.3, "/data/web"], [0.7, "/data/code"]], ((0.3, "/data/web"), (0.7, "/data/code"))),
    "flat_string": ("0.3 /data/web 0.7 /data/code", ((0.3, "/data/web"), (0.7, "/data/code"))),
    "flat_list": ([30, "/data/web", 70, "/data/code"], ((30.0, "/data/web"), (70.0, "/data/code"))),
}


@pytest.mark.parametrize("case", sorted(BLEND_CONFIGS))
def test_config_accepts_blend_spellings(case):
    from te_npu.training.data.blend import parse_blend

    written, parsed = BLEND_CONFIGS[case]
    cfg = load_config({"data": {"kind": "megatron", "blend": written}})
    assert parse_blend(cfg.data.blend, "data.blend") == parsed
    assert load_config(cfg.to_dict()).data == cfg.data  # round trip


@pytest.mark.parametrize(("data", "message"), [
    ({"kind": "megatron", "blend": "0.3 /a -0.7 /b"}, r"data\.blend\[1\]: weight -0\.7 of '/b' must be a finite number > 0"),
    ({"kind": "megatron", "blend": [[0, "/a"]]}, r"data\.blend\[0\]: weight 0\.0"),
    ({"kind": "megatron", "blend": "0.3 /a 0.7"}, r"data\.blend: .* give a weight before every prefix"),
    ({"kind": "megatron", "blend": "0.3 /a code /b"}, r"data\.blend\[1\]: weight 'code' is not a number"),
    ({"kind": "megatron"}, r"data\.path / data\.blend: .* give exactly one"),
    ({"kind": "megatron", "path": "/a", "blend": "1 /b"}, r"give exactly one"),
    ({"kind": "megatron", "path": "/a", "split": "99,1", "val_path": "/v"}, r"data\.split: .* not both"),
    ({"kind": "megatron", "path": "/a", "split": "100,0,0"}, r"data\.split: .* gives validation no documents"),
    ({"kind": "megatron", "path": "/a", "split": "9,x"}, r"data\.split: '9,x' is not comma-separated"),
    ({"kind": "megatron", "path": "/a", "tokenizer": "/t"}, r"data\.tokenizer: only used with data\.kind 'hf'"),
    ({"kind": "bin", "path": "/a", "blend": "1 /b"}, r"data\.blend: only used with data\.kind 'megatron'"),
    ({"kind": "stdlib", "path": "/a"}, r"data\.path: only used with data\.kind 'bin' / 'megatron' / 'hf'"),
    ({"kind": "parquet"}, r"data\.kind: 'parquet' is not supported; allowed values are \['stdlib', 'bin', 'megatron', 'hf'\]"),
], ids=["negative_weight", "zero_weight", "odd_flat", "no_weights", "neither", "both", "split_and_val", "no_valid",
        "bad_split", "foreign_key", "bin_blend", "stdlib_path", "unknown_kind"])
def test_config_refuses_bad_data_sections(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"data": data})
