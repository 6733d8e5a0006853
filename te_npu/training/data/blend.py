"""Weighted blends of token splits, sampled as Megatron-LM's ``BlendedDataset`` samples them.

Megatron (``megatron/core/datasets/blended_dataset.py`` + ``helpers.cpp``
``build_blending_indices``) normalises the weights (``w / sum(w)`` in float64) and fills sample
position ``p`` of the blend greedily: it takes the dataset whose error
``w_i * max(p, 1) - c_i`` is largest (``c_i``: samples taken from dataset ``i`` before ``p``;
the first such dataset on a tie), then gives it its next sample, ``c_i``. No randomness decides
*which* dataset: after any ``n`` samples every dataset has ``w_i * n`` of them to within one
sample, at every prefix (tested). Randomness (a fixed seed) only orders each dataset's own samples.
:func:`blending_indices` is that rule, computed in the same float64 operations, so a blend's
sequence of datasets is the one Megatron builds for the same weights.

Here the blend is an endless stream: position ``p`` of dataset ``i``'s own stream is sample
``order[c % n_i]`` of its epoch ``c // n_i`` (``np.random.default_rng([seed, i, epoch])``, or
file order when ``shuffle`` is off), so a small dataset simply repeats, as Megatron's
per-dataset epochs do. The stream's position and the per-dataset counts are the whole state,
so resume is exact on any world size and micro batch.

Config spellings (``parse_blend``): ``[[0.3, /data/web], [0.7, /data/code]]`` (YAML pairs) or
Megatron's flat ``"0.3 /data/web 0.7 /data/code"`` (``--data-path``), as a string or a list.

Legend: B = micro batch size, S = sequence length, W = world size, K = datasets in the blend.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from te_npu.errors import ConfigError
from te_npu.training.data.token_dataset import split_windows

__all__ = [
    "BlendPart",
    "TokenBlend",
    "BlendBatcher",
    "parse_blend",
    "normalize_weights",
    "blending_indices",
    "blend_validation_batches",
]

# ---------------------------------------------------------------------------------------
# Parsing the config
# ---------------------------------------------------------------------------------------


def parse_blend(value: Any, key: str) -> tuple[tuple[float | None, str], ...]:
    """``data.blend`` as written -> ``((weight, prefix), ...)``; ``ConfigError`` naming ``key``.

    Accepts a list of ``[weight, prefix]`` pairs, or Megatron's flat weight/prefix sequence as a
    string (``"0.3 web 0.7 code"``) or a list (``[0.3, web, 0.7, code]``), or prefixes alone
    (``"web code"``, ``[web, code]``: Megatron's ``--data-path a b``, weight None for each, i.e.
    weighted by the datasets' sizes). Weights must be finite and > 0 (as Megatron asserts);
    prefixes non-empty strings.
    """
    if isinstance(value, str):
        items: list[Any] = value.split()
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise ConfigError(f"{key}: expected [[weight, prefix], ...] or Megatron's flat \"w1 prefix1 w2 prefix2\", "
                          f"got {value!r}")
    if items and all(isinstance(i, Sequence) and not isinstance(i, str) for i in items):
        pairs = []
        for n, pair in enumerate(items):
            if len(pair) != 2:
                raise ConfigError(f"{key}[{n}]: expected [weight, prefix], got {list(pair)!r}")
            pairs.append((pair[0], pair[1]))
    elif items and not any(_is_number(i) for i in items):  # prefixes only: Megatron weighs them by size
        for n, prefix in enumerate(items):
            if not isinstance(prefix, str) or not prefix.strip():
                raise ConfigError(f"{key}[{n}]: the dataset prefix must be a non-empty string, got {prefix!r}")
        return tuple((None, p.strip()) for p in items)
    else:
        if not items or len(items) % 2:
            raise ConfigError(f"{key}: {value!r} is not weight/prefix pairs (Megatron's \"0.3 web 0.7 code\"); "
                              "give a weight before every prefix")
        pairs = list(zip(items[0::2], items[1::2]))
    out = []
    for n, (weight, prefix) in enumerate(pairs):
        where = f"{key}[{n}]"
        weight = _number(weight, where)
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{where}: weight {weight!r} of {prefix!r} must be a finite number > 0")
        if not isinstance(prefix, str) or not prefix.strip():
            raise ConfigError(f"{where}: the dataset prefix must be a non-empty string, got {prefix!r}")
        out.append((weight, prefix.strip()))
    return tuple(out)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: weight {value!r} is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: weight {value!r} is not a number (the flat form alternates weight, prefix)") \
            from None


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """``w / sum(w)`` in float64, as Megatron's ``utils.normalize``."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


# ---------------------------------------------------------------------------------------
# The blending rule
# ---------------------------------------------------------------------------------------


def blending_indices(weights: Sequence[float], counts: list[int], start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``start .. start + size - 1`` of the blend -> ``(dataset [size] int64, sample [size] int64)``.

    ``weights``: normalised; ``counts``: samples each dataset has given before ``start``,
    updated in place. Megatron's ``build_blending_indices`` rule (module doc), the same float64
    arithmetic: ``start = 0`` and ``counts = [0] * K`` reproduce its arrays for a blend of ``size``.
    """
    weights = [float(w) for w in weights]
    dataset = np.empty(size, dtype=np.int64)
    sample = np.empty(size, dtype=np.int64)
    k = len(weights)
    for n in range(size):
        p = float(max(start + n, 1))
        best, best_error = 0, weights[0] * p - float(counts[0])
        for i in range(1, k):
            error = weights[i] * p - float(counts[i])
            if error > best_error:
                best, best_error = i, error
        dataset[n], sample[n] = best, counts[best]
        counts[best] += 1
    return dataset, sample


# ---------------------------------------------------------------------------------------
# Blends and their sampler
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlendPart:
    """One dataset of a blend: ``data`` (a token split with ``num_samples`` / ``window_array``, e.g.
    ``TokenDataset``), its raw ``weight`` and ``key``, the config path errors name
    (``data.blend[1]``)."""

    data: Any
    weight: float
    key: str


class TokenBlend:
    """The datasets of a blend and their normalised weights (``weights``, float64 sum 1)."""

    def __init__(self, parts: Sequence[BlendPart]):
        if not parts:
            raise ValueError("a blend needs at least one dataset")
        self.parts = tuple(parts)
        self.weights = normalize_weights([p.weight for p in self.parts])

    def __len__(self) -> int:
        """Tokens in all parts together."""
        return sum(len(p.data) for p in self.parts)

    def describe(self) -> str:
        return " + ".join(f"{w:.4g} x {p.data.describe()}" for w, p in zip(self.weights, self.parts))

    def sample_counts(self, seq_len: int) -> list[int]:
        """Samples of ``seq_len + 1`` tokens in each part; ``ValueError`` naming a part with none."""
        counts = [p.data.num_samples(seq_len) for p in self.parts]
        for part, n in zip(self.parts, counts):
            if n == 0:
                raise ValueError(f"{part.key}: {part.data.describe()} ({len(part.data)} tokens) holds no sample of "
                                 f"seq_len + 1 = {seq_len + 1} tokens")
        return counts

    # --- the DataSplit protocol (te_npu.training.data.kind) ---

    def check_token_ids(self, vocab_size: int, key: str) -> str | None:
        """Each part's ids checked by the part itself, under the part's own key (``key`` unused)."""
        notes = [part.data.check_token_ids(vocab_size, part.key) for part in self.parts]
        return "; ".join(n for n in notes if n) or None

    def batcher(self, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True, vocab_size: int | None = None, run_samples: int | None = None,
                start_sample: int | None = None, train_samples: int | None = None,
                barrier: Callable[[], None] | None = None) -> BlendBatcher:
        """``BlendBatcher`` over this blend. Megatron's ``run_samples`` / ``start_sample`` /
        ``train_samples`` do not apply; nothing is written, so no ``barrier`` is needed."""
        return BlendBatcher(self, micro_batch_size, seq_len, seed=seed, rank=rank, world_size=world_size,
                            shuffle=shuffle, vocab_size=vocab_size)

    def validation_batches(self, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0,
                           world_size: int = 1, vocab_size: int | None = None,
                           seed: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The start of the blend's stream, each dataset in file order (``blend_validation_batches``)."""
        return blend_validation_batches(self, micro_batch_size, seq_len, num_batches=num_batches, rank=rank,
                                        world_size=world_size, vocab_size=vocab_size)


class _BlendStream:
    """The blend's endless sample stream from a position: which dataset and which of its samples."""

    def __init__(self, blend: TokenBlend, seq_len: int, seed: int, shuffle: bool):
        self.blend, self.seq_len, self.seed, self.shuffle = blend, seq_len, seed, shuffle
        self.num_samples = blend.sample_counts(seq_len)
        self.position = 0
        self.counts = [0] * len(self.num_samples)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # dataset -> (epoch, its order)

    def take(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``size`` positions -> ``(dataset [size], sample id within it [size])``; advances."""
        dataset, nth = blending_indices(self.blend.weights, self.counts, self.position, size)
        self.position += size
        sample = np.empty_like(nth)
        for i in np.unique(dataset).tolist():
            mine = dataset == i
            sample[mine] = [self._sample(i, int(c)) for c in nth[mine]]
        return dataset, sample

    def _sample(self, i: int, nth: int) -> int:
        n = self.num_samples[i]
        epoch, within = divmod(nth, n)
        if not self.shuffle:
            return within
        cached = self._orders.get(i)
        if cached is None or cached[0] != epoch:
            cached = self._orders[i] = (epoch, np.random.default_rng([self.seed, i, epoch]).permutation(n))
        return int(cached[1][within])

    def windows(self, dataset: np.ndarray, sample: np.ndarray, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [B, S], labels [B, S])`` int64 of the given samples, in their order."""
        window_BS1 = np.empty((len(sample), self.seq_len + 1), dtype=np.int64)
        for i in np.unique(dataset).tolist():
            rows = np.flatnonzero(dataset == i)
            window_BS1[rows] = self.blend.parts[i].data.window_array(sample[rows].tolist(), self.seq_len,
                                                                     vocab_size=vocab_size)
        return split_windows(window_BS1)


class BlendBatcher:
    """Endless ``(input_ids [B, S], labels [B, S])`` int64 batches of a blend for one rank.

    Each micro batch takes the next ``B * W`` positions of the blend stream; rank ``r`` gets
    positions ``r, r + W, ...`` of them (as ``TokenBatcher`` strides ranks), so ranks are
    disjoint and together follow the blend's order. ``state_dict()`` (the same on every rank)
    is the position, the per-dataset counts and the fingerprint they are valid for; any world
    size / micro batch resumes exactly at that position. ``vocab_size``: every batch is checked
    against it (``TokenDataset.windows``).
    """

    kind = "blend"

    def __init__(self, blend: TokenBlend, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, vocab_size: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.blend, self.micro_batch_size, self.seq_len = blend, micro_batch_size, seq_len
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.vocab_size = vocab_size
        self._stream = _BlendStream(blend, seq_len, seed, shuffle)

    @property
    def num_samples(self) -> list[int]:
        return self._stream.num_samples

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all ranks together so far (= the stream position)."""
        return self._stream.position

    def __iter__(self) -> BlendBatcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        dataset, sample = self._stream.take(self.micro_batch_size * self.world_size)
        mine = slice(self.rank, None, self.world_size)
        return self._stream.windows(dataset[mine], sample[mine], self.vocab_size)

    def state_dict(self) -> dict[str, Any]:
        """Position, per-dataset counts and their fingerprint (plain values: checkpoint-safe)."""
        return {
            "kind": self.kind,
            "position": self._stream.position,
            "counts": list(self._stream.counts),
            "consumed_samples": self._stream.position,
            "weights": list(self.blend.weights),
            "num_samples": list(self.num_samples),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position (``ValueError`` if it belongs to another blend or order)."""
        self._stream.position, self._stream.counts = self.position_for(state)

    def position_for(self, state: dict[str, Any]) -> tuple[int, list[int]]:
        """``(position, counts)`` that ``state`` resumes at; ``ValueError`` naming the mismatch."""
        if state.get("kind") != self.kind:
            raise ValueError("data state mismatch: the checkpoint was saved reading one dataset, this run reads a "
                             "blend (data.path / data.blend changed)")
        for key in ("weights", "num_samples", "seed", "seq_len", "shuffle"):
            mine = getattr(self.blend, key) if key == "weights" else getattr(self, key)
            if _plain(state[key]) != _plain(mine):
                raise ValueError(f"data state mismatch on {key!r}: checkpoint has {state[key]!r}, this run {mine!r} "
                                 "(the blend's sample order would differ)")
        position, counts = int(state["position"]), [int(c) for c in state["counts"]]
        if len(counts) != len(self.num_samples) or sum(counts) != position or min(counts) < 0:
            raise ValueError(f"data state: counts {counts} do not add up to position {position}")
        return position, counts


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def blend_validation_batches(
    blend: TokenBlend, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0, world_size: int = 1,
    vocab_size: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` batches of this rank from the start of ``blend``'s stream, each
    dataset's samples in file order: always the same ones."""
    stream = _BlendStream(blend, seq_len, seed=0, shuffle=False)
    for _ in range(num_batches):
        dataset, sample = stream.take(micro_batch_size * world_size)
        mine = slice(rank, None, world_size)
        yield stream.windows(dataset[mine], sample[mine], vocab_size)
