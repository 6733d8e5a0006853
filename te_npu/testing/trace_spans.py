"""``Span`` s (``te_npu.testing.time_shares``) from a profiler's chrome trace (a JSON dict).

Both torch's profiler (``export_chrome_trace``, kineto) and torch_npu's
(``ASCEND_PROFILER_OUTPUT/trace_view.json``) write the chrome trace-event format: complete
events ``{"ph": "X", "name", "ts", "dur", "pid", "tid", "cat"}`` (microseconds; torch_npu
writes the numbers as strings), ``"M"`` metadata naming each process, and flow events
``{"ph": "s" | "f", "id", "cat", "pid", "tid", "ts"}`` linking a host op to what it launched.

- **device spans**: complete events of a kernel category (kineto's ``kernel`` / ``gpu_memcpy``
  / ``gpu_memset``) or in a process named in ``device_processes`` (torch_npu: ``Ascend
  Hardware``, its device tasks);
- **skipped**: the trace's own span (kineto category ``Trace``), every process named in
  ``skip_processes`` (derived views, e.g. torch_npu's ``Overlap Analysis``) and, for a process in
  ``only_threads``, its other threads (torch_npu's ``HCCL``: only its ``Communication`` thread);
- **host spans**: every other complete event, on the track ``(pid, tid)``.

A flow pair (same ``cat`` and ``id``; not ``fwdbwd``, which links forward to backward ops)
whose end ``f`` lies in a device span and whose start ``s`` in a host span links them: the
innermost host span containing ``s``'s time on its track becomes a source of the device span.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from te_npu.testing.time_shares import Span

__all__ = ["DEVICE_CATEGORIES", "spans_from_chrome_trace"]

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_SKIP_CATEGORIES = frozenset({"Trace"})
_HOST_ONLY_FLOWS = frozenset({"fwdbwd"})


class _Track:
    """The spans of one track sorted by start, each with its innermost container on the track."""

    def __init__(self, spans: list[tuple[float, float, int]]):
        self.spans = sorted(spans, key=lambda x: (x[0], -x[1]))
        self.starts = [x[0] for x in self.spans]
        self.parent: list[int | None] = []
        stack: list[int] = []
        for k, (_, end, _) in enumerate(self.spans):
            while stack and self.spans[stack[-1]][1] < end:
                stack.pop()
            self.parent.append(stack[-1] if stack else None)
            stack.append(k)

    def innermost(self, ts: float) -> int | None:
        """Span index (in the trace) of the innermost span containing ``ts``, None if none does."""
        k = bisect_right(self.starts, ts) - 1
        while k is not None and k >= 0:
            start, end, index = self.spans[k]
            if start <= ts <= end:
                return index
            k = self.parent[k]
        return None


def spans_from_chrome_trace(trace: dict | list, *, device_processes=(), skip_processes=(),
                            only_threads: dict[str, str] | None = None) -> list[Span]:
    """The host and device spans of ``trace`` (a chrome trace: ``{"traceEvents": [...]}`` or the
    event list), flow-linked; see the module docstring. ``only_threads``: process name -> the one
    thread name of it to read (its other threads are detail views of the same time)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    names = {e.get("pid"): e.get("args", {}).get("name") for e in meta if e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name") for e in meta if e.get("name") == "thread_name"}
    device_pids = {pid for pid, n in names.items() if n in set(device_processes)}
    skip_pids = {pid for pid, n in names.items() if n in set(skip_processes)}
    only = {pid: (only_threads or {})[n] for pid, n in names.items() if n in (only_threads or {})}
    raw = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") in skip_pids or e.get("cat") in _SKIP_CATEGORIES:
            continue
        if e.get("pid") in only and threads.get((e.get("pid"), e.get("tid"))) != only[e.get("pid")]:
            continue
        device = e.get("cat") in DEVICE_CATEGORIES or e.get("pid") in device_pids
        raw.append((str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0) or 0),
                    (e.get("pid"), e.get("tid")), device))
    grouped: dict = defaultdict(list)  # (device, (pid, tid)) -> (start, end, index)
    for i, (_, ts, dur, track, device) in enumerate(raw):
        grouped[(device, track)].append((ts, ts + dur, i))
    tracks = {key: _Track(spans) for key, spans in grouped.items()}
    flows: dict = defaultdict(dict)
    for e in events:
        if e.get("ph") in ("s", "f") and e.get("cat") not in _HOST_ONLY_FLOWS and "id" in e:
            flows[(e.get("cat"), str(e["id"]))][e["ph"]] = e
    sources: dict[int, list[int]] = defaultdict(list)
    for pair in flows.values():
        if "s" not in pair or "f" not in pair:
            continue
        s, f = pair["s"], pair["f"]
        device_track, host_track = tracks.get((True, (f.get("pid"), f.get("tid")))), tracks.get(
            (False, (s.get("pid"), s.get("tid"))))
        target = device_track.innermost(float(f["ts"])) if device_track else None
        source = host_track.innermost(float(s["ts"])) if host_track else None
        if target is not None and source is not None:
            sources[target].append(source)
    return [Span(name, ts, dur, track, device, tuple(sources.get(i, ()))) for i, (name, ts, dur, track, device)
            in enumerate(raw)]
