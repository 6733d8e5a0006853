"""Issue 28's done-when: the TE 2.x training script of the issue (Embedding, ``fp8_model_init``
Linears, ``GroupedLinear(4)`` with an empty group, ``fp8_autocast(MXFP8BlockScaling())``,
``is_first_microbatch``, blocks under ``te.distributed.checkpoint`` as Megatron calls it, AdamW,
TE's availability probe, ``parameters_to_vector`` / ``.float()`` on FP8 weights, save / load /
resume) runs after only the TE table's renames (``docs/coming-from-te-megatron.md``), trains, and
resumes bit for bit."""
from __future__ import annotations

import pytest

from tests.unit.test_te_compat_table import RENAMES, _rows

TE_SCRIPT = '''
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

fp8_recipe = recipe.MXFP8BlockScaling()
fp8_available, reason = te.is_fp8_available(return_reason=True)  # TE 2.x: (bool, reason)
assert isinstance(fp8_available, bool) and isinstance(reason, str)
assert te.is_mxfp8_available() in (True, False) and not te.is_nvfp4_available()
M_SPLITS = [32, 64, 0, 32]
STEPS, SAVE_AT, MICRO = 4, 2, 2


def build(seed):
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(256, 64)
    with te.fp8_model_init(enabled=True, recipe=fp8_recipe):
        fc1 = te.Linear(64, 128, bias=True, params_dtype=torch.float32)
        fc2 = te.Linear(128, 64, bias=True, params_dtype=torch.float32)
    experts = te.GroupedLinear(4, 64, 64, bias=True, params_dtype=torch.float32)
    model = torch.nn.ModuleDict({"embed": embed, "fc1": fc1, "fc2": fc2, "experts": experts})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def block(model, h, is_first_microbatch):
    h = torch.nn.functional.gelu(model["fc1"](h, is_first_microbatch=is_first_microbatch))
    h = model["fc2"](h, is_first_microbatch=is_first_microbatch)
    return model["experts"](h, M_SPLITS, is_first_microbatch=is_first_microbatch)


def train_step(model, optimizer, step):
    optimizer.zero_grad()
    total = 0.0
    for micro in range(MICRO):
        gen = torch.Generator().manual_seed(1000 * step + micro)
        tokens = torch.randint(0, 256, (sum(M_SPLITS),), generator=gen)
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            h = model["embed"](tokens)
            y = te.distributed.checkpoint(block, model, h, micro == 0, distribute_saved_activations=False,
                                          tp_group=None)
        loss = y.float().pow(2).mean() / MICRO
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    # a TE user's logging: the parameter norm and one weight's high-precision copy
    param_norm = torch.nn.utils.parameters_to_vector(model.parameters()).norm().item()
    w = model["fc1"].weight.float()
    assert type(w) is torch.Tensor and w.t().shape == (64, 128) and param_norm == param_norm
    return total


model, optimizer = build(seed=0)
losses = []
for step in range(STEPS):
    losses.append(train_step(model, optimizer, step))
    if step + 1 == SAVE_AT:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, CHECKPOINT)
assert all(l == l for l in losses) and losses[-1] < losses[0], losses

# resume in fresh modules (another init), strictly, and redo the last steps
model, optimizer = build(seed=123)
state = torch.load(CHECKPOINT, weights_only=True)
model.load_state_dict(state["model"], strict=True)
optimizer.load_state_dict(state["optimizer"])
resumed = [train_step(model, optimizer, step) for step in range(SAVE_AT, STEPS)]
assert resumed == losses[SAVE_AT:], (resumed, losses[SAVE_AT:])
RESULT.update(losses=losses, resumed=resumed)
'''


@pytest.mark.filterwarnings("ignore::te_npu.tensor.QuantizedWeightUpdateWarning")
def test_te_script_with_distributed_checkpoint_trains_and_resumes(tmp_path):
    script = TE_SCRIPT
    for old, new in RENAMES:
        script = script.replace(old, new)
    assert "transformer_engine" not in script and "te.distributed.checkpoint(" in script
    result: dict = {}
    exec(compile(script, "<ported TE script>", "exec"), {"CHECKPOINT": str(tmp_path / "ckpt.pt"), "RESULT": result})
    assert len(result["losses"]) == 4 and result["resumed"] == result["losses"][2:]
    rows = _rows()
    for name in ("transformer_engine.pytorch.distributed.checkpoint(", "transformer_engine.pytorch.is_fp8_available("):
        assert any(name in row for row in rows), name  # the names the script uses are in the TE table
