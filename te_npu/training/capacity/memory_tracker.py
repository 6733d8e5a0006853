"""Bytes of every tensor storage a computation creates, by stage and by category (real or fake tensors).

A ``TorchDispatchMode`` that sees the output of every aten op while it is active, finds the
storages behind it (through wrapper subclasses: DTensor's local shard, a quantized weight's
inner tensors), and counts each storage once, from its creation until Python frees it (a weak
reference) or FSDP2 resizes it (``UntypedStorage.resize_``, which FSDP2 uses to free and
re-allocate its all-gather buffers and which no dispatch mode sees: patched while tracking, as
torch's own ``MemTracker`` does). Under ``FakeTensorMode`` nothing is allocated and the counts
are exactly what the tensors would occupy. torch's ``torch.distributed._tools.MemTracker`` does
the counting but files bytes only by module and by its own reference types; the capacity
estimate needs te_npu's categories (8-bit weights apart from high-precision ones, FP32 masters
apart from AdamW moments) and its own stages, hence this small tracker.

Two accounts:

- **device**: what the A5 would hold. Allocations made inside a ``kernel()`` block (the
  estimator's emulation backend marks each quantization and GEMM call) count only if they
  outlive the call: a vendor kernel allocates its outputs, not the emulation's decoded FP32
  operands and intermediates.
- **emulation**: everything, the emulation's scratch included (what this CPU run holds).

Categories (device account), ``CATEGORIES``: a storage is filed when created -- activations
during a forward, temporaries otherwise, FSDP2 buffers when FSDP2's all-gather / reduce-scatter
code (or te_npu's gather extension) creates it -- and re-filed by ``label`` when the caller knows
better (the estimator labels weights, masters and moments after each setup step and gradients
after each backward). Each stage keeps its peak, the categories at that peak, and its end. An
``exact`` stage (setup: few storages) keeps the storages live at its peak, so its categories
are those of their final labels; a step stage keeps the category totals of the moment.
Meta-device tensors hold no memory and are not counted.

Host reads of fake tensors' values (``.item()``, ``bool(t)``, ``.tolist()``) have no value to
read; ``scalar_value`` answers them (default: finite gradients, equal scales). Reads of real
tensors read them.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from te_npu import compat

__all__ = ["CATEGORIES", "StageMemory", "MemoryTracker"]

CATEGORIES = (
    "8-bit weights",
    "high-precision weights",
    "FP32 masters",
    "AdamW moments",
    "gradients",
    "activations",
    "FSDP2 buffers",
    "temporaries",
)

_FSDP_SOURCES = ("fsdp/_fully_shard/_fsdp_collectives.py", "fsdp/_fully_shard/_fsdp_param.py",
                 "te_npu/distributed/fsdp.py")
_STACK_DEPTH = 30  # frames searched for an FSDP2 source (its hooks allocate within ~15 frames)
_aten = torch.ops.aten


@dataclass
class StageMemory:
    """One stage: its device-account peak (bytes) and the categories at that moment, its bytes at
    the end, and the emulation account's peak."""

    name: str
    peak_bytes: int = 0
    peak_totals: dict[str, int] = field(default_factory=dict)
    end_bytes: int = 0
    emulation_peak_bytes: int = 0
    peak_records: list | None = None  # exact stages: (record, bytes) of every storage live at the peak

    @property
    def peak_by_category(self) -> dict[str, int]:
        """Bytes per category at the peak (an exact stage: by its storages' final labels)."""
        if self.peak_records is None:
            return dict(self.peak_totals)
        out: Counter[str] = Counter()
        for record, nbytes in self.peak_records:
            out[record.category] += nbytes
        return dict(out)

    def as_dict(self) -> dict:
        return {"name": self.name, "peak_bytes": self.peak_bytes, "end_bytes": self.end_bytes,
                "emulation_peak_bytes": self.emulation_peak_bytes,
                "peak_by_category": {c: self.peak_by_category.get(c, 0) for c in CATEGORIES}}


@dataclass
class _Record:
    nbytes: int
    category: str
    counted: bool  # in the device account (False: inside a kernel call, not yet known to outlive it)


def _default_scalar(t: torch.Tensor):
    """True for a flag (finite grad norm, equal scales), 1.0 for a number; an integer read (a
    size taken from data) has no neutral answer and raises."""
    if t.dtype == torch.bool:
        return True
    if t.dtype.is_floating_point:
        return 1.0
    raise RuntimeError(f"MemoryTracker: a host read of an integer value ({t.dtype}) under tracking; a size taken "
                       "from tensor data cannot be estimated (give it a host mirror)")


class MemoryTracker(compat.torch_dispatch_mode()):
    """Enter it (inside a ``FakeTensorMode`` for an estimate) around the computation to measure;
    ``start_stage(name)`` opens a stage, ``stages`` lists them, ``device_bytes`` is live now.

    scalar_value(tensor) -> bool / int / float: the answer to a host read of a value (default:
    True for a flag, 1.0 for a number, an error for an integer). phase_of() -> "forward" | "backward": which of the two is running (default:
    backward while the autograd engine runs, else forward), used to file new storages.
    """

    def __init__(self, *, scalar_value: Callable[[torch.Tensor], object] = _default_scalar) -> None:
        super().__init__()
        self.scalar_value = scalar_value
        self.stages: list[StageMemory] = [StageMemory("start")]
        self.device_bytes = 0
        self.emulation_bytes = 0
        self.totals: Counter[str] = Counter()
        self._records: dict[int, _Record] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._kernel_depth = 0
        self._pending: list[int] = []
        self._in_step = False
        self._backward_stage: str | None = None
        self._resize = None

    # ---- stages and labels ------------------------------------------------------------------------

    @property
    def stage(self) -> StageMemory:
        return self.stages[-1]

    def start_stage(self, name: str, *, step: bool = False, backward: str | None = None, exact: bool = False) -> None:
        """Close the current stage and open ``name``; ``step``: a forward / backward stage (its
        new storages are activations in forward, and FSDP2's are filed apart); ``backward``: the
        stage to open when the autograd engine starts the backward of this forward; ``exact``:
        keep the storages live at the peak (module doc)."""
        self.stage.end_bytes = self.device_bytes
        stage = StageMemory(name, self.device_bytes, dict(self.totals), self.device_bytes, self.emulation_bytes,
                            self._live() if exact else None)
        self.stages.append(stage)
        self._in_step = step
        self._backward_stage = backward

    def label(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """File the storages of ``tensors`` (and of their inner tensors) under ``category``."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; known: {CATEGORIES}")
        for t in tensors:
            if t is None:
                continue
            for st in _storages(t):
                record = self._records.get(id(st))
                if record is None or record.category == category:
                    continue
                if record.counted:
                    self.totals[record.category] -= record.nbytes
                    self.totals[category] += record.nbytes
                record.category = category

    @contextlib.contextmanager
    def kernel(self) -> Iterator[None]:
        """Mark one kernel call: its allocations join the device account only if they outlive it."""
        self._kernel_depth += 1
        try:
            yield
        finally:
            self._kernel_depth -= 1
            if self._kernel_depth == 0:
                pending, self._pending = self._pending, []
                for key in pending:
                    record = self._records.get(key)
                    if record is not None and not record.counted:
                        record.counted = True
                        self._add(record.category, record.nbytes)
                self._check_peak()

    # ---- the mode --------------------------------------------------------------------------------

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        tracker, original = self, self._resize

        def resize_(storage, size):
            before = storage.nbytes()
            out = original(storage, size)
            tracker._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self.stage.end_bytes = self.device_bytes
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten._local_scalar_dense.default and compat.holds_no_data(args[0]):
            return self.scalar_value(args[0])
        if self._backward_stage is not None and compat.in_autograd_backward():
            self.start_stage(self._backward_stage, step=True)
        out = func(*args, **(kwargs or {}))
        for t in _tensor_leaves(out):
            if t.device.type == "meta":
                continue
            for st in _storages(t):
                self._track(st)
        return out

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _track(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._records:
            return
        nbytes = st.nbytes()
        counted = self._kernel_depth == 0
        record = _Record(nbytes, self._category_for_new(), counted)
        self._records[key] = record
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._freed(key))
        self.emulation_bytes += nbytes
        if counted:
            self._add(record.category, nbytes)
        else:
            self._pending.append(key)
        self._check_peak()

    def _category_for_new(self) -> str:
        if not self._in_step:
            return "temporaries"
        if _from_fsdp(sys._getframe(3)):
            return "FSDP2 buffers"
        return "temporaries" if compat.in_autograd_backward() else "activations"

    def _freed(self, key: int) -> None:
        record = self._records.pop(key, None)
        self._refs.pop(key, None)
        if record is None:
            return
        self.emulation_bytes -= record.nbytes
        if record.counted:
            self._add(record.category, -record.nbytes)

    def _resized(self, st: torch.UntypedStorage, before: int) -> None:
        record = self._records.get(id(st))
        if record is None:
            return
        delta = st.nbytes() - before
        record.nbytes += delta
        self.emulation_bytes += delta
        if record.counted:
            self._add(record.category, delta)
        self._check_peak()

    def _add(self, category: str, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.totals[category] += nbytes

    def _live(self) -> list:
        return [(r, r.nbytes) for r in self._records.values() if r.counted]

    def _check_peak(self) -> None:
        stage = self.stage
        if self.device_bytes > stage.peak_bytes:
            stage.peak_bytes = self.device_bytes
            stage.peak_totals = dict(self.totals)
            if stage.peak_records is not None:
                stage.peak_records = self._live()
        if self.emulation_bytes > stage.emulation_peak_bytes:
            stage.emulation_peak_bytes = self.emulation_bytes


def _from_fsdp(frame) -> bool:
    """Whether FSDP2's gather / reduce code (or te_npu's gather extension) is on the stack."""
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(name.endswith(source) for source in _FSDP_SOURCES):
            return True
        frame = frame.f_back
    return False


def _tensor_leaves(out) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for item in out:
            yield from _tensor_leaves(item)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or its inner tensors' for a wrapper subclass."""
    if compat.is_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return
