"""Where each of a model's tensors lives in a Hugging Face checkpoint: key and shape planning.

Pure functions over names and shapes (no tensors, no I/O), shared by the sharded reader and
writer (``te_npu.distributed.storage.hf_checkpoint``) and testable without a checkpoint.

A model family declares its mapping with an ``HFKeyMap`` (DeepSeek-V3's is
``models/deepseek_v3/hf_mapping.py``). Every tensor keeps its own FQN as its HF key, except
those matched by a ``StackedExperts`` rule: our ``[E, P * R, *rest]`` expert stack is, per
expert ``e``, the concatenation along dim 0 of ``P`` HF tensors ``[R, *rest]``. A checkpoint may
hold such a tensor either way -- stacked under our FQN (transformers 5.x in memory,
``save_pretrained(save_original_format=False)``) or per expert (``save_pretrained``'s default,
and every published DeepSeek checkpoint) -- and the reader takes whichever it finds; the writer
writes per expert unless asked otherwise.

Shape legend: E experts, P parts per expert (gate, up), R rows per part.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from te_npu.errors import ConfigError

__all__ = [
    "StackedExperts",
    "HFPiece",
    "HFKeyMap",
    "HFStoredTensor",
    "HF_READABLE_DTYPES",
    "plan_hf_read",
    "left_out_note",
    "HFWriteEntry",
    "plan_hf_write",
]

HF_READABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Stored dtypes the reader casts from: exact into FP32 masters. 8-bit or integer weights (e.g.
block-quantized FP8 releases with ``weight_scale_inv``) are refused, never reinterpreted."""

_MAX_LISTED = 20  # keys shown per error category (the count is always given)


@dataclass(frozen=True)
class HFPiece:
    """One HF tensor that is a region of one of ours: ``ours[expert, rows[0]:rows[1]]``.

    key: HF key; fqn: our tensor; shape: the HF tensor's shape ``[R, *rest]``.
    """

    key: str
    fqn: str
    expert: int
    rows: tuple[int, int]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StackedExperts:
    """Rule: an FQN matching ``pattern`` (``re.fullmatch``) is an expert stack ``[E, P * R, *rest]``
    whose expert ``e`` concatenates the ``P`` HF tensors named by ``parts`` (format strings over
    ``{expert}`` and the pattern's named groups), in order, along dim 0."""

    pattern: str
    parts: tuple[str, ...]

    def pieces(self, fqn: str, shape: Sequence[int]) -> list[HFPiece] | None:
        """The per-expert HF tensors of ``fqn`` (expert-major, parts in order), or None if no match."""
        match = re.fullmatch(self.pattern, fqn)
        if match is None:
            return None
        if len(shape) < 2 or shape[1] % len(self.parts):
            raise ValueError(f"{fqn} {list(shape)}: dim 1 does not split into {len(self.parts)} parts {self.parts}")
        rows, rest = shape[1] // len(self.parts), tuple(shape[2:])
        return [
            HFPiece(part.format(expert=e, **match.groupdict()), fqn, e, (p * rows, (p + 1) * rows), (rows, *rest))
            for e in range(shape[0])
            for p, part in enumerate(self.parts)
        ]


@dataclass(frozen=True)
class HFKeyMap:
    """A model family's HF naming: expert-stack rules, and FQNs (regex, ``re.search``) that an
    export keeps in FP32 whatever dtype is asked (transformers keeps DeepSeek-V3's router FP32).

    left_out: HF keys (regex, ``re.search``) a checkpoint may hold that the model does not read
    (DeepSeek-V3's MTP layers, ``model.layers.{num_hidden_layers + i}.*``); the reader skips them
    instead of refusing them as unexpected, and ``left_out_note`` says which. left_out_reason:
    why, in a few words (ends that note).

    copies: ``(HF key, our FQN)`` pairs: HF tensors that repeat one of ours (DeepSeek-V3's MTP
    layers carry copies of the shared embedding and output head). An export writes our tensor
    again under each such key; the reader reads ours under its own key and not the copy (a
    stored copy is not unexpected), and ``left_out_note`` says so with copies_reason.

    missing_hints: ``(regex, hint)`` pairs: when a key the model needs is missing and matches the
    regex (``re.search``), the refusal ends with the hint (what setting would fit the checkpoint).
    """

    stacked_experts: tuple[StackedExperts, ...] = ()
    keep_fp32: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    left_out_reason: str = ""
    copies: tuple[tuple[str, str], ...] = ()
    copies_reason: str = ""
    missing_hints: tuple[tuple[str, str], ...] = ()

    def is_left_out(self, key: str) -> bool:
        return any(re.search(p, key) for p in self.left_out) or any(key == k for k, _ in self.copies)

    def pieces(self, fqn: str, shape: Sequence[int]) -> list[HFPiece] | None:
        for rule in self.stacked_experts:
            pieces = rule.pieces(fqn, shape)
            if pieces is not None:
                return pieces
        return None

    def export_dtype(self, fqn: str, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if any(re.search(p, fqn) for p in self.keep_fp32) else dtype


@dataclass(frozen=True)
class HFStoredTensor:
    """One tensor of a checkpoint as its header describes it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_hf_read(
    shapes: Mapping[str, Sequence[int]], stored: Mapping[str, HFStoredTensor], key_map: HFKeyMap, *, where: str
) -> dict[str, tuple[HFPiece, ...] | None]:
    """For each of our tensors (``shapes``: FQN -> global shape), how to read it from ``stored``:
    ``None`` = one HF tensor under its own FQN, else its per-expert pieces.

    Raises one ``ConfigError`` (prefixed by ``where``) listing every missing, unexpected,
    mis-shaped or unreadable-dtype key, so nothing is read from a checkpoint that does not fit.
    """
    plan: dict[str, tuple[HFPiece, ...] | None] = {}
    expected: dict[str, tuple[int, ...]] = {}
    missing: list[str] = []
    for fqn, shape in shapes.items():
        shape = tuple(shape)
        pieces = key_map.pieces(fqn, shape)
        if pieces is None or fqn in stored or not any(p.key in stored for p in pieces):
            plan[fqn], expected[fqn] = None, shape
            if fqn not in stored:
                alt = f" (or per expert: {pieces[0].key}, ...)" if pieces else ""
                missing.append(fqn + alt)
            continue
        plan[fqn] = tuple(pieces)
        for piece in pieces:
            expected[piece.key] = piece.shape
            if piece.key not in stored:
                missing.append(piece.key)
    unexpected = sorted(k for k in set(stored) - set(expected) if not key_map.is_left_out(k))
    wrong_shape = [f"{k}: checkpoint {list(stored[k].shape)}, model {list(s)}"
                   for k, s in expected.items() if k in stored and tuple(stored[k].shape) != s]
    wrong_dtype = [f"{k}: {stored[k].dtype}" for k in expected
                   if k in stored and stored[k].dtype not in HF_READABLE_DTYPES]
    problems = [
        (missing, "missing keys"),
        (unexpected, "unexpected keys"),
        (wrong_shape, "mis-shaped keys"),
        (wrong_dtype, f"keys in a dtype the reader does not take (only {[str(d) for d in HF_READABLE_DTYPES]})"),
    ]
    message = "; ".join(f"{len(keys)} {what}: {_listing(keys)}" for keys, what in problems if keys)
    hints = [hint for pattern, hint in key_map.missing_hints if any(re.search(pattern, k) for k in missing)]
    if message and hints:
        message += "; " + "; ".join(hints)
    if message:
        raise ConfigError(f"{where}: the checkpoint does not match the model: {message}")
    return plan


def left_out_note(stored: Mapping[str, HFStoredTensor], key_map: HFKeyMap, *, where: str) -> str | None:
    """One line naming the stored keys ``key_map`` leaves out (grouped by their first three name
    parts, e.g. ``model.layers.61.*``) and why; None when the map leaves nothing out."""
    copies = sorted(k for k, _ in key_map.copies if k in stored)
    copy_note = f"{key_map.copies_reason} ({len(copies)} stored)" if copies else None
    if not key_map.left_out:
        return None if copy_note is None else f"{where}: {copy_note}"
    keys = sorted(k for k in stored if any(re.search(p, k) for p in key_map.left_out))
    groups: dict[str, int] = {}
    for key in keys:
        prefix = ".".join(key.split(".")[:3]) + ".*"
        groups[prefix] = groups.get(prefix, 0) + 1
    what = (f"left out {len(keys)} tensor(s): " + ", ".join(f"{g} ({n})" for g, n in groups.items())
            if keys else "the checkpoint holds none of them")
    return f"{where}: {key_map.left_out_reason}; {what}" + ("" if copy_note is None else f"; {copy_note}")


@dataclass(frozen=True)
class HFWriteEntry:
    """One HF tensor an export writes: its key, global shape, dtype, output file index (1-based)
    and where it comes from (``piece`` None: the whole of our tensor ``fqn``)."""

    key: str
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file_index: int
    piece: HFPiece | None


def plan_hf_write(
    shapes: Mapping[str, Sequence[int]],
    key_map: HFKeyMap,
    *,
    dtype: torch.dtype,
    max_shard_bytes: int,
    per_expert: bool = True,
) -> list[HFWriteEntry]:
    """Every HF tensor of an export, in order, packed into files of at most ``max_shard_bytes``
    (a single tensor larger than that gets a file of its own), as ``save_pretrained`` does.
    Identical on every rank: it depends on names and global shapes only."""
    entries: list[HFWriteEntry] = []
    file_index, file_bytes = 1, 0
    for fqn, shape in shapes.items():
        shape = tuple(shape)
        out_dtype = key_map.export_dtype(fqn, dtype)
        pieces = key_map.pieces(fqn, shape) if per_expert else None
        whole = [(fqn, shape, None), *((k, shape, None) for k, src in key_map.copies if src == fqn)]
        for key, piece_shape, piece in ([(p.key, p.shape, p) for p in pieces] if pieces else whole):
            nbytes = _numel(piece_shape) * out_dtype.itemsize
            if file_bytes and file_bytes + nbytes > max_shard_bytes:
                file_index, file_bytes = file_index + 1, 0
            entries.append(HFWriteEntry(key, fqn, piece_shape, out_dtype, file_index, piece))
            file_bytes += nbytes
    return entries


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _listing(keys: Sequence[str]) -> str:
    shown = list(keys[:_MAX_LISTED])
    more = f" ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return "[" + ", ".join(shown) + "]" + more
