"""``data.kind: megatron``: train on Megatron-LM indexed datasets in place, one or a blend, on
exactly the samples Megatron-LM's ``GPTDataset`` / ``BlendedDataset`` serve.

    data: {kind: megatron, path: /data/web_text_document}                     # one dataset
    data: {kind: megatron, blend: [[0.3, /data/web], [0.7, /data/code]]}     # a blend
    data: {kind: megatron, blend: "0.3 /data/web 0.7 /data/code"}            # Megatron's --data-path
    data: {kind: megatron, blend: "/data/web /data/code"}                    # weighted by their sizes
    data: {..., split: "969,30,1"}                                           # Megatron's --split
    data: {..., val_path: /data/valid_text_document}                         # or val_blend: [...]
    data: {..., start_sample: 1024000, train_samples: 4096000}               # continue a Megatron run

Each prefix names ``<prefix>.bin`` + ``<prefix>.idx`` (``indexed_dataset``), validated and
memory-mapped, never converted. The train data is ``path`` / ``blend`` cut by ``split``
(default Megatron's ``"969,30,1"``) **by sequence**, as Megatron's builder cuts a GPT dataset
(``GPTDataset.numel_low_level_dataset``: for ``--split-sentences`` data a sentence is a
sequence), each dataset on its own, at ``int(round(bookend * sequences))``; validation is its
valid share, or ``val_path`` / ``val_blend`` whole (Megatron's ``--valid-data-path``). Samples,
their order and the data-parallel hand-out are Megatron's (``gpt_samples``, ``gpt_index``):
``training.seed`` is ``--seed``, ``training.seq_len`` ``--seq-length``, ``data.cache_dir``
holds the indices as ``--data-cache-path`` does, ``data.train_samples`` sizes them as
``--train-samples`` (default: this run's ``start_sample + train_steps x global batch``), and
``data.start_sample`` starts a fresh run at a global sample (Megatron's ``consumed_samples``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from te_npu.errors import ConfigError
from te_npu.training.data.blend import parse_blend
from te_npu.training.data.megatron.gpt_samples import GPTSource, MegatronSplit
from te_npu.training.data.megatron.indexed_dataset import IndexFormatError, MegatronIndexedDataset
from te_npu.training.data.kind import DataKind
from te_npu.training.data.splits import DEFAULT_SPLIT, TRAIN, VALID, DataSplits, parse_split, split_range
from te_npu.training.data.token_dataset import TokenDataset

__all__ = ["KIND", "KEYS", "check_config", "build_megatron", "open_indexed", "document_split", "sequence_split",
           "read_global_samples"]

KEYS = frozenset({"path", "blend", "val_path", "val_blend", "split", "start_sample", "train_samples"})
"""The optional ``data.*`` keys this kind reads."""


def check_config(d: Any) -> None:
    """Config-only rules: exactly one of ``path`` / ``blend``; blends well formed (weights > 0, or
    none); validation from ``split`` or from ``val_path`` / ``val_blend``, not both; Megatron's
    order is always shuffled; a start sample below the samples indexed."""
    if not d.shuffle:
        raise ConfigError("data.shuffle: false is not supported with data.kind 'megatron', which serves Megatron's "
                          "GPTDataset samples in its (always shuffled) order")
    if d.start_sample is not None and d.train_samples is not None and d.start_sample >= d.train_samples:
        raise ConfigError(f"data.start_sample: {d.start_sample} must be below data.train_samples ({d.train_samples})")
    if (d.path is None) == (d.blend is None):
        raise ConfigError("data.path / data.blend: data.kind 'megatron' reads one dataset prefix (data.path) or a "
                          "blend (data.blend); give exactly one")
    for key in ("blend", "val_blend"):
        if getattr(d, key) is not None:
            parse_blend(getattr(d, key), f"data.{key}")
    check_validation_keys(d)


def check_validation_keys(d: Any) -> None:
    """``split`` xor separate validation data; a split that leaves validation something."""
    separate = [k for k in ("val_path", "val_blend") if getattr(d, k, None) is not None]
    if len(separate) > 1:
        raise ConfigError("data.val_path / data.val_blend: give one of them")
    if d.split is not None:
        if separate:
            raise ConfigError(f"data.split: validation comes from the split or from data.{separate[0]}, not both")
        if parse_split(d.split, "data.split")[VALID] == 0:
            raise ConfigError(f"data.split: {d.split!r} gives validation no documents (the second weight is 0)")


def build_megatron(d: Any, vocab_size: int | None, progress: bool) -> DataSplits:
    """The ``data`` section -> train / validation ``MegatronSplit`` (``ConfigError`` for any bad prefix,
    index or empty share); their indices are built for a sequence length and seed later
    (``MegatronSplit.samples``)."""
    separate = d.val_path is not None or d.val_blend is not None
    fractions = None if separate else parse_split(d.split or DEFAULT_SPLIT, "data.split")
    train_key = "data.blend" if d.blend is not None else "data.path"
    opened = [(w, open_indexed(p, key), key) for w, p, key in _sources(d.blend, d.path, train_key)]
    train = _split(opened, fractions, TRAIN, d.cache_dir, train_key, per_split=separate)
    if fractions is not None:
        val = _split([(w, ds, f"{key} / data.split") for w, ds, key in opened], fractions, VALID, d.cache_dir,
                     "data.split", per_split=False)
        return DataSplits(train, val, train_key, "data.split")
    val_key = "data.val_blend" if d.val_blend is not None else "data.val_path"
    val = _split([(w, open_indexed(p, key), key) for w, p, key in _sources(d.val_blend, d.val_path, val_key)],
                 None, VALID, d.cache_dir, val_key, per_split=True)
    return DataSplits(train, val, train_key, val_key)


KIND = DataKind(build_megatron, KEYS, check_config)
"""The registry entry (``te_npu.training.data.DATA_KINDS["megatron"]``): the splits are
``MegatronSplit`` objects, whose batcher builds the sample indices (rank 0 first)."""


def _split(opened: list[tuple[float | None, MegatronIndexedDataset, str]], fractions: tuple[float, float, float] | None,
           which: int, cache_dir: str, key: str, *, per_split: bool) -> MegatronSplit:
    """Megatron's builder for one split: an unweighted prefix, or a one-prefix blend of a split
    named on its own (``--train-data-path`` / ``--valid-data-path``), is a ``GPTDataset``;
    anything else a ``BlendedDataset`` (weights None: weighted by the datasets' sizes)."""
    sources = tuple(sequence_split(ds, fractions, which, k) for _, ds, k in opened)
    if len(opened) == 1 and (opened[0][0] is None or per_split):
        return MegatronSplit(sources, None, which, str(cache_dir), key)
    weights = None if opened[0][0] is None else tuple(float(w) for w, _, _ in opened)
    return MegatronSplit(sources, weights, which, str(cache_dir), key)


def sequence_split(dataset: MegatronIndexedDataset, fractions: tuple[float, float, float] | None, which: int,
                   key: str) -> GPTSource:
    """Split ``which`` of ``dataset``'s sequences (all of them when ``fractions`` is None), cut as
    Megatron cuts a GPT dataset (``split_range`` over its sequence count); ``ConfigError`` naming
    ``key`` when it holds fewer than two tokens."""
    count = dataset.num_sequences
    begin, end = (0, count) if fractions is None else split_range(fractions, count, which)
    if end <= begin or int(dataset.sequence_lengths[begin:end].astype("int64").sum()) <= 1:
        share = "" if fractions is None else f" ({['train', 'valid', 'test'][which]} share of {count} sequences)"
        raise ConfigError(f"{key}: {dataset.prefix} has no sequences to sample{share}")
    return GPTSource(dataset, begin, end, which, key)


def _sources(blend: Any, path: str | None, key: str) -> list[tuple[float | None, str, str]]:
    """``(weight, prefix, key)`` of a blend's entries (``data.blend[n]``; weight None for a
    weightless blend), or of one prefix (no weight)."""
    if blend is None:
        return [(None, path, key)]
    return [(w, p, f"{key}[{n}]") for n, (w, p) in enumerate(parse_blend(blend, key))]


def open_indexed(prefix: str, key: str) -> MegatronIndexedDataset:
    """``MegatronIndexedDataset(prefix)`` with its problems as one-line ``ConfigError`` naming ``key``."""
    try:
        return MegatronIndexedDataset(prefix)
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    except IndexFormatError as exc:
        raise ConfigError(f"{key}: not a valid Megatron indexed dataset: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {prefix!r}: {exc}") from None


def document_split(dataset: MegatronIndexedDataset, fractions: tuple[float, float, float] | None, which: int,
                   key: str, meta: dict | None = None) -> TokenDataset:
    """The tokens of split ``which`` of ``dataset``'s documents (all of them when ``fractions`` is
    None) as a ``TokenDataset`` view of its ``.bin``; ``ConfigError`` naming ``key`` when it holds
    no document. ``meta``: extra header fields (e.g. the tokenizer's ``vocab_size``)."""
    begin, end = (0, dataset.num_documents) if fractions is None else split_range(fractions, dataset.num_documents,
                                                                                 which)
    if end <= begin:
        share = "" if fractions is None else f" ({['train', 'valid', 'test'][which]} share of {dataset.num_documents})"
        raise ConfigError(f"{key}: {dataset.prefix} has no documents{share}")
    first, last = (int(x) for x in dataset.document_offsets([begin, end]))
    header = {"format": "megatron.indexed", "dtype": dataset.dtype.name, "num_tokens": dataset.num_tokens,
              "documents": [begin, end], **(meta or {})}
    return TokenDataset.view(dataset.prefix, dataset.tokens[first:last], header, start=first)


def read_global_samples(data: Any, seq_len: int, seed: int, indices: Sequence[int], *,
                        train_samples: int | None = None, split: str = "train") -> np.ndarray:
    """Global samples ``indices`` of a ``data`` section (a ``DataConfig`` of kind ``megatron``, e.g.
    ``load_config({"data": {...}}).data``) without training: ``[len(indices), seq_len + 1]`` int64,
    ``input_ids = row[:-1]``, ``labels = row[1:]``; Megatron's ``GPTDataset`` / ``BlendedDataset``
    sample ``i`` for ``--seed seed --seq-length seq_len`` and the same ``--split`` / blend.

    ``train_samples``: the samples the index is built for (Megatron's ``--train-samples`` /
    ``--train-iters x --global-batch-size``; default ``data.train_samples``, else one epoch, else
    (weighted blends) ``max(indices) + 1``). ``split``: ``"train"`` or ``"valid"``. The indices are
    cached in ``data.cache_dir``.
    """
    if data.kind != "megatron":
        raise ValueError(f"data.kind {data.kind!r}: read_global_samples reads data.kind 'megatron' sections")
    splits = build_megatron(data, None, False)
    which = {"train": splits.train, "valid": splits.val}.get(split)
    if which is None:
        raise ValueError(f"split {split!r}: expected 'train' or 'valid'")
    wanted = [int(i) for i in indices]
    n = train_samples if train_samples is not None else data.train_samples
    if n is None and which.weights is not None:
        n = max(wanted, default=0) + 1
    samples = which.samples(seq_len, seed, n)
    if wanted and not 0 <= min(wanted) <= max(wanted) < len(samples):
        raise IndexError(f"global samples {min(wanted)}..{max(wanted)} outside the {len(samples)} samples of "
                         f"{samples.describe()}")
    return samples.window_array(wanted)
