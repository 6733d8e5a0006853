"""Time shares of profiled steps: quant / MM-GMM / all-gather / reduce-scatter / other.

The one definition of time shares in te_npu: the acceptance report (``scripts/q3_acceptance.py``)
and the recipe comparison (``scripts/compare_recipes.py``) both profile steps with
``te_npu.testing.step_profile`` and publish these numbers (docs/benchmarks-and-reports.md, docs/a5.md).

``time_shares(spans, wall_us)`` is a pure function of a profile's spans (``Span``: a named
interval on a track; ``te_npu.testing.trace_spans`` reads them from a profiler's chrome trace).

**Host spans** (CPU ops and ``record_function`` ranges) nest by time on their track (a span
inside another one's interval on the same track is its descendant). Each span's *self time*
(its duration minus its direct children's) is counted once, in the category of the **innermost
labelled range** around it (itself included), by ``RANGE_RULES``:

- ``te_npu::quantize ...`` (``te_npu.ops.profiling.QUANT_RANGE``: every te_npu quantization) -> quant
- ``te_npu::gemm ...`` (``GEMM_RANGE``: every te_npu 8-bit dense / grouped GEMM) -> MM-GMM
- ``FSDP::all_gather``, ``FSDP::all_gather_copy_out`` -> all-gather
- ``FSDP::post_backward_reduce``, ``FSDP::post_backward_rs_wait`` -> reduce-scatter (under HSDP
  the replicate all-reduce runs inside ``post_backward_reduce`` too)
- ``aten::scaled_dot_product_attention`` / ``aten::_scaled_dot_product*`` -> other (attention is
  not an MM-GMM even where the CPU math path decomposes it into aten GEMMs)

The FSDP names are FSDP2's own ranges (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``: ``unshard`` opens
``FSDP::all_gather``, ``wait_for_unshard`` ``FSDP::all_gather_copy_out``, ``post_backward``
``FSDP::post_backward_reduce`` and ``FSDP::post_backward_rs_wait``; each with `` (<module fqn>)``
appended), matched by prefix. Outside every labelled range, the innermost aten GEMM op
(``OP_RULES``: ``aten::mm`` / ``addmm`` / ``_grouped_mm`` / ``matmul`` / ``linear``,
``npu_grouped_matmul``: the BF16 linears, lm_head and router GEMMs, forward and backward;
batched ``bmm`` is left out: in this model only attention's CPU math path runs it) counts as MM-GMM, and a ``c10d`` all-gather / reduce-scatter op as its
collective. Everything else is "other". So nested ranges never count twice: a quantization
inside a gather counts as quant, an aten op inside a te_npu GEMM as MM-GMM.

**Collective worker threads** -- a host track whose every outermost span is a collective
library's own (``gloo:`` / ``nccl:`` / ``hccl:`` names, the threads gloo runs its
all-gathers and all-reduces on) -- are not counted: the step's thread waits for them inside the
FSDP ranges, where that wait already counts as all-gather / reduce-scatter. Their busy time is
reported apart (``comm_threads_ms``, by name).

**Device spans** (kernels, ``Span.device``) do not nest with host spans; each takes the category
of the host span that launched it (``Span.sources``, the flow links of the trace; the first
source with a category other than "other" wins), else of its own name (a collective kernel:
``allgather`` / ``reducescatter`` in any case or spelling) else "other". When a profile has
device spans the shares are device busy time (``basis: "device"``), else host self time
(``basis: "host"``: the CPU emulation, whose numbers are emulation numbers).

Each category is reported in ms over the profiled steps and in percent of their wall time
``wall_us``; ``unattributed`` is the wall time no span covers (host: Python between ops; device:
idle), negative where tracks overlap (threads, streams, communication overlapping compute).
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from te_npu.ops.profiling import GEMM_RANGE, QUANT_RANGE

__all__ = ["CATEGORIES", "RANGE_RULES", "OP_RULES", "Span", "time_shares", "category_of_name", "mean_over_ranks"]

CATEGORIES = ("quant", "mm_gmm", "all_gather", "reduce_scatter", "other")

RANGE_RULES = (
    (QUANT_RANGE, "quant"),
    (GEMM_RANGE, "mm_gmm"),
    ("FSDP::all_gather", "all_gather"),  # also FSDP::all_gather_copy_out
    ("FSDP::post_backward_reduce", "reduce_scatter"),
    ("FSDP::post_backward_rs_wait", "reduce_scatter"),
    ("aten::scaled_dot_product_attention", "other"),  # attention is no MM-GMM, even where it
    ("aten::_scaled_dot_product", "other"),  # decomposes into aten GEMMs (CPU math path)
)
"""(name prefix, category) of the labelled ranges; the innermost one around a span decides."""

OP_RULES = (
    (re.compile(r"^aten::(mm|addmm|_grouped_mm|matmul|linear)$"), "mm_gmm"),
    (re.compile(r"npu_grouped_matmul$"), "mm_gmm"),
    (re.compile(r"^c10d::.*(allgather|all_gather)", re.I), "all_gather"),
    (re.compile(r"^c10d::.*reduce_scatter", re.I), "reduce_scatter"),
)
"""(name pattern, category) of ops that count outside every labelled range (innermost decides)."""

_KERNEL_RULES = (
    (re.compile(r"all_?gather", re.I), "all_gather"),
    (re.compile(r"reduce_?scatter", re.I), "reduce_scatter"),
)
_COMM_THREAD_SPAN = re.compile(r"^(gloo|nccl|hccl):", re.I)
_EPS_US = 1e-3


@dataclass(frozen=True)
class Span:
    """One interval of a profile: ``name``, ``start_us`` and ``dur_us`` (microseconds), its
    ``track`` (host: one per process and thread; device: one per stream). ``device``: a kernel;
    ``sources``: indices (in the same span list) of the host spans that launched it."""

    name: str
    start_us: float
    dur_us: float
    track: Hashable = 0
    device: bool = False
    sources: tuple[int, ...] = ()


def category_of_name(name: str, rules) -> str | None:
    """The category a name alone gives under ``rules`` (``RANGE_RULES`` prefixes or compiled
    patterns), None when no rule matches."""
    for rule, category in rules:
        if (name.startswith(rule) if isinstance(rule, str) else rule.search(name)):
            return category
    return None


def _parents(spans: Sequence[Span]) -> list[int | None]:
    """Per span: the index of the innermost host span on its track that contains it."""
    parents: list[int | None] = [None] * len(spans)
    by_track: dict = defaultdict(list)
    for i, s in enumerate(spans):
        if not s.device:
            by_track[s.track].append(i)
    for indices in by_track.values():
        indices.sort(key=lambda i: (spans[i].start_us, -spans[i].dur_us))
        stack: list[int] = []
        for i in indices:
            s = spans[i]
            end = s.start_us + s.dur_us
            while stack and spans[stack[-1]].start_us + spans[stack[-1]].dur_us < end - _EPS_US:
                stack.pop()  # ended before this span does: not an ancestor
            parents[i] = stack[-1] if stack else None
            stack.append(i)
    return parents


def _label(name: str) -> str:
    return name.split(" (")[0].split(" [pg=")[0]  # FSDP's " (<fqn>)" / " [pg=N]" suffixes


def time_shares(spans: Sequence[Span], wall_us: float) -> dict:
    """Category times of ``spans`` (see the module docstring) over a wall time of ``wall_us`` us.

    Returns ``{"basis": "host" | "device", "wall_ms", "ms": {category: ms}, "percent":
    {category: % of wall}, "unattributed_ms", "unattributed_percent", "host_ms": {category: ms}
    (host self time, also when the basis is device), "comm_threads_ms": {span name: ms} (the
    collective worker threads, not counted), "by_label": {category: [[label, ms], ...]}
    (the deciding range or op names, largest first, ten at most)}``.
    """
    if wall_us <= 0:
        raise ValueError(f"time_shares: wall time must be positive, got {wall_us} us")
    parents = _parents(spans)
    children_us = [0.0] * len(spans)
    for i, p in enumerate(parents):
        if p is not None:
            children_us[p] += spans[i].dur_us
    roots: dict = defaultdict(list)
    for i, s in enumerate(spans):
        if not s.device and parents[i] is None:
            roots[s.track].append(s.name)
    comm_tracks = {t for t, names in roots.items() if all(_COMM_THREAD_SPAN.match(n) for n in names)}
    comm = Counter()
    cache: dict[int, tuple[str, str]] = {}

    def decide(i: int) -> tuple[str, str]:
        """(category, deciding name) of host span i: innermost labelled range, else innermost op rule."""
        if i in cache:
            return cache[i]
        chain, j = [], i
        while j is not None:
            chain.append(j)
            j = parents[j]
        found = None
        for rules in (RANGE_RULES, OP_RULES):
            for k in chain:
                category = category_of_name(spans[k].name, rules)
                if category is not None:
                    found = (category, _label(spans[k].name))
                    break
            if found:
                break
        cache[i] = found or ("other", _label(spans[i].name))
        return cache[i]

    host, device = Counter(), Counter()
    labels: dict[str, Counter] = defaultdict(Counter)
    has_device = any(s.device for s in spans)
    for i, s in enumerate(spans):
        if s.device:
            category, label = next((decide(k) for k in s.sources if decide(k)[0] != "other"),
                                   (category_of_name(s.name, _KERNEL_RULES), s.name))
            category = category or "other"
            device[category] += s.dur_us
            labels[category][label] += s.dur_us
        elif s.track in comm_tracks:
            if parents[i] is None:
                comm[s.name] += s.dur_us
        else:
            category, label = decide(i)
            own = max(0.0, s.dur_us - children_us[i])
            host[category] += own
            if not has_device:
                labels[category][label] += own
    basis = device if has_device else host
    to_ms = lambda us: round(us / 1000, 3)  # noqa: E731
    return {
        "basis": "device" if has_device else "host",
        "wall_ms": to_ms(wall_us),
        "ms": {c: to_ms(basis[c]) for c in CATEGORIES},
        "percent": {c: round(100 * basis[c] / wall_us, 2) for c in CATEGORIES},
        "unattributed_ms": to_ms(wall_us - sum(basis.values())),
        "unattributed_percent": round(100 * (wall_us - sum(basis.values())) / wall_us, 2),
        "host_ms": {c: to_ms(host[c]) for c in CATEGORIES},
        "comm_threads_ms": {name: to_ms(us) for name, us in comm.most_common()},
        "by_label": {c: [[name, to_ms(us)] for name, us in labels[c].most_common(10)] for c in CATEGORIES if labels[c]},
    }


def mean_over_ranks(per_rank: Sequence[dict], steps: int) -> dict:
    """The mean over ranks of ``time_shares`` results, each over ``steps`` profiled steps.

    Returns ``{"basis", "steps", "wall_ms_per_step", "percent": {category: %}, "ms_per_step":
    {category: ms}, "unattributed_percent", "comm_threads_percent": {span name: % of wall}}``; a
    collective thread's name missing on a rank counts 0 there."""
    if not per_rank or steps <= 0:
        raise ValueError(f"mean_over_ranks: need at least one rank and one step, got {len(per_rank)} / {steps}")
    def mean(values) -> float:
        return sum(values) / len(per_rank)

    names = sorted({name for s in per_rank for name in s["comm_threads_ms"]})
    return {
        "basis": per_rank[0]["basis"],
        "steps": steps,
        "wall_ms_per_step": mean(s["wall_ms"] for s in per_rank) / steps,
        "percent": {c: mean(s["percent"][c] for s in per_rank) for c in CATEGORIES},
        "ms_per_step": {c: mean(s["ms"][c] for s in per_rank) / steps for c in CATEGORIES},
        "unattributed_percent": mean(s["unattributed_percent"] for s in per_rank),
        "comm_threads_percent": {name: mean(100 * s["comm_threads_ms"].get(name, 0.0) / s["wall_ms"] for s in per_rank)
                                 for name in names},
    }
