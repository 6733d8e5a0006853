"""Group row counts: an int64 ``[G]`` tensor on the device for kernels, mirrored on the host.

Ragged layouts need Python ints (how many MXFP8 blocks, output shapes, checks); reading them
from an accelerator tensor is a host sync, one per read. :func:`group_sizes_tensor` builds the
tensor from host ints and keeps those ints as its mirror; :func:`host_group_sizes` returns the
mirror, or reads the values (one sync) from a tensor without one. A mirror belongs to one
tensor version: an in-place change of the tensor makes the next read go to the values.
(Inference-mode tensors have no version counter; their mirror is trusted as made.)

The mirror is state carried on a tensor (an attribute), and making the tensor branches on the
device (pinned copies to CUDA), so this lives in ``te_npu.ops``, not in the pure
``te_npu.numerics``: the ragged numerics take the host ints as an argument (``host_sizes``),
which ops reads from here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_sizes_tensor", "host_group_sizes", "with_mirror_of"]

_MIRROR = "_te_npu_host_group_sizes"


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def _attach(tensor: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    setattr(tensor, _MIRROR, (_version(tensor), sizes))
    return tensor


def group_sizes_tensor(sizes: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """int64 ``[G]`` tensor of ``sizes`` on ``device``, mirrored on the host. The copy to a CUDA
    device goes through pinned memory, non-blocking, so making it does not sync either."""
    sizes = tuple(int(s) for s in sizes)
    host = torch.tensor(sizes, dtype=torch.int64)
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        tensor = host.pin_memory().to(device, non_blocking=True)
    else:
        tensor = host.to(device)
    return _attach(tensor, sizes)


def host_group_sizes(group_sizes: torch.Tensor) -> tuple[int, ...]:
    """The row counts of ``group_sizes`` ``[G]`` as Python ints: the mirror when it is current,
    else the tensor's values (a host sync on an accelerator)."""
    mirror = getattr(group_sizes, _MIRROR, None)
    if mirror is not None and mirror[0] == _version(group_sizes):
        return mirror[1]
    return tuple(int(s) for s in group_sizes.tolist())


def with_mirror_of(tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a copy of ``source``'s values, e.g. ``source.to(...)``) with ``source``'s mirror."""
    mirror = getattr(source, _MIRROR, None)
    if tensor is source or mirror is None or mirror[0] != _version(source):
        return tensor
    return _attach(tensor, mirror[1])
