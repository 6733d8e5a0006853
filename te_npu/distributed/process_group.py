"""This process's place in the default process group, with a single process as rank 0 of 1."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank", "world_size", "barrier"]


def rank() -> int:
    """Rank in the default process group; 0 when none is initialized."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Size of the default process group; 1 when none is initialized."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank of the default process group; nothing without one."""
    if dist.is_initialized():
        dist.barrier()
