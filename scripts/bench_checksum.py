"""Cost of the checkpoint manifest's CRC-32 and the token files' SHA-256 versus reading the same
bytes, in seconds per GiB.

Writes ``--files`` files of random bytes (``--gib`` GiB in all, like one rank's DCP shards)
under ``--dir``, then times, from the page cache (the state right after a save):

* ``read``: reading every file in 16 MiB chunks, nothing else (the baseline);
* ``crc32 1 thread``: ``storage.manifest.file_entry`` on each file in turn;
* ``crc32 hash_files``: ``storage.manifest.hash_files`` (what save / load run: up to 4 threads);
* ``sha256 1 thread``: ``token_checksum.sha256_of`` on each file in turn (what opening a token
  file whose header records its digest costs: ``te_npu.training.data.token_checksum``).

"ratio" is each row's time over the read baseline's. Medians of ``--repeats`` runs.

    PYTHONPATH=. python scripts/bench_checksum.py [--gib 1] [--files 4] [--dir /tmp] [--repeats 5]
"""
import argparse
import os
import statistics
import tempfile
import time

from te_npu.distributed.storage.manifest import file_entry, hash_files
from te_npu.training.data.token_checksum import sha256_of

_CHUNK = 16 << 20


def _read(paths):
    buf = bytearray(_CHUNK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = int(args.gib * 2**30) // args.files
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        names = [f"__{i}_0.distcp" for i in range(args.files)]
        for name in names:
            with open(os.path.join(work, name), "wb") as f:
                for _ in range(0, size, _CHUNK):
                    f.write(os.urandom(min(_CHUNK, size)))
        paths = [os.path.join(work, n) for n in names]
        gib = sum(os.path.getsize(p) for p in paths) / 2**30
        rows = {
            "read": lambda: _read(paths),
            "crc32 1 thread": lambda: [file_entry(p) for p in paths],
            "crc32 hash_files": lambda: hash_files(work, names),
            "sha256 1 thread": lambda: [sha256_of(p) for p in paths],
        }
        _read(paths)  # page cache warm, as right after a save
        times = {}
        for name, fn in rows.items():
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples)
    print(f"{gib:.2f} GiB in {args.files} files, cpus={os.cpu_count()}, median of {args.repeats}")
    print(f"{'':20s} {'s/GiB':>8s} {'GiB/s':>8s} {'ratio':>7s}")
    for name, t in times.items():
        print(f"{name:20s} {t / gib:8.3f} {gib / t:8.2f} {t / times['read']:7.2f}x")


if __name__ == "__main__":
    main()
