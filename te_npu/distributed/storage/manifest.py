"""Checkpoint manifests: every file of a step with its size and CRC-32, written last.

``step_N/manifest.json``::

    {"format": "te_npu.checkpoint.manifest", "version": 1, "step": N, "checksum": "crc32",
     "files": {"<name>": {"size": bytes, "crc32": "<8 hex digits>"}, ...}}

lists every file of the step (DCP ``.distcp`` shards and ``.metadata``, ``te_npu.json``, each
rank's ``extra_rank{r}.pt``). A step directory is complete only if its manifest parses and
every listed file is there with its size; with ``checksums`` its CRC-32 must match too.
DCP itself checks neither (a flipped byte in a ``.distcp`` loads silently).

CRC-32 (``zlib.crc32``, stdlib, releases the GIL) detects accidental corruption (bit flips,
truncation, torn writes), not tampering. ``scripts/bench_checksum.py`` measures its cost per
GiB against a plain read of the same bytes. Files are hashed on a few threads at once.
"""
from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

__all__ = [
    "MANIFEST_NAME",
    "ManifestError",
    "file_entry",
    "fsync_dir",
    "hash_files",
    "read_manifest",
    "verify_files",
    "write_manifest",
    "adopt_step",
]

MANIFEST_NAME = "manifest.json"
_FORMAT, _VERSION = "te_npu.checkpoint.manifest", 1
_CHUNK = 16 << 20  # bytes read per crc32 call
_THREADS = 4


class ManifestError(ValueError):
    """A step directory has no readable manifest (message names the file and why)."""


def file_entry(path: str) -> dict:
    """``{"size": bytes, "crc32": hex}`` of one file, read in 16 MiB chunks."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": f"{crc:08x}"}


def hash_files(directory: str, names: Iterable[str]) -> dict[str, dict]:
    """``{name: file_entry(directory/name)}`` computed on up to 4 threads."""
    names = sorted(names)
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(_THREADS, len(names))) as pool:
        entries = pool.map(lambda n: file_entry(os.path.join(directory, n)), names)
        return dict(zip(names, entries))


def write_manifest(directory: str, step: int, files: dict[str, dict]) -> None:
    """Write ``directory/manifest.json`` atomically (temp file, fsync, rename, fsync dir)."""
    record = {"format": _FORMAT, "version": _VERSION, "step": int(step), "checksum": "crc32",
              "files": dict(sorted(files.items()))}
    tmp = os.path.join(directory, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST_NAME))
    fsync_dir(directory)


def read_manifest(directory: str) -> dict[str, dict]:
    """The ``files`` table of ``directory/manifest.json``; ``ManifestError`` if absent or unreadable."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise ManifestError(
            f"{path} is missing (an interrupted save, or a step saved before te_npu wrote manifests; for the "
            f"latter, if you trust its files: python -m te_npu.distributed.storage.manifest adopt {directory})"
        ) from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path} is unreadable: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != _FORMAT or not isinstance(record.get("files"), dict):
        raise ManifestError(f"{path} is not a te_npu checkpoint manifest")
    return record["files"]


def verify_files(directory: str, files: dict[str, dict], names: Iterable[str], *, checksums: bool) -> list[str]:
    """Problems (one line each, naming the file) of ``names`` (a subset of ``files``) in ``directory``.

    The size is always checked; with ``checksums`` each file whose size matches is also
    read and its CRC-32 compared.
    """
    problems, to_hash = [], []
    for name in sorted(names):
        path, want = os.path.join(directory, name), files[name]
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing (listed in {MANIFEST_NAME})")
            continue
        if size != want["size"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or rewritten)")
        elif checksums:
            to_hash.append(name)
    for name, got in hash_files(directory, to_hash).items():
        if got["crc32"] != files[name]["crc32"]:
            problems.append(f"{os.path.join(directory, name)}: CRC-32 {got['crc32']}, the manifest says "
                            f"{files[name]['crc32']} (corrupted bytes)")
    return problems


def fsync_dir(directory: str) -> None:
    """Make a rename / create inside ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def adopt_step(directory: str) -> int:
    """Write a manifest for a complete step saved before te_npu wrote manifests (its
    ``te_npu.json`` names the step); returns the number of files listed. The files are taken as
    they are: run it only on a step you trust. Refuses a step that has a manifest already."""
    if os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        raise ManifestError(f"{directory} already has a {MANIFEST_NAME}")
    try:
        with open(os.path.join(directory, "te_npu.json")) as f:
            step = int(json.load(f)["step"])
    except (OSError, ValueError, KeyError) as exc:
        raise ManifestError(f"{directory} is not a te_npu step directory (te_npu.json: {exc})") from None
    names = [n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))]
    write_manifest(directory, step, hash_files(directory, names))
    return len(names)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m te_npu.distributed.storage.manifest",
                                     description="Adopt a step saved before te_npu wrote manifests.")
    parser.add_argument("command", choices=["adopt"])
    parser.add_argument("step_dir", help="e.g. runs/x/checkpoints/step_100")
    args = parser.parse_args(argv)
    try:
        count = adopt_step(args.step_dir)
    except ManifestError as exc:
        print(f"checkpoint_manifest: {exc}")
        return 2
    print(f"checkpoint_manifest: wrote {os.path.join(args.step_dir, MANIFEST_NAME)} ({count} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
