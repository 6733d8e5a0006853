"""``MasterWeightOptimizer.step`` casts gradients to FP32 one bounded chunk at a time: the update
is bitwise the one AdamW step over every FP32 gradient at once makes, and its extra memory is
about one parameter's FP32 gradient (plus AdamW's per-tensor temporaries), not all of them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from te_npu.distributed import MasterWeightOptimizer
from te_npu.training.capacity.memory_tracker import MemoryTracker

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)


def _model(n: int = 8, rows: int = 256) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    for i in range(n):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(rows, 64, dtype=torch.bfloat16)))
    model.register_parameter("bias", nn.Parameter(torch.randn(64, dtype=torch.bfloat16)))
    return model


def _set_grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) * 3


def _reference_step(params: dict, masters: dict, adamw: torch.optim.AdamW) -> None:
    """The pre-chunking update: every gradient cast to FP32 at once, global norm, clip, one AdamW step."""
    grads = {fqn: params[fqn].grad.to(torch.float32) for fqn in masters}
    norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt()
    coef = torch.clamp(HP["max_grad_norm"] / (norm + 1e-6), max=1.0)
    for fqn, master in masters.items():
        master.grad = grads[fqn].mul_(coef)
    adamw.step()
    for master in masters.values():
        master.grad = None


def test_chunked_step_equals_one_adamw_step_over_all_fp32_gradients_bitwise():
    model = _model()
    optimizer = MasterWeightOptimizer(model, **HP)
    reference = _model()
    params = dict(reference.named_parameters())
    masters = {fqn: p.detach().float().clone() for fqn, p in params.items()}
    no_decay = [masters["bias"]]
    adamw = torch.optim.AdamW([{"params": [m for f, m in masters.items() if f != "bias"], "weight_decay": HP["weight_decay"]},
                               {"params": no_decay, "weight_decay": 0.0}], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                              foreach=False)
    for step in range(3):
        _set_grads(model, step)
        _set_grads(reference, step)
        assert optimizer.step().updated
        optimizer.zero_grad()
        _reference_step(params, masters, adamw)
        for fqn, master in masters.items():
            assert torch.equal(optimizer.masters[fqn], master), f"step {step}: {fqn}"
            assert torch.equal(optimizer.optimizer.state[optimizer.masters[fqn]]["exp_avg_sq"], adamw.state[master]["exp_avg_sq"])


def test_step_holds_about_one_parameters_fp32_gradient_not_all():
    n, rows = 8, 256
    model = _model(n, rows)
    optimizer = MasterWeightOptimizer(model, **HP)
    _set_grads(model, 0)
    tracker = MemoryTracker()
    with tracker:
        tracker.start_stage("step")
        optimizer.step()
    extra = tracker.stages[-1].peak_bytes - tracker.stages[-1].end_bytes
    one_fp32_grad = rows * 64 * 4
    # one chunk's FP32 gradients (<= the largest) + AdamW's sqrt / division temporaries of one tensor
    assert extra <= 3 * one_fp32_grad + 4096, extra
    assert extra < n * one_fp32_grad / 2  # the old cast of every gradient at once held n of them


def test_optimizer_for_sharded_init_refuses_to_step_before_its_masters_are_written():
    model = _model(2)
    optimizer = MasterWeightOptimizer.for_sharded_init(model, **HP)
    _set_grads(model, 0)
    with pytest.raises(RuntimeError, match="never written"):
        optimizer.step()
    values = {fqn: torch.full(p.shape, 0.5) for fqn, p in model.named_parameters()}
    optimizer.initialize_masters_(values.__getitem__)
    assert all(torch.equal(m, torch.full_like(m, 0.5)) for m in optimizer.masters.values())
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())  # params copied from masters
    assert optimizer.step().updated


def test_initialize_masters_rounds_to_the_parameter_dtype_first():
    """A BF16 parameter initialised in place would hold bf16(x): its FP32 master is exactly that."""
    model = _model(1)
    optimizer = MasterWeightOptimizer.for_sharded_init(model, **HP)
    value = torch.randn(256, 64) / 3
    optimizer.initialize_masters_(lambda fqn: value if fqn == "w0" else torch.zeros(64))
    assert torch.equal(optimizer.masters["w0"], value.to(torch.bfloat16).float())
