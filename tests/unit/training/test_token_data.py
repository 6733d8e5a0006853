"""Token files, the stdlib corpus and the samplers: determinism, disjoint shards, exact resume."""
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from te_npu import ConfigError
from te_npu.training.data import (
    BYTE_EOS_ID,
    TokenBatcher,
    TokenDataset,
    build_datasets,
    build_stdlib_corpus,
    check_token_ids,
    split_by_file,
    stdlib_sources,
    validation_batches,
    write_token_file,
)

SMALL_STDLIB = 256 * 1024  # bytes of stdlib sources for the corpus tests (fast)


def arange_dataset(tmp_path, num_tokens=4001) -> TokenDataset:
    """Tokens 0..N-1 (uint32): a window's first token / S is its sample index."""
    ids = np.arange(num_tokens)
    write_token_file(tmp_path / "ar", [("ar", b"", ids)], vocab_size=num_tokens, tokenizer={"kind": "test"}, eos_token_id=None, split="train")
    return TokenDataset(tmp_path / "ar")


def sample_ids(batch, seq_len):
    x, _ = batch
    return (x[:, 0] // seq_len).tolist()


@pytest.mark.parametrize(("vocab", "dtype"), [(256, "uint16"), (65536, "uint16"), (65537, "uint32")])
def test_token_file_memmap_round_trip(tmp_path, vocab, dtype):
    rng = np.random.default_rng(7)
    docs = [(f"doc{i}", f"raw{i}".encode(), rng.integers(0, vocab, size=50 + i)) for i in range(3)]
    meta = write_token_file(tmp_path / "t", docs, vocab_size=vocab, tokenizer={"kind": "test"}, eos_token_id=1, split="train")
    ds = TokenDataset(tmp_path / "t")
    expected = np.concatenate([np.append(ids, 1) for _, _, ids in docs])
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ds.tokens, expected)
    assert len(ds) == meta["num_tokens"] == expected.size and ds.vocab_size == vocab and ds.eos_token_id == 1
    bin_bytes = (tmp_path / "t.bin").read_bytes()
    assert meta["sha256"] == hashlib.sha256(bin_bytes).hexdigest()
    assert [s["sha256"] for s in meta["sources"]] == [hashlib.sha256(raw).hexdigest() for _, raw, _ in docs]
    assert json.loads((tmp_path / "t.json").read_text()) == meta
    assert not list(tmp_path.glob("*.tmp*"))


def test_token_file_rejects_out_of_vocab_and_truncation(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        write_token_file(tmp_path / "t", [("d", b"", np.array([300]))], vocab_size=256, tokenizer={}, eos_token_id=None, split="x")
    write_token_file(tmp_path / "t", [("d", b"", np.arange(10))], vocab_size=256, tokenizer={}, eos_token_id=None, split="x")
    (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="expected num_tokens"):
        TokenDataset(tmp_path / "t")
    with pytest.raises(FileNotFoundError):
        TokenDataset(tmp_path / "missing")


def test_token_batcher_labels_are_next_tokens(tmp_path):
    x, y = next(TokenBatcher(arange_dataset(tmp_path), 3, 16, seed=0))
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1) and torch.equal(x[:, 0] % 16, torch.zeros(3, dtype=torch.int64))


def test_token_batcher_deterministic_per_seed(tmp_path):
    ds = arange_dataset(tmp_path)
    run = lambda seed: [sample_ids(next(b), 16) for b in [TokenBatcher(ds, 4, 16, seed=seed, rank=1, world_size=2)] for _ in range(20)]
    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_token_batcher_rank_shards_disjoint_and_cover(tmp_path, world_size):
    ds, seq, b = arange_dataset(tmp_path), 16, 4
    per_rank = []
    for rank in range(world_size):
        batcher = TokenBatcher(ds, b, seq, seed=3, rank=rank, world_size=world_size)
        per_rank.append([i for _ in range(batcher.batches_per_epoch) for i in sample_ids(next(batcher), seq)])
    flat = [i for ids in per_rank for i in ids]
    assert len(flat) == len(set(flat)) == world_size * batcher.batches_per_epoch * b
    assert set(flat) <= set(range(ds.num_samples(seq)))


def test_token_batcher_resume_matches_continuous_run(tmp_path):
    ds = arange_dataset(tmp_path)
    continuous = TokenBatcher(ds, 4, 16, seed=11, rank=1, world_size=2)
    batches_per_epoch = continuous.batches_per_epoch
    total = batches_per_epoch + 7  # crosses an epoch boundary after the resume point
    reference = [next(continuous) for _ in range(total)]
    first = TokenBatcher(ds, 4, 16, seed=11, rank=1, world_size=2)
    for _ in range(batches_per_epoch - 3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoint-safe plain values
    resumed = TokenBatcher(ds, 4, 16, seed=11, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for expected in reference[batches_per_epoch - 3 :]:
        got = next(resumed)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert resumed.consumed_samples == continuous.consumed_samples == total * 4 * 2


def test_token_batcher_state_mismatch_fails(tmp_path):
    ds = arange_dataset(tmp_path)
    state = TokenBatcher(ds, 4, 16, seed=1, world_size=2).state_dict()
    with pytest.raises(ValueError, match="seed"):
        TokenBatcher(ds, 4, 16, seed=2, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        TokenBatcher(ds, 4, 8, seed=1, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        TokenBatcher(ds, 4, 16, seed=1, world_size=2, shuffle=False).load_state_dict(state)


def _epoch_positions(batcher, steps, seq_len):
    """Sample ids served by ``steps`` batches of ``batcher``."""
    return [i for _ in range(steps) for i in sample_ids(next(batcher), seq_len)]


@pytest.mark.parametrize(("saved", "resumed"), [((2, 4), (1, 4)), ((1, 4), (2, 4)), ((2, 4), (4, 2)), ((2, 2), (1, 8))],
                         ids=["2x4->1x4", "1x4->2x4", "2x4->4x2", "2x2->1x8"])
def test_token_batcher_reshards_at_exact_position(tmp_path, saved, resumed):
    ds, seq = arange_dataset(tmp_path), 16
    (w0, b0), (w1, b1) = saved, resumed
    before = [TokenBatcher(ds, b0, seq, seed=5, rank=r, world_size=w0) for r in range(w0)]
    consumed = set()
    for batcher in before:
        consumed |= set(_epoch_positions(batcher, 8, seq))
    state = before[0].state_dict()
    after = [TokenBatcher(ds, b1, seq, seed=5, rank=r, world_size=w1) for r in range(w1)]
    for batcher in after:
        batcher.load_state_dict(state)
        assert batcher.consumed_samples == state["consumed_samples"]
    # the new ranks continue the same epoch order exactly where the old ones stopped: nothing
    # repeated, nothing skipped (the union of old + new is a prefix of the epoch's order)
    order = np.random.default_rng([5, 0]).permutation(ds.num_samples(seq))
    steps = 3
    served = set()
    for batcher in after:
        served |= set(_epoch_positions(batcher, steps, seq))
    assert not served & consumed
    total = len(consumed) + len(served)
    assert consumed | served == set(order[:total].tolist())
    assert after[0].consumed_samples == state["consumed_samples"] + steps * b1 * w1


def test_token_batcher_refuses_position_inside_a_batch(tmp_path):
    ds = arange_dataset(tmp_path)
    first = TokenBatcher(ds, 4, 16, seed=1, world_size=1)
    next(first)  # 4 samples consumed: not a multiple of 4 x 2
    with pytest.raises(ValueError, match="does not map onto whole batches"):
        TokenBatcher(ds, 4, 16, seed=1, world_size=2).load_state_dict(first.state_dict())


def test_token_batcher_checks_ids_against_vocab(tmp_path):
    ids = np.arange(400) % 250
    ids[100] = 300
    write_token_file(tmp_path / "v", [("v", b"", ids)], vocab_size=512, tokenizer={}, eos_token_id=None, split="x")
    ds = TokenDataset(tmp_path / "v")
    batcher = TokenBatcher(ds, 1, 16, seed=0, shuffle=False, vocab_size=256)
    for _ in range(6):  # samples 0-5 hold tokens 0..96: fine
        next(batcher)
    with pytest.raises(ValueError, match=r"v\.bin: token id 300 at token offset 100 \(sample 6\) is >= .* 256"):
        next(batcher)


def test_check_token_ids_before_training(tmp_path):
    ids = np.arange(1000) % 200
    write_token_file(tmp_path / "ok", [("d", b"", ids)], vocab_size=256, tokenizer={}, eos_token_id=None, split="x")
    assert check_token_ids(TokenDataset(tmp_path / "ok"), 256, "data.path") is None
    with pytest.raises(ConfigError, match=r"data\.path: .*vocab_size 256 .*larger than the model's vocab_size 128"):
        check_token_ids(TokenDataset(tmp_path / "ok"), 128, "data.path")
    # a .bin edited after a header without a digest was written (older files): the scan finds the id
    # (train slice reports the file offset)
    tokens = np.memmap(tmp_path / "ok.bin", dtype=np.uint16, mode="r+")
    tokens[900] = 40000
    tokens.flush()
    _drop_digest(tmp_path / "ok.json")
    tail = TokenDataset(tmp_path / "ok").slice(800, 1000)
    with pytest.raises(ConfigError, match=r"ok\.bin \[tokens 800:1000\] holds token id 40000 at token offset 900"):
        check_token_ids(tail, 256, "data.path")


def _drop_digest(meta_path):
    meta = json.loads(meta_path.read_text())
    del meta["sha256"]
    meta_path.write_text(json.dumps(meta))


def test_token_file_edited_after_its_header_fails_naming_the_file(tmp_path):
    ids = np.arange(1000) % 200
    write_token_file(tmp_path / "ok", [("d", b"", ids)], vocab_size=256, tokenizer={}, eos_token_id=None, split="x")
    tokens = np.memmap(tmp_path / "ok.bin", dtype=np.uint16, mode="r+")
    tokens[900] = 7  # a valid id, same size: only the digest sees it
    tokens.flush()
    with pytest.raises(ValueError, match=r"ok\.bin: its SHA-256 is [0-9a-f]{16}\.\.\., its \.json header says"):
        TokenDataset(tmp_path / "ok")
    cfg = SimpleNamespace(kind="bin", path=str(tmp_path / "ok"), val_path=None, val_fraction=0.1)
    with pytest.raises(ConfigError, match=r"^data\.path: .*ok\.bin: its SHA-256 is"):
        build_datasets(cfg)
    _drop_digest(tmp_path / "ok.json")  # a header that records none: nothing to check against
    assert len(TokenDataset(tmp_path / "ok")) == 1000


def test_token_file_digest_is_skipped_above_the_limit(tmp_path):
    from te_npu.training.data.token_checksum import check_sha256

    write_token_file(tmp_path / "ok", [("d", b"", np.arange(100))], vocab_size=256, tokenizer={}, eos_token_id=None,
                     split="x")
    assert check_sha256(tmp_path / "ok.bin", "0" * 64, limit=100) is False  # 200 bytes > limit: not read
    with pytest.raises(ValueError, match="SHA-256"):
        check_sha256(tmp_path / "ok.bin", "0" * 64, limit=1000)


def test_token_batcher_too_small_dataset_fails(tmp_path):
    with pytest.raises(ValueError, match="fewer than one"):
        TokenBatcher(arange_dataset(tmp_path, 100), 4, 16, seed=0, world_size=2)


def test_validation_batches_fixed_and_disjoint(tmp_path):
    ds = arange_dataset(tmp_path)
    per_rank = [[sample_ids(b, 16) for b in validation_batches(ds, 4, 16, num_batches=5, rank=r, world_size=2)] for r in range(2)]
    again = [sample_ids(b, 16) for b in validation_batches(ds, 4, 16, num_batches=5, rank=0, world_size=2)]
    assert per_rank[0] == again and len(again) == 5
    assert not set(sum(per_rank[0], [])) & set(sum(per_rank[1], []))
    assert len(list(validation_batches(ds, 4, 16, num_batches=10**6, world_size=2))) == ds.num_samples(16) // 2 // 4
    with pytest.raises(ValueError, match="no full batch"):
        next(validation_batches(ds.slice(0, 20), 4, 16, num_batches=1))


def test_split_by_file_deterministic_and_disjoint():
    names = [f"pkg/mod{i}.py" for i in range(200)]
    train, val = split_by_file(names, 0.1)
    assert set(val) == set(split_by_file(list(reversed(names)), 0.1)[1])  # independent of file order
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(names) and 5 < len(val) < 40
    assert split_by_file(["a.py", "b.py"], 0.01)[1]  # never an empty validation split


def test_stdlib_sources_sorted_capped_and_filtered():
    sources = stdlib_sources(SMALL_STDLIB)
    names = [n for n, _ in sources]
    assert names == sorted(names) and sum(p.stat().st_size for _, p in sources) <= SMALL_STDLIB
    every = [n for n, _ in stdlib_sources(10**9)]
    assert not any(part in ("site-packages", "test", "tests") for n in every for part in n.split("/"))


def test_stdlib_corpus_split_cache_and_content(tmp_path):
    train, val = build_stdlib_corpus(tmp_path / "a" / "std", 0.2, max_bytes=SMALL_STDLIB)
    tr, va = TokenDataset(train), TokenDataset(val)
    tr_files, va_files = [s["path"] for s in tr.meta["sources"]], [s["path"] for s in va.meta["sources"]]
    assert va_files and set(tr_files).isdisjoint(va_files)
    assert tr.vocab_size == 256 and tr.eos_token_id == BYTE_EOS_ID and tr.tokens.dtype == np.uint16
    first = dict(stdlib_sources(SMALL_STDLIB))[tr_files[0]].read_bytes()
    assert bytes(tr.tokens[: len(first)].astype(np.uint8)) == first and tr.tokens[len(first)] == BYTE_EOS_ID
    stamp = (tmp_path / "a" / "std_train.bin").stat().st_mtime_ns
    assert build_stdlib_corpus(tmp_path / "a" / "std", 0.2, max_bytes=SMALL_STDLIB) == (train, val)
    assert (tmp_path / "a" / "std_train.bin").stat().st_mtime_ns == stamp  # cached: not rewritten
    other = TokenDataset(build_stdlib_corpus(tmp_path / "b" / "std", 0.2, max_bytes=SMALL_STDLIB)[0])
    assert other.meta["sha256"] == tr.meta["sha256"]  # deterministic


def test_build_datasets_stdlib_and_bin(tmp_path):
    cfg = SimpleNamespace(kind="stdlib", cache_dir=str(tmp_path), val_fraction=0.2, max_bytes=SMALL_STDLIB, include_tests=False)
    train, val = build_datasets(cfg)
    assert len(train) > len(val) > 0
    ds = arange_dataset(tmp_path, 1000)
    train, val = build_datasets(SimpleNamespace(kind="bin", path=str(tmp_path / "ar"), val_path=None, val_fraction=0.1))
    assert (len(train), len(val)) == (900, 100) and train.tokens[-1] + 1 == val.tokens[0] == 900
    train, val = build_datasets(SimpleNamespace(kind="bin", path=str(tmp_path / "ar"), val_path=str(tmp_path / "ar"), val_fraction=0.1))
    assert len(train) == len(val) == len(ds)
    with pytest.raises(ConfigError, match="data.path"):
        build_datasets(SimpleNamespace(kind="bin", path=str(tmp_path / "nope"), val_path=None, val_fraction=0.1))
