"""MasterWeightOptimizer on 2 gloo ranks (both formats) and in one process without FSDP."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import te_npu
from te_npu.distributed import MasterWeightOptimizer, shard_model
from te_npu.events import OptimizerStepEvent, WeightRefreshEvent, subscribe
from te_npu.tensor import HiF8Tensor, MXFP8Tensor, QuantizedWeightTensor
from tests.distributed.harness import RECIPES, batch, build, local, loss_of, run_ranks

QUANTIZED = ["up.weight", "mix.weight", "moe.gate_up_proj", "moe.down_proj"]


def _count_requantizations(counter: Counter):
    """Count every re-quantization of a stored weight, whoever triggers it."""
    for cls in (MXFP8Tensor, HiF8Tensor):
        for name in ("refresh_from_master", "_requantize_"):
            original = getattr(cls, name)

            def counted(self, *args, _original=original, **kwargs):
                if counter["_depth"] == 0:  # refresh_from_master may call _requantize_: count once
                    counter["total"] += 1
                counter["_depth"] += 1
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    counter["_depth"] -= 1

            setattr(cls, name, counted)


def _optimizer_worker(rank, world, workdir):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    requantized = Counter()
    _count_requantizations(requantized)
    for fmt in ("mxfp8", "hif8"):
        model, init = build(fmt, recompute=True)
        shard_model(model, mesh, reshard_after_forward=True)
        opt = MasterWeightOptimizer(model, init, lr=1e-2, max_grad_norm=1.0)
        del init
        hooked, steps = [], []
        refreshes = subscribe(lambda e: hooked.append(e.fqn), WeightRefreshEvent)
        step_events = subscribe(steps.append, OptimizerStepEvent)
        requantized["total"] = 0
        for micro in range(2):  # micro-batches with full recompute: no refresh
            loss_of(model, fmt, batch(micro)).backward()
        r = {"after_micro": requantized["total"]}
        result = opt.step()
        r["step1"] = (result.updated, result.skipped)
        r["after_step"] = requantized["total"]
        r["counts"] = dict(opt.refresh_counts)
        r["hooked"] = sorted(hooked)
        opt.zero_grad()
        r["after_zero_grad"] = requantized["total"]
        # a NaN gradient on rank 1 only: both ranks skip, nothing refreshed or updated
        loss_of(model, fmt, batch(5)).backward()
        if rank == 1:
            local(model.up.weight.grad).view(-1)[0] = float("nan")
        masters_before = {k: local(m).clone() for k, m in opt.masters.items()}
        result = opt.step()
        r["skip"] = (result.updated, result.skipped)
        r["after_skip"] = requantized["total"]
        refreshes.close(), step_events.close()
        r["hooked"] = sorted(hooked)  # still one per weight: the skipped step refreshed nothing
        r["step_events"] = [(e.updated, e.skipped, e.grad_norm == e.grad_norm) for e in steps]
        r["masters_unchanged"] = all(torch.equal(local(m), masters_before[k]) for k, m in opt.masters.items())
        r["dtypes"] = {
            (str(local(m).dtype), str(opt.optimizer.state[m]["exp_avg"].dtype), str(opt.optimizer.state[m]["exp_avg_sq"].dtype))
            for m in opt.masters.values()
        }
        scale = local(model.up.weight).scale.clone() if fmt == "hif8" else torch.zeros(())
        scales = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(scales, scale)
        r["dense_scales_equal"] = all(torch.equal(s, scales[0]) for s in scales)
        out[fmt] = r
    return out


def test_optimizer_refresh_counts_skip_and_scales(tmp_path):
    for rank, res in enumerate(run_ranks(_optimizer_worker, 2, tmp_path)):
        for fmt, r in res.items():
            where = f"rank {rank} {fmt}"
            assert r["after_micro"] == 0, where  # micro-batches + recompute never re-quantize
            assert r["step1"] == (True, False), where
            assert r["after_step"] == len(QUANTIZED), where  # each weight once
            assert r["counts"] == {fqn: 1 for fqn in QUANTIZED}, where
            assert r["hooked"] == sorted(QUANTIZED), where
            assert r["after_zero_grad"] == len(QUANTIZED), where
            assert r["skip"] == (False, True), where
            assert r["after_skip"] == len(QUANTIZED), where
            assert r["step_events"] == [(True, False, True), (False, True, False)], where  # finite norm, then NaN
            assert r["masters_unchanged"], where
            assert r["dtypes"] == {("torch.float32",) * 3}, where
            assert r["dense_scales_equal"], where


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_optimizer_without_fsdp_masters_from_high_precision_init(fmt):
    model, init = build(fmt)
    opt = MasterWeightOptimizer(model, init, lr=1e-2)
    for fqn in QUANTIZED:  # masters come from the BF16 init, never from 8-bit data
        assert torch.equal(opt.masters[fqn], init[fqn].float())
    losses = []
    for step in range(3):
        loss = loss_of(model, fmt, batch(step))
        loss.backward()
        assert opt.step().updated
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert dict(opt.refresh_counts) == {fqn: 3 for fqn in QUANTIZED}
    assert torch.equal(model.norm, opt.masters["norm"].to(torch.bfloat16))
    assert all(isinstance(model.get_parameter(f), QuantizedWeightTensor) for f in QUANTIZED)


def test_optimizer_requires_high_precision_init_for_quantized_params():
    model, _ = build("mxfp8")
    with pytest.raises(ValueError, match="up.weight"):
        MasterWeightOptimizer(model, {})


def test_weight_decay_shrinks_matrices_but_not_norms_or_biases():
    model, init = build("mxfp8")
    opt = MasterWeightOptimizer(model, init, lr=1e-2, weight_decay=0.5)
    one_dim = sorted(fqn for fqn, p in model.named_parameters() if p.dim() < 2)
    assert "norm" in one_dim and sorted(opt.no_decay) == one_dim
    before = {fqn: m.clone() for fqn, m in opt.masters.items()}
    for p in model.parameters():  # zero gradients: AdamW's update is 0, only decay moves weights
        p.grad = torch.zeros(p.shape, dtype=p.dtype)  # logical shape/dtype (quantized weights too)
    assert opt.step().updated
    for fqn, master in opt.masters.items():
        if fqn in opt.no_decay:
            assert torch.equal(master, before[fqn]), fqn
        else:
            assert torch.equal(master, before[fqn] * (1 - 1e-2 * 0.5)), fqn
