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
from tests.seeded import BF16_NO_BIAS, fan_in_uniform_init, nn_linear_init

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


class _FourWeights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        linear = dict(init_method=nn_linear_init, **BF16_NO_BIAS)
        self.a, self.b, self.c = te_npu.TELinear(64, 64, **linear), te_npu.TELinear(64, 128, **linear), te_npu.TELinear(128, 64, **linear)
        self.experts = te_npu.TEGroupedLinear(2, 64, 64, init_method=fan_in_uniform_init, **BF16_NO_BIAS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # FSDP2 needs one; this test never runs it
        return self.experts(self.c(self.b(self.a(x))), [x.shape[0], 0])


def _coalesced_amax_worker(rank, world, workdir):
    """Three dense HiF8 weights (one scalar scale each, shards on both ranks) and a grouped one."""
    from te_npu.distributed import finalize_low_precision_weights
    from te_npu.numerics import hif8

    mesh = init_device_mesh("cpu", (world,))
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = _FourWeights()
        with torch.no_grad():
            model.b.weight.mul_(5)  # the three dense weights get different scales
    init = finalize_low_precision_weights(model, te_npu.HiF8CurrentScalingRecipe())
    shard_model(model, mesh)
    opt = MasterWeightOptimizer(model, init, lr=1e-2)
    del init
    reduces = []
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        reduces.append(list(tensor.shape))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        with torch.no_grad():  # a different update per rank and weight, as AdamW makes
            for m in opt.masters.values():
                local(m).mul_(1.5 + rank)
        from te_npu.distributed.optim import refresh_low_precision_weights

        names = list(opt.masters)
        refresh_low_precision_weights([opt.params[n] for n in names], [opt.masters[n] for n in names])
    finally:
        dist.all_reduce = original
    out = {"reduces": reduces, "scales_match_full_weight": {}}
    for name in names:
        full = torch.cat([torch.zeros_like(local(opt.masters[name])) for _ in range(world)])
        dist.all_gather_into_tensor(full, local(opt.masters[name]).contiguous())
        shard = local(opt.params[name])
        if shard.dim() == 2:  # the scale of the whole FP32 weight, from an amax computed here
            want = hif8.current_scale(full.abs().amax(), 15.0)
        else:
            want = hif8.current_scale(local(opt.masters[name]).abs().amax(dim=(1, 2)), 15.0)
        out["scales_match_full_weight"][name] = torch.equal(shard.scale, want)
    return out


def test_dense_hif8_amaxes_meet_in_one_all_reduce_per_refresh(tmp_path):
    """Every dense HiF8 weight needs the FSDP-group MAX of its shards' amaxes: one stacked
    all-reduce serves them all (not one per weight), and each weight still gets the scale of
    its whole FP32 master; the experts' per-expert scales stay local."""
    for rank, r in enumerate(run_ranks(_coalesced_amax_worker, 2, tmp_path)):
        assert r["reduces"] == [[3]], f"rank {rank}: {r['reduces']}"
        assert all(r["scales_match_full_weight"].values()), f"rank {rank}: {r['scales_match_full_weight']}"
