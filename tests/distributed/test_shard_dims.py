"""FSDP2 ``Shard(1)`` (over K) for MXFP8 weights whose rows break the 64-row pairs, on 2 gloo ranks.

``narrow [96, 128]``: 48 local rows at W = 2 (not a pair of 32-row blocks), 64 local columns
(whole pairs along K), so the plan shards it on dim 1; ``wide [128, 96]`` shards on dim 0. The
sharded model must equal the unsharded one bitwise (loss, gradients, the weights after an
optimizer step), and the scales of the K-sharded weight travel once per refresh, not per gather.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import te_npu
from te_npu import ConfigError
from te_npu.distributed import MasterWeightOptimizer, finalize_low_precision_weights, plan_shards, shard_model
from te_npu.events import FSDPGatherEvent, subscribe
from te_npu.tensor import quantize_weight
from tests.distributed.harness import local, run_ranks

TOKENS = 64


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.narrow = te_npu.TELinear(128, 96, bias=False, params_dtype=torch.bfloat16)
        self.wide = te_npu.TELinear(96, 128, bias=False, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.wide(self.narrow(x))


def _build(recipe):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TwoLinears()
    return model, finalize_low_precision_weights(model, recipe)


def _x(step):
    return torch.randn(TOKENS, 128, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)


def _loss(model, recipe, x):
    with te_npu.autocast(recipe=recipe):
        return model(x).float().pow(2).mean()


def _payload(weight):
    return {n: getattr(weight, n).view(torch.uint8).clone() for n in weight.inner_field_names()}


def _worker(rank, world, workdir, reshard):
    recipe = te_npu.MXFP8BlockRecipe()
    mesh = init_device_mesh("cpu", (world,))
    reference, ref_init = _build(recipe)
    sharded, init = _build(recipe)
    plan = shard_model(sharded, mesh, reshard_after_forward=reshard)
    ref_opt = MasterWeightOptimizer(reference, ref_init, lr=1e-2)
    opt = MasterWeightOptimizer(sharded, init, lr=1e-2)
    out = {"dims": dict(plan.dims), "describe": plan.describe(), "steps": []}
    for step in range(2):
        gathers = []
        with subscribe(gathers.append, FSDPGatherEvent):
            loss = _loss(sharded, recipe, _x(step))
            loss.backward()
        ref_loss = _loss(reference, recipe, _x(step))
        ref_loss.backward()
        cols = 128 // world
        grads = {
            "narrow": torch.equal(local(sharded.narrow.weight.grad), reference.narrow.weight.grad[:, rank * cols:(rank + 1) * cols]),
            "wide": torch.equal(local(sharded.wide.weight.grad), reference.wide.weight.grad[rank * 64:(rank + 1) * 64]),
        }
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        shard, full = local(sharded.narrow.weight), reference.narrow.weight
        expected = full[:, rank * cols:(rank + 1) * cols]
        out["steps"].append({
            "loss": torch.equal(loss, ref_loss),
            "grads": grads,
            "refreshed": all(torch.equal(a, b) for a, b in zip(_payload(shard).values(), _payload(expected).values())),
            "narrow_gathers": [(e.context.phase, e.context.shard_dim, e.fields) for e in gathers
                               if e.context.param_fqn == "narrow.weight"],
        })
    return out


@pytest.mark.parametrize("reshard", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["reshard", "keep"])
def test_shard_dim1_mxfp8_equals_unsharded_and_sends_scales_once_per_refresh(reshard, tmp_path):
    results = run_ranks(_worker, 2, tmp_path, reshard)
    for rank, res in enumerate(results):
        assert res["dims"] == {"narrow.weight": 1, "wide.weight": 0}
        assert "Shard(1): narrow.weight [96, 128]" in res["describe"]
        for step, r in enumerate(res["steps"]):
            where = f"rank {rank} step {step}"
            assert r["loss"] and all(r["grads"].values()) and r["refreshed"], (where, r)
            gathers = r["narrow_gathers"]
            assert all(dim == 1 for _, dim, _ in gathers), where
            # the first gather after a refresh sends the scales; the later ones only the data
            assert gathers[0][2][-2:] == ("row_scale", "col_scale") or gathers[0][2][-1:] == ("row_scale",), where
            assert all("scale" not in " ".join(f) for _, _, f in gathers[1:]), (where, gathers)
            phases = [p for p, _, _ in gathers]
            assert phases == (["forward", "backward"] if reshard else ["forward"]), where


def test_plan_names_what_no_dim_can_shard_and_where_it_would():
    """[96, 96] MXFP8 at W = 2: 48 rows, 48 columns: no pair-aligned dim. The error lists both
    dims' reasons and the world sizes that would shard it (none here but 1), fails before FSDP."""
    param = nn.Parameter(quantize_weight(torch.zeros(96, 128, dtype=torch.bfloat16), te_npu.MXFP8BlockRecipe()))
    with pytest.raises(ConfigError) as info:
        plan_shards([("w", param)], 4, fallback_to_unsharded=False)
    message = str(info.value)
    assert "Shard(0): MXFP8Tensor local rows N_local=24" in message
    assert "Shard(1): MXFP8Tensor local columns K_local=32 is not a multiple of 64" in message
    assert "it shards at world sizes [2]" in message and "fallback_to_unsharded: true" in message
    plan = plan_shards([("w", param)], 4, fallback_to_unsharded=True)
    assert list(plan.replicated) == ["w"] and plan.replicated_bytes_per_rank() == 96 * 128 * (2 + 2 / 32)


def test_plan_names_the_hsdp_layouts_that_would_shard_it():
    """The 16B ``kv_b_proj [3072, 3072]`` MXFP8 at 32 ranks, flat: 96 rows and 96 columns per rank.
    The error names every ``dp_shard_size x dp_replicate_size`` layout of 32 ranks that shards it;
    under HSDP the plan is made for the shard group alone (16 ranks: 192 rows each)."""
    param = nn.Parameter(quantize_weight(torch.zeros(3072, 3072, dtype=torch.bfloat16, device="meta"),
                                         te_npu.MXFP8BlockRecipe()))
    with pytest.raises(ConfigError) as info:
        plan_shards([("kv_b_proj.weight", param)], 32, fallback_to_unsharded=False)
    message = str(info.value)
    assert "N_local=96" in message and "K_local=96" in message
    assert ("at 32 ranks these shard them: dp_shard_size=16 x dp_replicate_size=2, dp_shard_size=8 x "
            "dp_replicate_size=4, dp_shard_size=4 x dp_replicate_size=8, dp_shard_size=2 x dp_replicate_size=16"
            in message), message
    plan = plan_shards([("kv_b_proj.weight", param)], 16, fallback_to_unsharded=False, replicate_size=2)
    assert plan.dims == {"kv_b_proj.weight": 0} and not plan.replicated
    assert plan.describe().startswith("HSDP plan over 32 ranks (2 replicas x 16-rank shard groups)")
    with pytest.raises(ConfigError, match=r"dp_shard_size=32 x dp_replicate_size=2\).*at 64 ranks these shard "
                                          r"them: dp_shard_size=16 x dp_replicate_size=4"):
        plan_shards([("kv_b_proj.weight", param)], 32, fallback_to_unsharded=False, replicate_size=2)


def test_plan_keeps_hif8_on_dim0_and_plain_tensors_fall_back_to_dim1():
    hif8 = nn.Parameter(quantize_weight(torch.zeros(96, 128, dtype=torch.bfloat16), te_npu.HiF8CurrentScalingRecipe()))
    plain = nn.Parameter(torch.zeros(6, 128))
    plan = plan_shards([("h", hif8), ("p", plain)], 4, fallback_to_unsharded=False)
    assert plan.dims == {"h": 0, "p": 1}
