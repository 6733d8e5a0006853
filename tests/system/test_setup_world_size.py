"""Sharded setup (meta build -> FSDP2 on meta -> local shards -> each rank's region of every
initial value): the full weights after ``Trainer.setup`` are bitwise the same at W = 1, 2, 4.

Each rank returns its local shards; rank 0 of each world size reassembles every FP32 master,
high-precision parameter and 8-bit payload (inner tensors concatenated along the parameter's
shard dim) and the test compares them with the one-rank run, bit for bit. MXFP8 at W = 4 keeps
the tiny model's 128 x 128 weights replicated (no dim gives 64-row / 64-column pairs there).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_npu.compat import local_tensor
from te_npu.tensor import QuantizedWeightTensor
from tests.distributed.harness import run_ranks
from tests.system.harness import st_config

WORLDS = (1, 2, 4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _setup_worker(rank, world, workdir, fmt, data_dir):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.trainer import Trainer

    extra = [f"fsdp_config.dp_shard_size={world}"]
    if fmt == "mxfp8" and world == 4:
        extra.append("fsdp_config.fallback_to_unsharded=true")
    trainer = Trainer(DeepseekV3Task(), print_fn=lambda line: None)
    trainer.setup(st_config(fmt, workdir, data_dir, *extra))
    dims = dict(trainer.shard_plan.dims) if trainer.shard_plan else {}
    local = {}
    for fqn, param in trainer.model.named_parameters():
        shard = local_tensor(param)
        if isinstance(shard, QuantizedWeightTensor):
            fields = {n: getattr(shard, n).detach().clone() for n in shard.inner_field_names()}
        else:
            fields = {"value": shard.detach().clone()}
        local[fqn] = {"master": local_tensor(trainer.optimizer.masters[fqn]).detach().clone(), **fields}
    buffers = {fqn: b.detach().clone() for fqn, b in trainer.model.named_buffers()}
    parts = [None] * world
    dist.all_gather_object(parts, local) if world > 1 else parts.__setitem__(0, local)
    trainer.close()
    if rank != 0:
        return None
    full = {}
    for fqn in local:
        dim = dims.get(fqn)
        full[fqn] = {}
        for name, value in local[fqn].items():
            pieces = [p[fqn][name] for p in parts]
            if dim is None or value.dim() == 0:  # replicated (or one rank), or a shared scalar scale
                whole = pieces[0]
            else:
                whole = torch.cat(pieces, dim=dim)
            full[fqn][name] = _bits(whole)
    return {"weights": full, "buffers": {k: _bits(v) for k, v in buffers.items()}, "dims": dims}


def _check_world_size_independent(fmt, tmp_path):
    data_dir = tmp_path / "data"
    results = {w: run_ranks(_setup_worker, w, tmp_path / f"w{w}", fmt, data_dir)[0] for w in WORLDS}
    reference = results[1]
    for world in WORLDS[1:]:
        got = results[world]
        assert got["weights"].keys() == reference["weights"].keys()
        for fqn, fields in reference["weights"].items():
            for name, bits in fields.items():
                assert torch.equal(got["weights"][fqn][name], bits), f"W={world}: {fqn}.{name} differs from W=1"
        for fqn, bits in reference["buffers"].items():
            assert torch.equal(got["buffers"][fqn], bits), f"W={world}: buffer {fqn}"
    return results


def test_setup_weights_are_bitwise_independent_of_world_size_mxfp8(tmp_path):
    results = _check_world_size_independent("mxfp8", tmp_path)
    assert set(results[2]["dims"].values()) == {0}  # the tiny model shards on dim 0 at W = 2


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hif8", "bf16"])
def test_setup_weights_are_bitwise_independent_of_world_size(fmt, tmp_path):
    _check_world_size_independent(fmt, tmp_path)
