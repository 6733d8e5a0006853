"""Every private PyTorch name te_npu touches, behind one small function each (checked on torch 2.13).

PyTorch has no public API for these. Keeping them here means a torch upgrade that moves one
breaks in one file, and ``tests/unit/test_compat.py`` (pinned to ``TESTED_TORCH``) imports or
reads each name below and fails, naming it, when it is gone. Nothing else in ``te_npu`` writes
``torch._C`` (a test greps for it) or reaches into FSDP2's internals.

=========================================================  =========================================
private name                                               used for
=========================================================  =========================================
``torch._C._current_graph_task_id``                        is the autograd engine running a backward
                                                           (activation recompute; autocast entries)
``torch._C._disabled_torch_function_impl``                 quantized weights opt out of
                                                           ``__torch_function__`` (dispatch only)
``torch.Tensor._make_wrapper_subclass``                    the quantized weight wrapper tensor
``torch._grouped_mm``                                      high-precision grouped GEMM (the BF16 path)
``torch.utils._pytree.tree_map``                           map over an aten call's nested arguments
``torch.autograd._profiler_enabled``                       is a profiler recording (te_npu's op ranges
                                                           open only then)
``torch.utils.cpp_extension._get_build_directory``         where torch builds the native kernels
                                                           (their build turn's lock lives there)
``torch._dynamo.config`` recompile limits                  compiled codecs: one graph per shape
``torch.utils._python_dispatch.TorchDispatchMode``          the host-sync counter (``te_npu.testing``),
                                                           the capacity estimate's memory tracker
``torch.utils._python_dispatch``
``.is_traceable_wrapper_subclass``                         the storages behind a DTensor / quantized weight
``torch._subclasses.fake_tensor.FakeTensorMode``           the capacity estimate: tensors without memory
``torch._subclasses.fake_tensor.is_fake``                  a tensor without values (MoE routing counts)
``torch._subclasses.fake_tensor.unset_fake_temporarily``   DTensor shard offsets inside the estimate
``torch.testing._internal.distributed.fake_pg.FakeStore``  its fake process group (registers "fake")
``torch.distributed.distributed_c10d._get_default_store``  the job's store (cross-rank failure flags)
``torch.distributed.checkpoint._consolidate_hf_safetensors``
``._consolidate_safetensors_files``                        HF safetensors export, one file at a time
``DTensor._local_tensor``                                  the tensor a DTensor wraps, itself
                                                           (``to_local()`` of a parameter is a view)
``torch.distributed.tensor._utils``
``.compute_local_shape_and_global_offset``                 a DTensor shard's region in the full tensor
``nn.Module._non_persistent_buffers_set``                  which buffers a state dict leaves out
``Tensor._version``                                        has a tensor been written since (a cached
                                                           gather of a K-sharded weight's scales)
``torch.distributed.checkpoint.filesystem._StorageInfo``,  what a DCP ``.metadata`` pickle is made of:
``torch.distributed.checkpoint.metadata                    the restricted unpickler of
._MEM_FORMAT_ENCODING``, ``torch.serialization            ``distributed/storage/metadata.py``
._get_layout``                                             resolves exactly these
``torch.distributed._composable_state._module_state_mapping``
                                                           the FSDP2 unit that manages a parameter
FSDP2 ``FSDPState._fsdp_param_groups`` (older torch:       its parameter groups and their reshard
``_fsdp_param_group``), ``FSDPParamGroup.fsdp_params`` /   setting (``set_reshard_after_forward``
``._training_state`` (``_fsdp_common.TrainingState``),     changes the group's only)
``.post_forward_mesh_info``,
``FSDPParam._sharded_local_tensor`` / ``._param_fqn`` /    one parameter's shard, name, reshard
``.fsdp_placement`` /                                      shard dim and all-gather buffers
``.all_gather_outputs`` / ``._unsharded_inner_tensors``    (a gather extension that changes its
                                                           tensors between phases re-sizes them)
=========================================================  =========================================
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "TESTED_TORCH",
    "PRIVATE_NAMES",
    "current_graph_task_id",
    "in_autograd_backward",
    "disabled_torch_function_impl",
    "make_wrapper_subclass",
    "parse_to_args",
    "grouped_mm",
    "grouped_mm_available",
    "grouped_mm_takes_dtype",
    "tree_map",
    "extension_build_directory",
    "profiler_enabled",
    "raise_dynamo_recompile_limits",
    "torch_dispatch_mode",
    "is_wrapper_subclass",
    "holds_no_data",
    "fake_tensor_mode",
    "init_fake_process_group",
    "default_store",
    "consolidate_safetensors_files",
    "local_tensor",
    "local_shape_and_global_offset",
    "non_persistent_buffer_names",
    "version_counter",
    "DCP_METADATA_PRIVATE_GLOBALS",
    "dcp_metadata_private_globals",
    "FSDPParamInfo",
    "fsdp_param_info",
    "fit_all_gather_outputs",
    "set_unsharded_inner_tensors",
]

TESTED_TORCH = "2.13"
"""The torch release (major.minor) every name below was read against."""

PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("torch._C", "_current_graph_task_id"),
    ("torch._C", "_disabled_torch_function_impl"),
    ("torch", "Tensor._make_wrapper_subclass"),
    ("torch._C._nn", "_parse_to"),
    ("torch", "_grouped_mm"),
    ("torch.utils._pytree", "tree_map"),
    ("torch.utils.cpp_extension", "_get_build_directory"),
    ("torch.autograd", "_profiler_enabled"),
    ("torch._dynamo.config", "recompile_limit"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "is_fake"),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    ("torch._dynamo.config", "accumulated_recompile_limit"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.checkpoint._consolidate_hf_safetensors", "_consolidate_safetensors_files"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed._composable_state", "_module_state_mapping"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState"),
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState.PRE_BACKWARD"),
)
"""``(module, dotted name)`` of every private torch name imported here (the test imports each;
the FSDP2 instance attributes and ``nn.Module._non_persistent_buffers_set`` are checked on live
objects there)."""


# ---- autograd --------------------------------------------------------------------------------------


def current_graph_task_id() -> int:
    """Id of the autograd graph task running on this thread; -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_autograd_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (incl. the forward that
    activation recompute replays inside it); FSDP2 tells its own phases apart the same way."""
    return torch._C._current_graph_task_id() != -1


disabled_torch_function_impl = torch._C._disabled_torch_function_impl
"""Assign as a tensor subclass's ``__torch_function__`` to take part in ``__torch_dispatch__`` only."""


def make_wrapper_subclass(cls: type, shape, *, dtype: torch.dtype, device: torch.device,
                          requires_grad: bool = False) -> torch.Tensor:
    """A storage-less ``cls`` instance with the given logical ``shape`` / ``dtype`` / ``device``
    (the standard construction of a wrapper tensor subclass)."""
    return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                               requires_grad=requires_grad)


def parse_to_args(*args, **kwargs) -> tuple[torch.device | None, torch.dtype | None, bool, bool]:
    """``(device, dtype, non_blocking, copy)`` of a ``Tensor.to(...)`` call, every overload
    (``to(dtype)``, ``to(device, dtype)``, ``to(other)``; positional or keyword ``copy``)."""
    copy = kwargs.pop("copy", False)
    bools = 0
    while bools < len(args) and isinstance(args[len(args) - 1 - bools], bool):
        bools += 1
    if bools == 2:  # (..., non_blocking, copy)
        copy, args = args[-1], args[:-1]
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking, copy


def grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs[, out_dtype=...])``: one GEMM per group of rows of ``a``
    (``offs``: int32 cumulative group ends)."""
    if out_dtype is None:
        return torch._grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a, b, offs=offs, out_dtype=out_dtype)


def grouped_mm_available() -> bool:
    """Whether this torch build has ``torch._grouped_mm`` (older releases do not)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_takes_dtype(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``t``'s dtype where ``t`` lives: on a tensor without
    data (meta, ``FakeTensor``: the capacity estimate) its meta kernel runs, which takes BF16 only
    (``_meta_grouped_mm_common``: "Expected inputs of BF16 type", CUDA's rule), while the CPU
    kernel itself takes FP32 / FP16 / BF16."""
    return t.dtype == torch.bfloat16 or not holds_no_data(t)


def profiler_enabled() -> bool:
    """Whether torch's autograd profiler is recording on this thread (cheap: one C call)."""
    return torch.autograd._profiler_enabled()


def extension_build_directory(name: str) -> str:
    """The folder ``torch.utils.cpp_extension.load(name=...)`` builds in (created if missing;
    honours ``TORCH_EXTENSIONS_DIR``)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def tree_map(fn, tree):
    """``fn`` applied to every leaf of nested lists / tuples / dicts (``torch.utils._pytree``)."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def raise_dynamo_recompile_limits(per_function: int, accumulated: int) -> None:
    """Raise ``torch._dynamo.config``'s recompile limits to at least these values, process-wide
    (never lowering a limit the user set higher)."""
    import torch._dynamo  # noqa: F401 -- heavy: only when something is compiled

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, per_function)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, accumulated)


# ---- torch.distributed -----------------------------------------------------------------------------


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base class of a
    ``__torch_dispatch__`` mode (documented in torch's extending guide, in a private module)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper tensor subclass with ``__tensor_flatten__`` (DTensor, a
    quantized weight): its storage is its inner tensors'."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def holds_no_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has no values to read: a meta tensor or a ``FakeTensor``."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def fake_tensor_mode():
    """A ``FakeTensorMode`` in which factories and ops make tensors with shapes, dtypes and
    devices but no memory; real tensors entering it are converted (the data pipeline's batches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as torch's fake one: this process plays ``rank`` of
    ``world_size``, every collective returns at once and moves no data (torchtitan's and
    torch's memory estimates run FSDP2 on it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def default_store():
    """The default process group's ``Store`` (torchrun's agent store or the ``init_method``'s)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def consolidate_safetensors_files(input_dir: str, output_dir: str, fqn_to_file: dict[str, str], *,
                                  num_threads: int = 1) -> None:
    """Merge the sharded safetensors DCP wrote to ``input_dir`` into the full files named by
    ``fqn_to_file`` (key -> file name) in ``output_dir``, streaming one tensor at a time."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files

    _consolidate_safetensors_files(input_dir, output_dir, fqn_to_file, num_threads=num_threads)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a DTensor wraps on this rank (the very object: a quantized weight's shard is its
    ``QuantizedWeightTensor``), else ``t``. Public ``to_local()`` returns an autograd view when
    grad mode is on and, since torch 2.13, always a fresh view for an ``nn.Parameter``."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def local_shape_and_global_offset(global_shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and its offset in the full tensor, for a DTensor layout (metadata:
    computed on real tensors even inside a ``FakeTensorMode``, whose fake ones hold no offsets)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with unset_fake_temporarily():
        shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(shape), tuple(offset)


def version_counter(t: torch.Tensor) -> int:
    """``t._version``: bumped by every in-place write to ``t`` (autograd's saved-tensor check)."""
    return t._version


def non_persistent_buffer_names(module: nn.Module) -> frozenset[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False``."""
    return frozenset(module._non_persistent_buffers_set)


DCP_METADATA_PRIVATE_GLOBALS: tuple[tuple[str, str], ...] = (
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # one storage entry (file, offset, length)
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # TensorProperties' pickled memory format
    ("torch.serialization", "_get_layout"),  # how torch.layout pickles: _get_layout("torch.strided")
)
"""The private ``(module, name)`` globals a DCP ``.metadata`` pickle refers to (torch 2.13,
``FileSystemWriter.finish``'s ``pickle.dump`` of ``Metadata``)."""


def dcp_metadata_private_globals() -> dict[tuple[str, str], Any]:
    """``{(module, name): object}`` of ``DCP_METADATA_PRIVATE_GLOBALS``."""
    import importlib

    return {(m, n): getattr(importlib.import_module(m), n) for m, n in DCP_METADATA_PRIVATE_GLOBALS}


# ---- FSDP2 internals (the quantized-weight all-gather extension) ----------------------------------


@dataclass(frozen=True)
class FSDPParamInfo:
    """What FSDP2 knows about one parameter at the moment its shard is all-gathered.

    param_fqn: the parameter's name from the root; reshard_after_forward: whether its group
    frees the unsharded weight after forward; group_unsharding_for_backward: the group's
    training state is ``PRE_BACKWARD`` (its pre-backward unshard or a backward prefetch);
    shard_dim: the dim of its ``Shard`` placement (``FSDPParam.fsdp_placement``).
    """

    param_fqn: str
    reshard_after_forward: bool
    group_unsharding_for_backward: bool
    _fsdp_param: Any  # torch's FSDPParam; read only by the functions below
    shard_dim: int = 0


_OWNER_STATE: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""Cache over torch's ``_module_state_mapping``: module owning a parameter -> the FSDP state that
manages it (a unit's state manages the parameters of its submodules that no inner unit took)."""


def fsdp_param_info(shard: torch.Tensor, owner: nn.Module) -> FSDPParamInfo | None:
    """FSDP2's view of the parameter whose local shard is ``shard``, or None when no FSDP2 unit
    manages it. ``owner``: the module that registers the parameter (FSDP2 passes it to
    ``fsdp_pre_all_gather``; it is the unit itself only when that module was sharded alone)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for state in _states_for(owner):
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                if fsdp_param._sharded_local_tensor is shard:
                    return FSDPParamInfo(
                        param_fqn=fsdp_param._param_fqn or "<unknown>",
                        reshard_after_forward=group.post_forward_mesh_info is not None,
                        group_unsharding_for_backward=group._training_state == TrainingState.PRE_BACKWARD,
                        _fsdp_param=fsdp_param,
                        shard_dim=fsdp_param.fsdp_placement.dim,
                    )
    return None


def fit_all_gather_outputs(info: FSDPParamInfo, inputs: tuple[torch.Tensor, ...], world_size: int) -> None:
    """Drop the parameter's all-gather output buffers when ``inputs`` would not fit them.

    FSDP2 allocates them once, sized by the first gather's inputs, and reuses them; an extension
    that gathers other tensors in another phase (MXFP8: row in forward, row + col in backward)
    makes FSDP allocate new ones by clearing the list first.
    """
    fsdp_param = info._fsdp_param
    wanted = [(t.numel() * world_size, t.dtype) for t in inputs]
    if [(t.numel(), t.dtype) for t in fsdp_param.all_gather_outputs] != wanted:
        fsdp_param.all_gather_outputs = []


def set_unsharded_inner_tensors(info: FSDPParamInfo, tensors: list[torch.Tensor]) -> None:
    """Tell FSDP2 which tensors the unsharded parameter now holds (freed at reshard), after an
    in-place ``fsdp_post_all_gather(..., out=...)`` rebound them to new all-gather outputs."""
    info._fsdp_param._unsharded_inner_tensors = list(tensors)


def _states_for(owner: nn.Module):
    """The FSDP states that may manage ``owner``'s parameters: the cached one first, then all."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    cached = _OWNER_STATE.get(owner)
    state = cached() if cached is not None else None
    if state is not None:
        yield state
    for ref in list(_module_state_mapping.values()):
        candidate = ref()
        if isinstance(candidate, FSDPState) and candidate is not state:
            if any(p._module_info.module is owner for g in _param_groups(candidate) for p in g.fsdp_params):
                _OWNER_STATE[owner] = weakref.ref(candidate)
                yield candidate


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list (one per mesh)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # earlier releases: at most one
    return [] if group is None else [group]


def set_process_group_timeout(seconds: float, group=None) -> bool:
    """Set the timeout of ``group``'s (default: the default group's) later collectives
    (``torch.distributed.distributed_c10d._set_pg_timeout``); False where the backend has no
    settable timeout (torch supports gloo and NCCL; HCCL keeps the one it was created with)."""
    import datetime
    import warnings

    from torch.distributed.distributed_c10d import _set_pg_timeout

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _set_pg_timeout(datetime.timedelta(seconds=seconds), group)
    return not any("only supported" in str(w.message) for w in caught)
