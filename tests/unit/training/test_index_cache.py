"""Issue 38: the Megatron sample-index cache knows what it was built from. A dataset re-segmented
under an existing cache (same file sizes), a cache corrupted in place at its own size, or a cache
without its check record is rebuilt with one line naming the data and what changed (the samples
then equal a fresh cache's), or refused in one line where it may not be rebuilt; an index that
spans many epochs, or a ``train_samples`` below the run's needs, is said in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from te_npu.training.config import DataConfig
from te_npu.training.data import build_splits
from te_npu.training.data.megatron.index_cache import StaleIndexCache
from te_npu.training.data.sampling import make_batcher
from tests.system.megatron_files import random_documents, write_megatron

SEQ, SEED, N = 32, 5, 300


def _split(prefix, cache):
    """The whole dataset as the train split (validation: the same files, named apart)."""
    return build_splits(DataConfig(kind="megatron", path=str(prefix), val_path=str(prefix), cache_dir=str(cache))).train


def _all(samples) -> np.ndarray:
    return samples.window_array(range(len(samples)))


@pytest.fixture
def docs():
    return random_documents(3, 12, vocab=200)


def _resegment(prefix, docs, moved=10):
    """The same tokens (a byte-identical .bin, an .idx of the same size): ``moved`` tokens of
    document 0 now start document 1."""
    joined = [docs[0][:-moved], np.concatenate((docs[0][-moved:], docs[1])), *docs[2:]]
    write_megatron(prefix, joined)
    return joined


def test_index_cache_rebuilds_a_resegmented_dataset_and_names_it(tmp_path, docs):
    prefix = write_megatron(tmp_path / "d", docs)
    first = _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    assert first.notes == []
    old = _all(first)
    bin_before, idx_size = (tmp_path / "d.bin").read_bytes(), (tmp_path / "d.idx").stat().st_size
    _resegment(prefix, docs)
    assert (tmp_path / "d.bin").read_bytes() == bin_before and (tmp_path / "d.idx").stat().st_size == idx_size
    again = _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    fresh = _split(prefix, tmp_path / "fresh").samples(SEQ, SEED, N)
    np.testing.assert_array_equal(_all(again), _all(fresh))
    assert not np.array_equal(_all(again), old)  # same tokens, other samples: the old index was stale
    [note] = again.notes
    assert note.startswith(f"data.path: {tmp_path / 'd.idx'} [train: sequences 0:12]: rebuilt the sample index cache ")
    assert "the data changed since it was built (sequence_lengths_sha256: " in note and "\n" not in note
    assert _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N).notes == []  # rebuilt once


def test_index_cache_rebuilds_reversed_lengths_with_new_tokens(tmp_path, docs):
    prefix = write_megatron(tmp_path / "d", docs)
    _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    write_megatron(prefix, [np.full(len(d), 7) for d in reversed(docs)])  # same sizes, lengths reversed, other tokens
    again = _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)  # used to be 'all input arrays must have ...'
    np.testing.assert_array_equal(_all(again), _all(_split(prefix, tmp_path / "fresh").samples(SEQ, SEED, N)))
    assert len(again.notes) == 1 and "the data changed since it was built" in again.notes[0]


@pytest.mark.parametrize("damage", ["swap_shuffle", "shift_sample_offsets"])
def test_index_cache_corrupted_in_place_is_rebuilt(tmp_path, docs, damage):
    prefix = write_megatron(tmp_path / "d", docs)
    good = _all(_split(prefix, tmp_path / "cache").samples(SEQ, SEED, N))
    name = "shuffle_index" if damage == "swap_shuffle" else "sample_index"
    [path] = (tmp_path / "cache" / "megatron_indices").glob(f"*-{name}.npy")
    size = path.stat().st_size
    array = np.load(path, mmap_mode="r+")
    if damage == "swap_shuffle":
        array[[0, 1]] = array[[1, 0]]
    else:
        array[1:, 1] += 1
    array.flush()
    del array
    assert path.stat().st_size == size
    again = _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    np.testing.assert_array_equal(_all(again), good)
    [note] = again.notes
    assert f"{path.name} does not match its CRC-32 (changed or corrupted in place)" in note


def test_index_cache_without_check_record_is_rebuilt(tmp_path, docs):
    prefix = write_megatron(tmp_path / "d", docs)
    _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    [check] = (tmp_path / "cache" / "megatron_indices").glob("*-check.json")
    check.unlink()  # a cache an older te_npu wrote
    again = _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    assert "it has no readable check record" in again.notes[0]
    assert json.loads(check.read_text())["built_from"]["split_tokens"] == sum(map(len, docs))


def test_stale_index_cache_refused_where_it_may_not_be_rebuilt(tmp_path, docs):
    import dataclasses

    prefix = write_megatron(tmp_path / "d", docs)
    _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    _resegment(prefix, docs)
    other_rank = dataclasses.replace(_split(prefix, tmp_path / "cache"), may_build=False)
    with pytest.raises(StaleIndexCache) as err:
        other_rank.samples(SEQ, SEED, N)
    message = str(err.value)
    assert message.startswith(f"data.path: {tmp_path / 'd.idx'} [train: sequences 0:12]: the sample index cache ")
    assert "is stale: the data changed since it was built" in message and "other ranks map it already" in message
    assert "\n" not in message


def test_stale_index_cache_refused_in_a_read_only_folder(tmp_path, docs, monkeypatch):
    import errno

    from te_npu.training.data.megatron.index_cache import IndexCache

    prefix = write_megatron(tmp_path / "d", docs)
    _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)
    _resegment(prefix, docs)

    def read_only(self, names, arrays):  # a read-only mount (this test may run as root, whom chmod does not stop)
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(IndexCache, "_write", read_only)
    with pytest.raises(StaleIndexCache, match=r"is stale \(the data changed .*\) and cannot be rebuilt: Read-only file "
                                              r"system \(give data.cache_dir a writable folder\)$"):
        _split(prefix, tmp_path / "cache").samples(SEQ, SEED, N)


def test_megatron_batcher_says_when_the_index_spans_many_epochs(tmp_path, docs):
    train = _split(write_megatron(tmp_path / "d", docs), tmp_path / "cache")
    one_epoch = len(train.samples(SEQ, SEED, None))
    batcher = make_batcher(train, 2, SEQ, seed=SEED, start_sample=one_epoch * 40, run_samples=8)
    [note] = batcher.notes
    assert note.startswith("data.start_sample / data.train_samples: indexing ")
    assert f"takes {batcher.samples.num_epochs} epochs of its data" in note and "of index for" in note
    assert batcher.samples.num_epochs >= 40
    assert make_batcher(train, 2, SEQ, seed=SEED, run_samples=8).notes == []


def test_megatron_batcher_says_when_train_samples_is_below_the_run(tmp_path, docs):
    train = _split(write_megatron(tmp_path / "d", docs), tmp_path / "cache")
    one_epoch = len(train.samples(SEQ, SEED, None))
    [note] = make_batcher(train, 2, SEQ, seed=SEED, train_samples=10, run_samples=one_epoch).notes
    assert note.startswith(f"data.train_samples: 10 is fewer than the {one_epoch} samples this run consumes")
    with pytest.raises(ValueError, match=r"data.train_samples: 10 is fewer than .* holds \d+: raise data.train_samples"):
        make_batcher(train, 2, SEQ, seed=SEED, train_samples=10, run_samples=one_epoch * 3)
