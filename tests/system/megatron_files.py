"""Megatron-LM indexed datasets written by the tests themselves, field by field, from Megatron's
documented layout (``megatron/core/datasets/indexed_dataset.py``: ``_IndexWriter.__enter__`` /
``write``, ``IndexedDatasetBuilder.add_document`` / ``end_document``), never with te_npu's writer:

    .idx: b"MMIDIDX\\x00\\x00" | <Q version 1 | <B dtype code | <Q sequence count | <Q document count
          | int32 lengths[S] | int64 byte pointers[S] | int64 document indices[D] (0 first, S last)
    .bin: the sequences' tokens back to back

Megatron's dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MEGATRON_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                  8: np.uint16}


def write_megatron(prefix, documents, code: int = 8, *, sentences_per_doc: int = 1, version: int = 1,
                   magic: bytes = b"MMIDIDX\x00\x00", **corrupt) -> Path:
    """``documents``: token-id sequences; each is stored as ``sentences_per_doc`` sequences (like
    ``--split-sentences``) forming one document. ``corrupt``: ``lengths`` / ``pointers`` /
    ``doc_index`` replace those arrays as written; ``extra_idx_bytes`` appends to the .idx;
    ``bin_bytes_cut`` removes bytes from the end of the .bin. Returns the prefix."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(MEGATRON_CODES.get(code, np.uint16)).newbyteorder("<")
    lengths, doc_index, data = [], [0], b""
    for doc in documents:
        doc = np.asarray(doc)
        for piece in np.array_split(doc, sentences_per_doc):
            data += piece.astype(dtype).tobytes()
            lengths.append(int(piece.size))
        doc_index.append(len(lengths))
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * dtype.itemsize
    lengths = corrupt.get("lengths", lengths)
    pointers = corrupt.get("pointers", pointers)
    doc_index = corrupt.get("doc_index", doc_index)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(doc_index, dtype="<i8").tobytes())
        f.write(corrupt.get("extra_idx_bytes", b""))
    cut = corrupt.get("bin_bytes_cut", 0)
    Path(f"{prefix}.bin").write_bytes(data[: len(data) - cut] if cut else data)
    return prefix


def random_documents(seed: int, count: int, vocab: int, *, min_len: int = 20, max_len: int = 400,
                     eod: int | None = 0) -> list[np.ndarray]:
    """``count`` documents of random ids in ``[1, vocab)`` (``eod`` appended, as ``--append-eod``)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        doc = rng.integers(1, vocab, size=int(rng.integers(min_len, max_len)))
        docs.append(np.append(doc, eod) if eod is not None else doc)
    return docs
