"""Megatron's global samples of a ``data.kind: megatron`` split, and the sampler that hands them to
data-parallel ranks as Megatron's ``MegatronPretrainingSampler`` does.

- ``GPTSource``: one dataset's share of a split (a range of its sequences, cut by
  ``numel_low_level_dataset`` = sequences, as Megatron's builder cuts a GPT dataset), not yet indexed.
- ``MegatronSplit``: what the megatron kind builds for train and for validation: one source (a
  ``GPTDataset``) or several with weights (a ``BlendedDataset``; weights None = weighted by each
  dataset's one-epoch sample count, as Megatron weighs ``--data-path a b``). ``samples(seq_len,
  seed, num_samples)`` builds (or maps from ``data.cache_dir``) the indices (``gpt_index``).
- ``GPTSamples`` / ``BlendedSamples``: global sample ``i`` -> its ``S + 1`` tokens, Megatron's
  ``GPTDataset[i]`` / ``BlendedDataset[i]`` ``tokens`` + the last ``labels`` token.
- ``MegatronBatcher``: micro batch ``m`` of the run covers global samples ``[c, c + B * W)``
  (``c`` = consumed samples); rank ``r`` takes ``[c + r * B, c + (r + 1) * B)``. Its state is
  ``consumed_samples`` alone (plus what fixes the order), so a resume is exact on any world size
  and micro batch; ``start_sample`` starts a fresh run at a global sample (a Megatron run's
  ``consumed_samples``).

``megatron_data.read_global_samples(data, seq_len, seed, indices)`` reads samples of a ``data`` section
without training. The number of samples a split is indexed for matters to Megatron only through
the epochs it needs (a run of more samples than one epoch); ``train_samples`` gives it.

Legend: B = micro batch size, S = sequence length, W = world size.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from te_npu.training.data.blend import blending_indices, normalize_weights
from te_npu.training.data.megatron.gpt_index import blend_sizes, build_gpt_indices, separate_final_epoch
from te_npu.training.data.megatron.index_cache import IndexCache
from te_npu.training.data.megatron.indexed_dataset import MegatronIndexedDataset
from te_npu.training.data.token_dataset import TokenDataset, describe_invalid_id, first_invalid_id, split_windows

__all__ = ["GPTSource", "MegatronSplit", "GPTSamples", "BlendedSamples", "MegatronBatcher",
           "megatron_validation_batches"]

_SPLIT_NAMES = ("train", "valid", "test")
MANY_EPOCHS = 10
"""An index of more epochs than this gets a note (its epochs and bytes): usually a start_sample or
train_samples far beyond the data, e.g. global sample 1e8 of 10,219 samples is about 9,800 epochs."""


@dataclass(frozen=True)
class GPTSource:
    """Sequences ``[begin, end)`` of ``dataset`` for split ``which`` (0 train, 1 valid); ``key`` names it."""

    dataset: MegatronIndexedDataset
    begin: int
    end: int
    which: int
    key: str

    def token_view(self) -> TokenDataset:
        """The split's tokens (contiguous in the ``.bin``) as a ``TokenDataset`` view, for id checks."""
        ds = self.dataset
        first, last = (int(ds.sequence_pointers[k]) // ds.dtype.itemsize if k < ds.num_sequences else ds.num_tokens
                       for k in (self.begin, self.end))
        header = {"format": "megatron.indexed", "dtype": ds.dtype.name, "num_tokens": ds.num_tokens,
                  "sequences": [self.begin, self.end]}
        return TokenDataset.view(ds.prefix, ds.tokens[first:last], header, start=first)

    def description(self, seq_len: int, seed: int, num_samples: int | None) -> dict[str, Any]:
        ds = self.dataset
        return {"class": "GPTDataset", "format": "te_npu megatron indices 1", "dataset_path": str(ds.prefix.resolve()),
                "num_sequences": ds.num_sequences, "num_tokens": ds.num_tokens, "sequences": [self.begin, self.end],
                "index_split": _SPLIT_NAMES[self.which], "num_samples": num_samples, "random_seed": seed,
                "sequence_length": seq_len, "add_extra_token_to_sequence": True, "drop_last_partial_sequence": True}

    def built_from(self) -> dict[str, Any]:
        """What the indices depend on beyond ``description``: the split's sequence lengths (their
        SHA-256, 4 bytes per sequence) and token count, so a re-segmented dataset is seen."""
        lengths = np.ascontiguousarray(self.dataset.sequence_lengths[self.begin:self.end])
        return {"sequence_lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest(),
                "split_tokens": int(lengths.sum(dtype=np.int64))}

    def label(self) -> str:
        return f"{self.key}: {self.dataset.idx_path} [{_SPLIT_NAMES[self.which]}: sequences {self.begin}:{self.end}]"


class GPTSamples:
    """One indexed GPT split: ``len()`` samples; ``window_array(ids)`` their tokens ``[B, S + 1]`` int64."""

    def __init__(self, source: GPTSource, seq_len: int, seed: int, num_samples: int | None,
                 cache_dir: str | os.PathLike, *, may_build: bool = True):
        self.source, self.seq_len, self.seed, self.num_samples = source, seq_len, seed, num_samples
        ds = source.dataset
        documents = np.arange(source.begin, source.end, dtype=np.int32)
        cache = IndexCache(cache_dir, source.description(seq_len, seed, num_samples), "GPTDataset",
                           _SPLIT_NAMES[source.which], built_from=source.built_from(), label=source.label())

        def build() -> dict[str, np.ndarray]:
            ix = build_gpt_indices(ds.sequence_lengths, documents, seq_len, seed, num_samples)
            return {"document_index": ix.document, "sample_index": ix.sample, "shuffle_index": ix.shuffle}

        arrays = cache.load_or_build(("document_index", "sample_index", "shuffle_index"), build, may_build=may_build)
        self.notes = cache.notes
        self.document_index, self.sample_index = arrays["document_index"], arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.cache_files = cache.path("*")
        tokens_per_epoch = int(np.sum(ds.sequence_lengths[source.begin:source.end], dtype=np.int64))
        self.num_epochs = len(self.document_index) // max(source.end - source.begin, 1)
        separate = separate_final_epoch(tokens_per_epoch, num_samples, seq_len, self.num_epochs)
        self.order = {"dataset": str(ds.prefix), "sequences": [source.begin, source.end], "seed": seed,
                      "seq_len": seq_len, "num_epochs": self.num_epochs, "separate_final_epoch": separate,
                      "tokens_per_epoch": tokens_per_epoch}

    def index_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.document_index, self.sample_index, self.shuffle_index))

    def data_bytes(self) -> int:
        return int(self.order["tokens_per_epoch"]) * self.source.dataset.dtype.itemsize

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def describe(self) -> str:
        return f"{self.source.dataset.bin_path} [{_SPLIT_NAMES[self.source.which]}: sequences {self.source.begin}:" \
               f"{self.source.end}]"

    def sample(self, i: int) -> np.ndarray:
        """Global sample ``i``: ``[S + 1]`` token ids in the file's dtype."""
        ds = self.source.dataset
        k = int(self.shuffle_index[i])
        (j0, o0), (j1, o1) = (self.sample_index[k].tolist(), self.sample_index[k + 1].tolist())
        parts = []
        for j in range(j0, j1 + 1):
            seq = int(self.document_index[j])
            start = int(ds.sequence_pointers[seq]) // ds.dtype.itemsize
            begin = o0 if j == j0 else 0
            stop = o1 + 1 if j == j1 else int(ds.sequence_lengths[seq])
            parts.append(ds.tokens[start + begin : start + stop])
        return np.concatenate(parts)

    def window_array(self, indices: Sequence[int], vocab_size: int | None = None) -> np.ndarray:
        """Samples ``indices`` -> ``[B, S + 1]`` int64; ``ValueError`` naming the file, the sample
        and the id when one is no id of a ``vocab_size`` vocabulary."""
        raw_BS1 = np.stack([self.sample(int(i)) for i in indices]) if len(indices) else \
            np.zeros((0, self.seq_len + 1), self.source.dataset.dtype)
        if vocab_size is not None:
            bad = first_invalid_id(raw_BS1.reshape(-1), vocab_size)
            if bad is not None:
                b, s = divmod(bad[0], self.seq_len + 1)
                raise ValueError(f"{self.describe()}: token id {bad[1]} at position {s} of global sample "
                                 f"{int(indices[b])} {describe_invalid_id(bad[1], vocab_size)}")
        return raw_BS1.astype(np.int64)


class BlendedSamples:
    """Megatron's ``BlendedDataset``: sample ``i`` is sample ``dataset_sample_index[i]`` of part
    ``dataset_index[i]``; ``size`` samples in all."""

    def __init__(self, parts: Sequence[GPTSamples], weights: Sequence[float], size: int, cache_dir: str | os.PathLike,
                 which: int, *, may_build: bool = True):
        self.parts, self.weights, self.size = list(parts), [float(w) for w in weights], int(size)
        description = {"class": "BlendedDataset", "format": "te_npu megatron indices 1",
                       "datasets": [p.source.description(p.seq_len, p.seed, p.num_samples) for p in self.parts],
                       "split": _SPLIT_NAMES[which], "weights": self.weights, "size": self.size}
        cache = IndexCache(cache_dir, description, "BlendedDataset", _SPLIT_NAMES[which],
                           label=f"the {_SPLIT_NAMES[which]} blend of {len(self.parts)} datasets")

        def build() -> dict[str, np.ndarray]:
            dataset, sample = blending_indices(self.weights, [0] * len(self.parts), 0, self.size)
            return {"dataset_index": dataset.astype(np.int16), "dataset_sample_index": sample}

        arrays = cache.load_or_build(("dataset_index", "dataset_sample_index"), build, may_build=may_build)
        self.notes = [n for p in self.parts for n in p.notes] + cache.notes
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        counts = np.bincount(np.asarray(self.dataset_index, dtype=np.int64), minlength=len(self.parts))
        for part, (n, need) in enumerate(zip((len(p) for p in self.parts), counts.tolist())):
            if need > n:
                raise ValueError(f"{self.parts[part].describe()}: the blend draws {need} samples from it, more than "
                                 f"the {n} its index holds (Megatron's 'blend oversamples' error)")
        self.order = {"parts": [p.order for p in self.parts], "weights": self.weights}

    def __len__(self) -> int:
        return self.size

    @property
    def num_epochs(self) -> int:
        return max(p.num_epochs for p in self.parts)

    def index_bytes(self) -> int:
        return sum(p.index_bytes() for p in self.parts) + int(self.dataset_index.nbytes) + \
            int(self.dataset_sample_index.nbytes)

    def data_bytes(self) -> int:
        return sum(p.data_bytes() for p in self.parts)

    def describe(self) -> str:
        return " + ".join(f"{w:.4g} x {p.describe()}" for w, p in zip(self.weights, self.parts))

    def window_array(self, indices: Sequence[int], vocab_size: int | None = None) -> np.ndarray:
        """Samples ``indices`` -> ``[B, S + 1]`` int64 (checked as ``GPTSamples.window_array``)."""
        indices = np.asarray(indices, dtype=np.int64)
        out_BS1 = np.empty((len(indices), self.parts[0].seq_len + 1), dtype=np.int64)
        dataset = np.asarray(self.dataset_index[indices], dtype=np.int64)
        for i in np.unique(dataset).tolist():
            rows = np.flatnonzero(dataset == i)
            out_BS1[rows] = self.parts[i].window_array(np.asarray(self.dataset_sample_index[indices[rows]]).tolist(),
                                                       vocab_size)
        return out_BS1


@dataclass(frozen=True)
class MegatronSplit:
    """One split of the megatron kind before indexing: ``sources`` with ``weights`` (None: one
    ``GPTDataset``, or a blend weighted by the sources' sample counts), indices kept in ``cache_dir``."""

    sources: tuple[GPTSource, ...]
    weights: tuple[float, ...] | None
    which: int
    cache_dir: str
    key: str
    may_build: bool = True  # False: a cache that is missing or stale is refused (other ranks map it already)

    def token_views(self) -> list[tuple[TokenDataset, str]]:
        return [(s.token_view(), s.key) for s in self.sources]

    # --- the DataSplit protocol (te_npu.training.data.kind) ---

    def check_token_ids(self, vocab_size: int, key: str) -> str | None:
        """Each dataset's share of the split, checked as the tokens of its ``.bin`` under its own key."""
        notes = [view.check_token_ids(vocab_size, part_key) for view, part_key in self.token_views()]
        return "; ".join(n for n in notes if n) or None

    def batcher(self, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True, vocab_size: int | None = None, run_samples: int | None = None,
                start_sample: int | None = None, train_samples: int | None = None,
                barrier: Callable[[], None] | None = None) -> MegatronBatcher:
        """``MegatronBatcher`` over this split, its indices sized for ``train_samples`` (default
        ``start_sample + run_samples``). ``shuffle`` is ignored: Megatron's order is always shuffled
        (``megatron_data.check_config``). With ``barrier``, rank 0 builds (or checks, or rebuilds)
        the indices in ``cache_dir`` first; the other ranks then map what it wrote, or refuse it,
        never rebuilding it themselves."""
        if train_samples is None:
            if run_samples is None:
                raise ValueError("Megatron's samples need train_samples or run_samples (how many the index covers)")
            train_samples = (start_sample or 0) + run_samples

        def make(split: MegatronSplit) -> MegatronBatcher:
            return MegatronBatcher(split, micro_batch_size, seq_len, seed=seed, rank=rank, world_size=world_size,
                                   vocab_size=vocab_size, train_samples=train_samples, start_sample=start_sample,
                                   run_samples=run_samples)

        if barrier is None:
            return make(self)
        made = make(self) if rank == 0 else None
        barrier()
        return made if made is not None else make(replace(self, may_build=False))

    def validation_batches(self, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0,
                           world_size: int = 1, vocab_size: int | None = None,
                           seed: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first batches of Megatron's validation samples (``megatron_validation_batches``;
        ``seed`` required: ``training.seed``)."""
        if seed is None:
            raise ValueError("Megatron's validation samples need the seed (training.seed)")
        return megatron_validation_batches(self, micro_batch_size, seq_len, seed=seed, num_batches=num_batches,
                                           rank=rank, world_size=world_size, vocab_size=vocab_size)

    def describe(self) -> str:
        return " + ".join(str(s.dataset.bin_path) for s in self.sources)

    def samples(self, seq_len: int, seed: int, num_samples: int | None) -> GPTSamples | BlendedSamples:
        """The indexed split, for at least ``num_samples`` samples (one epoch when None), as
        Megatron's ``BlendedMegatronDatasetBuilder`` builds it for that size."""
        if self.weights is None and len(self.sources) == 1:
            return GPTSamples(self.sources[0], seq_len, seed, num_samples, self.cache_dir, may_build=self.may_build)
        if self.weights is None:  # Megatron: one epoch of each, weights = their lengths, size capped at their sum
            parts = [GPTSamples(s, seq_len, seed, None, self.cache_dir, may_build=self.may_build)
                     for s in self.sources]
            lengths = [len(p) for p in parts]
            size = sum(lengths) if num_samples is None else min(num_samples, sum(lengths))
            return BlendedSamples(parts, normalize_weights(lengths), size, self.cache_dir, self.which,
                                  may_build=self.may_build)
        weights = normalize_weights(self.weights)
        if num_samples is None:
            raise ValueError("a weighted blend needs a number of samples (Megatron: 'Using client-specified weights "
                             "requires client-specified size')")
        target, requested = blend_sizes(weights, num_samples)
        parts = [GPTSamples(s, seq_len, seed, n, self.cache_dir, may_build=self.may_build)
                 for s, n in zip(self.sources, requested)]
        return BlendedSamples(parts, normalize_weights(weights), sum(target), self.cache_dir, self.which,
                              may_build=self.may_build)


class MegatronBatcher:
    """Endless ``(input_ids [B, S], labels [B, S])`` int64 micro batches of global samples for one
    data-parallel rank, in Megatron's ``MegatronPretrainingSampler`` order (module doc).

    ``train_samples``: the samples the index is built for (Megatron's ``--train-samples``, or
    ``--train-iters x --global-batch-size``); the run may read up to the index's length.
    ``start_sample``: a fresh run's first global sample (None: 0). ``state_dict()`` holds
    ``consumed_samples`` and the order's fingerprint; ``load_state_dict`` resumes there on any
    world size and micro batch. ``run_samples``: the samples this run consumes (for ``notes``).

    ``notes``: one line each for a rebuilt stale cache, an index of more than ``MANY_EPOCHS``
    epochs (its epochs and bytes against the data's), and a ``train_samples`` below what the run
    consumes; the trainer prints them.
    """

    kind = "megatron"

    def __init__(self, data: MegatronSplit, micro_batch_size: int, seq_len: int, *, seed: int, train_samples: int,
                 start_sample: int | None = None, rank: int = 0, world_size: int = 1, vocab_size: int | None = None,
                 run_samples: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.data, self.micro_batch_size, self.seq_len, self.seed = data, micro_batch_size, seq_len, seed
        self.rank, self.world_size, self.vocab_size = rank, world_size, vocab_size
        self.start_sample, self.train_samples = start_sample, int(train_samples)
        self.samples = data.samples(seq_len, seed, self.train_samples)
        self.consumed_samples = int(start_sample or 0)
        if self.consumed_samples >= len(self.samples):
            raise ValueError(f"start sample {self.consumed_samples} is past the {len(self.samples)} samples of "
                             f"{self.samples.describe()} (indexed for {self.train_samples} samples)")
        self.notes = list(self.samples.notes) + self._sizing_notes(run_samples)

    def _sizing_notes(self, run_samples: int | None) -> list[str]:
        """Lines for an index that spans many epochs, and for ``train_samples`` below the run's needs."""
        notes, samples = [], self.samples
        if samples.num_epochs > MANY_EPOCHS:
            notes.append(f"data.start_sample / data.train_samples: indexing {self.train_samples} samples of "
                         f"{samples.describe()} takes {samples.num_epochs} epochs of its data, "
                         f"{_size(samples.index_bytes())} of index for {_size(samples.data_bytes())} of tokens "
                         f"(Megatron repeats the data that often to reach global sample {self.train_samples})")
        needed = int(self.start_sample or 0) + int(run_samples or 0)
        if run_samples is not None and self.train_samples < needed:
            said = (f"data.train_samples: {self.train_samples} is fewer than the {needed} samples this run consumes "
                    f"(start sample {self.start_sample or 0} + {run_samples} = train_steps x global batch)")
            if len(samples) < needed:
                raise ValueError(f"{said}, and the index of {samples.describe()} holds {len(samples)}: raise "
                                 "data.train_samples (or remove it)")
            notes.append(f"{said}; the index holds {len(samples)} (whole epochs), so the run reads past it")
        return notes

    def __iter__(self) -> MegatronBatcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, c = self.micro_batch_size, self.consumed_samples
        if c + b * self.world_size > len(self.samples):
            raise ValueError(f"data: the index of {self.samples.describe()} holds {len(self.samples)} samples (built "
                             f"for {self.train_samples}); the run needs more: raise data.train_samples")
        mine = range(c + self.rank * b, c + (self.rank + 1) * b)
        self.consumed_samples = c + b * self.world_size
        return split_windows(self.samples.window_array(mine, self.vocab_size))

    def state_dict(self) -> dict[str, Any]:
        """Consumed samples and what fixes their order (plain values: checkpoint-safe)."""
        return {"kind": self.kind, "consumed_samples": self.consumed_samples, "start_sample": self.start_sample or 0,
                "train_samples": self.train_samples, "order": self.samples.order, "seed": self.seed,
                "seq_len": self.seq_len, "world_size": self.world_size, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s consumed samples (``ValueError`` if its order differs)."""
        self.consumed_samples = self.position_for(state)

    def position_for(self, state: dict[str, Any]) -> int:
        """The consumed samples ``state`` resumes at; ``ValueError`` naming the mismatch."""
        if state.get("kind") != self.kind:
            raise ValueError(f"data state mismatch: the checkpoint was saved by a {state.get('kind', 'windows')!r} "
                             f"sampler, this run reads Megatron's samples (data.kind changed)")
        if self.start_sample is not None and int(state["start_sample"]) != self.start_sample:
            raise ValueError(f"data.start_sample: {self.start_sample} contradicts the checkpoint, whose run started at "
                             f"global sample {state['start_sample']} and is at {state['consumed_samples']}; a resume "
                             f"keeps its own position (remove data.start_sample or set it to {state['start_sample']})")
        if _plain(state["order"]) != _plain(self.samples.order):
            raise ValueError(f"data state mismatch: the checkpoint's sample order ({state['order']}) is not this "
                             f"run's ({self.samples.order}); it was indexed for data.train_samples = "
                             f"{state['train_samples']}, this run for {self.train_samples}")
        consumed = int(state["consumed_samples"])
        if not 0 <= consumed < len(self.samples):
            raise ValueError(f"data state: consumed samples {consumed} outside [0, {len(self.samples)})")
        return consumed


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def megatron_validation_batches(data: MegatronSplit, micro_batch_size: int, seq_len: int, *, seed: int,
                                num_batches: int, rank: int = 0, world_size: int = 1,
                                vocab_size: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` batches of Megatron's validation samples (consumed 0, the sampler's
    order), always the same ones; fewer when the split is short, ``ValueError`` when it has none."""
    samples = data.samples(seq_len, seed, num_batches * micro_batch_size * world_size)
    per_batch = micro_batch_size * world_size
    available = min(num_batches, len(samples) // per_batch)
    if available == 0:
        raise ValueError(f"validation split {samples.describe()} ({len(samples)} samples) has no full batch of "
                         f"{micro_batch_size}x{seq_len} per rank for world_size {world_size}")
    for k in range(available):
        c = k * per_batch + rank * micro_batch_size
        yield split_windows(samples.window_array(range(c, c + micro_batch_size), vocab_size))
