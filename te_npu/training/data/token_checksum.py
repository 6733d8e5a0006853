"""A token file against its header: the ``.bin``'s SHA-256 must be the one its ``.json`` records.

``scripts/prepare_data.py`` (``data.write_token_file``) writes ``"sha256"`` of the ``.bin`` into
the header; a file edited, truncated-and-padded or swapped after that trains on other tokens
than the header describes. ``check_sha256`` recomputes it when the file is opened
(``TokenDataset``) and raises ``ValueError`` naming the file and both digests (the data layer
turns it into a ``ConfigError`` naming the key). Files larger than ``CHECKSUM_LIMIT_BYTES`` are
not hashed at open (that would cost every rank a full read per start); the per-batch token-id
check still runs on them.

Cost (``scripts/bench_checksum.py``, its ``sha256`` row): see docs/reliability.md
("Validated before the build"); it is paid once per open of a split, on every rank, from the page cache after the first.
"""
from __future__ import annotations

import hashlib
import os

__all__ = ["CHECKSUM_LIMIT_BYTES", "check_sha256", "sha256_of"]

CHECKSUM_LIMIT_BYTES = 4 << 30
"""Token files up to this size are hashed when opened."""
_CHUNK = 16 << 20


def sha256_of(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks."""
    digest, buf = hashlib.sha256(), bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def check_sha256(bin_path: str | os.PathLike, expected: str | None, *, limit: int = CHECKSUM_LIMIT_BYTES) -> bool:
    """``ValueError`` if ``bin_path``'s SHA-256 is not ``expected`` (its header's); returns whether
    it was checked (False: the header records none, or the file is larger than ``limit``)."""
    if not expected or os.path.getsize(bin_path) > limit:
        return False
    got = sha256_of(bin_path)
    if got != expected:
        raise ValueError(f"{os.fspath(bin_path)}: its SHA-256 is {got[:16]}..., its .json header says {expected[:16]}... "
                         "(the tokens changed after the header was written: re-run scripts/prepare_data.py)")
    return True
