"""``data.kind: hf``: a local Hugging Face dataset and tokenizer, tokenized once into a cached
Megatron indexed dataset, then read like ``data.kind: megatron``.

    data:
      kind: hf
      path: /data/corpus            # parquet / jsonl / json / arrow / txt / csv files, a folder of
                                    # them, or a datasets.save_to_disk folder
      tokenizer: /models/tokenizer  # a local folder for transformers.AutoTokenizer (never downloads)
      text_key: text                # the column holding each document's text
      hf_split: train               # the dataset's split to read
      split: "969,30,1"             # train / valid / test by documents, or val_path: another dataset
      cache_dir: data_cache         # the tokenized cache lives in <cache_dir>/hf/
      streaming: false              # true: tokenize on the fly, no cache (``hf_stream``)

Before anything is read, the tokenizer is loaded (``local_files_only``) and its vocabulary
(``len(tokenizer)``, added tokens included) must fit the model's ``vocab_size``. The cache key is
a sha256 over the content of every data file, the tokenizer's files and the settings above
(plus the format version), so a changed file or tokenizer builds a new cache and an unchanged
one is reused on every later run and rank (``<cache_dir>/hf/<name>-<key>.{bin,idx,json}``, the
``.json`` written last: a half-written build is never taken for a cache). Building streams the
files (``datasets.load_dataset(..., streaming=True)``: no Arrow copy of the corpus), tokenizes
in batches of ``BATCH_DOCS`` with a progress bar, appends the tokenizer's EOS id to every
document (Megatron's ``--append-eod``), and writes one sequence per document in uint16 (fewer
than 65,500 ids) or int32, as ``preprocess_data.py`` would: the cache is also a valid input of
Megatron-LM itself.

``datasets`` and ``transformers`` are imported only when this kind runs (optional dependencies,
the ``test`` extra installs both); without them the run stops with a one-line ``ConfigError``.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from te_npu.errors import ConfigError
from te_npu.training.data.hf_stream import HFStream, fingerprint
from te_npu.training.data.megatron.indexed_dataset import MegatronIndexedDataset, index_paths, smallest_token_dtype, \
    write_indexed_dataset
from te_npu.training.data.kind import DataKind
from te_npu.training.data.megatron_data import check_validation_keys, document_split, open_indexed
from te_npu.training.data.splits import DEFAULT_SPLIT, TRAIN, VALID, DataSplits, parse_split

__all__ = ["KIND", "KEYS", "check_config", "build_hf", "load_tokenizer", "tokenized_cache", "open_stream", "data_files", "BUILDERS"]

KEYS = frozenset({"path", "val_path", "split", "tokenizer", "streaming"})
"""The optional ``data.*`` keys this kind reads (besides ``text_key``, ``hf_split``, ``cache_dir``)."""

CACHE_FORMAT, CACHE_VERSION = "te_npu.hf_tokens", 1
BATCH_DOCS = 1000
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".txt": "text",
            ".csv": "csv"}
"""File suffix -> the ``datasets`` packaged builder that reads it."""
_SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what datasets.save_to_disk leaves in its folder
_TOKENIZER_FILE_HINTS = ("token", "vocab", "merges", "spiece", "tiktoken")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")


def check_config(d: Any) -> None:
    """Config-only rules: ``path`` and ``tokenizer`` given; validation from ``split`` xor ``val_path``."""
    if d.path is None:
        raise ConfigError("data.path: required when data.kind is 'hf' (a local dataset: parquet / jsonl / arrow "
                          "files, a folder of them, or a save_to_disk folder)")
    if d.tokenizer is None:
        raise ConfigError("data.tokenizer: required when data.kind is 'hf' (a local tokenizer folder for "
                          "transformers.AutoTokenizer)")
    check_validation_keys(d)
    if d.streaming:
        if d.shuffle:
            raise ConfigError("data.shuffle: a streamed dataset is read in order; set data.shuffle=false, or "
                              "tokenize it into the cache (data.streaming=false) for shuffled samples")
        if d.val_path is None:
            raise ConfigError("data.val_path: required with data.streaming (a stream has no document count to "
                              "split; name a validation dataset)")


def build_hf(d: Any, vocab_size: int | None, progress: bool) -> DataSplits:
    """The ``data`` section -> train / validation splits, tokenizing into the cache where needed."""
    tokenizer = load_tokenizer(d.tokenizer, vocab_size)
    if d.streaming:
        return DataSplits(open_stream(d.path, "data.path", tokenizer, d), open_stream(d.val_path, "data.val_path",
                                                                                      tokenizer, d),
                          "data.path", "data.val_path")
    train_prefix = tokenized_cache(d.path, "data.path", tokenizer, d, progress=progress)
    meta = _tokenizer_meta(tokenizer)
    train_data = open_indexed(str(train_prefix), "data.path")
    if d.val_path is not None:
        val_prefix = tokenized_cache(d.val_path, "data.val_path", tokenizer, d, progress=progress)
        return DataSplits(document_split(train_data, None, TRAIN, "data.path", meta),
                          document_split(open_indexed(str(val_prefix), "data.val_path"), None, TRAIN, "data.val_path",
                                         meta), "data.path", "data.val_path")
    fractions = parse_split(d.split or DEFAULT_SPLIT, "data.split")
    return DataSplits(document_split(train_data, fractions, TRAIN, "data.path", meta),
                      document_split(train_data, fractions, VALID, "data.path / data.split", meta),
                      "data.path", "data.split")


KIND = DataKind(build_hf, KEYS, check_config, writes_cache=True)
"""The registry entry (``te_npu.training.data.DATA_KINDS["hf"]``): the build writes the tokenized
cache (rank 0 first); the splits are ``TokenDataset`` views of it, or ``HFStream`` objects."""


def load_tokenizer(directory: str, vocab_size: int | None) -> Any:
    """``AutoTokenizer.from_pretrained(directory, local_files_only=True)``, its vocabulary checked
    against the model's ``vocab_size`` (``ConfigError`` naming ``data.tokenizer``)."""
    transformers = _require("transformers")
    if not Path(directory).is_dir():
        raise ConfigError(f"data.tokenizer: {directory!r} is not a folder (a local tokenizer folder is needed; "
                          "nothing is downloaded)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.tokenizer: cannot load a tokenizer from {directory!r}: {first}") from None
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ConfigError(f"data.tokenizer: {directory!r} has {len(tokenizer)} token ids, more than the model's "
                          f"vocab_size {vocab_size}; ids >= {vocab_size} would index past the embedding")
    return tokenizer


def tokenized_cache(source: str, key: str, tokenizer: Any, d: Any, *, progress: bool = False) -> Path:
    """The prefix of ``source``'s tokenized cache in ``<d.cache_dir>/hf`` (built now if absent)."""
    files, saved = data_files(source, key)
    settings = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "text_key": d.text_key, "hf_split": d.hf_split,
                "eos_token_id": tokenizer.eos_token_id, "tokenizer_class": type(tokenizer).__name__,
                "vocab_size": len(tokenizer)}
    digest = _content_hash(settings, files, Path(source), _tokenizer_files(d.tokenizer), Path(d.tokenizer))
    prefix = Path(d.cache_dir) / "hf" / f"{Path(source).name.split('.')[0] or 'data'}-{digest[:16]}"
    record_path = prefix.with_name(prefix.name + ".json")
    if _cached(record_path, digest):
        return prefix
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir: cannot create {prefix.parent}: {exc.strerror or exc}") from None
    dtype = smallest_token_dtype(len(tokenizer))
    documents = _tokenized_documents(source, key, files, saved, tokenizer, d, progress)
    num_docs, num_tokens = write_indexed_dataset(prefix, documents, dtype)
    record = {**settings, "key": digest, "source": str(Path(source).resolve()), "files": len(files),
              "tokenizer": str(Path(d.tokenizer).resolve()), "documents": num_docs, "num_tokens": num_tokens,
              "dtype": dtype.name}
    tmp = record_path.with_name(record_path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, record_path)
    return prefix


def open_stream(source: str, key: str, tokenizer: Any, d: Any) -> HFStream:
    """``source`` as an ``HFStream``: its files found and its first row read now (a missing
    column fails before the model is built), tokenized as the trainer reads it."""
    files, saved = data_files(source, key)

    def documents() -> Iterator[np.ndarray]:
        return _tokenized_documents(source, key, files, saved, tokenizer, d, progress=False)

    next(documents(), None)  # opens the dataset and checks the first rows' column
    return HFStream(source, key, documents, len(tokenizer), fingerprint(files, len(tokenizer), d.text_key))


def data_files(source: str, key: str) -> tuple[list[Path], bool]:
    """``(files, saved)``: the data files of ``source`` (a file, a folder of files, or a
    ``save_to_disk`` folder: then ``saved`` and all its files); ``ConfigError`` naming ``key``."""
    path = Path(source)
    if path.is_file():
        if _suffix(path) not in BUILDERS:
            raise ConfigError(f"{key}: {source!r} is not a file kind datasets reads here ({sorted(BUILDERS)})")
        return [path], False
    if not path.is_dir():
        raise ConfigError(f"{key}: {source!r} does not exist")
    everything = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if any((path / marker).is_file() for marker in _SAVED_MARKERS):
        return everything, True
    files = [p for p in everything if _suffix(p) in BUILDERS]
    if not files:
        raise ConfigError(f"{key}: {source!r} holds no {sorted(BUILDERS)} file and is not a save_to_disk folder")
    kinds = sorted({BUILDERS[_suffix(p)] for p in files})
    if len(kinds) > 1:
        raise ConfigError(f"{key}: {source!r} mixes {kinds} files; point it at one kind")
    return files, False


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _tokenized_documents(source: str, key: str, files: list[Path], saved: bool, tokenizer: Any, d: Any,
                         progress: bool) -> Iterator[np.ndarray]:
    """Token ids of each document of ``source``, EOS appended, in the dataset's order."""
    from tqdm.auto import tqdm  # a dependency of datasets

    rows = _rows(source, key, files, saved, d.hf_split)
    eos = tokenizer.eos_token_id
    with tqdm(total=getattr(rows, "num_rows", None), desc=f"tokenizing {Path(source).name}", unit=" docs",
              disable=not progress) as bar:
        for batch in _batches(rows, key, d.text_key):
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                yield np.asarray(ids + ([eos] if eos is not None else []), dtype=np.int64)
            bar.update(len(batch))


def _rows(source: str, key: str, files: list[Path], saved: bool, hf_split: str) -> Any:
    datasets = _require("datasets")
    try:
        if saved:
            loaded = datasets.load_from_disk(source)
            if isinstance(loaded, datasets.DatasetDict):
                if hf_split not in loaded:
                    raise ConfigError(f"data.hf_split: {hf_split!r} is not a split of {source!r} ({list(loaded)})")
                loaded = loaded[hf_split]
            return loaded
        builder = BUILDERS[_suffix(files[0])]
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split=hf_split, streaming=True)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for unreadable input
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key}: datasets cannot read {source!r}: {type(exc).__name__}: {first}") from None


def _batches(rows: Any, key: str, text_key: str) -> Iterator[list[str]]:
    batch: list[str] = []
    for n, row in enumerate(rows):
        if text_key not in row:
            raise ConfigError(f"data.text_key: {text_key!r} is not a column of {key}'s dataset (columns: "
                              f"{sorted(row)})")
        text = row[text_key]
        if not isinstance(text, str):
            raise ConfigError(f"data.text_key: row {n} of {key}'s dataset has a {type(text).__name__} in column "
                              f"{text_key!r}, not text")
        batch.append(text)
        if len(batch) == BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def _content_hash(settings: dict, files: list[Path], root: Path, tokenizer_files: list[Path], tok_root: Path) -> str:
    """sha256 of the settings, then each file's relative name, size and bytes (data, then tokenizer)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for group, base in ((files, root), (tokenizer_files, tok_root)):
        for path in group:
            name = path.name if base.is_file() or path == base else path.relative_to(base).as_posix()
            digest.update(f"\0{name}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def _tokenizer_files(directory: str) -> list[Path]:
    """The files of a tokenizer folder that define it (names with token / vocab / merges ...; no weights)."""
    return sorted(p for p in Path(directory).iterdir() if p.is_file()
                  and any(h in p.name.lower() for h in _TOKENIZER_FILE_HINTS)
                  and not p.name.lower().endswith(_WEIGHT_SUFFIXES))


def _tokenizer_meta(tokenizer: Any) -> dict:
    """Header fields of the splits: the tokenizer's vocabulary (checked against the model's)."""
    return {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}


def _cached(record_path: Path, digest: str) -> bool:
    prefix = record_path.with_name(record_path.name[: -len(".json")])
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return False
    if record.get("key") != digest or not all(p.is_file() for p in index_paths(prefix)):
        return False
    try:
        MegatronIndexedDataset(prefix)
    except (OSError, ValueError):
        return False  # damaged: rebuilt (the new files replace it atomically)
    return True


def _require(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as exc:
        raise ConfigError(f"data.kind: 'hf' needs the {module!r} package, which does not import here ({exc}); "
                          f"pip install {module}") from None
