"""Every forward uses the weight's current values, however they were written (issue 14, item 1).

Each case writes new values between two forwards -- through ``param.data`` (``copy_``,
``mul_``: Megatron's optimizer, EMA swaps), ``load_state_dict``, rebinding (``param.data = t``,
a new ``nn.Parameter``), ``.to()`` -- and checks the forward against a fresh module built from
those values. Both formats, dense, grouped and SwiGLU experts, high-precision weights (quantized
per forward) and quantized weights (read as stored).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import te_npu
from te_npu import functional as te_functional
from te_npu.tensor import QuantizedWeightTensor, quantize_weight
from tests.seeded import seeded_init, seeded_randn
from tests.unit.functional.gemm_reference import RECIPES

KINDS = {
    "dense": (lambda: te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16), (32, 64), ()),
    "grouped": (lambda: te_npu.TEGroupedLinear(4, 64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16), (100, 64), ([40, 0, 55, 5],)),
    "swiglu": (lambda: te_npu.TEGroupedSwiGLUExperts(4, 64, 32, init_method=seeded_init(0, std=0.02)), (100, 64),
               ([40, 0, 55, 5],)),
}


def _new_values(module: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: (torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16) for name, p in module.named_parameters()}


def _set_data_copy(module, values):
    for name, p in module.named_parameters():
        p.data.copy_(values[name])


def _set_data_mul(module, values):
    for name, p in module.named_parameters():  # values = 2 * current, written through .data
        values[name] = (p.dequantize() if isinstance(p, QuantizedWeightTensor) else p.detach()) * 2
        p.data.mul_(2)


def _load_state_dict(module, values):
    module.load_state_dict(values)


def _rebind_data(module, values):
    for name, p in module.named_parameters():
        if isinstance(p, QuantizedWeightTensor):
            p.data.copy_(values[name])  # a quantized parameter's storage is its inner tensors
        else:
            p.data = values[name].clone()


def _rebind_parameter(module, values):
    for name, p in list(module.named_parameters()):
        new = values[name].clone()
        if isinstance(p, QuantizedWeightTensor):
            new = type(p).from_high_precision(new, p._quantizer)
        setattr(module, name, nn.Parameter(new))


def _to(module, values):
    if any(isinstance(p, QuantizedWeightTensor) for p in module.parameters()):
        module._apply(lambda t: t.to("cpu", copy=True))  # new quantized copies (a device move's path)
        _set_data_copy(module, values)
    else:
        module.to(torch.float32)  # new storages in another dtype, written, then back
        _set_data_copy(module, values)
        module.to(torch.bfloat16)


WRITES = {"data_copy_": _set_data_copy, "data_mul_": _set_data_mul, "load_state_dict": _load_state_dict,
          "param_data_rebind": _rebind_data, "parameter_rebind": _rebind_parameter, "to": _to}


def _reference(kind: str, values: dict[str, torch.Tensor], recipe, quantized: bool, x, extra) -> torch.Tensor:
    """The forward of ``values`` straight through ``te_npu.functional`` (no module, no cache)."""
    weights = {name: (quantize_weight(v, recipe) if quantized else v) for name, v in values.items()}
    if kind == "dense":
        return te_functional.linear(x, weights["weight"], recipe=recipe)
    if kind == "grouped":
        return te_functional.grouped_linear(x, weights["weight"], *extra, recipe=recipe)
    return te_functional.grouped_swiglu(x, weights["gate_up_proj"], weights["down_proj"], *extra, recipe=recipe)


@pytest.mark.filterwarnings("ignore::te_npu.tensor.QuantizedWeightUpdateWarning")  # .data.mul_ of an 8-bit weight
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("quantized", [False, True], ids=["high_precision", "quantized"])
def test_te_modules_forward_uses_values_written_between_forwards(recipe, kind, quantized):
    gen = torch.Generator().manual_seed(11)
    build, x_shape, extra = KINDS[kind]
    module = build()
    if quantized:
        te_npu.quantize_weights_(module, recipe)
    x = torch.randn(*x_shape, generator=gen).to(torch.bfloat16)
    previous = None
    for write, apply_write in WRITES.items():
        values = _new_values(module, gen)
        apply_write(module, values)
        assert all(isinstance(p, QuantizedWeightTensor) == quantized for p in module.parameters()), write
        with te_npu.autocast(recipe=recipe):
            y = module(x, *extra)
        assert torch.equal(y, _reference(kind, values, recipe, quantized, x, extra)), write
        assert previous is None or not torch.equal(y, previous), write
        previous = y


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_linear_stale_data_write_loss_decreases(recipe):
    """The issue's script: train with ``lin.weight.data.copy_(master)`` after each step; the
    8-bit loss must follow the master like the BF16 one does, not stay flat."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    target = torch.randn(64, 64, generator=gen).to(torch.bfloat16)

    def losses(use_recipe):
        lin = te_npu.TELinear(64, 64, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
        master = lin.weight.detach().float().clone().requires_grad_()
        optimizer = torch.optim.SGD([master], lr=0.5)
        out = []
        for _ in range(4):
            with te_npu.autocast(enabled=use_recipe, recipe=recipe):
                loss = (lin(x).float() - target.float()).pow(2).mean()
            loss.backward()
            master.grad = lin.weight.grad.float()
            lin.weight.grad = None
            optimizer.step()
            lin.weight.data.copy_(master.detach())
            out.append(loss.item())
        return out

    eight_bit, baseline = losses(True), losses(False)
    assert baseline[-1] < baseline[0] and eight_bit[-1] < eight_bit[0] - 0.5 * (baseline[0] - baseline[-1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_linear_is_first_microbatch_false_sees_metadata_changes(recipe):
    """``False`` reuses the kept copy only while nothing visible changed; a version bump, a new
    storage, a new parameter object, ``.to()`` or another recipe quantizes anew."""
    from te_npu.events import QuantEvent, subscribe

    lin = te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
    x = seeded_randn(3)(32, 64)

    def quantizations(flag):
        events = []
        with subscribe(events.append), te_npu.autocast(recipe=recipe):
            lin(x, is_first_microbatch=flag)
        return len([e for e in events if isinstance(e, QuantEvent) and e.shape == (96, 64)])

    assert quantizations(True) == 1 and quantizations(False) == 0
    with torch.no_grad():
        lin.weight.add_(1.0)  # version bump
    assert quantizations(False) == 1 and quantizations(False) == 0
    lin.weight.data = lin.weight.detach().clone()  # new storage
    assert quantizations(False) == 1
    lin.weight = nn.Parameter(lin.weight.detach().clone())  # new object
    assert quantizations(False) == 1
    lin.to(torch.device("cpu"))
    assert quantizations(False) == 1 and quantizations(False) == 0
    assert quantizations(None) == 1 and quantizations(False) == 0  # None never touches the kept copy
    twin = copy.deepcopy(lin)
    with te_npu.autocast(recipe=recipe):
        assert torch.equal(twin(x, is_first_microbatch=False), lin(x))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_linear_fresh_across_fsdp2_resharding_and_optimizer_steps(recipe):
    """FSDP2 (gloo, one rank, reshard_after_forward) frees and re-gathers the unsharded weight
    around every forward; with optimizer steps in between, every forward (default, and
    is_first_microbatch True / False within a step) equals an unsharded module's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    gen = torch.Generator().manual_seed(2)
    sharded, reference = te_npu.TELinear(64, 96, params_dtype=torch.float32, init_method=seeded_init(0), bias=False), None
    reference = copy.deepcopy(sharded)
    xs = [torch.randn(32, 64, generator=gen) for _ in range(3)]
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fully_shard(sharded, reshard_after_forward=True)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, reference)]
        for step in range(3):
            for micro, x in enumerate(xs):
                flag = None if step == 0 else micro == 0
                with te_npu.autocast(recipe=recipe):
                    got = sharded(x, is_first_microbatch=flag)
                    want = reference(x)  # default: quantized from the current values
                assert torch.equal(got, want), (step, micro)
                got.sum().backward()
                want.sum().backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    finally:
        dist.destroy_process_group()
