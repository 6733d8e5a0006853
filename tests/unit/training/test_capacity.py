"""The capacity estimate runs the real Trainer setup and one step on fake tensors: its resting
bytes equal the parameter arithmetic of the shard plan, its setup peak is the resting state plus
one parameter's full initial value, and its categories add up at every peak."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from models.deepseek_v3.config import DSV3_16B_NUM_PARAMS
from models.deepseek_v3.pretrain import DeepseekV3Task, model_config
from models.deepseek_v3.model import DeepseekV3ForCausalLM, low_precision_scope
from te_npu.errors import ConfigError
from te_npu.training.capacity import estimate, estimation_overrides
from te_npu.training.config import load_config
from tests.system.harness import REPO, TINY_MODEL_OVERRIDES

MX_BYTES_PER_ELEMENT = 2 + 2 / 32  # row + col E4M3 codes, one E8M0 code per 32 of each
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def _expected_resting(cfg, world: int, fmt: str | None) -> int:
    """Per-rank bytes of a fully sharded plan, counted from the meta model: every parameter's
    weight (8-bit for TE GEMM weights), FP32 master and two moments divided by the world size,
    AdamW's step scalar and the buffers on every rank."""
    param_bytes = DTYPE_BYTES[cfg.training.param_dtype]
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_config(cfg), dtype=torch.float32)
    te_weights = _te_weight_fqns(model)
    total = 0.0
    for fqn, p in model.named_parameters():
        n = p.numel()
        if fqn in te_weights and fmt == "mxfp8":
            weight = n * MX_BYTES_PER_ELEMENT
        elif fqn in te_weights and fmt == "hif8":
            weight = n + (4 * world if p.dim() == 2 else 4 * p.shape[0])  # codes + scalar (per rank) or [E] scales
        else:
            weight = n * (4 if ".gate.weight" in fqn else param_bytes)  # the router stays FP32
        total += (weight + 12 * n) / world + 4
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    assert total == math.floor(total)
    return int(total)


def _te_weight_fqns(model) -> set[str]:
    """The GEMM weights of the model's TE modules (the model carries no TE biases)."""
    return {f"{module}.{name}" for module in low_precision_scope(model)
            for name, _ in model.get_submodule(module).named_parameters(recurse=False)}


def test_estimate_tiny_resting_bytes_equal_the_parameter_arithmetic(tmp_path):
    world = 2
    overrides = [TINY_MODEL_OVERRIDES, "training.seq_len=64", "training.micro_batch_size=2",
                 f"data.cache_dir={tmp_path / 'data'}", f"data.max_bytes={2**18}",
                 *estimation_overrides(world, str(tmp_path))]
    cfg = load_config(REPO / "recipes" / "dsv3_tiny_mxfp8.yaml", overrides, model_section=DeepseekV3Task.model_section)
    report = estimate(cfg, DeepseekV3Task(), world_size=world, micro_batches=2)
    assert report.replicated_params == {}
    assert report.resting_bytes == _expected_resting(cfg, world, "mxfp8")
    # setup never holds more than the resting state plus the largest parameter's full FP32 value
    # (its initial value) and that value's local region in the parameter's dtype
    largest = max(p.numel() for p in DeepseekV3ForCausalLM(model_config(cfg)).parameters())
    assert report.setup_peak_bytes <= report.resting_bytes + largest * (4 + 4 / world)
    for stage in report.stages:
        assert sum(stage.peak_by_category.values()) == stage.peak_bytes, stage.name
    names = [s.name for s in report.stages]
    assert names[1:6] == ["setup: build on meta", "setup: shard on meta", "setup: allocate shards",
                          "setup: optimizer state", "setup: initial values"]
    assert "micro-batch 2 backward" in names and names[-2:] == ["optimizer step", "after the step"]
    data = report.as_dict()
    assert {"setup_peak_bytes", "step_peak_bytes", "resting_bytes", "replicated_params", "stages"} <= data.keys()
    assert data["resting_by_category"]["8-bit weights"] > 0 and data["fits"] is True


def test_estimate_tiny_hsdp_holds_the_shard_groups_bytes(tmp_path):
    """HSDP 2 x 2 (world 4, 2 replicas): rank 0 holds exactly what a rank of a flat 2-rank job holds
    (the parameter arithmetic at W = 2: the plan and every shard are the shard group's); the
    replica all-reduce runs on the 2-D mesh the job builds."""
    overrides = [TINY_MODEL_OVERRIDES, "training.seq_len=64", "training.micro_batch_size=2",
                 f"data.cache_dir={tmp_path / 'data'}", f"data.max_bytes={2**18}",
                 *estimation_overrides(4, str(tmp_path), replicate_size=2)]
    cfg = load_config(REPO / "recipes" / "dsv3_tiny_mxfp8.yaml", overrides, model_section=DeepseekV3Task.model_section)
    assert (cfg.fsdp_config.dp_shard_size, cfg.fsdp_config.dp_replicate_size) == (2, 2)
    report = estimate(cfg, DeepseekV3Task(), world_size=4, micro_batches=1)
    assert report.replicated_params == {} and report.replicate_size == 2
    # + the shard sub-mesh FSDP2 slices from the 2-D mesh on meta (its int64 rank tensor, 2 x 8 B)
    assert report.resting_bytes == _expected_resting(cfg, 2, "mxfp8") + 2 * 8
    assert report.plan.startswith("HSDP plan over 4 ranks (2 replicas x 2-rank shard groups)")
    assert "rank 0 of 4 (dp_shard_size 2 x dp_replicate_size 2)" in report.render()
    with pytest.raises(ConfigError, match="fsdp_config.dp_replicate_size: 3 does not divide the world size 4"):
        estimation_overrides(4, str(tmp_path), replicate_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("world, replicate", [(32, 4), (64, 8)])
def test_estimate_16b_mxfp8_hsdp_fits_at_32_and_64_ranks(world, replicate, tmp_path):
    """docs/a5.md's HSDP rows: 16B MXFP8 at 32 ranks (8 x 4) and 64 ranks (8 x 8) exits 0 with nothing
    replicated, rank 0 holding the 8-rank shard group's resting bytes. (Flat, 32 ranks refuse it.)"""
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "estimate_memory.py"), "--config",
                           str(REPO / "recipes" / "dsv3_16b_mxfp8.yaml"), "--world", str(world), "--replicate",
                           str(replicate), "--micro", "2", "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["replicated_params"] == {} and report["replicate_size"] == replicate
    cfg = load_config(REPO / "recipes" / "dsv3_16b_mxfp8.yaml", estimation_overrides(world, str(tmp_path), replicate),
                      model_section=DeepseekV3Task.model_section)
    shard = world // replicate
    # + the device mesh's rank map: FSDP2 reads the shard sub-mesh's ``mesh``, a view of the whole
    # world's int32 rank map (torch 2.13 DeviceMesh._rank_map, [world]), first touched while tracked
    assert report["resting_bytes"] == _expected_resting(cfg, shard, "mxfp8") + 4 * world


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp8", "hif8", "bf16"])
def test_estimate_16b_recipe_as_shipped_fits_at_world_8(fmt, tmp_path):
    """scripts/estimate_memory.py on recipes/dsv3_16b_<fmt>.yaml at --world 8 (two micro-batches: the
    second holds every gradient while it runs, as all later ones do):
    exit 0 (fits an Ascend 950DT), fully sharded (no replica), setup peak <= 1.10x step peak,
    resting bytes = the parameter arithmetic (16,161,832,960 TE GEMM weights of 16,585,005,056),
    setup peak <= resting + the largest parameter's FP32 value and its local region."""
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "estimate_memory.py"), "--config",
                           str(REPO / "recipes" / f"dsv3_16b_{fmt}.yaml"), "--world", "8", "--micro", "2",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["replicated_params"] == {}
    assert report["setup_peak_bytes"] <= 1.10 * report["step_peak_bytes"]
    cfg = load_config(REPO / "recipes" / f"dsv3_16b_{fmt}.yaml", estimation_overrides(8, str(tmp_path)),
                      model_section=DeepseekV3Task.model_section)
    assert report["resting_bytes"] == _expected_resting(cfg, 8, None if fmt == "bf16" else fmt)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_config(cfg), dtype=torch.bfloat16)
    te_numel = sum(model.get_parameter(fqn).numel() for fqn in _te_weight_fqns(model))
    assert te_numel == 16_161_832_960 and sum(p.numel() for p in model.parameters()) == DSV3_16B_NUM_PARAMS
    # setup holds at most the resting state plus the largest parameter's full FP32 initial value
    # (an expert stack, 369,098,752 elements) and its local region
    largest = max(p.numel() for p in model.parameters())
    assert report["setup_peak_bytes"] <= report["resting_bytes"] + largest * (4 + 4 / 8)
