"""Multi-token prediction versus an independent reference (CPU, fp32, no autocast).

The reference is written here from the technical report (section 2.2): plain PyTorch for the
shifts, norms, ``eh_proj`` concatenation, head and per-position cross-entropy, and
transformers' ``DeepseekV3DecoderLayer`` as each depth's transformer block (transformers has
no MTP module). Megatron-core's ``roll_tensor`` checks the shifted inputs and targets.
"""
import pytest
import torch
import torch.nn.functional as F

import te_npu
from models.deepseek_v3 import DSV3_TINY, DeepseekV3ForCausalLM, from_hf_state_dict
from models.deepseek_v3.hf_mapping import load_state_dict_strict_
from models.deepseek_v3.model_section import MTPSection
from models.deepseek_v3.mtp import mtp_cross_entropy, shift_left
from tests.model.conftest import hf_model_for

pytest.importorskip("transformers", reason="the reference's transformer blocks are transformers'")

N_MAIN, DEPTHS, S = 2, 2, 12
_MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _models(gen):
    """Ours with D = 2 and transformers' twin with the MTP blocks as ordinary layers 2 and 3; the
    MTP-only tensors (random, norms far from 1) kept apart for the reference."""
    config = DSV3_TINY.replace(num_hidden_layers=N_MAIN, num_nextn_predict_layers=DEPTHS)
    hf = hf_model_for(config.replace(num_hidden_layers=N_MAIN + DEPTHS, num_nextn_predict_layers=0), seed=0)
    ours = DeepseekV3ForCausalLM(config, seed=1)
    state = from_hf_state_dict(hf.state_dict())
    mtp_only = {}
    for k in range(DEPTHS):
        for name in _MTP_ONLY:
            fqn = f"model.layers.{N_MAIN + k}.{name}"
            shape = ours.state_dict()[fqn].shape
            scale = 0.05 if name == "eh_proj.weight" else 0.5
            mtp_only[fqn] = (1.0 if "norm" in name else 0.0) + scale * torch.randn(shape, generator=gen)
    load_state_dict_strict_(ours, {**state, **mtp_only})
    return config, ours, hf, {k: v.clone().requires_grad_() for k, v in mtp_only.items()}


def _reference_logits(hf, p, ids, eps):
    """Depth k at position i: block_k(eh_proj [enorm(emb(t[i + k])) ; hnorm(h_{k-1}[i])]), head of
    shared_head.norm; h_0 the main model's normed output; positions without t[i + k] embed id 0."""
    B, S_ = ids.shape
    pos = torch.arange(S_)[None]
    x = hf.model.embed_tokens(ids)
    rope = hf.model.rotary_emb(x, pos)
    for layer in hf.model.layers[:N_MAIN]:
        x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
    h = hf.model.norm(x)
    logits = []
    for k in range(1, DEPTHS + 1):
        ahead = torch.zeros_like(ids)
        for i in range(S_ - k):
            ahead[:, i] = ids[:, i + k]
        L = f"model.layers.{N_MAIN + k - 1}"
        joined = torch.cat([_rms(hf.model.embed_tokens(ahead), p[f"{L}.enorm.weight"], eps),
                            _rms(h, p[f"{L}.hnorm.weight"], eps)], dim=-1)
        h = hf.model.layers[N_MAIN + k - 1](joined @ p[f"{L}.eh_proj.weight"].T, attention_mask=None,
                                            position_ids=pos, position_embeddings=rope)
        logits.append(hf.lm_head(_rms(h, p[f"{L}.shared_head.norm.weight"], eps)))
    return logits


def _reference_loss(logits, ids, k):
    """Mean over (b, i) with i + k + 1 < len(ids) of -log p(t[i + k + 1]) (``logits`` may cover
    fewer positions than ``ids``: the trainer's inputs are ids[:-1], its labels ids[1:])."""
    terms = [-F.log_softmax(logits[b, i].float(), -1)[ids[b, i + k + 1]]
             for b in range(ids.shape[0]) for i in range(min(logits.shape[1], ids.shape[1] - k - 1))]
    return torch.stack(terms).mean()


def test_mtp_two_depths_logits_losses_and_grads_versus_reference(gen):
    config, ours, hf, p = _models(gen)
    ids = torch.randint(0, config.vocab_size, (2, S), generator=gen)
    out = ours(ids, labels=ids)
    ref_logits = _reference_logits(hf, p, ids, config.rms_norm_eps)
    assert len(out.mtp_logits) == len(out.mtp_losses) == DEPTHS
    for k, (got, want) in enumerate(zip(out.mtp_logits, ref_logits), start=1):
        assert (got - want).abs().max().item() <= 1e-5, k
        torch.testing.assert_close(out.mtp_losses[k - 1], _reference_loss(want, ids, k), rtol=1e-6, atol=1e-6)
    sum(out.mtp_losses).backward()
    sum(_reference_loss(logits, ids, k) for k, logits in enumerate(ref_logits, start=1)).backward()
    params = dict(ours.named_parameters())
    for fqn, ref in p.items():
        rel = (params[fqn].grad - ref.grad).norm() / ref.grad.norm()
        assert rel.item() <= 1e-5, f"{fqn}: relative grad error {rel.item():.2e}"


def test_mtp_last_positions_are_ignored_and_only_future_tokens_reach_a_depth(gen):
    """Depth k's logits at i depend on tokens <= i + k only (causal attention, the shift, and the
    chaining: depth k - 1's hidden at j <= i saw tokens <= j + k - 1): changing the last token
    leaves positions < S - 1 - k as they were (up to the grouped GEMMs' summation order, which
    follows the tokens per expert), and moves position S - 1 - k."""
    config, ours, _, _ = _models(gen)
    ids = torch.randint(0, config.vocab_size, (1, S), generator=gen)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % config.vocab_size
    with torch.no_grad():
        a, b = ours(ids).mtp_logits, ours(changed).mtp_logits
    for k in range(1, DEPTHS + 1):
        assert (a[k - 1][:, : S - 1 - k] - b[k - 1][:, : S - 1 - k]).abs().max().item() <= 1e-5, k
        assert (a[k - 1][:, S - 1 - k] - b[k - 1][:, S - 1 - k]).abs().max().item() > 1e-3, k
    # the last k positions have no target: whatever depth k predicts there is not scored
    logits = torch.randn(1, S, config.vocab_size, generator=gen)
    next_labels = torch.randint(0, config.vocab_size, (1, S), generator=gen)
    for k in range(1, DEPTHS + 1):
        garbage = logits.clone()
        garbage[:, S - k:] = 1e4 * torch.randn(1, k, config.vocab_size, generator=gen)
        assert torch.equal(mtp_cross_entropy(logits, next_labels, k), mtp_cross_entropy(garbage, next_labels, k))
        garbage[:, S - k - 1, 0] += 1.0  # the last scored position is scored
        assert not torch.equal(mtp_cross_entropy(logits, next_labels, k), mtp_cross_entropy(garbage, next_labels, k))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_shifts_equal_megatron_roll_tensor(k, gen):
    """Megatron rolls inputs and labels left once per depth, zero-filling (and zeroing the loss
    mask) at the end: depth k's input ids and targets are ours."""
    roll_tensor = pytest.importorskip("megatron.core.transformer.multi_token_prediction",
                                      reason="megatron-core's MTP helpers").roll_tensor
    ids = torch.randint(1, 256, (2, S), generator=gen)
    labels = torch.randint(0, 256, (2, S), generator=gen)
    rolled_ids, rolled_labels, mask = ids, labels, torch.ones_like(labels)
    for _ in range(k):
        rolled_ids, _ = roll_tensor(rolled_ids, shifts=-1, dims=-1)
        rolled_labels, _ = roll_tensor(rolled_labels, shifts=-1, dims=-1)
        mask, _ = roll_tensor(mask, shifts=-1, dims=-1)
    assert torch.equal(shift_left(ids, k, 0), rolled_ids)
    ours = shift_left(labels, k, -100)
    assert torch.equal(ours != -100, mask.bool()) and torch.equal(ours[mask.bool()], rolled_labels[mask.bool()])


def test_task_loss_is_lm_plus_weighted_mtp_mean_and_reports_each_depth(gen):
    """Trainer labels are already shifted: the task's depth losses equal the model's HF-convention
    ones; total = lm + lambda / D * sum; lambda changes after change_step."""
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.task_step import LossParts

    config, ours, _, _ = _models(gen)
    ids = torch.randint(0, config.vocab_size, (2, S + 1), generator=gen)
    task = DeepseekV3Task()
    task.mtp = MTPSection(loss_scaling_factor=0.3, loss_scaling_factor_after=0.1, change_step=4)
    with torch.no_grad():
        reference = ours(ids[:, :-1], labels=ids[:, :-1])
        for steps_done, weight in ((3, 0.3), (4, 0.1)):
            task.steps_done = steps_done  # what step_end records (test_pretrain: the Trainer's hook)
            parts = task.loss(ours, ids[:, :-1], ids[:, 1:])
            assert isinstance(parts, LossParts) and list(parts.extras) == ["mtp_1_loss", "mtp_2_loss"]
            for k in (1, 2):  # shifted labels: depth k at i targets ids[i + k + 1], the last one included
                want = _reference_loss(reference.mtp_logits[k - 1].float(), ids, k)
                torch.testing.assert_close(parts.extras[f"mtp_{k}_loss"], want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(parts.lm_loss, F.cross_entropy(reference.logits.flatten(0, 1),
                                                                       ids[:, 1:].flatten()))
            torch.testing.assert_close(parts.total, parts.lm_loss + weight / 2 * sum(parts.extras.values()))


@pytest.mark.parametrize(("mtp", "match"), [
    ({"change_step": 10}, r"^model\.mtp\.change_step: set together with"),
    ({"loss_scaling_factor_after": 0.1}, r"^model\.mtp\.loss_scaling_factor_after: set together with"),
    ({"loss_scaling_factor": -1}, r"^model\.mtp\.loss_scaling_factor: -1\.0 is out of range"),
    ({"colour": 1}, r"^model\.mtp\.colour: unknown key"),
], ids=["step_alone", "after_alone", "negative", "unknown"])
def test_mtp_section_errors_name_the_key(mtp, match):
    from models.deepseek_v3.model_section import DeepseekV3ModelSection
    from te_npu.training.schema import build_section

    raw = {"preset": "dsv3_tiny", "overrides": {"num_nextn_predict_layers": 1}, "mtp": mtp}
    with pytest.raises(te_npu.ConfigError, match=match):
        build_section(DeepseekV3ModelSection, raw, "model")


def test_mtp_section_on_a_model_without_mtp_is_refused_and_defaults_hold():
    from models.deepseek_v3.model_section import DeepseekV3ModelSection
    from te_npu.training.schema import build_section

    with pytest.raises(te_npu.ConfigError, match=r"^model\.mtp: set, but the model has num_nextn_predict_layers = 0"):
        build_section(DeepseekV3ModelSection, {"preset": "dsv3_tiny", "mtp": {"loss_scaling_factor": 0.1}}, "model")
    section = build_section(DeepseekV3ModelSection, {"preset": "dsv3_tiny", "overrides": {"num_nextn_predict_layers": 1},
                                                     "mtp": {"loss_scaling_factor_after": 0.1, "change_step": 5}},
                            "model")
    assert [section.mtp.weight(s) for s in (1, 5, 6)] == [0.3, 0.3, 0.1]


def test_deepseek_layout_checkpoint_with_mtp_keys_loads_and_its_mtp_logits_equal_the_reference(gen, tmp_path):
    """transformers' save_pretrained of the twin (per-expert keys, the MTP blocks as layers 2, 3),
    plus the MTP-only tensors and the embed_tokens / shared_head.head copies, config.json saying
    num_hidden_layers 2 and num_nextn_predict_layers 2: DeepSeek-V3's release layout. Ours loads
    it; its MTP logits equal the reference's; an export writes the same keys back and re-loads bitwise."""
    import json

    from safetensors.torch import load_file, save_file

    from models.deepseek_v3 import load_hf_checkpoint, save_hf_checkpoint

    config, ours, hf, p = _models(gen)
    hf.save_pretrained(tmp_path / "release")
    tensors = load_file(tmp_path / "release" / "model.safetensors")
    for k in range(N_MAIN, N_MAIN + DEPTHS):
        tensors[f"model.layers.{k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{k}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors.update({k: v.detach().clone() for k, v in p.items()})
    save_file(tensors, tmp_path / "release" / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((tmp_path / "release" / "config.json").read_text())
    raw.update(num_hidden_layers=N_MAIN, num_nextn_predict_layers=DEPTHS)
    (tmp_path / "release" / "config.json").write_text(json.dumps(raw))

    loaded = DeepseekV3ForCausalLM(config, seed=7)
    load_hf_checkpoint(loaded, tmp_path / "release")
    ids = torch.randint(0, config.vocab_size, (2, S), generator=gen)
    with torch.no_grad():
        ref = _reference_logits(hf, p, ids, config.rms_norm_eps)
        for got, want in zip(loaded(ids).mtp_logits, ref):
            assert (got - want).abs().max().item() <= 1e-5

    save_hf_checkpoint(loaded, tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert set(exported) == set(tensors)  # DeepSeek's layout, copies included
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == DEPTHS
    again = DeepseekV3ForCausalLM(config, seed=8)
    load_hf_checkpoint(again, tmp_path / "export")
    for (name, a), b in zip(loaded.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_mtp_model_refuses_a_checkpoint_without_mtp_tensors_naming_them(gen, tmp_path):
    """transformers' own save_pretrained has no MTP tensors although its config says 1: a model
    with an MTP layer refuses it, listing what is missing (no silent random MTP layer)."""
    from models.deepseek_v3 import load_hf_checkpoint

    config = DSV3_TINY.replace(num_hidden_layers=N_MAIN)
    hf_model_for(config, seed=0).save_pretrained(tmp_path)
    with pytest.raises(te_npu.ConfigError, match=r"missing keys: \[model\.layers\.2\.self_attn"):
        load_hf_checkpoint(DeepseekV3ForCausalLM(config.replace(num_nextn_predict_layers=1)), tmp_path)


def test_mtp_layer_under_full_recompute_gives_the_same_gradients(gen):
    """The MTP layer is a recompute unit (a ``DecoderLayer``): wrapped, its tuple output and the
    gradients of every parameter are those of the plain model, bit for bit."""
    from models.deepseek_v3.model import DecoderLayer
    from te_npu.training.recompute import apply_activation_checkpointing

    config = DSV3_TINY.replace(num_hidden_layers=N_MAIN, num_nextn_predict_layers=1)
    plain, wrapped = DeepseekV3ForCausalLM(config, seed=3), DeepseekV3ForCausalLM(config, seed=3)
    assert "model.layers.2" in apply_activation_checkpointing(wrapped, (DecoderLayer,))
    ids = torch.randint(0, config.vocab_size, (2, S), generator=gen)
    for model in (plain, wrapped):
        out = model(ids, labels=ids)
        (out.loss + out.mtp_losses[0]).backward()
    grads = dict(wrapped.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
