"""FSDP2 all-gather extension for quantized weights (docs/fsdp2.md).

FSDP2 calls two methods on the *local shard* of a parameter whose class defines them
(torch ``_fully_shard/_fsdp_param.py``, checked against torch 2.13):

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` from
  ``FSDPParam.all_gather_inputs`` -> ``(tensors, metadata)``. Each tensor is flattened and
  all-gathered along dim 0; a mix of dtypes is gathered as uint8 bytes.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` from
  ``FSDPParam.init_unsharded_param``. ``outputs[i]`` is the world-size concatenation of
  ``tensors[i]`` (rank-major, viewed as ``[-1, *shape[1:]]``). The first call (``out is
  None``) returns ``(unsharded, tensors_to_free)``; later calls pass the same unsharded
  parameter as ``out`` and it is refilled in place (the autograd graph of the forward holds
  that object, so it must never be replaced).

This module holds the format-free protocol -- ``FSDPGatherContext`` (declared in
``te_npu.events`` next to ``FSDPGatherEvent``, which every pre-all-gather emits when somebody
subscribes) and ``GatherSchema`` -- and the schema of each format. The tensor classes import
nothing from here:
``install_fsdp_extension(cls, schema)`` attaches the two methods (``te_npu.distributed``
does it on import).

Phase. FSDP2 does not pass the phase; it is read from FSDP2's own state, as Transformer
Engine's FSDP2 support reads it (through ``te_npu.compat``, which holds every FSDP2 internal
used here): the parameter's group unsharding in state ``PRE_BACKWARD`` (its pre-backward
unshard, a backward prefetch) is ``"backward"``, and so is an unshard while the autograd engine
runs a backward (a module sharded on its own inside a region that activation checkpointing
replays in backward: FSDP2 itself tells that case by the same test and keeps the weight
unsharded for the backward that follows); anything else (forward, forward prefetch, an
explicit ``unshard()``) is ``"forward"``. ``reshard_after_forward`` and ``param_fqn`` come
from the same state. ``module`` (what FSDP2 passes) is the module registering the parameter;
the unit managing it may be that module or any ancestor (a decoder layer). A parameter no
FSDP2 unit manages gathers its full schema (backward phase).

Schema changes between phases. FSDP2 allocates a parameter's all-gather output buffers once,
sized by the first gather, so a gather with other tensors (MXFP8 dense,
``reshard_after_forward=True``: row in forward, row + col in backward) first has them dropped
(``compat.fit_all_gather_outputs``); the post then rebinds the unsharded tensor's inner fields
to the new outputs and hands them to FSDP as the tensors to free at reshard
(``compat.set_unsharded_inner_tensors``). A field not gathered in this phase is a
*storage-free placeholder* of the right shape, so ``select()`` on it raises instead of reading
stale bytes.

Shard dims. A parameter sharded on dim 1 (``Shard(1)``, over K; ``sharding.py`` picks it where
dim 0 breaks the format's alignment) is gathered the same way, but FSDP2 copies a non-dim-0
gather out with one chunk-cat per gathered tensor, viewing each as the parameter's shard shape
``[N, K/W]`` (torch ``foreach_all_gather_copy_out``): only inner tensors with the shard's element
count fit (the 8-bit data). The others (MXFP8's block scales, 1/32 of the bytes) are gathered
*alongside*, by the extension itself: one all-gather of their bytes, concatenated along dim 1
into the full scales and kept on the shard until one of them is written again (their version
counters: the optimizer's refresh), so a K-sharded weight sends its scales once per optimizer
step, not once per gather. ``GatherSchema.shard_dims`` says which dims a format's gather takes.

Shape legend: ``W`` = FSDP world size, ``N_local`` = local rows, ``E_local`` = local experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from te_npu import compat, events
from te_npu.events import FSDPGatherContext
from te_npu.tensor import QuantizedWeightTensor

__all__ = [
    "FSDPGatherContext",
    "GatherSchema",
    "MXFP8GatherSchema",
    "HiF8GatherSchema",
    "install_fsdp_extension",
    "gather_schema_of",
    "is_materialized",
]

class GatherSchema(Protocol):
    """Per-format choice and reassembly of the physical tensors of one all-gather."""

    def shard_dims(self, ndim: int) -> tuple[int, ...]:
        """The dims a weight of ``ndim`` dims may be sharded on (and so gathered along)."""
        ...

    def fields(self, shard: QuantizedWeightTensor, context: FSDPGatherContext) -> tuple[str, ...]:
        """Inner-field names to gather, in order (a subset of ``shard.inner_field_names()``)."""
        ...

    def assemble(
        self, field: str, gathered: torch.Tensor, world_size: int, logical_shape: torch.Size, context: FSDPGatherContext
    ) -> torch.Tensor:
        """The unsharded inner tensor of ``field`` from its gathered output (usually itself)."""
        ...


# ---- schemas of the two formats -----------------------------------------------------------------


class MXFP8GatherSchema:
    """MXFP8 (our orientation names; docs/fsdp2.md).

    =========  =======================  ===========  ===========
    phase      reshard_after_forward    dense        grouped
    =========  =======================  ===========  ===========
    forward    True                     row          row
    forward    False                    row + col    row + col
    backward   any                      row + col    row + col
    =========  =======================  ===========  ===========

    Grouped forward reads the K-blocked copy, which this project calls ``row`` (weights are
    ``[E, N, K]`` like dense ones); Ascend's naming calls that copy ``col`` because the NPU
    kernel views the weight as ``[E, K, N]``. Same bytes, different name.
    """

    _ROW = ("row_data", "row_scale")
    _BOTH = ("row_data", "row_scale", "col_data", "col_scale")

    def shard_dims(self, ndim: int) -> tuple[int, ...]:
        # dense [N, K] also along K: every inner tensor splits on its last dim (module doc)
        return (0, 1) if ndim == 2 else (0,)

    def fields(self, shard: QuantizedWeightTensor, context: FSDPGatherContext) -> tuple[str, ...]:
        if context.phase == "forward" and context.reshard_after_forward:
            return self._ROW
        return self._BOTH

    def assemble(self, field, gathered, world_size, logical_shape, context):
        return gathered


class HiF8GatherSchema:
    """HiF8: data + scale in every phase, one copy serves row and col.

    Dense ``[N, K]``: every rank holds the same scalar scale (the optimizer MAX-reduces the
    amax before refreshing), so the gather returns ``W`` copies; they must all be equal and
    fold to one scalar. Grouped ``[E, N, K]``: ``scale[E_local]`` shards gather to ``scale[E]``
    in expert order, next to whole experts of data.
    """

    def shard_dims(self, ndim: int) -> tuple[int, ...]:
        # dim 0 only: the dense scalar scale is gathered replicated (and checked), which FSDP2's
        # dim-1 copy-out cannot carry; every shipped HiF8 weight shards on dim 0 up to W = 64
        return (0,)

    def fields(self, shard: QuantizedWeightTensor, context: FSDPGatherContext) -> tuple[str, ...]:
        return shard.inner_field_names()  # the codes and the scale

    def assemble(self, field, gathered, world_size, logical_shape, context):
        if field != "scale" or len(logical_shape) == 3:
            return gathered
        # gathered: [W] copies of the replicated scalar scale.
        if not bool(torch.all(gathered == gathered[0])):
            raise RuntimeError(
                f"FSDP all-gather of HiF8 weight {context.param_fqn!r} {list(logical_shape)}: the "
                f"{world_size} ranks hold different scalar scales {gathered.tolist()}; a dense HiF8 "
                "weight must be refreshed with one FSDP-group scale (refresh_low_precision_weights)"
            )
        return gathered[0]  # a 0-d view: freed with the gather buffer


_SCHEMAS: dict[type, GatherSchema] = {}


def gather_schema_of(cls: type) -> GatherSchema:
    """The schema installed for a quantized weight class."""
    for klass in cls.__mro__:
        if klass in _SCHEMAS:
            return _SCHEMAS[klass]
    raise TypeError(f"{cls.__name__} has no FSDP gather schema; call install_fsdp_extension({cls.__name__}, schema)")


def install_fsdp_extension(cls: type, schema: GatherSchema) -> None:
    """Give ``cls`` FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, gathering per ``schema``."""
    if not issubclass(cls, QuantizedWeightTensor):
        raise TypeError(f"install_fsdp_extension: {cls.__name__} is not a QuantizedWeightTensor")
    _SCHEMAS[cls] = schema
    cls.fsdp_pre_all_gather = _fsdp_pre_all_gather
    cls.fsdp_post_all_gather = _fsdp_post_all_gather
    cls._gathered_alongside = _gathered_alongside


# ---- the two FSDP2 hooks --------------------------------------------------------------------------


@dataclass(frozen=True)
class _GatherMetadata:
    context: FSDPGatherContext
    fields: tuple[str, ...]
    local_shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    world_size: int
    logical_shape: torch.Size
    fsdp_param: compat.FSDPParamInfo | None = None
    alongside: dict[str, torch.Tensor] | None = None  # full tensors gathered by the extension (dim 1)
    field_dtypes: tuple[torch.dtype, ...] = ()  # each field's own dtype (float8 is sent as uint8)


def _fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """FSDP2 hook on the local shard: the physical tensors of this phase plus metadata."""
    info = compat.fsdp_param_info(self, module)
    context = _context(info)
    wanted = gather_schema_of(type(self)).fields(self, context)
    world_size = mesh.size()
    if context.shard_dim == 0:
        fields, beside = wanted, ()
    else:  # FSDP2's dim-1 copy-out takes only tensors shaped like the shard (module doc)
        fits = {n for n in self.inner_field_names() if getattr(self, n).numel() == self.numel()}
        fields = tuple(n for n in wanted if n in fits)
        beside = tuple(n for n in wanted if n not in fits)
    alongside, sent = None, 0
    if beside:  # every field that does not fit, in one gather, kept until written (any phase reuses it)
        kept, sent = self._gathered_alongside(tuple(n for n in self.inner_field_names() if n not in fits), mesh,
                                              context.shard_dim)
        alongside = {n: kept[n] for n in beside}
    # float8 travels as its bytes: one all-gather dtype FSDP2 and every backend (gloo too) takes
    tensors = tuple(_as_bytes(getattr(self, name)) for name in fields)
    if info is not None:
        compat.fit_all_gather_outputs(info, tensors, world_size)  # FSDP reallocates for another schema
    metadata = _GatherMetadata(
        context, fields, tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors), world_size,
        torch.Size(outer_size), info, alongside, tuple(getattr(self, name).dtype for name in fields),
    )
    if events.has_subscribers(events.FSDPGatherEvent):
        local_bytes = sum(t.numel() * t.element_size() for t in tensors) + sent
        events.emit(events.FSDPGatherEvent(
            context, self.format.value, fields + (beside if sent else ()), local_bytes, local_bytes * world_size,
            torch.Size(outer_size).numel(),
        ))
    return tensors, metadata


def _gathered_alongside(self, names: tuple[str, ...], mesh, dim: int) -> tuple[dict[str, torch.Tensor], int]:
    """The full tensors of ``names`` (inner fields of this dim-``dim`` shard), all-gathered in
    one collective of their bytes and kept on the shard until any of them is written again;
    returns them and the bytes this rank sent (0 when the kept ones are current)."""
    locals_ = [getattr(self, n) for n in names]
    key = tuple((id(t), compat.version_counter(t)) for t in locals_)
    kept = getattr(self, "_fsdp_gathered_alongside", None)
    if kept is not None and kept[0] == key:
        return kept[1], 0
    world = mesh.size()
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in locals_])
    gathered = flat.new_empty((world, flat.numel()))
    dist.all_gather_single(gathered.view(-1), flat, group=mesh.get_group())
    full, offset = {}, 0
    for name, t in zip(names, locals_):
        nbytes = t.numel() * t.element_size()
        pieces = gathered[:, offset: offset + nbytes].contiguous().view(t.dtype).view(world, *t.shape)
        full[name] = torch.cat(pieces.unbind(0), dim=dim)
        offset += nbytes
    self._fsdp_gathered_alongside = (key, full)
    return full, flat.numel()


def _fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    """FSDP2 hook: validate the gathered tensors and build (or refill ``out`` with) the full weight."""
    _validate_outputs(type(self).__name__, outputs, metadata)
    schema = gather_schema_of(type(self))
    ctx = metadata.context
    if metadata.field_dtypes:
        outputs = tuple(g if g.dtype == d else g.view(d) for g, d in zip(outputs, metadata.field_dtypes))
    if ctx.shard_dim != 0:  # FSDP2 chunk-catted each output along the dim: the full tensor, flat
        outputs = tuple(g.view(_full_shape(shape, ctx.shard_dim, metadata.world_size))
                        for g, shape in zip(outputs, metadata.local_shapes))
    inner = {
        name: schema.assemble(name, gathered, metadata.world_size, metadata.logical_shape, ctx)
        for name, gathered in zip(metadata.fields, outputs)
    }
    inner.update(metadata.alongside or {})
    if out is not None:
        for name in self.inner_field_names():
            value = inner.get(name)
            setattr(out, name, value if value is not None else _placeholder_like(getattr(out, name)))
        if metadata.fsdp_param is not None:
            compat.set_unsharded_inner_tensors(metadata.fsdp_param, list(outputs))
        return None
    for name in self.inner_field_names():
        if name not in inner:
            inner[name] = _full_shape_of(self, name, metadata)
    unsharded = self.rewrap(inner, shape=metadata.logical_shape, logical_dtype=param_dtype or self.dtype)
    return unsharded, list(outputs)


def is_materialized(t: torch.Tensor) -> bool:
    """False for a storage-free placeholder (a field this gather did not bring)."""
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


# ---- helpers -------------------------------------------------------------------------------------


def _context(info: compat.FSDPParamInfo | None) -> FSDPGatherContext:
    if info is None:  # unknown FSDP layout: gather everything
        return FSDPGatherContext("backward", False, "<unknown>")
    backward = info.group_unsharding_for_backward or compat.in_autograd_backward()
    return FSDPGatherContext(
        phase="backward" if backward else "forward",
        reshard_after_forward=info.reshard_after_forward,
        param_fqn=info.param_fqn,
        shard_dim=info.shard_dim,
    )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as its uint8 codes (same storage); anything else as it is."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def _full_shape(local_shape: torch.Size, dim: int, world_size: int) -> tuple[int, ...]:
    """The unsharded shape of an inner tensor of ``local_shape`` sharded ``world_size`` ways on ``dim``."""
    if not len(local_shape):
        return tuple(local_shape)
    full = list(local_shape)
    full[dim] *= world_size
    return tuple(full)


def _validate_outputs(cls_name: str, outputs: tuple, metadata: _GatherMetadata) -> None:
    where = f"{cls_name} {metadata.context.param_fqn!r}"
    if len(outputs) != len(metadata.fields):
        raise RuntimeError(f"FSDP all-gather of {where}: got {len(outputs)} tensors, expected {list(metadata.fields)}")
    for i, (name, gathered, local_shape, dtype) in enumerate(
        zip(metadata.fields, outputs, metadata.local_shapes, metadata.dtypes)
    ):
        rows = local_shape[0] if len(local_shape) else 1
        want = [rows * metadata.world_size, *local_shape[1:]]
        if gathered.dtype != dtype or list(gathered.shape) != want:
            raise RuntimeError(
                f"FSDP all-gather of {where}: tensor {i} ({name}) is {gathered.dtype}{list(gathered.shape)}, "
                f"expected {dtype}{want} (order {list(metadata.fields)})"
            )


def _full_shape_of(shard: QuantizedWeightTensor, name: str, metadata: _GatherMetadata) -> torch.Tensor:
    """A storage-free tensor with the unsharded shape of ``shard``'s field ``name``."""
    local = getattr(shard, name)
    return _placeholder(_full_shape(local.shape, metadata.context.shard_dim, metadata.world_size), local.dtype,
                        local.device)


def _placeholder_like(t: torch.Tensor) -> torch.Tensor:
    return _placeholder(t.shape, t.dtype, t.device)


def _placeholder(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` with no storage: reading it raises, ``select`` refuses it."""
    placeholder = torch.empty(shape, dtype=dtype, device=device)
    placeholder.untyped_storage().resize_(0)
    return placeholder
