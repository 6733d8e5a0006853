"""Shard validation, fail-fast configuration, replicated fallback and gather-output validation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import te_npu
from te_npu import ConfigError
from te_npu.distributed import plan_shards, shard_model, validate_parallel_config
from te_npu.distributed.fsdp import _GatherMetadata, FSDPGatherContext
from te_npu.tensor import quantize_weight
from tests.distributed.harness import local, run_ranks
from tests.seeded import BF16_NO_BIAS, nn_linear_init


def _param(shape, fmt):
    if fmt == "bf16":
        return nn.Parameter(torch.randn(shape, dtype=torch.bfloat16))
    recipe = te_npu.MXFP8BlockRecipe() if fmt == "mxfp8" else te_npu.HiF8CurrentScalingRecipe()
    return nn.Parameter(quantize_weight(torch.randn(shape, dtype=torch.bfloat16), recipe))


@pytest.mark.parametrize(
    "fmt, shape, message",
    [
        ("mxfp8", (64, 64), "N_local=32 = 32 is not a multiple of 64"),
        ("mxfp8", (2, 32, 64), r"\(E_local=1\) \* D1=32 = 32"),
        ("hif8", (3, 32, 32), r"dim 0 \(3\) is not divisible"),
        ("bf16", (63,), r"dim 0 \(63\) is not divisible"),
    ],
    ids=["mxfp8-dense-rows", "mxfp8-grouped-rows", "hif8-split-expert", "uneven"],
)
def test_plan_shards_rejects_misaligned_shards_naming_fqn_shape_world(fmt, shape, message):
    params = [("layers.0.proj.weight", _param(shape, fmt))]
    with pytest.raises(ConfigError, match=message) as info:
        plan_shards(params, 2, fallback_to_unsharded=False)
    assert "layers.0.proj.weight" in str(info.value) and str(list(shape)) in str(info.value)
    assert "world size 2" in str(info.value)
    plan = plan_shards(params, 2, fallback_to_unsharded=True)
    assert list(plan.replicated) == ["layers.0.proj.weight"] and plan.sharded == ()


def test_plan_shards_accepts_aligned_shards():
    params = [("a", _param((128, 64), "mxfp8")), ("b", _param((2, 64, 64), "mxfp8")), ("c", _param((2, 32, 32), "hif8"))]
    assert plan_shards(params, 2, fallback_to_unsharded=False).sharded == ("a", "b", "c")


@pytest.mark.parametrize(
    "kwargs, name",
    [({"comm_fusion": True}, "comm_fusion"), ({"tensor_parallel": 2}, "tensor_parallel"),
     ({"context_parallel": 2}, "context_parallel"), ({"expert_parallel": 2}, "expert_parallel"),
     ({"pipeline_parallel": 2}, "pipeline_parallel")],
)
def test_validate_parallel_config_fails_fast(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        validate_parallel_config(**kwargs)


def test_hif8_delayed_scaling_is_rejected():
    with pytest.raises(ConfigError, match="delayed"):
        te_npu.recipe_from_config({"enabled": True, "format": "hif8", "scaling": "delayed"})


def _post(weight, outputs, fields, world=2):
    shard = local(weight)
    meta = _GatherMetadata(FSDPGatherContext("forward", True, "w"), fields,
                           tuple(getattr(shard, f).shape for f in fields), tuple(getattr(shard, f).dtype for f in fields),
                           world, torch.Size([s * (world if i == 0 else 1) for i, s in enumerate(shard.shape)]))
    return shard.fsdp_post_all_gather(outputs, meta, None)


def test_post_all_gather_validates_count_shape_dtype_and_hif8_scale_agreement():
    w = _param((32, 64), "hif8")
    fields = ("qdata", "scale")
    data2, scale2 = torch.cat([w.qdata, w.qdata]), torch.stack([w.scale, w.scale])
    full, _ = _post(w, (data2, scale2), fields)
    assert list(full.shape) == [64, 64] and full.scale.dim() == 0
    with pytest.raises(RuntimeError, match="got 1 tensors"):
        _post(w, (data2,), fields)
    with pytest.raises(RuntimeError, match="tensor 0"):
        _post(w, (data2.float(), scale2), fields)
    with pytest.raises(RuntimeError, match="tensor 1"):
        _post(w, (data2, scale2[:1]), fields)
    with pytest.raises(RuntimeError, match="different scalar scales"):
        _post(w, (data2, torch.stack([w.scale, w.scale * 2])), fields)


class _FallbackModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = te_npu.TELinear(64, 64, init_method=nn_linear_init, **BF16_NO_BIAS)  # MXFP8 N_local = 32: kept replicated
        self.big = te_npu.TELinear(64, 128, init_method=nn_linear_init, **BF16_NO_BIAS)

    def forward(self, x):
        return self.big(self.small(x))


def _fallback_worker(rank, world, workdir):
    recipe = te_npu.MXFP8BlockRecipe()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(te_npu.quantize_weights_(_FallbackModel(), recipe))
    reference, sharded = models
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(ConfigError, match="small.weight"):
        shard_model(te_npu.quantize_weights_(_FallbackModel(), recipe), mesh, fallback_to_unsharded=False)
    plan = shard_model(sharded, mesh, fallback_to_unsharded=True)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    losses = []
    for model in (reference, sharded):
        with te_npu.autocast(recipe=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss)
    rows = 64
    return {
        "replicated": list(plan.replicated),
        "loss_equal": torch.equal(*losses),
        "small_grad_equal": torch.equal(sharded.small.weight.grad, reference.small.weight.grad),
        "big_grad_equal": torch.equal(local(sharded.big.weight.grad), reference.big.weight.grad[rank * rows:(rank + 1) * rows]),
        "small_is_plain": not hasattr(sharded.small.weight, "_local_tensor"),
    }


def test_fallback_to_unsharded_keeps_param_replicated_with_matching_grads(tmp_path):
    for res in run_ranks(_fallback_worker, 2, tmp_path):
        assert res == {"replicated": ["small.weight"], "loss_equal": True, "small_grad_equal": True,
                       "big_grad_equal": True, "small_is_plain": True}
