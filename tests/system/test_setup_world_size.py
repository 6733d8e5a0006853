"""Sharded setup (meta build -> FSDP2 on meta -> local shards -> each rank's region of every
initial value): the full weights after ``Trainer.setup`` are bitwise the same at W = 1, 2, 4.

Each rank returns its local shards as bytes; the test reassembles every FP32 master,
high-precision parameter and 8-bit payload (inner tensors concatenated along the parameter's
shard dim) and compares them with the one-rank run, bit for bit. MXFP8 at W = 4 keeps
the tiny model's 128 x 128 weights replicated (no dim gives 64-row / 64-column pairs there).
"""
from __future__ import annotations

import pytest
import torch

from te_npu.compat import local_tensor
from te_npu.tensor import QuantizedWeightTensor
from tests.distributed.harness import run_ranks
from tests.system.harness import st_config

WORLDS = (1, 2, 4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().clone()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _setup_worker(rank, world, workdir, fmt, data_dir):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.trainer import Trainer

    extra = [f"fsdp_config.dp_shard_size={world}"]
    if fmt == "mxfp8" and world == 4:
        extra.append("fsdp_config.fallback_to_unsharded=true")
    trainer = Trainer(DeepseekV3Task(), print_fn=lambda line: None)
    trainer.setup(st_config(fmt, workdir, data_dir, *extra))
    local, scalars = {}, set()
    for fqn, param in trainer.model.named_parameters():
        shard = local_tensor(param)
        if isinstance(shard, QuantizedWeightTensor):
            fields = {n: _bits(getattr(shard, n)) for n in shard.inner_field_names()}
            scalars.update((fqn, n) for n in shard.inner_field_names() if getattr(shard, n).dim() == 0)
        else:
            fields = {"value": _bits(shard)}
        local[fqn] = {"master": _bits(local_tensor(trainer.optimizer.masters[fqn])), **fields}
    buffers = {fqn: _bits(b) for fqn, b in trainer.model.named_buffers()}
    dims = dict(trainer.shard_plan.dims) if trainer.shard_plan else {}
    trainer.close()
    return {"local": local, "buffers": buffers, "dims": dims, "scalars": scalars}


def _assemble(ranks: list[dict]) -> dict:
    """Every tensor's full bits: the ranks' pieces concatenated along the parameter's shard dim
    (byte views concatenate like their elements); a replicated tensor or a shared scalar scale
    is rank 0's."""
    dims, full = ranks[0]["dims"], {}
    for fqn, fields in ranks[0]["local"].items():
        full[fqn] = {}
        for name, bits in fields.items():
            dim = dims.get(fqn)
            pieces = [r["local"][fqn][name] for r in ranks]
            shared = dim is None or (fqn, name) in ranks[0]["scalars"]
            full[fqn][name] = bits if shared else torch.cat(pieces, dim=dim)
    return full


def _check_world_size_independent(fmt, tmp_path):
    data_dir = tmp_path / "data"
    results = {w: run_ranks(_setup_worker, w, tmp_path / f"w{w}", fmt, data_dir) for w in WORLDS}
    reference = _assemble(results[1])
    for world in WORLDS[1:]:
        got = _assemble(results[world])
        assert got.keys() == reference.keys()
        for fqn, fields in reference.items():
            for name, bits in fields.items():
                assert torch.equal(got[fqn][name], bits), f"W={world}: {fqn}.{name} differs from W=1"
        for fqn, bits in results[1][0]["buffers"].items():
            assert torch.equal(results[world][0]["buffers"][fqn], bits), f"W={world}: buffer {fqn}"
    return {w: r[0] for w, r in results.items()}


def test_setup_weights_are_bitwise_independent_of_world_size_mxfp8(tmp_path):
    results = _check_world_size_independent("mxfp8", tmp_path)
    assert set(results[2]["dims"].values()) == {0}  # the tiny model shards on dim 0 at W = 2


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hif8", "bf16"])
def test_setup_weights_are_bitwise_independent_of_world_size(fmt, tmp_path):
    _check_world_size_independent(fmt, tmp_path)
