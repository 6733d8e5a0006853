"""DeepSeek-V3's expert balancing against independent references (megatron-core 0.16.1's own
functions, hand-computed cases) and the router's counting rules (training forwards only, once
under activation recompute, summed over micro-batches)."""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

import te_npu
from models.deepseek_v3 import DSV3_TINY, DeepseekV3ForCausalLM, materialize_
from models.deepseek_v3.balance_step import ExpertLoadBalancer
from models.deepseek_v3.load_balance import routing_figures, sequence_balance_loss, updated_expert_bias
from models.deepseek_v3.model import TopKRouter, initial_value
from te_npu.training.task_step import StepEnd

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils",
                                reason="megatron-core (a test dependency) is the independent reference")


def _megatron_seq_aux_loss(logits_BSE: torch.Tensor, top_k: int, coeff: float) -> torch.Tensor:
    """megatron-core's sequence-level aux loss, one sequence at a time: its routing scores for the aux
    loss (sigmoid, normalised; top-k without bias) and its switch load-balancing loss, averaged."""
    losses = []
    for logits_SE in logits_BSE:
        routing_map_SE, scores_SE = moe_utils.compute_routing_scores_for_aux_loss(logits_SE, top_k, "sigmoid")
        losses.append(moe_utils.switch_load_balancing_loss_func(
            scores_SE, routing_map_SE.sum(dim=0), logits_SE.shape[0], top_k, logits_SE.shape[-1], coeff))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("B, S, E, K", [(1, 16, 8, 2), (3, 32, 8, 2), (2, 24, 16, 6)])
def test_load_balance_sequence_loss_and_its_gradient_equal_megatrons(B, S, E, K, gen):
    logits = torch.randn(B, S, E, generator=gen, dtype=torch.float64).float().requires_grad_()
    ours = sequence_balance_loss(logits.sigmoid(), K, 1e-4)
    (grad_ours,) = torch.autograd.grad(ours, logits)
    reference = _megatron_seq_aux_loss(logits, K, 1e-4)
    (grad_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-5, atol=1e-12)


def test_load_balance_sequence_loss_hand_case():
    """One sequence of 2 tokens, 2 experts, top-1: scores (0.75, 0.25) and (0.5, 0.5 -> tie to 0).
    s' = s (rows sum to 1); f = 2/(1*2) * (2, 0) = (2, 0); P = (0.625, 0.375); L = a * 1.25."""
    scores = torch.tensor([[[0.75, 0.25], [0.5, 0.5]]])
    assert sequence_balance_loss(scores, 1, 0.1).item() == pytest.approx(0.125, rel=1e-7)


def _megatron_bias_update(counts: torch.Tensor, bias: torch.Tensor, rate: float) -> torch.Tensor:
    """megatron-core's ``get_updated_expert_bias`` with its all-reduce made a no-op (one rank: the
    counts are already summed over ranks, as ours are when the rule runs)."""
    with mock.patch.object(torch.distributed, "all_reduce", lambda *a, **k: None), \
            mock.patch.object(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **k: None):
        return moe_utils.get_updated_expert_bias(counts.clone(), bias, rate)


@pytest.mark.parametrize("rate", [1e-3, 1e-2])
def test_load_balance_bias_update_is_megatrons_bitwise(rate, gen):
    bias = torch.randn(3, 16, generator=gen) * 0.01
    counts = torch.randint(0, 50, (3, 16), generator=gen)
    counts[0] = 7  # every expert at the mean: no move
    counts[1, :8], counts[1, 8:] = 3, 5  # mean 4: half rise, half fall
    ours = updated_expert_bias(bias, counts, rate)
    theirs = _megatron_bias_update(counts.float(), bias, rate)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[0], bias[0])
    assert torch.equal(ours[1, :8], bias[1, :8] + rate) and torch.equal(ours[1, 8:], bias[1, 8:] - rate)


def test_load_balance_routing_figures_hand_case():
    counts = torch.tensor([[4, 4, 4, 4], [10, 5, 1, 0], [0, 0, 0, 0]])
    flat, skewed, unseen = routing_figures(counts)
    assert (flat.load_max, flat.load_min, flat.load_cv, flat.experts_under_10pct) == (1.0, 1.0, 0.0, 0)
    # mean 4: shares 2.5, 1.25, 0.25, 0; population std sqrt(((6)^2 + 1 + 9 + 16) / 4) = sqrt(15.5)
    assert skewed.load_max == 2.5 and skewed.load_min == 0.0 and skewed.experts_under_10pct == 1
    assert skewed.load_cv == pytest.approx(math.sqrt(15.5) / 4, rel=1e-12)
    assert unseen.load_cv == 0.0 and unseen.experts_under_10pct == 0


def _tiny(layers: int = 2) -> DeepseekV3ForCausalLM:
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DSV3_TINY.replace(num_hidden_layers=layers))
    return materialize_(model, seed=0)


def _counts(model) -> list[torch.Tensor]:
    return [router.take_step_counts()[0] for router in model.routers()]


def _picks(model, ids) -> list[torch.Tensor]:
    """What each router picks for ``ids`` (a hook on the routers, in a no-grad forward)."""
    picked, mode = [], model.training
    model.eval()
    hooks = [r.register_forward_hook(lambda m, a, out: picked.append(
        torch.bincount(out[1].flatten(), minlength=m.e_score_correction_bias.numel()))) for r in model.routers()]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    model.train(mode)
    return picked


def test_router_counts_training_forwards_only_and_sums_micro_batches(gen):
    model = _tiny(3)
    a, b = (torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2))
    model.eval()
    model(a)  # evaluation mode (the Trainer's evaluate): no count
    with torch.no_grad():
        model(a)
    model.train()
    assert all(int(c.sum()) == 0 for c in _counts(model))
    model(a)
    model(b)  # two micro-batches of one step
    expected = [x + y for x, y in zip(_picks(model, a), _picks(model, b))]
    got = _counts(model)
    assert len(got) == 2 and all(torch.equal(g, e) for g, e in zip(got, expected))
    assert all(int(g.sum()) == 2 * 16 * 2 * DSV3_TINY.num_experts_per_tok for g in got)
    assert all(int(c.sum()) == 0 for c in _counts(model))  # taken: the next step starts from zero


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_router_counts_once_under_activation_recompute(use_reentrant, gen):
    model = _tiny(2)
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    layers = model.model.layers
    x = model.model.embed_tokens(ids)
    cos, sin = torch.ones(1, 16, 32), torch.zeros(1, 16, 32)
    out = te_npu.checkpoint(layers[1], x, cos, sin, use_reentrant=use_reentrant)
    out.float().pow(2).mean().backward()  # the backward replays the layer's forward
    router = layers[1].mlp.gate
    counts, _, forwards = router.take_step_counts()
    assert forwards == 1 and int(counts.sum()) == 2 * 16 * DSV3_TINY.num_experts_per_tok


def test_model_balance_loss_is_the_routers_sum_and_reaches_the_router_weights(gen):
    model = _tiny(3)
    model.set_seq_aux_loss_coeff(1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    scores = []
    hooks = [r.register_forward_hook(lambda m, a, out: scores.append(
        torch.nn.functional.linear(a[0].float(), m.weight).sigmoid().reshape(2, 16, -1))) for r in model.routers()]
    out = model(ids)
    for h in hooks:
        h.remove()
    expected = sum(sequence_balance_loss(s, DSV3_TINY.num_experts_per_tok, 1e-2) for s in scores)
    torch.testing.assert_close(out.balance_loss, expected, rtol=1e-6, atol=0)
    out.balance_loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in model.routers())
    assert model.lm_head.weight.grad is None  # only through the routers' P_i
    assert model(ids).balance_loss is not None and _tiny(2)(ids).balance_loss is None  # alpha 0: none


def _step(balancer, step, updated=True, world=1):
    return balancer.step_end(StepEnd(step=step, updated=updated, world_size=world, all_reduce_sum=lambda t: t.clone()))


def test_balancer_moves_biases_once_per_step_and_not_on_a_skipped_step(gen):
    model = _tiny(2)
    balancer = ExpertLoadBalancer(ExpertLoadBalancer.routers_of(model, TopKRouter), bias_update_rate=0.01,
                                  bias_update_until_step=2, idle_expert_warn_steps=2)
    router = model.routers()[0]
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    model(ids)
    counts = _picks(model, ids)[0]
    report = _step(balancer, 1)
    assert torch.equal(router.e_score_correction_bias, updated_expert_bias(torch.zeros(8), counts, 0.01))
    assert set(report.metrics) >= {"moe/layer_1/load_cv", "moe/layer_1/load_max", "moe/layer_1/load_min",
                                   "moe/layer_1/experts_under_10pct", "moe/layer_1/bias_min", "moe/layer_1/bias_max",
                                   "moe/layer_1/balance_loss"}
    assert report.summary.startswith("routing (worst layer_1): cv ")
    before = router.e_score_correction_bias.clone()
    model(ids)
    _step(balancer, 2, updated=False)  # skipped: no move
    assert torch.equal(router.e_score_correction_bias, before)
    model(ids)
    _step(balancer, 3)  # after bias_update_until_step: rate 0
    assert torch.equal(router.e_score_correction_bias, before)
    assert balancer.rate_at(2) == 0.01 and balancer.rate_at(3) == 0.0


def test_balancer_names_an_expert_idle_for_many_steps(gen):
    model = _tiny(2)
    balancer = ExpertLoadBalancer(ExpertLoadBalancer.routers_of(model, TopKRouter), bias_update_rate=0.0,
                                  bias_update_until_step=None, idle_expert_warn_steps=2)
    router = model.routers()[0]
    with torch.no_grad():
        router.e_score_correction_bias[3] = -10.0  # expert 3 is never picked
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    warnings = []
    for step in (1, 2, 3, 4):
        model(ids)
        warnings.append(_step(balancer, step).warnings)
    assert warnings[0] == () and warnings[2] == ()
    assert any("MoE layer_1: expert 3 got no token for 2 steps in a row" in w for w in warnings[1])
    assert any("expert 3 got no token for 4 steps in a row" in w for w in warnings[3])


def test_initial_value_refuses_a_buffer_it_has_no_rule_for():
    model = _tiny(2)
    model.model.layers[0].self_attn.register_buffer("mystery", torch.zeros(3))
    with pytest.raises(ValueError, match="no rule for buffer .model.layers.0.self_attn.mystery."):
        initial_value(model, "model.layers.0.self_attn.mystery", 0)
    assert torch.equal(initial_value(model, "model.layers.1.mlp.gate.e_score_correction_bias", 0), torch.zeros(8))


def test_balance_loss_under_activation_recompute_trains_as_without_it(gen):
    """A recomputed MoE layer replays the balance loss's forward (it must save the same tensors: torch
    checks) without counting again, and the router's gradient equals the plain run's."""
    grads = []
    for recompute in (False, True):
        model = _tiny(2)
        model.set_seq_aux_loss_coeff(1e-2)
        if recompute:
            from te_npu.training.recompute import apply_activation_checkpointing
            from models.deepseek_v3.model import DecoderLayer

            apply_activation_checkpointing(model, (DecoderLayer,))
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        out = model(ids)
        (out.logits.float().pow(2).mean() + out.balance_loss).backward()
        counts, _, forwards = model.routers()[0].take_step_counts()
        assert forwards == 1 and int(counts.sum()) == 2 * 16 * DSV3_TINY.num_experts_per_tok
        grads.append(model.routers()[0].weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_hf_config_balance_fields_are_named_in_one_line(tmp_path):
    import json

    from models.deepseek_v3.config import to_hf_config_dict
    from models.deepseek_v3.model_section import DeepseekV3ModelSection

    fields = {**to_hf_config_dict(DSV3_TINY), "aux_loss_alpha": 0.001, "seq_aux": True, "topk_method": "noaux_tc"}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    (note,) = DeepseekV3ModelSection(hf_config=str(tmp_path)).notes()
    assert "aux_loss_alpha=0.001, seq_aux=true, topk_method='noaux_tc'" in note and "\n" not in note
    assert "model.load_balance (seq_aux_loss_coeff=0.0001, bias_update_rate=0.001)" in note
    assert DeepseekV3ModelSection(preset="dsv3_tiny").notes() == ()
