"""``QuantizedWeightTensor``: the persistent 8-bit owner of one TE weight.

A torch wrapper subclass whose *logical* shape / dtype / device are the high-precision
weight's (dense ``w: [N, K]``, grouped ``w: [E, N, K]``, usually bf16) and whose storage is
a fixed set of inner tensors declared once per subclass in ``_inner_fields``. It can be an
``nn.Parameter``: autograd sees the logical tensor, so a custom autograd Function that
reads the weight through ``select`` returns a plain ``[N, K]`` gradient for it.

The weight is derived state: it is (re)built from a high-precision master by the
quantizers (``refresh_from_master``), never by math written here. ``__torch_dispatch__``
looks each aten op up in a per-class handler table (``implements``); an op without a
handler follows Transformer Engine's ``QuantizedTensor`` fallback (``te_npu.tensor.weight_fallback``:
it runs on the dequantized values and emits an event; a view or a write raises naming it). As
in TE, ``float()`` / ``to(dtype)`` / ``cpu()`` / ``numpy()`` return high-precision values (a
device move alone, ``to(device)``, keeps the payload). The handlers here are the shape/storage
ops that ``nn.Module``, ``nn.Parameter``, state dicts, ``copy.deepcopy`` and FSDP2's dim-0
sharding send (each handler says who sends it); ``te_npu.tensor.weight_ops`` adds the listed
reads (high-precision results), in-place updates (re-quantized) and factories that ordinary
PyTorch code (``torch.optim``, ``nn.init``, ``w.norm()``) sends.

Pickling (``torch.save``) goes through one rebuild function, registered with
``torch.serialization.add_safe_globals``, so ``torch.load(f)`` (``weights_only=True``) loads
quantized state dicts; nothing else is allowlisted (the class is named by its format, the
quantizer by its fields).

Slicing is format specific (which inner tensors follow the rows or the columns, and where a
legal boundary lies); subclasses implement ``_slice_dim0`` (dim 0), ``_slice_last`` (the last
dim of a 2D weight, FSDP2's ``Shard(1)``) and ``_inner_layout`` (the inner tensors' shapes and
dtypes for a weight shape), and the shared handlers below build every split / slice / pad /
empty tensor from those. ``empty`` builds a weight with uninitialised inner tensors (on the
meta device: FSDP2 can shard it before anything is allocated; its values come from the first
``refresh_from_master``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable, ClassVar

import torch

from te_npu.compat import disabled_torch_function_impl, make_wrapper_subclass
from te_npu.formats import Format, Orientation
from te_npu.ops.operand import QuantizedOperand
from te_npu.tensor.weight_conversions import HighPrecisionConversions
from te_npu.tensor.weight_fallback import fallback

__all__ = ["QuantizedWeightTensor", "ShardAlignment", "implements", "attach_high_precision_init_val"]

aten = torch.ops.aten

Handler = Callable[[Any, tuple, dict], Any]

@dataclass(frozen=True)
class ShardAlignment:
    """Where an FSDP2 shard of a weight class may begin and end.

    rows: a dim-0 shard holds a multiple of this many rows of the weight's flattened ``[-1, K]``
    view (dense ``[N, K]``: ``N_local``; grouped ``[E, N, K]``: ``E_local * N``); 1 means any
    row. (Dim 0 itself is always split into equal parts, so a grouped weight is always split
    between whole experts.) reason: why, for the error naming a parameter that breaks it.
    cols: a shard along the last dim of a 2D weight (FSDP2 ``Shard(1)``, over K) holds a
    multiple of this many columns; None: the class cannot be sharded there. cols_reason: why.
    """

    rows: int
    reason: str
    cols: int | None = None
    cols_reason: str = ""

    def violation(self, shape: tuple[int, ...] | torch.Size, dim: int, world_size: int) -> str | None:
        """Why a ``shape`` weight cannot be split into ``world_size`` equal shards along ``dim``
        (0, or the last dim of a 2D weight) under this alignment, or None."""
        shape = list(shape)
        if dim == 0:
            rows_local = shape[0] // world_size
            flat_rows = rows_local * math.prod(shape[1:-1])
            if flat_rows % self.rows:
                what = f"(E_local={rows_local}) * D1={shape[1]}" if len(shape) == 3 else f"N_local={rows_local}"
                return f"local rows {what} = {flat_rows} is not a multiple of {self.rows} ({self.reason})"
            return None
        if len(shape) != 2 or dim != 1:
            return f"dim {dim} of a {len(shape)}D weight is not a shard dim (dim 0, or dim 1 of a 2D weight)"
        if self.cols is None:
            return f"not shardable along K ({self.cols_reason})"
        cols_local = shape[1] // world_size
        if cols_local % self.cols:
            return f"local columns K_local={cols_local} is not a multiple of {self.cols} ({self.cols_reason})"
        return None


def implements(table: dict, *ops: Any) -> Callable[[Handler], Handler]:
    """Register ``handler(func, args, kwargs)`` for each aten overload in ``ops`` into ``table``."""

    def decorator(handler: Handler) -> Handler:
        for op in ops:
            table[op] = handler
        return handler

    return decorator


class QuantizedWeightTensor(HighPrecisionConversions, torch.Tensor):
    """Base of ``MXFP8Tensor`` / ``HiF8Tensor``: logical weight metadata over 8-bit inner storage.

    Subclasses declare:
    - ``_inner_fields``: names of the inner tensors, in ``__tensor_flatten__`` order;
    - ``format``: the ``Format`` of the payload; ``quantizer_type``: its quantizer class;
    - ``shard_alignment``: the ``ShardAlignment`` FSDP2 shards must keep;
    - ``_handlers``: their own aten table (format-specific entries; looked up before the
      base table along the MRO);
    - ``_inner_layout(shape, quantizer)``, ``_fill_zero_(self)``, ``_slice_dim0(start, stop)``,
      ``_slice_last(start, stop)`` (2D only), ``_requantize_(hp)``, ``select``, ``_dequantize_weight``,
      ``refresh_from_master``, ``from_high_precision``.

    ``_quantizer`` (a frozen quantizer, not a tensor) travels in the flatten context, so every
    derived tensor (split, clone, copy) re-quantizes exactly as the original did.
    """

    _inner_fields: ClassVar[tuple[str, ...]] = ()
    _handlers: ClassVar[dict] = {}
    format: ClassVar[Format]
    quantizer_type: ClassVar[type]
    shard_alignment: ClassVar[ShardAlignment]

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> "QuantizedWeightTensor":
        raise TypeError(f"build a {cls.__name__} with {cls.__name__}.from_high_precision(...) or _make(...)")

    @classmethod
    def _make(
        cls,
        inner: dict[str, torch.Tensor],
        *,
        shape: torch.Size | tuple[int, ...],
        logical_dtype: torch.dtype,
        quantizer: Any,
        requires_grad: bool = False,
    ) -> "QuantizedWeightTensor":
        """Wrap already-quantized inner tensors (no copy); the single construction path."""
        missing = [name for name in cls._inner_fields if name not in inner]
        if missing:
            raise ValueError(f"{cls.__name__}: missing inner tensor(s) {missing}")
        first = inner[cls._inner_fields[0]]
        self = make_wrapper_subclass(cls, shape, dtype=logical_dtype, device=first.device, requires_grad=requires_grad)
        for name in cls._inner_fields:
            setattr(self, name, inner[name])
        self._quantizer = quantizer
        weight_shape = list(self.weight_shape)
        if list(shape) not in (weight_shape, [first.numel()]):
            raise ValueError(f"{cls.__name__}: logical shape {list(shape)} does not match inner shape {weight_shape}")
        self._check_inner()
        return self

    @classmethod
    def empty(
        cls,
        shape: torch.Size | tuple[int, ...],
        *,
        logical_dtype: torch.dtype,
        quantizer: Any,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
    ) -> "QuantizedWeightTensor":
        """A weight of logical ``shape`` whose inner tensors are allocated but not written (on
        ``meta``: not allocated at all). Its values come from ``refresh_from_master``: how a model
        built on the meta device gets 8-bit weights that FSDP2 shards before any memory exists."""
        inner = {name: torch.empty(inner_shape, dtype=dtype, device=device)
                 for name, (inner_shape, dtype) in cls._inner_layout(tuple(shape), quantizer).items()}
        return cls._make(inner, shape=shape, logical_dtype=logical_dtype, quantizer=quantizer,
                         requires_grad=requires_grad)

    @property
    def weight_shape(self) -> torch.Size:
        """Shape of the weight, read off the first inner tensor.

        Equals ``shape`` except on the flat view FSDP2 takes (``view(-1)``), which only
        supports metadata ops and can be viewed back to ``weight_shape``.
        """
        return getattr(self, self._inner_fields[0]).shape

    def _require_weight_shape(self, what: Any) -> None:
        if self.shape != self.weight_shape:
            raise NotImplementedError(
                f"{type(self).__name__} flat view {list(self.shape)} of a {list(self.weight_shape)} weight "
                f"does not support {what}; view it back to {list(self.weight_shape)} first"
            )

    def _check_inner(self) -> None:
        """Raise ``ValueError`` when inner shapes/dtypes do not fit ``weight_shape``."""

    # ---- public accessors (FSDP2 extension, optimizer, sharding) ---------------------------------

    @property
    def quantizer(self) -> Any:
        """The frozen quantizer this weight is (re)quantized with."""
        return self._quantizer

    @classmethod
    def inner_field_names(cls) -> tuple[str, ...]:
        """Names of the inner tensors (attributes of every instance), in ``__tensor_flatten__`` order."""
        return cls._inner_fields

    def rewrap(self, inner: dict[str, torch.Tensor], *, shape: tuple[int, ...] | torch.Size | None = None,
               logical_dtype: torch.dtype | None = None) -> "QuantizedWeightTensor":
        """This class and quantizer over other inner tensors (no copy), e.g. all-gathered shards;
        ``shape`` / ``logical_dtype`` default to this weight's."""
        return type(self)._make(
            inner,
            shape=self.shape if shape is None else shape,
            logical_dtype=logical_dtype or self.dtype,
            quantizer=self._quantizer,
        )

    def shared_scale_amax(self, master_shard: torch.Tensor) -> torch.Tensor | None:
        """This shard's FP32 amax toward a scale every shard of the weight shares (HiF8 dense: one
        scalar for the whole weight), or None when no scale spans shards (MXFP8 blocks, HiF8
        per-expert scales). The MAX of it over the shards is the ``amax`` that
        ``refresh_from_master`` takes."""
        return None

    def refresh_from_master(self, master_shard: torch.Tensor, *, amax: torch.Tensor | None = None) -> None:
        """Re-quantize from ``master_shard`` (the FP32 master of this shard, same shape) into the
        existing storage (the optimizer's per-step refresh).

        ``amax``: the whole weight's FP32 amax for a shared scale (the MAX over every shard's
        ``shared_scale_amax``), so every shard quantizes with the scale of the full weight; None:
        this shard is the whole weight (the amax is its own). A format with no shared scale
        refuses one.
        """
        raise NotImplementedError

    # ---- subclass hooks -------------------------------------------------------------------------

    @classmethod
    def _inner_layout(cls, shape: tuple[int, ...], quantizer: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{inner field: (shape, dtype)}`` of a weight of logical ``shape`` (``_inner_fields`` order)."""
        raise NotImplementedError

    def _fill_zero_(self) -> None:
        """Write, in place, the payload of quantizing zeros."""
        raise NotImplementedError

    def _slice_dim0(self, start: int, stop: int) -> "QuantizedWeightTensor":
        """Rows ``[start, stop)`` along dim 0 as a view of the same storage."""
        raise NotImplementedError

    def _slice_last(self, start: int, stop: int) -> "QuantizedWeightTensor":
        """Columns ``[start, stop)`` of a 2D weight ``[N, K]`` (along K) as a view of the same storage."""
        raise NotImplementedError

    def _slice(self, dim: int, start: int, stop: int) -> "QuantizedWeightTensor":
        """``[start, stop)`` along ``dim``: dim 0, or the last dim of a 2D weight."""
        dim %= self.dim()
        if dim == 0:
            return self._slice_dim0(start, stop)
        if self.dim() == 2 and dim == 1:
            return self._slice_last(start, stop)
        raise NotImplementedError(
            f"{type(self).__name__} {list(self.shape)} cannot be sliced along dim {dim}; only dim 0 "
            "(and dim 1 of a 2D weight) are supported"
        )

    def _zeros(self, shape: tuple[int, ...] | list[int], device: torch.device | str | None = None
               ) -> "QuantizedWeightTensor":
        """A new weight of ``shape`` (same class, quantizer, logical dtype), equal to quantizing zeros."""
        out = type(self).empty(tuple(shape), logical_dtype=self.dtype, quantizer=self._quantizer,
                               device=self.device if device is None else device)
        out._fill_zero_()
        return out

    def _zeros_like_rows(self, rows: int) -> "QuantizedWeightTensor":
        """A new tensor with ``rows`` along dim 0, equal to quantizing zeros."""
        return self._zeros([rows, *self.shape[1:]])

    def _requantize_(self, high_precision: torch.Tensor) -> None:
        """Quantize ``high_precision`` (same shape) and copy into the existing storage."""
        raise NotImplementedError

    def select(self, orientation: Orientation) -> QuantizedOperand:  # type: ignore[override]
        """The stored payload for one GEMM orientation, as an operand (no copy)."""
        raise NotImplementedError

    def _dequantize_weight(self, dtype: torch.dtype | None) -> torch.Tensor:
        """High-precision value of a weight of ``weight_shape`` (logical dtype unless ``dtype``)."""
        raise NotImplementedError

    def _values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dequantize`` without the autograd node (the aten handlers run below autograd)."""
        if self.shape != self.weight_shape:
            return self.rewrap(self._inner(), shape=self.weight_shape)._dequantize_weight(dtype).reshape(self.shape)
        return self._dequantize_weight(dtype)

    # ---- shared machinery -----------------------------------------------------------------------

    def _inner(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._inner_fields}

    def _rewrap(self, inner: dict[str, torch.Tensor], shape: tuple[int, ...] | torch.Size | None = None):
        """Same class / logical dtype / quantizer over new inner tensors."""
        return self.rewrap(inner, shape=shape)

    def _map_inner(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        return self._rewrap({name: fn(t) for name, t in self._inner().items()})

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return list(self._inner_fields), {"logical_dtype": self.dtype, "quantizer": self._quantizer}

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        return cls._make(
            dict(inner_tensors), shape=outer_size, logical_dtype=ctx["logical_dtype"], quantizer=ctx["quantizer"]
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # never reads data
        inner = ", ".join(f"{name}={getattr(self, name).dtype}{list(getattr(self, name).shape)}" for name in self._inner_fields)
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"{type(self).__name__}(format={self.format.value}, shape={list(self.shape)}, "
            f"logical_dtype={self.dtype}, device={self.device}, {inner}{grad})"
        )

    __torch_function__ = disabled_torch_function_impl

    # ``param.data = t`` (``nn.utils.vector_to_parameters``, EMA swaps through ``.data``): as TE's
    # float8 tensors do, the weight takes ``t``'s values in its own format instead of silently
    # keeping its payload. Reading ``.data`` is torch's detached alias, as for any tensor.
    def _get_data(self) -> "QuantizedWeightTensor":
        return torch.Tensor.data.__get__(self)

    def _set_data(self, value: torch.Tensor) -> None:
        """Re-point this weight at ``value``: a weight of this class is aliased (its payload and
        quantizer, as TE does); a high-precision tensor (or a weight of another format, through its
        values) is quantized with this weight's quantizer. The logical shape, dtype and device
        follow ``value`` as they would for a plain tensor; ``requires_grad`` stays (PyTorch's
        rule for ``param.data =``)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.data must be set to a tensor, got {type(value).__name__}")
        if type(value) is not type(self):
            if isinstance(value, QuantizedWeightTensor):
                value = value.dequantize()
            value = type(self).from_high_precision(value.detach(), self._quantizer)
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            torch.Tensor.data.__set__(self, value.detach())  # the wrapper's metadata only
        for name in self._inner_fields:
            setattr(self, name, getattr(value, name))
        self._quantizer = value._quantizer

    data = property(_get_data, _set_data)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = next((k.__dict__["_handlers"][func] for k in cls.__mro__ if func in k.__dict__.get("_handlers", ())), None)
        if handler is None:  # TE's fallback: dequantize; views and writes raise (weight_fallback)
            return fallback(QuantizedWeightTensor, cls, func, args, kwargs or {})
        return handler(func, args, kwargs or {})

    # Pickling (torch.save of a module / state dict): rebuild from the inner tensors. Only plain
    # values travel (the format's name, the quantizer's fields), so the rebuild function is the
    # one global ``torch.load(weights_only=True)`` must allow.
    def __reduce_ex__(self, protocol: int):
        quantizer_fields = {f.name: getattr(self._quantizer, f.name) for f in dataclasses.fields(self._quantizer)}
        return (
            _rebuild_quantized_weight,
            (
                self.format.value,
                self._inner(),
                tuple(self.shape),
                self.dtype,
                quantizer_fields,
                self.requires_grad,
                getattr(self, "_is_param", False),
            ),
        )


def _rebuild_quantized_weight(format_name, inner, shape, logical_dtype, quantizer_fields, requires_grad, is_param):
    """Unpickle a quantized weight (``torch.load``, also with ``weights_only=True``); restores
    ``nn.Parameter``-ness."""
    classes = {c.format.value: c for c in QuantizedWeightTensor.__subclasses__()}
    if format_name not in classes:
        raise ValueError(f"cannot load a quantized weight of format {format_name!r}; known: {sorted(classes)}")
    cls = classes[format_name]
    tensor = cls._make(inner, shape=shape, logical_dtype=logical_dtype, quantizer=cls.quantizer_type(**quantizer_fields),
                       requires_grad=requires_grad)
    if is_param:
        tensor._is_param = True
    return tensor


torch.serialization.add_safe_globals([_rebuild_quantized_weight])


# ---- TE's preserve_high_precision_init_val ---------------------------------------------------------


def _get_high_precision_init_val(param: torch.Tensor) -> torch.Tensor | None:
    return getattr(param, "_high_precision_init_val", None)


def _clear_high_precision_init_val(param: torch.Tensor) -> None:
    if hasattr(param, "_high_precision_init_val"):
        del param._high_precision_init_val


def attach_high_precision_init_val(param: torch.Tensor, value: torch.Tensor) -> None:
    """Keep ``value`` (the high-precision initial weight, on the CPU) on ``param`` behind TE's
    ``param.get_high_precision_init_val()`` / ``param.clear_high_precision_init_val()``.

    As in TE, the two methods exist only on parameters that preserved a value (Megatron tests
    ``hasattr(param, "get_high_precision_init_val")``); ``clear`` frees the CPU copy.
    """
    param._high_precision_init_val = value
    param.get_high_precision_init_val = MethodType(_get_high_precision_init_val, param)
    param.clear_high_precision_init_val = MethodType(_clear_high_precision_init_val, param)


# ---- shared aten handlers ----------------------------------------------------------------------
_table = QuantizedWeightTensor._handlers


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of an aten call by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _slice_dim(dim: int, ndim: int, func: Any, cls_name: str) -> int:
    """``dim`` normalised; dim 0, or dim 1 of a 2D weight (FSDP2 ``Shard(0)`` / ``Shard(1)``)."""
    dim %= ndim
    if dim != 0 and not (ndim == 2 and dim == 1):
        raise NotImplementedError(
            f"{cls_name} does not support {func} along dim {dim}; only dim 0 (and dim 1 of a 2D weight) are supported"
        )
    return dim


@implements(_table, aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    # nn.Parameter(t) (detach), state_dict() (detach), module.to()/Parameter re-wrapping.
    return args[0]._map_inner(func)


@implements(_table, aten.view.default, aten._unsafe_view.default)
def _view(func, args, kwargs):
    # Same-shape views (autograd / nn.Module no-ops) and the flat view FSDP2's
    # _init_sharded_param takes (`_sharded_param_data = padded.view(-1)`, stored and never
    # read when the extension hooks exist). A flat view keeps the inner tensors unchanged;
    # it can be viewed back to the weight shape but not sliced, selected or dequantized.
    self, size = args[0], _fill(list(args[1]), args[0].numel())
    if size in (list(self.weight_shape), [self.numel()]):
        return self._rewrap({n: t.view(t.shape) for n, t in self._inner().items()}, shape=size)
    raise NotImplementedError(f"{type(self).__name__} does not support {func} to {list(args[1])} from {list(self.shape)}")


def _fill(size: list[int], numel: int) -> list[int]:
    """Resolve one ``-1`` in a view size."""
    known = 1
    for s in size:
        if s != -1:
            known *= s
    return [numel // known if s == -1 else s for s in size] if known else size


@implements(_table, aten.as_strided.default)
def _as_strided(func, args, kwargs):
    # FSDP2 init_unsharded_param: as_strided(post_all_gather output, orig size, contiguous
    # stride, 0) -- an identity view; anything else is refused.
    call = _bind(func, args, kwargs)
    self, size, stride, offset = call["self"], list(call["size"]), list(call["stride"]), call["storage_offset"]
    if size == list(self.shape) and stride == list(self.stride()) and not offset:
        return self._map_inner(lambda t: t.view(t.shape))
    raise NotImplementedError(f"{type(self).__name__} does not support {func} with size={size} stride={stride}")


@implements(_table, aten.split.Tensor)
def _split(func, args, kwargs):
    # torch.chunk / torch.split along dim 0 or dim 1 of a 2D weight: FSDP2 _chunk_with_empty
    # when sharding with Shard(0) / Shard(1).
    call = _bind(func, args, kwargs)
    self, split_size, dim = call["self"], call["split_size"], call["dim"]
    self._require_weight_shape(func)
    dim = _slice_dim(dim, self.dim(), func, type(self).__name__)
    length = self.shape[dim]
    return [self._slice(dim, s, min(s + split_size, length)) for s in range(0, length, split_size)] or [
        self._slice(dim, 0, 0)
    ]


@implements(_table, aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    # torch.split(t, [sizes]) along dim 0 (or dim 1 of a 2D weight): FSDP2 uneven chunking, user code.
    call = _bind(func, args, kwargs)
    self, sizes, dim = call["self"], list(call["split_sizes"]), call["dim"]
    self._require_weight_shape(func)
    dim = _slice_dim(dim, self.dim(), func, type(self).__name__)
    if sum(sizes) != self.shape[dim]:
        raise ValueError(f"split sizes {sizes} do not sum to dim {dim} = {self.shape[dim]} of {list(self.shape)}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [self._slice(dim, s, s + n) for s, n in zip(starts, sizes)]


@implements(_table, aten.slice.Tensor)
def _slice(func, args, kwargs):
    # t.narrow(dim, start, length) / t[a:b]: FSDP2 copies a shard into its padded buffer.
    call = _bind(func, args, kwargs)
    self, dim, start, end, step = (call[k] for k in ("self", "dim", "start", "end", "step"))
    if self.shape != self.weight_shape and step == 1 and slice(start, end).indices(self.numel())[:2] == (0, self.numel()):
        # the whole flat view (DDP's broadcast bucket of one parameter: flat.narrow(0, 0, numel))
        return self._rewrap({n: t.view(t.shape) for n, t in self._inner().items()}, shape=self.shape)
    self._require_weight_shape(func)
    dim = _slice_dim(dim, self.dim(), func, type(self).__name__)
    if step != 1:
        raise NotImplementedError(f"{type(self).__name__} does not support {func} with step {step}")
    start, stop = slice(start, end).indices(self.shape[dim])[:2]
    return self._slice(dim, start, max(start, stop))


@implements(_table, aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    # FSDP2 pads the local shard into param.new_zeros(padded_sharded_size): same rank, any
    # sizes the class can hold (a dim-0 shard's rows, a Shard(1) shard's columns).
    self, size = args[0], list(args[1])
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        raise NotImplementedError(f"{type(self).__name__} does not support {func} with dtype {dtype}")
    if len(size) != self.dim():
        raise NotImplementedError(
            f"{type(self).__name__} does not support {func} to {size}: a {self.dim()}D weight stays {self.dim()}D"
        )
    self._require_weight_shape(func)
    return self._zeros(size, kwargs.get("device"))


@implements(_table, aten.empty_like.default)
def _empty_like(func, args, kwargs):
    # torch.empty_like(param[, device=]): optimizer / checkpoint helpers and nn.Module.to_empty
    # (a meta-built, FSDP2-sharded weight allocated on its device); zero-filled for determinism.
    self = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != self.dtype:
        raise NotImplementedError(f"{type(self).__name__} does not support {func} with dtype {dtype}")
    self._require_weight_shape(func)
    return self._zeros(list(self.shape), kwargs.get("device"))


@implements(_table, aten.copy_.default)
def _copy_(func, args, kwargs):
    # load_state_dict in every direction, through the logical values: high-precision src ->
    # re-quantize; same-class src -> copy every inner tensor (also FSDP2 shard padding,
    # model.to(...) swaps); other-format src -> its values re-quantized; high-precision dst <-
    # quantized src -> the dequantized values.
    dst, src = args[0], args[1]
    if list(src.shape) != list(dst.shape):
        raise ValueError(f"copy_: shape {list(src.shape)} does not match {type(dst).__name__} {list(dst.shape)}")
    if not isinstance(dst, QuantizedWeightTensor):
        return dst.copy_(src._values(dst.dtype if dst.is_floating_point() else None))
    if type(src) is type(dst):
        for name in dst._inner_fields:
            getattr(dst, name).copy_(getattr(src, name))
        return dst
    dst._require_weight_shape(func)
    if isinstance(src, QuantizedWeightTensor):
        src._require_weight_shape(func)
        src = src.dequantize()
    dst._requantize_(src.to(dst.device))
    return dst


@implements(_table, aten.clone.default)
def _clone(func, args, kwargs):
    # copy.deepcopy(module) (Tensor.__deepcopy__ clones wrapper subclasses), user clones.
    fmt = kwargs.get("memory_format")
    if fmt not in (None, torch.preserve_format, torch.contiguous_format):
        raise NotImplementedError(f"{type(args[0]).__name__} does not support {func} with memory_format={fmt}")
    return args[0]._map_inner(lambda t: t.clone())


@implements(_table, aten._to_copy.default)
def _to_copy(func, args, kwargs):
    # module.to(device) / t.to(device) / FSDP2 CPU offload: device moves keep the subclass.
    # A dtype change (t.float(), t.to(torch.bfloat16) of an fp32 weight, module.to(dtype)) is a
    # read: the dequantized values in that dtype, a plain tensor.
    self = args[0]
    dtype = kwargs.get("dtype")
    move = {k: kwargs[k] for k in ("device", "non_blocking") if kwargs.get(k) is not None}
    if dtype is not None and dtype != self.dtype:
        self._require_weight_shape(func)
        return self._values(dtype).to(**move)
    pin = kwargs.get("pin_memory")
    out = self._map_inner(lambda t: t.to(copy=True, **move))
    return out._map_inner(lambda t: t.pin_memory()) if pin else out


@implements(_table, aten.zero_.default)
def _zero_(func, args, kwargs):
    # module.zero_() style re-initialisation: the weight becomes quantize(zeros) in place.
    self = args[0]
    self._require_weight_shape(func)
    self._fill_zero_()
    return self


@implements(_table, aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    # autograd / optimizers compare a parameter's size with a gradient's.
    return list(args[0].shape) == list(args[1].shape)


@implements(_table, aten.equal.default)
def _equal(func, args, kwargs):
    # torch.equal(a, b): tests and state-dict comparisons; equal payloads, not values.
    a, b = args
    return type(a) is type(b) and a.shape == b.shape and all(
        torch.equal(getattr(a, n), getattr(b, n)) for n in a._inner_fields
    )
