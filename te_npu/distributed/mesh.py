"""The data-parallel device mesh: flat FSDP, or HSDP (replicate x shard), torchtitan's layout.

``dp_mesh(device_type, replicate=R, shard=S)`` is a 1-D mesh ``("dp_shard",)`` over every rank
when ``R == 1``, else the 2-D mesh ``("dp_replicate", "dp_shard")`` of shape ``[R, S]``: rank
``r * S + s`` is shard ``s`` of replica ``r``, so a shard group is ``S`` consecutive ranks (one
node when ``S`` is the ranks per node) and the replicas of a shard sit ``S`` ranks apart.
``fully_shard(mesh=...)`` given the 2-D mesh runs HSDP (torch ``_fsdp_init``: ``HSDPMeshInfo``,
shard on the last dim, replicate on the first): parameters are sharded within the shard group
(each replica holds the same shards), every all-gather spans the shard group only (FSDP2
passes the shard sub-mesh to ``fsdp_pre_all_gather``), and gradients are reduce-scattered in the
shard group, then all-reduced over the replicas.

What uses which group:

- the shard plan, the 8-bit formats' alignment and every all-gather: the shard group
  (``shard_size``), never the world;
- HiF8 dense amax MAX-reduce (``optim``): the shard group of each parameter
  (``dtensor_shard_group``; the replicas hold identical masters, so the world's max is the same);
- the gradient norm: squares summed over the shard group (replicas hold equal gradients after
  FSDP2's all-reduce; summing over the world would count each shard ``R`` times);
- a replicated parameter's gradient (``fallback_to_unsharded``) and the loss, stop and stall
  decisions of the trainer: every rank (``mesh_groups``, the world).
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["SHARD_DIM", "REPLICATE_DIM", "dp_mesh", "shard_size", "replicate_size", "mesh_groups",
           "dtensor_shard_group"]

SHARD_DIM, REPLICATE_DIM = "dp_shard", "dp_replicate"


def dp_mesh(device_type: str, *, replicate: int, shard: int) -> DeviceMesh:
    """The data-parallel mesh over ``replicate * shard`` ranks (module doc); 1-D when ``replicate == 1``."""
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=(SHARD_DIM,))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def shard_size(mesh: DeviceMesh) -> int:
    """Ranks one parameter is sharded over: the last mesh dim (the whole of a 1-D mesh)."""
    return mesh.size(mesh.ndim - 1)


def replicate_size(mesh: DeviceMesh) -> int:
    """Copies of every shard: the first dim of a 2-D mesh, 1 for a 1-D one."""
    return mesh.size(0) if mesh.ndim == 2 else 1


def mesh_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """One process group per mesh dim; reducing over each in turn reduces over the whole mesh."""
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def dtensor_shard_group(t: DTensor) -> dist.ProcessGroup | None:
    """The group of the mesh dim ``t`` is sharded on (FSDP2: the shard group), None if none is."""
    dims = [dim for dim, placement in enumerate(t.placements) if isinstance(placement, Shard)]
    if not dims:
        return None
    if len(dims) > 1:
        raise ValueError(f"dtensor_shard_group: {list(t.placements)} shards on {len(dims)} mesh dims; FSDP2 "
                         "data parallelism shards on one")
    return t.device_mesh.get_group(dims[0])
