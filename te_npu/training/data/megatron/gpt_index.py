"""Megatron-LM's ``GPTDataset`` sample order, rebuilt in numpy: the document, sample and shuffle
indices of one split of one indexed dataset, and the blend's dataset / dataset-sample indices,
with their cache on disk.

The rules, each the same arithmetic as Megatron-core's (``megatron/core/datasets/gpt_dataset.py``
``_build_document_sample_shuffle_indices``, ``_build_document_index``, ``_build_shuffle_index``,
``_get_num_epochs``; ``helpers.cpp`` ``build_sample_idx``; ``blended_dataset.py`` +
``build_blending_indices``), checked against megatron-core itself by tests/unit/training/test_gpt_index.py:

- **epochs**: the fewest ``E`` with ``E * tokens_per_epoch >= num_samples * S + 1`` (one epoch
  when ``num_samples`` is None); with ``E > 1`` the last epoch is shuffled apart ("separate
  final epoch") when it contributes fewer than ``int(0.8 * samples_per_epoch)`` samples.
- **document index** ``int32 [E * D]``: the split's sequence ids repeated ``E`` times and shuffled
  by one ``numpy.random.RandomState(seed)`` (the first ``E - 1`` epochs together, then the last
  one, when separate).
- **sample index** ``[n + 1, 2]``: sample ``k`` starts ``k * S`` tokens into the concatenation of
  the documents in document-index order; row ``k`` is (position in the document index, token
  offset in that document) of that start, the row after it its end (inclusive: each sample has
  ``S + 1`` tokens, Megatron's ``add_extra_token_to_sequence``, so the last token of a sample is
  the first of the next). ``n = (E * tokens_per_epoch - 1) // S``: the last partial sample is
  dropped. int32 when the document index and every length fit, else int64 (Megatron's choice).
- **shuffle index** ``[n]``: ``arange(n)`` shuffled by the same RandomState after the document
  index (uint32, int64 from 2**32 - 1 on); with a separate final epoch, the samples before it
  and the rest are shuffled apart.
- **blend**: dataset ``i`` of weight ``w_i`` (normalised in float64) serves blend position
  ``p`` when its error ``w_i * max(p, 1) - c_i`` is the largest (``te_npu.training.data.blend.blending_indices``).

Global sample ``i`` of a split is then the ``S + 1`` tokens between sample-index rows
``shuffle[i]`` and ``shuffle[i] + 1``: Megatron's ``GPTDataset[i]``.

Cache: ``te_npu.training.data.megatron.index_cache.IndexCache`` (``<cache_dir>/megatron_indices``, as
Megatron's ``--data-cache-path``), which also records the sequence lengths the indices were
built from and each file's checksum, and rebuilds (saying so) or refuses a cache that does not
match.

Legend: S = sequence length, D = sequences in the split, E = epochs, n = samples.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "GPTIndices",
    "num_epochs_for",
    "separate_final_epoch",
    "build_document_index",
    "build_sample_index",
    "build_shuffle_index",
    "build_gpt_indices",
    "blend_sizes",
]

FINAL_EPOCH_THRESHOLD = 0.80
"""Megatron's threshold: a last epoch giving fewer than this share of an epoch's samples is shuffled apart."""
MID_LEVEL_SURPLUS = 0.005
"""Megatron's ``mid_level_dataset_surplus``: each dataset of a weighted blend is indexed for this many more samples."""
_CHUNK = 1 << 22


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_len: int) -> int:
    """Megatron's ``_get_num_epochs``: epochs whose tokens cover ``num_samples * seq_len + 1``."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_len + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, num_samples: int | None, seq_len: int, num_epochs: int) -> bool:
    """Whether Megatron shuffles the last of ``num_epochs`` epochs apart (module doc)."""
    if num_epochs == 1 or num_samples is None:
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - 1) // seq_len
    if not 0 <= from_final <= per_epoch + 1:
        raise AssertionError(f"{from_final} samples from the final epoch, outside [0, {per_epoch + 1}]")
    return from_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """``documents`` (sequence ids) ``num_epochs`` times, shuffled by ``rng``: ``int32 [E * D]``."""
    if not separate_final or num_epochs == 1:
        index_ED = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(index_ED)
        return index_ED
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_len: int) -> np.ndarray:
    """Megatron's ``build_sample_idx`` (last partial sample dropped, one extra token per sample):
    ``[n + 1, 2]`` rows (document-index position, token offset). ``sizes``: every sequence's length."""
    if seq_len <= 1:
        raise ValueError(f"seq_len {seq_len}: Megatron's sample index needs a sequence length > 1")
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)  # ends[j]: tokens up to and including document-index position j
    total = int(ends[-1]) if ends.size else 0
    if total <= 1:
        raise ValueError(f"{total} token(s) in the split: Megatron's sample index needs more than one")
    num_samples = (total - 1) // seq_len
    fits = max(len(document_index), int(np.max(sizes))) <= np.iinfo(np.int32).max
    index = np.empty((num_samples + 1, 2), dtype=np.int32 if fits else np.int64)
    index[0] = 0
    for begin in range(1, num_samples + 1, _CHUNK):
        start = np.arange(begin, min(begin + _CHUNK, num_samples + 1), dtype=np.int64) * seq_len
        # the first position whose document ends after the sample's start (empty documents skipped)
        j = np.searchsorted(ends, start, side="right")
        index[begin : begin + len(start), 0] = j
        index[begin : begin + len(start), 1] = start - (ends[j] - lengths[j])
    return index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``[0, num_samples)`` shuffled, then ``[num_samples, total_size)`` shuffled (Megatron's dtypes)."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass(frozen=True)
class GPTIndices:
    """The three indices of one GPT split (module doc) and the epoch facts they were built with."""

    document: np.ndarray
    sample: np.ndarray
    shuffle: np.ndarray
    num_epochs: int
    separate_final_epoch: bool

    def __len__(self) -> int:
        return int(self.sample.shape[0]) - 1


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_len: int, seed: int,
                      num_samples: int | None) -> GPTIndices:
    """Megatron's ``_build_document_sample_shuffle_indices`` for the sequences ``documents`` of a
    dataset whose sequence lengths are ``sizes``, indexed for at least ``num_samples`` samples
    (one epoch when None)."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_len)
    separate = separate_final_epoch(tokens_per_epoch, num_samples, seq_len, epochs)
    rng = np.random.RandomState(seed)
    document = build_document_index(documents, epochs, rng, separate)
    sample = build_sample_index(sizes, document, seq_len)
    total = int(sample.shape[0]) - 1
    first = ((epochs - 1) * tokens_per_epoch - 1) // seq_len if separate else total
    shuffle = build_shuffle_index(first, total, rng)
    return GPTIndices(document, sample, shuffle, epochs, separate)


def blend_sizes(weights: Sequence[float], size: int) -> tuple[list[int], list[int]]:
    """Megatron's ``_get_size_per_split_per_dataset`` for one split of ``size`` samples:
    ``(target, requested)`` samples per dataset: ``ceil(size * w)``, and that plus the surplus
    each dataset is indexed for."""
    import math

    target = [int(math.ceil(size * w)) for w in weights]
    return target, [int(math.ceil(t * (1 + MID_LEVEL_SURPLUS))) for t in target]
