"""scripts/prepare_data.py: byte-level and a local HF tokenizer built here (no downloads)."""
import numpy as np
import pytest

from te_npu.training.data import BYTE_EOS_ID, TokenDataset

TEXTS = {"a.txt": "the cat sat on the mat\n", "b.txt": "the dog sat\n", "sub/c.txt": "a cat and a dog\n"}


@pytest.fixture
def corpus(tmp_path):
    for name, text in TEXTS.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    return tmp_path / "in"


def test_prepare_data_byte_level(tmp_path, corpus, load_script):
    prepare = load_script("prepare_data")
    assert prepare.main(["--input", f"{corpus}/**/*.txt", "--byte-level", "--out-prefix", str(tmp_path / "out" / "c")]) == 0
    ds = TokenDataset(tmp_path / "out" / "c")
    expected = b"".join(TEXTS[k].encode() + bytes([BYTE_EOS_ID]) for k in sorted(TEXTS))  # sorted paths
    assert bytes(ds.tokens.astype(np.uint8)) == expected
    assert ds.vocab_size == 256 and ds.meta["tokenizer"]["kind"] == "byte" and len(ds.meta["sources"]) == 3


def test_prepare_data_byte_level_val_split(tmp_path, corpus, load_script):
    prepare = load_script("prepare_data")
    prepare.main(["--input", f"{corpus}/*.txt", "--input", f"{corpus}/sub/*.txt", "--byte-level",
                  "--val-fraction", "0.3", "--no-eos", "--out-prefix", str(tmp_path / "c")])
    train, val = TokenDataset(tmp_path / "c_train"), TokenDataset(tmp_path / "c_val")
    names = lambda ds: {s["path"] for s in ds.meta["sources"]}
    assert names(train).isdisjoint(names(val)) and len(names(train) | names(val)) == 3 and names(val)
    assert len(train) + len(val) == sum(len(t) for t in TEXTS.values()) and train.eos_token_id is None


def test_prepare_data_local_hf_tokenizer(tmp_path, corpus, load_script):
    tokenizers = pytest.importorskip("tokenizers", reason="building a local tokenizer needs `tokenizers`")
    transformers = pytest.importorskip("transformers", reason="loading a tokenizer dir needs `transformers`")
    words = sorted({w for text in TEXTS.values() for w in text.split()})
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(tmp_path / "tok")

    prepare = load_script("prepare_data")
    prepare.main(["--input", f"{corpus}/**/*.txt", "--tokenizer", str(tmp_path / "tok"), "--out-prefix", str(tmp_path / "c")])
    ds = TokenDataset(tmp_path / "c")
    expected = [i for k in sorted(TEXTS) for i in [*(vocab[w] for w in TEXTS[k].split()), 1]]
    assert ds.tokens.tolist() == expected
    assert ds.vocab_size == len(vocab) and ds.eos_token_id == 1 and ds.meta["tokenizer"]["kind"] == "hf"


def test_prepare_data_no_match_fails(tmp_path, load_script):
    with pytest.raises(SystemExit, match="no files match"):
        load_script("prepare_data").main(["--input", str(tmp_path / "*.none"), "--byte-level", "--out-prefix", str(tmp_path / "x")])


def test_prepare_data_megatron_format_is_one_document_per_file(tmp_path, corpus, load_script):
    from te_npu.training.data.megatron.indexed_dataset import MegatronIndexedDataset

    prepare = load_script("prepare_data")
    out = tmp_path / "out" / "m"
    assert prepare.main(["--input", f"{corpus}/**/*.txt", "--byte-level", "--format", "megatron", "--out-prefix", str(out)]) == 0
    ds = MegatronIndexedDataset(out)
    offsets = ds.document_offsets()
    assert ds.num_documents == 3 and ds.dtype == np.uint16
    for k, name in enumerate(sorted(TEXTS)):
        assert ds.tokens[offsets[k]:offsets[k + 1]].tolist() == [*TEXTS[name].encode(), BYTE_EOS_ID]
