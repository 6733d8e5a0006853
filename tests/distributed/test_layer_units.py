"""FSDP2 units per decoder layer (``layer_units``, the trainer's plan) on 2 gloo ranks: one
all-gather per layer and phase carrying every 8-bit weight of the layer in its own schema,
sharded == unsharded bitwise, with and without reshard / full recompute, and a misaligned weight
kept replicated inside its layer's unit.

Toy stack (hidden 64, ffn 128, 2 experts):

    x -> inp Linear (before the layers) -> 2 x Block -> final RMSNorm -> out Linear (after)
    Block: x + experts(mix(up(x * norm))): up TELinear [128, 64], mix TEGroupedLinear [2, 64, 128],
           experts TEGroupedSwiGLUExperts(2) (gate_up [2, 128, 64], down [2, 64, 64]); ``side``
           TELinear [32, 64] (misaligned for MXFP8 over 2 ranks: 16 local rows) only in the
           fallback model.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import te_npu
from te_npu.distributed import finalize_low_precision_weights, layer_units, shard_model
from te_npu.events import FSDPGatherEvent, subscribe
from te_npu.training.recompute import apply_activation_checkpointing
from tests.distributed.harness import EXPERTS, FFN, HIDDEN, M_SPLITS, RECIPES, TOKENS, local, run_ranks
from tests.seeded import BF16_NO_BIAS, fan_in_uniform_init, nn_linear_init

MX_ROW = ("row_data", "row_scale")
MX_BOTH = ("row_data", "row_scale", "col_data", "col_scale")
CONFIGS = [(reshard, recompute) for reshard in (True, False) for recompute in (False, True)]


class Block(nn.Module):
    def __init__(self, side: bool) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16))
        self.up = te_npu.TELinear(HIDDEN, FFN, init_method=nn_linear_init, **BF16_NO_BIAS)
        self.mix = te_npu.TEGroupedLinear(EXPERTS, FFN, HIDDEN, init_method=fan_in_uniform_init, **BF16_NO_BIAS)
        self.experts = te_npu.TEGroupedSwiGLUExperts(EXPERTS, HIDDEN, HIDDEN)
        self.side = te_npu.TELinear(HIDDEN, 32, init_method=nn_linear_init, **BF16_NO_BIAS) if side else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.experts(self.mix(self.up(x * self.norm), M_SPLITS), M_SPLITS)
        if self.side is not None:
            h = h + self.side(h).sum(-1, keepdim=True)
        return x + h


class Stack(nn.Module):
    def __init__(self, side: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)
        self.layers = nn.ModuleList([Block(side) for _ in range(2)])
        self.final = nn.RMSNorm(HIDDEN, dtype=torch.bfloat16)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.final(h))


def _build(fmt: str, *, side: bool = False, recompute: bool = False) -> Stack:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Stack(side)
        with torch.no_grad():
            for layer in model.layers:
                layer.norm.add_(torch.randn(HIDDEN, dtype=torch.bfloat16) * 0.1)
    finalize_low_precision_weights(model, RECIPES[fmt]())
    if recompute:
        apply_activation_checkpointing(model, (Block,))
    return model


def _loss(model: nn.Module, fmt: str) -> torch.Tensor:
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with te_npu.autocast(recipe=RECIPES[fmt]()):
        y = model(x)
    return y.float().pow(2).mean()


def _grads_equal(sharded: nn.Module, reference: nn.Module, rank: int, world: int) -> dict[str, bool]:
    out = {}
    for (fqn, p), (_, ref) in zip(sharded.named_parameters(), reference.named_parameters()):
        if isinstance(p, torch.distributed.tensor.DTensor):
            rows = p.shape[0] // world
            out[fqn] = torch.equal(local(p.grad), ref.grad[rank * rows:(rank + 1) * rows])
        else:  # replicated (fallback): the whole averaged gradient
            out[fqn] = torch.equal(p.grad, ref.grad)
    return out


def _count_collectives(counter: Counter):
    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counter[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _worker(rank, world, workdir, fmt):
    mesh = init_device_mesh("cpu", (world,))
    collectives = Counter()
    _count_collectives(collectives)
    out = {}
    for reshard, recompute in CONFIGS:
        reference, sharded = (_build(fmt, recompute=recompute) for _ in range(2))
        plan = shard_model(sharded, mesh, units=layer_units(sharded, (Block,)), reshard_after_forward=reshard)
        ref_loss = _loss(reference, fmt)
        ref_loss.backward()
        collectives.clear()
        forward, backward = [], []
        with subscribe(forward.append, FSDPGatherEvent):
            loss = _loss(sharded, fmt)
        forward_collectives = dict(collectives)
        with subscribe(backward.append, FSDPGatherEvent):
            loss.backward()
        out[(fmt, reshard, recompute)] = {
            "units": plan.units,
            "loss_equal": torch.equal(loss, ref_loss),
            "grads_equal": _grads_equal(sharded, reference, rank, world),
            "forward": [(r.context, r.fields) for r in forward],
            "backward": [(r.context, r.fields) for r in backward],
            "forward_collectives": forward_collectives,
            "collectives": dict(collectives),
        }
    if fmt != "mxfp8":
        return out
    # fallback: the misaligned MXFP8 `side` weights stay replicated inside their layer's unit
    reference, sharded = (_build("mxfp8", side=True) for _ in range(2))
    plan = shard_model(sharded, mesh, units=layer_units(sharded, (Block,)), fallback_to_unsharded=True)
    ref_loss = _loss(reference, "mxfp8")
    ref_loss.backward()
    loss = _loss(sharded, "mxfp8")
    loss.backward()
    out["fallback"] = {
        "replicated": sorted(plan.replicated),
        "loss_equal": torch.equal(loss, ref_loss),
        "grads_equal": _grads_equal(sharded, reference, rank, world),
    }
    return out


QUANTIZED = {f"layers.{i}.{w}" for i in range(2) for w in ("up.weight", "mix.weight", "experts.gate_up_proj", "experts.down_proj")}


@pytest.mark.parametrize("fmt", ["mxfp8", pytest.param("hif8", marks=pytest.mark.slow)])
def test_layer_units_shard_each_layer_once_bitwise_equal_to_unsharded(fmt, tmp_path):
    for rank, res in enumerate(run_ranks(_worker, 2, tmp_path, fmt)):
        for (fmt, reshard, recompute), r in ((k, v) for k, v in res.items() if k != "fallback"):
            where = f"rank {rank} {fmt} reshard={reshard} recompute={recompute}"
            assert r["units"] == (("layers.0",), ("layers.1",), ("inp",), ("final", "out"), ("",)), where
            assert r["loss_equal"], where
            assert all(r["grads_equal"].values()), (where, r["grads_equal"])
            # one all-gather per unit in forward (inp, 2 layers, final+out); in backward the
            # resharded ones again (inp, 2 layers; final+out stays unsharded), one reduce-scatter each
            assert r["forward_collectives"] == {"all_gather_single": 4}, where
            gathers = 4 + (3 if reshard else 0)
            assert r["collectives"] == {"all_gather_single": gathers, "reduce_scatter_single": 4}, where
            # every 8-bit weight gathered with its layer, in its own schema
            assert {c.param_fqn for c, _ in r["forward"]} == QUANTIZED, where
            assert all(c.phase == "forward" and c.reshard_after_forward == reshard for c, _ in r["forward"]), where
            assert all(c.phase == "backward" for c, _ in r["backward"]), where
            if not reshard:
                assert r["backward"] == [], where  # still unsharded from forward, also under recompute
            else:
                assert {c.param_fqn for c, _ in r["backward"]} == QUANTIZED and len(r["backward"]) == len(QUANTIZED), where
            if fmt == "mxfp8":
                assert {f for _, f in r["forward"]} == ({MX_ROW} if reshard else {MX_BOTH}), where
                assert all(f == MX_BOTH for _, f in r["backward"]), where
            else:
                assert all(f == ("qdata", "scale") for _, f in r["forward"] + r["backward"]), where
        if fmt != "mxfp8":
            continue
        fallback = res["fallback"]
        assert fallback["replicated"] == ["layers.0.side.weight", "layers.1.side.weight"]
        assert fallback["loss_equal"] and all(fallback["grads_equal"].values()), fallback["grads_equal"]


def test_layer_units_plan_of_the_tiny_deepseek_model():
    """Meta-built DeepSeek-V3 (BF16, FP32 routers): routers apart, one unit per decoder layer,
    the embedding, then final norm + lm_head together and not resharded after forward."""
    from models.deepseek_v3.config import DSV3_TINY
    from models.deepseek_v3.model import DecoderLayer, DeepseekV3ForCausalLM, TopKRouter

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DSV3_TINY, dtype=torch.bfloat16)
    names = {id(m): n for n, m in model.named_modules()}
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    units = layer_units(model, (DecoderLayer,), apart=routers)
    plan = [(tuple(names[id(m)] for m in u.modules), u.reshard_after_forward) for u in units]
    layers = DSV3_TINY.num_hidden_layers
    assert plan == (
        [((names[id(r)],), None) for r in routers]
        + [((f"model.layers.{i}",), None) for i in range(layers)]
        + [(("model.embed_tokens",), None), (("model.norm", "lm_head"), False)]
    )
    assert len(routers) == layers - DSV3_TINY.first_k_dense_replace


def test_layer_units_needs_a_layer():
    with pytest.raises(ValueError, match="holds no"):
        layer_units(nn.Sequential(nn.Linear(2, 2)), (Block,))
