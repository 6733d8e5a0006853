"""A progress bar for the long loops of checkpoint conversion: tqdm when installed, else a plain one.

Only the ranks that ask for it show one (callers pass ``enabled=rank == 0``); a disabled bar
costs nothing. Bars write to stderr, so log lines on stdout stay parseable.
"""
from __future__ import annotations

import sys
import threading

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar(total, "reading", enabled=True) as bar: ... bar.update()``; thread-safe."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, unit: str = "it") -> None:
        self.total, self.desc, self.count = int(total), desc, 0
        self._lock = threading.Lock()
        self._tqdm = None
        self._printed = -1
        self.enabled = enabled and self.total > 0
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the plain bar below
                tqdm = None
            if tqdm is not None:
                self._tqdm = tqdm(total=self.total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.count += n
            if self._tqdm is not None:
                self._tqdm.update(n)
                return
            tenth = 10 * self.count // self.total
            if tenth > self._printed:  # one line per 10 %
                self._printed = tenth
                print(f"{self.desc}: {self.count}/{self.total} ({100 * self.count // self.total}%)", file=sys.stderr,
                      flush=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
