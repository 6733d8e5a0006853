#!/usr/bin/env python
"""Tokenize text files into a te_npu token split (``<prefix>.bin`` + ``<prefix>.json``), or a
Megatron-LM indexed dataset (``--format megatron``: ``<prefix>.bin`` + ``<prefix>.idx``).

    # a local HF tokenizer directory (never downloads)
    python scripts/prepare_data.py --input 'corpus/**/*.txt' --tokenizer /models/dsv3-tokenizer --out-prefix data/corpus
    # byte-level (vocab 256, NUL ends each document), no tokenizer needed
    python scripts/prepare_data.py --input 'notes/*.md' --byte-level --out-prefix data/notes --val-fraction 0.05

Files are taken in sorted path order. With ``--val-fraction`` > 0 whole files are held out
(``sha256(path) < fraction``) and ``<prefix>_train`` / ``<prefix>_val`` are written;
otherwise a single ``<prefix>``. Use the result with ``data: {kind: bin, path: <prefix>}``
(or ``path: <prefix>_train, val_path: <prefix>_val``). Each document is followed by the
tokenizer's EOS id (``--no-eos`` to omit). With ``--format megatron`` each file is one document
of a Megatron indexed dataset (uint16 below 65,500 ids, else int32, as Megatron's
``preprocess_data.py`` writes), for ``data: {kind: megatron, path: <prefix>}`` and for Megatron-LM.
"""
from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from te_npu.training.data.megatron.indexed_dataset import smallest_token_dtype, write_indexed_dataset  # noqa: E402
from te_npu.training.data import (  # noqa: E402
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    byte_tokenize,
    split_by_file,
    tokenize_files,
    write_token_file,
)


def expand_inputs(patterns: list[str]) -> list[str]:
    """Sorted, de-duplicated files matching the glob patterns (``**`` recursive)."""
    files = sorted({p for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
    if not files:
        raise SystemExit(f"prepare_data: no files match {patterns}")
    return files


def byte_level_tokenizer(eos: bool):
    info = {"kind": "byte", "vocab_size": BYTE_VOCAB_SIZE}
    return (lambda raw, _name: byte_tokenize(raw)), BYTE_VOCAB_SIZE, (BYTE_EOS_ID if eos else None), info


def hf_tokenizer(directory: str, eos: bool):
    """A local ``transformers`` tokenizer (``local_files_only=True``: no network)."""
    from transformers import AutoTokenizer  # optional dependency, only for this path

    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)

    def encode(raw: bytes, name: str) -> np.ndarray:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SystemExit(f"prepare_data: {name} is not UTF-8 ({exc})") from None
        return np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int64)

    eos_id = tok.eos_token_id if eos else None
    info = {"kind": "hf", "path": str(Path(directory).resolve()), "class": type(tok).__name__, "eos_token": tok.eos_token}
    return encode, len(tok), eos_id, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True, help="glob of text files (repeatable)")
    parser.add_argument("--out-prefix", required=True, type=Path, help="output prefix (writes .bin and .json)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", help="local HF tokenizer directory")
    which.add_argument("--byte-level", action="store_true", help="token = byte value, vocab 256")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="fraction of files held out for validation")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    parser.add_argument("--format", choices=["te_npu", "megatron"], default="te_npu",
                        help="te_npu: <prefix>.bin + .json (data.kind bin); megatron: <prefix>.bin + .idx")
    args = parser.parse_args(argv)
    if not 0.0 <= args.val_fraction < 1.0:
        parser.error("--val-fraction must be in [0, 1)")

    files = expand_inputs(args.input)
    if args.byte_level:
        encode, vocab_size, eos_id, info = byte_level_tokenizer(not args.no_eos)
    else:
        encode, vocab_size, eos_id, info = hf_tokenizer(args.tokenizer, not args.no_eos)
    build = {"kind": "prepare_data", "inputs": args.input, "val_fraction": args.val_fraction}
    if args.val_fraction > 0:
        train, val = split_by_file(files, args.val_fraction)
        name = args.out_prefix.name
        splits = [(args.out_prefix.with_name(f"{name}_train"), train, "train"), (args.out_prefix.with_name(f"{name}_val"), val, "val")]
    else:
        splits = [(args.out_prefix, files, "all")]
    for prefix, names, split in splits:
        if args.format == "megatron":
            docs = (np.append(ids, eos_id) if eos_id is not None else ids
                    for _, _, ids in tokenize_files(((n, Path(n)) for n in names), encode))
            count, tokens = write_indexed_dataset(prefix, docs, smallest_token_dtype(vocab_size))
            print(f"wrote {prefix}.bin + .idx: {tokens} tokens in {count} documents (Megatron indexed dataset)")
            continue
        meta = write_token_file(
            prefix,
            tokenize_files(((n, Path(n)) for n in names), encode),
            vocab_size=vocab_size,
            tokenizer=info,
            eos_token_id=eos_id,
            split=split,
            build=build,
        )
        print(f"wrote {prefix}.bin: {meta['num_tokens']} tokens ({meta['dtype']}) from {len(names)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
