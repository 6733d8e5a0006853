"""The acceptance matrix: each case's jobs and phases, and the rules each phase answers.

A case (``Q3-01``..``Q3-11``, docs/a5.md, acceptance matrix) reads the per-rank results of some
(job, phase) pairs. Jobs: ``train-<fmt>`` (phases of ``PHASES``, one fresh Trainer each, in the
same processes), ``resume-<fmt>`` (Q3-09's resume, in fresh processes), ``perf`` and
``profile`` (phases: the formats). ``NEEDS[case]`` lists (job, phase, rules): the
``te_npu.testing.acceptance.rules`` results of that phase that count for the case (None: all);
a phase's error always counts. ``phase_rules`` chooses which rules a train phase answers.
"""
from __future__ import annotations

from te_npu.testing.acceptance import rules as R
from te_npu.testing.acceptance.run_config import FORMATS, RunSettings

__all__ = ["CASES", "PASS", "FAIL", "NOT_JUDGED", "SHORT_STEPS", "PERF_WARMUP", "PERF_STEADY", "PROFILE_STEPS",
           "MISALIGNED", "MISALIGNED_FQN", "MISALIGNED_SHAPE", "PHASES", "NEEDS", "REPORTED", "phase_rules"]

CASES = {
    "Q3-01": "BF16 baseline: >= 20 steps finite, save and resume 5 steps",
    "Q3-02": "MXFP8 end to end: every GEMM role in MXFP8, no high-precision GEMM",
    "Q3-03": "HiF8 end to end: every GEMM role in HiF8, FP32 current scales",
    "Q3-04": "model boundary: TE modules exactly the low-precision scope",
    "Q3-05": "MXFP8 FSDP2: gathers with reshard_after_forward true / false",
    "Q3-06": "HiF8 FSDP2: data + scale gathers, rank scales, expert order",
    "Q3-07": "gradient accumulation: one refresh per weight per optimizer step",
    "Q3-08": "full recompute: no extra refresh or weight quantization",
    "Q3-09": "DCP resume: N + 5 continuous vs saved at N, resumed in fresh processes",
    "Q3-10": "illegal configurations fail in their stage naming key / FQN / shape",
    "Q3-11": "performance: steady tokens/s and step time vs BF16",
}
PASS, FAIL, NOT_JUDGED = "pass", "fail", "not judged"
SHORT_STEPS = 5  # the switch phases (Q3-05..08) and the resume each run 5 optimizer steps
PERF_WARMUP = {"cpu": 3, "npu": 10}  # Q3-11's warm-up steps, left out of its steady means
PERF_STEADY = 20  # Q3-11's steady steps after the warm-up
PROFILE_STEPS = 3  # the profiled job (time shares): warm-up as PERF_WARMUP, then these

# Q3-10's shard row: hidden_size 96 and v_head_dim 48 make o_proj [96, 96]: 48 local rows and 48
# local columns on 2 ranks, no 64-aligned MXFP8 shard dim; setup must refuse it naming FQN and shape.
MISALIGNED = ("model.validate_16b=false",
              "model.overrides={num_hidden_layers: 2, n_shared_experts: 2, hidden_size: 96, v_head_dim: 48}")
MISALIGNED_FQN, MISALIGNED_SHAPE = "model.layers.0.self_attn.o_proj.weight", "[96, 96]"

PHASES = {
    "main": (("fsdp_config.reshard_after_forward=true",), None),
    "reshard_false": (("fsdp_config.reshard_after_forward=false",), SHORT_STEPS),
    "accum": (("training.gradient_accumulation_steps=2",), SHORT_STEPS),
    "recompute": (("activation_checkpoint.mode=full",), SHORT_STEPS),
    "misaligned": (MISALIGNED, 0),
}
"""Phases of a format's training job: (overrides, optimizer steps; None: the run's ``--steps``)."""

_RUN = ("steps", "loss_trend")
_KERNELS = ("gemm_roles", "gemm_counts")
_LIFECYCLE = ("steps", "refreshes", "gemm_counts", "no_low_precision_work")
NEEDS = {
    "Q3-01": [("train-bf16", "main", None), ("resume-bf16", "resume", None)],
    "Q3-02": [("train-mxfp8", "main", _RUN + _KERNELS)],
    "Q3-03": [("train-hif8", "main", _RUN + _KERNELS + ("hif8_scales",))],
    "Q3-04": [("train-mxfp8", "main", ("scope", "high_precision_pieces")),
              ("train-hif8", "main", ("scope", "high_precision_pieces"))],
    "Q3-05": [("train-mxfp8", "main", ("steps", "gathers")), ("train-mxfp8", "reshard_false", ("steps", "gathers"))],
    "Q3-06": [("train-hif8", "main", ("steps", "gathers")), ("train-hif8", "reshard_false", ("steps", "gathers"))],
    "Q3-07": [(f"train-{f}", "accum", _LIFECYCLE) for f in FORMATS],
    "Q3-08": [(f"train-{f}", "recompute", _LIFECYCLE + ("gathers",)) for f in FORMATS],
    "Q3-09": [(f"train-{f}", "main", ("checkpoint_contents",)) for f in FORMATS]
    + [(f"resume-{f}", "resume", None) for f in FORMATS],
    "Q3-10": [("train-mxfp8", "misaligned", None)],
    "Q3-11": [("perf", f, None) for f in FORMATS],
}
REPORTED = {"Q3-11": [("profile", f) for f in FORMATS]}
"""case -> the (job, phase)s its report needs besides the judged ones (a failure there is reported,
never judged): Q3-11's time shares come from a profiled run apart from its profiling-off timing."""


def phase_rules(settings: RunSettings, fmt: str, phase: str, result: dict, cfg, world: int,
                steps: int) -> dict[str, list[str]]:
    """The rules a train phase answers (each: its problems). Every phase: its steps; the main
    phase: the loss trend; BF16: no low-precision work; 8-bit formats: GEMM roles and counts,
    refreshes, gathers (more than one rank), and on the main phase the scope, the high-precision
    pieces and (HiF8) the activation scales."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[cfg.training.param_dtype]
    micro = cfg.training.gradient_accumulation_steps
    recompute = cfg.activation_checkpoint.mode == "full"
    reshard = cfg.fsdp_config.reshard_after_forward
    rules = {"steps": R.check_steps(result, steps)}
    if phase == "main":
        rules["loss_trend"] = R.check_loss_falls(result["records"], min_drop=None)
    if fmt == "bf16":
        rules["no_low_precision_work"] = R.check_no_low_precision_work(result)
        return rules
    rules["gemm_roles"] = R.check_gemm_roles(result, fmt, settings.backend, dtype)
    rules["gemm_counts"] = R.check_gemm_counts(result, micro, recompute)
    rules["refreshes"] = R.check_refreshes(result, fmt, micro, recompute)
    if world > 1:
        rules["gathers"] = R.check_gathers(result, fmt, micro, reshard, world)
    if phase == "main":
        model = settings.model
        rules["scope"] = R.check_scope(result, model.expected_scope(cfg))
        rules["high_precision_pieces"] = R.check_high_precision_pieces(result, *model.layers(cfg))
        if fmt == "hif8":
            rules["hif8_scales"] = R.check_hif8_activation_scales(result)
    return rules
