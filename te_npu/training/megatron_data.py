"""``data.kind: megatron``: train on Megatron-LM indexed datasets in place, one or a blend.

    data: {kind: megatron, path: /data/web_text_document}                     # one dataset
    data: {kind: megatron, blend: [[0.3, /data/web], [0.7, /data/code]]}     # a blend
    data: {kind: megatron, blend: "0.3 /data/web 0.7 /data/code"}            # Megatron's --data-path
    data: {..., split: "969,30,1"}                                           # Megatron's --split
    data: {..., val_path: /data/valid_text_document}                         # or val_blend: [...]

Each prefix names ``<prefix>.bin`` + ``<prefix>.idx`` (``indexed_dataset``), validated and
memory-mapped, never converted. Validation data: ``val_path`` / ``val_blend`` if given, else
the ``valid`` share of ``split`` (default Megatron's ``"969,30,1"``), cut from each dataset by
whole documents as Megatron cuts a GPT dataset (by its sequences, i.e. documents, in file
order); a blend's validation is the blend of its datasets' validation shares, same weights.
The tokens of a split are one stream in file order, so a sample (``seq_len + 1`` tokens, see
``token_dataset``) may span a document boundary, as in Megatron, where ``preprocess_data.py
--append-eod`` marks it.
"""
from __future__ import annotations

from typing import Any

from te_npu.errors import ConfigError
from te_npu.training.blend import BlendPart, TokenBlend, parse_blend
from te_npu.training.indexed_dataset import IndexFormatError, MegatronIndexedDataset
from te_npu.training.splits import DEFAULT_SPLIT, TRAIN, VALID, DataSplits, parse_split, split_range
from te_npu.training.token_dataset import TokenDataset

__all__ = ["KEYS", "check_config", "build_megatron", "open_indexed", "document_split"]

KEYS = frozenset({"path", "blend", "val_path", "val_blend", "split"})
"""The optional ``data.*`` keys this kind reads."""


def check_config(d: Any) -> None:
    """Config-only rules: exactly one of ``path`` / ``blend``; blends well formed (weights > 0);
    validation from ``split`` or from ``val_path`` / ``val_blend``, not both."""
    if (d.path is None) == (d.blend is None):
        raise ConfigError("data.path / data.blend: data.kind 'megatron' reads one dataset prefix (data.path) or a "
                          "weighted blend (data.blend); give exactly one")
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
    """The ``data`` section -> train / validation splits (``ConfigError`` for any bad prefix or index)."""
    separate = d.val_path is not None or d.val_blend is not None
    fractions = None if separate else parse_split(d.split or DEFAULT_SPLIT, "data.split")
    train_key = "data.blend" if d.blend is not None else "data.path"
    opened = [(w, open_indexed(p, key), key) for w, p, key in _sources(d.blend, d.path, train_key)]
    train = _combine([(w, document_split(ds, fractions, TRAIN, key), key) for w, ds, key in opened])
    if fractions is not None:
        val = _combine([(w, document_split(ds, fractions, VALID, f"{key} / data.split"), key)
                        for w, ds, key in opened])
        return DataSplits(train, val, train_key, "data.split")
    val_key = "data.val_blend" if d.val_blend is not None else "data.val_path"
    val = _combine([(w, document_split(open_indexed(p, key), None, TRAIN, key), key)
                    for w, p, key in _sources(d.val_blend, d.val_path, val_key)])
    return DataSplits(train, val, train_key, val_key)


def _sources(blend: Any, path: str | None, key: str) -> list[tuple[float | None, str, str]]:
    """``(weight, prefix, key)`` of a blend's entries (``data.blend[n]``), or of one prefix (no weight)."""
    if blend is None:
        return [(None, path, key)]
    return [(w, p, f"{key}[{n}]") for n, (w, p) in enumerate(parse_blend(blend, key))]


def _combine(parts: list[tuple[float | None, TokenDataset, str]]) -> TokenDataset | TokenBlend:
    """One unweighted split as itself, weighted ones as a ``TokenBlend``."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    return TokenBlend([BlendPart(data, weight, key) for weight, data, key in parts])


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
