"""This process's resident memory on Linux, in bytes, from ``/proc/self/status``.

``status_bytes("VmRSS")`` is the current RSS, ``status_bytes("VmHWM")`` its peak since the
process began or since the last ``reset_peak_rss()`` (writing 5 to ``/proc/self/clear_refs``
sets ``VmHWM`` back to the current RSS). Both answer None / False where /proc has no such file
(not Linux, a restricted container). Used by the capacity estimate's per-stage RSS and the
acceptance run's per-phase host peak.
"""
from __future__ import annotations

__all__ = ["status_bytes", "reset_peak_rss"]


def status_bytes(field: str) -> int | None:
    """``field`` of ``/proc/self/status`` (a ``kB`` line such as ``VmRSS`` / ``VmHWM``) in bytes,
    or None when the file or the field is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Set ``VmHWM`` back to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
