"""The acceptance rules (cases Q3-01..Q3-11, docs/a5.md, acceptance matrix), each stated once, as
functions returning problems.

Every ``check_*`` takes the plain results of ``te_npu.testing.acceptance.runs`` (one rank's phase,
or all ranks') and returns a list of one-line problems: empty means the rule holds. The acceptance
system tests (``tests/system``) assert the list is empty; the acceptance run
(``te_npu.testing.acceptance.verdicts``) writes it into its report as the reason of a ``fail``.
``expected_*`` derive the counts a rule expects from the model's TE module list (the probe's
``low_precision_modules``). Which rules count for which case: ``te_npu.testing.acceptance.matrix``.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict

import torch

from te_npu.numerics.constants import HIF8_GRAD_MAX, HIF8_INPUT_MAX

__all__ = [
    "GEMMS", "TE_TYPES", "FORMAT_VALUE", "unwrapped", "expected_gemm_counts", "expected_activation_quants",
    "expected_weight_fqns", "gather_counts", "check_steps", "check_loss_falls", "check_no_low_precision_work",
    "check_gemm_roles", "check_gemm_counts", "check_hif8_activation_scales", "check_scope", "check_high_precision_pieces",
    "check_gathers", "check_hif8_weight_scales", "check_refreshes", "check_resume", "check_misaligned_shard",
    "steady_ratios", "check_checkpoint_contents", "ILLEGAL_CONFIGS",
    "check_illegal_config",
]

GEMMS = ("fprop", "dgrad", "wgrad")
TE_TYPES = frozenset({"TELinear", "TEGroupedLinear", "TEGroupedSwiGLUExperts"})
FORMAT_VALUE = {"bf16": None, "mxfp8": "mxfp8_e4m3", "hif8": "hif8"}
GROUPED_GEMMS_PER_CALL = {"TELinear": 0, "TEGroupedLinear": 1, "TEGroupedSwiGLUExperts": 2}
DENSE_GEMMS_PER_CALL = {"TELinear": 1, "TEGroupedLinear": 0, "TEGroupedSwiGLUExperts": 0}
ROW, BOTH = ("row_data", "row_scale"), ("row_data", "row_scale", "col_data", "col_scale")
HIF8_FIELDS = ("qdata", "scale")
_WEIGHT_NAMES = {"TELinear": ("weight",), "TEGroupedLinear": ("weight",),
                 "TEGroupedSwiGLUExperts": ("gate_up_proj", "down_proj")}


class _Problems(list):
    def expect(self, ok, message) -> bool:
        if not ok:
            self.append(message() if callable(message) else message)
        return bool(ok)


# ---- what the model's TE module list implies ----------------------------------------------------
def unwrapped(type_name: str) -> str:
    """FSDP2 renames a sharded module's class ``FSDP<cls>``; the probe records that name."""
    return type_name.removeprefix("FSDP")


def _te_counts(low_precision_modules: dict[str, str]) -> tuple[int, int]:
    types = [unwrapped(t) for t in low_precision_modules.values()]
    return sum(DENSE_GEMMS_PER_CALL[t] for t in types), sum(GROUPED_GEMMS_PER_CALL[t] for t in types)


def expected_gemm_counts(low_precision_modules: dict[str, str], micro_steps: int, recompute: bool = False) -> Counter:
    """``Counter[(kind, gemm)]`` of one optimizer step: 3 GEMMs per TE GEMM call per micro-batch
    (a TELinear is one dense GEMM, TEGroupedSwiGLUExperts two grouped ones); full recompute
    replays every forward once more in backward (fprop twice)."""
    dense, grouped = _te_counts(low_precision_modules)
    counts = Counter()
    for gemm in GEMMS:
        replay = 2 if recompute and gemm == "fprop" else 1
        if dense:
            counts[("dense", gemm)] = dense * micro_steps * replay
        if grouped:
            counts[("grouped", gemm)] = grouped * micro_steps * replay
    return counts


def expected_activation_quants(low_precision_modules: dict[str, str], fmt: str, micro_steps: int,
                               recompute: bool = False) -> int:
    """Quantization calls of one optimizer step inside forward/backward when only activations are
    quantized: every GEMM call quantizes its input X in forward and its dY in backward, each once
    (MXFP8 dense: one dual-axis call; MXFP8 grouped: a row call plus a ragged col call; HiF8: one
    call serves both orientations); full recompute quantizes X once more. A weight quantized
    during forward/backward would add to this count."""
    dense, grouped = _te_counts(low_precision_modules)
    per_grouped = 2 if fmt == "mxfp8" else 1
    sources = 2 + (1 if recompute else 0)  # X (forward, replayed by recompute) and dY (backward)
    return micro_steps * sources * (dense + grouped * per_grouped)


def expected_weight_fqns(low_precision_modules: dict[str, str]) -> set[str]:
    """Parameter FQNs of the 8-bit weights of the TE modules."""
    return {f"{m}.{n}" for m, t in low_precision_modules.items() for n in _WEIGHT_NAMES[unwrapped(t)]}


def gather_counts(probe, step: int) -> Counter:
    """``Counter[(param_fqn, phase)]`` of the quantized-weight all-gathers of one step."""
    return Counter((g.context.param_fqn, g.context.phase) for g in probe.gathers(step))


# ---- Q3-01..03: the run itself --------------------------------------------------------------------
def check_steps(result: dict, steps: int) -> list[str]:
    """``steps`` optimizer steps numbered 1.., each updated, finite loss and grad norm, grad norm > 0."""
    p, records = _Problems(), result["records"]
    p.expect(len(records) == steps, f"{len(records)} optimizer steps, expected {steps}")
    p.expect([r["step"] for r in records] == list(range(1, len(records) + 1)), "steps not numbered 1..N")
    skipped = [r["step"] for r in records if not r["updated"]]
    p.expect(not skipped, f"steps {skipped} skipped (non-finite gradients)")
    bad = [(r["step"], r["lm_loss"], r["grad_norm"]) for r in records
           if not (math.isfinite(r["lm_loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0)]
    p.expect(not bad, f"non-finite loss / grad norm or zero grad norm at (step, loss, grad norm) {bad[:3]}")
    return p


def check_loss_falls(records: list[dict], min_drop: float | None = 0.5, window: int = 5) -> list[str]:
    """Mean loss of the last ``window`` steps below the first ``window``'s by ``min_drop`` (None: only
    that it moves and does not explode: the last window's mean <= 1.5x the first's)."""
    p = _Problems()
    losses = [r["lm_loss"] for r in records]
    if len(losses) < 2 * window:
        return [f"{len(losses)} steps: too few to judge the loss trend (need {2 * window})"]
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    p.expect(len(set(losses)) > 1, "the loss never changes (training does not update)")
    if min_drop is None:
        p.expect(last <= 1.5 * first, f"loss explodes: first {window} mean {first:.4f}, last {window} mean {last:.4f}")
    else:
        p.expect(last < first - min_drop, f"loss not falling by {min_drop}: first {window} mean {first:.4f}, "
                                          f"last {window} mean {last:.4f}")
    return p


def check_no_low_precision_work(result: dict) -> list[str]:
    """The BF16 baseline: no 8-bit GEMM, quantization, gather, refresh or 8-bit parameter."""
    p, probe = _Problems(), result["probe"]
    p.expect(not probe.gemm_events, f"{len(probe.gemm_events)} low-precision GEMM(s) in the BF16 baseline")
    p.expect(not probe.quant_events, f"{len(probe.quant_events)} quantization(s) in the BF16 baseline")
    p.expect(not probe.gather_records, "8-bit all-gathers in the BF16 baseline")
    p.expect(not result["weights"], f"8-bit parameters in the BF16 baseline: {sorted(result['weights'])[:3]}")
    return p


def check_gemm_roles(result: dict, fmt: str, backend: str, output_dtype: torch.dtype) -> list[str]:
    """Q3-02 / 03: dense and grouped fprop, dgrad, wgrad all ran in the recipe's format on ``backend``,
    inside forward/backward only, with the format's scale dtypes; no other format (no fallback)."""
    p, probe = _Problems(), result["probe"]
    missing = {(k, g) for k in ("dense", "grouped") for g in GEMMS} - probe.executed_kernel_roles()
    p.expect(not missing, f"GEMM roles never run in {fmt}: {sorted(missing)}")
    p.expect(probe.kernel_formats() == {FORMAT_VALUE[fmt]}, f"GEMM formats {sorted(probe.kernel_formats())}, "
                                                            f"expected only {FORMAT_VALUE[fmt]}")
    p.expect({e.backend for e in probe.gemms()} == {backend}, f"GEMM backends {sorted({e.backend for e in probe.gemms()})}, "
                                                              f"expected {backend}")
    p.expect(set(probe.gemm_phases) == {"forward_backward"}, f"GEMMs in phases {sorted(set(probe.gemm_phases))}")
    scale_dtype = torch.uint8 if fmt == "mxfp8" else torch.float32  # E8M0 codes / FP32
    dtypes = {(e.left_scale_dtype, e.right_scale_dtype) for e in probe.gemms()}
    p.expect(dtypes == {(scale_dtype, scale_dtype)}, f"GEMM scale dtypes {dtypes}, expected {scale_dtype}")
    outs = {e.output_dtype for e in probe.gemms()}
    p.expect(outs == {output_dtype}, f"GEMM output dtypes {outs}, expected {output_dtype}")
    return p


def check_gemm_counts(result: dict, micro_steps: int, recompute: bool = False) -> list[str]:
    """Each step ran exactly the GEMMs the TE module list implies (no extra, no missing one)."""
    p, probe = _Problems(), result["probe"]
    expected = expected_gemm_counts(probe.low_precision_modules, micro_steps, recompute)
    p.expect(sum(expected.values()) > 0, "no TE module: no low-precision GEMM expected")
    for step in range(len(result["records"])):
        got = probe.gemm_counts(step)
        p.expect(got == expected, lambda: f"step {step + 1}: GEMMs {dict(got)}, expected {dict(expected)}")
    return p


def check_hif8_activation_scales(result: dict) -> list[str]:
    """Q3-03: every HiF8 scale is FP32, finite, positive and ``amax * (1 / format_max)`` of its own
    tensor; activations use 15 (inputs) and 224 (gradients), the optimizer's weight refresh 15."""
    p, probe = _Problems(), result["probe"]
    events = [e for e in probe.hif8_quant_events() if e.format_max is not None]
    if not p.expect(events, "no HiF8 quantization reported its amax and format maximum"):
        return p
    p.expect({e.format_max for e in events} == {HIF8_INPUT_MAX, HIF8_GRAD_MAX},
             f"HiF8 maxima {sorted({e.format_max for e in events})}, expected 15 and 224")
    for e in events:
        if not p.expect(e.amax is not None and e.scale is not None, f"{e.shape}: no amax / scale reported"):
            continue
        ok = e.scale.dtype == torch.float32 and bool(torch.isfinite(e.scale).all()) and bool((e.scale > 0).all())
        p.expect(ok, f"{e.shape}: scale {e.scale} not FP32 / finite / positive")
        amax = e.amax.float().cpu()
        recip = float(torch.tensor(1.0) / torch.tensor(e.format_max))  # the kernel's amax * (1.0f / max)
        expected = torch.where(torch.isfinite(amax) & (amax > 0), amax * recip, torch.ones_like(amax))
        p.expect(torch.equal(e.scale.cpu(), expected), f"{e.shape} max {e.format_max}: scale {e.scale} != amax {amax} "
                                                       f"* (1 / {e.format_max})")
    fb = {e.format_max for e in probe.quant_events_in("forward_backward")}
    p.expect(fb == {HIF8_INPUT_MAX, HIF8_GRAD_MAX}, f"forward/backward HiF8 maxima {sorted(fb)}, expected 15 and 224")
    opt = {e.format_max for e in probe.quant_events_in("optimizer_step")}
    p.expect(opt == {HIF8_INPUT_MAX}, f"optimizer-step HiF8 maxima {sorted(opt)}, expected 15 (weights)")
    return p


# ---- Q3-04: the model boundary --------------------------------------------------------------------
def check_scope(result: dict, expected_scope: list[str]) -> list[str]:
    """Exactly ``expected_scope`` are TE modules (in order), only TE types there and nowhere else, and
    the 8-bit parameters are exactly their weights."""
    p, probe = _Problems(), result["probe"]
    got = list(probe.low_precision_modules)
    p.expect(got == expected_scope, lambda: f"TE modules differ from the expected scope: missing "
                                            f"{sorted(set(expected_scope) - set(got))[:5]}, extra {sorted(set(got) - set(expected_scope))[:5]}")
    types = {unwrapped(t) for t in probe.low_precision_modules.values()}
    p.expect(types <= TE_TYPES, f"non-TE types in the low-precision scope: {sorted(types - TE_TYPES)}")
    high = {n: unwrapped(t) for n, t in probe.module_types.items() if n not in probe.low_precision_modules}
    leaked = sorted(n for n, t in high.items() if t in TE_TYPES)
    p.expect(not leaked, f"TE modules outside the scope: {leaked[:5]}")
    weights = set(result["weights"])
    want = expected_weight_fqns(probe.low_precision_modules)
    p.expect(weights == want, lambda: f"8-bit parameters differ from the TE weights: missing {sorted(want - weights)[:3]}, "
                                      f"extra {sorted(weights - want)[:3]}")
    return p


def check_high_precision_pieces(result: dict, num_layers: int, mtp_layers: int = 0) -> list[str]:
    """DeepSeek-V3 (HF names): embedding, lm_head, final and per-layer norms, routers exist and stay
    high precision; so do each MTP layer's (``model.layers.{num_layers + k}``) enorm, hnorm,
    shared_head.norm and router."""
    p, probe = _Problems(), result["probe"]
    high = {n: unwrapped(t) for n, t in probe.module_types.items() if n not in probe.low_precision_modules}
    p.expect(high.get("model.embed_tokens") == "Embedding", "model.embed_tokens is not a high-precision Embedding")
    p.expect(high.get("lm_head") == "Linear", "lm_head is not a high-precision Linear")
    p.expect(high.get("model.norm") == "RMSNorm", "model.norm is not a high-precision RMSNorm")
    routers = [n for n, t in high.items() if t == "TopKRouter"]
    p.expect(routers and all(n.endswith(".mlp.gate") for n in routers), f"routers {routers[:3]} not high precision")
    for layer in range(num_layers, num_layers + mtp_layers):
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            name = f"model.layers.{layer}.{norm}"
            p.expect(high.get(name) == "RMSNorm", f"{name} (MTP) is not a high-precision RMSNorm")
        p.expect(high.get(f"model.layers.{layer}.mlp.gate") == "TopKRouter",
                 f"model.layers.{layer}.mlp.gate (MTP router) is not a high-precision TopKRouter")
    norms = [n for n, t in high.items() if t == "RMSNorm"]
    want = 1 + 3 * num_layers + 6 * mtp_layers
    p.expect(len(norms) >= want, f"{len(norms)} high-precision RMSNorms, expected >= {want}")
    return p


# ---- Q3-05 / 06: FSDP gathers ---------------------------------------------------------------------
def check_gathers(result: dict, fmt: str, micro_steps: int, reshard: bool, world: int) -> list[str]:
    """Every 8-bit weight is gathered once per micro-step in forward (and again in backward when
    resharded), in 8-bit. MXFP8: forward row only and backward row + col with reshard, the first
    (forward) gather both directions without; HiF8: data + scale."""
    p, probe = _Problems(), result["probe"]
    weights = set(result["weights"]) - set(result.get("replicated", {}))
    for step in range(len(result["records"])):
        counts = gather_counts(probe, step)
        expected = Counter({(w, "forward"): micro_steps for w in weights})
        if reshard:
            expected.update({(w, "backward"): micro_steps for w in weights})
        p.expect(counts == expected, lambda: f"step {step + 1}: gathers differ from one per weight per micro-step "
                                             f"{'and phase' if reshard else 'in forward'} (got {len(list(counts.elements()))}, "
                                             f"expected {len(list(expected.elements()))})")
    gathers = probe.gathers()
    p.expect(all(g.context.reshard_after_forward == reshard for g in gathers), "gather context's reshard flag is wrong")
    by_phase = defaultdict(set)
    for g in gathers:
        by_phase[g.context.phase].add(g.fields)
        directions = 2 if "col_data" in g.fields else 1  # MXFP8 row + col: two 8-bit copies
        p.expect(g.bytes_per_element <= 0.55 * 2.0 * directions,  # 8-bit + scales, not BF16's 2 bytes per copy
                 f"{g.context.param_fqn}: {g.bytes_per_element:.2f} bytes/element gathered for {directions} "
                 f"direction(s) (not 8-bit)")
        p.expect(g.gathered_bytes == g.local_bytes * world, f"{g.context.param_fqn}: gathered bytes != local x world")
    if fmt == "mxfp8":
        want = {"forward": {ROW}, "backward": {BOTH}} if reshard else {"forward": {BOTH}}
        p.expect(dict(by_phase) == want, f"MXFP8 gathered fields by phase {dict(by_phase)}, expected {want}")
    else:
        p.expect(set().union(*by_phase.values()) == {HIF8_FIELDS} if by_phase else False,
                 f"HiF8 gathered fields {dict(by_phase)}, expected data + scale {HIF8_FIELDS}")
    p.expect({g.format for g in gathers} == {FORMAT_VALUE[fmt]}, f"gather formats {sorted({g.format for g in gathers})}")
    return p


def check_hif8_weight_scales(rank_weights: list[dict], world: int) -> list[str]:
    """Q3-06 across ranks: every HiF8 scale is FP32 positive ``amax(master) / 15``; a dense weight's
    scalar scale is the same on every rank; a grouped weight holds ``[E / world]`` scales of whole experts."""
    p = _Problems()
    first = rank_weights[0]
    for fqn, info in first.items():
        scale = torch.as_tensor(info["scale"])
        p.expect(scale.dtype == torch.float32 and bool((scale > 0).all()), f"{fqn}: scale not FP32 positive")
        p.expect(all(w[fqn]["scale_matches_master"] for w in rank_weights), f"{fqn}: scale != amax(master) * (1/15)")
        if len(info["shape"]) == 2:
            same = all(torch.equal(torch.as_tensor(w[fqn]["scale"]), scale) for w in rank_weights)
            p.expect(scale.dim() == 0 and same, f"{fqn}: dense scale differs across ranks "
                                                f"{[float(torch.as_tensor(w[fqn]['scale'])) for w in rank_weights]}")
        else:
            E = info["shape"][0]
            p.expect(tuple(info["local_shape"])[0] == E // world and tuple(scale.shape) == (E // world,),
                     f"{fqn}: local experts {info['local_shape']} / scales {tuple(scale.shape)}, expected {E // world}")
    return p


# ---- Q3-07 / 08: refresh once per successful step -------------------------------------------------
def check_refreshes(result: dict, fmt: str, micro_steps: int, recompute: bool = False) -> list[str]:
    """Setup writes each 8-bit shard once; every successful step refreshes each exactly once in the
    optimizer step (one quantization per local shard); micro-steps and recompute quantize
    activations only (their exact count); nothing quantizes outside these phases."""
    p, probe = _Problems(), result["probe"]
    weights = set(result["weights"])
    p.expect(weights == expected_weight_fqns(probe.low_precision_modules), "8-bit weights differ from the TE weights")
    p.expect(result["setup_refreshes"] == dict.fromkeys(weights, 1), "setup did not write each 8-bit shard exactly once")
    local_shapes = sorted(tuple(info["local_shape"]) for info in result["weights"].values())
    want_fb = expected_activation_quants(probe.low_precision_modules, fmt, micro_steps, recompute)
    for step, record in enumerate(result["records"]):
        n = step + 1
        p.expect(probe.micro_steps[step] == micro_steps, f"step {n}: {probe.micro_steps[step]} micro-steps, expected {micro_steps}")
        refreshed = probe.refresh_counts(step)
        p.expect(refreshed == Counter(dict.fromkeys(weights, 1)),
                 lambda: f"step {n}: refreshes {sorted(set(refreshed.values()))} per weight over {len(refreshed)} weights, "
                         f"expected 1 for each of {len(weights)}")
        opt = probe.quant_events_in("optimizer_step", step)
        p.expect(sorted(tuple(e.shape) for e in opt) == local_shapes, f"step {n}: the optimizer step quantized "
                                                                     f"{len(opt)} tensors, expected one per local shard")
        if fmt == "mxfp8":
            p.expect({e.orientation for e in opt} <= {"dual"}, f"step {n}: MXFP8 refresh not dual-axis")
        fb = probe.quant_events_in("forward_backward", step)
        p.expect(len(fb) == want_fb, f"step {n}: {len(fb)} quantizations in forward/backward, expected {want_fb} "
                                     f"(activations only: a weight re-quantized per micro-step or recompute adds)")
    p.expect(not probe.quant_events_in("other"), "quantizations outside setup / forward-backward / optimizer step")
    return p


# ---- Q3-09: DCP resume ----------------------------------------------------------------------------
def check_resume(continuous: dict, resumed: dict, save_at: int) -> tuple[list[str], dict]:
    """Fresh processes resumed at ``save_at``: step, FP32 state, each 8-bit shard rebuilt once from its
    master, one refresh per step; and the measured difference to the continuous run's later steps
    (first resumed loss, every step's loss / grad norm, the final FP32 masters and buffers such as
    router biases): ``bitwise`` when they are equal. Returns (problems, measurement). No tolerance
    for a non-bitwise resume is agreed yet, so the difference is measured, not judged here (the
    acceptance run reports such a resume ``not judged``: docs/a5.md, acceptance matrix, Q3-09)."""
    p = _Problems()
    p.expect(resumed["step"] == save_at, f"resumed at step {resumed['step']}, expected {save_at}")
    later = continuous["records"][save_at:]
    p.expect(len(resumed["records"]) == len(later), f"{len(resumed['records'])} resumed steps, expected {len(later)}")
    p.expect([r["step"] for r in resumed["records"]] == [r["step"] for r in later], "resumed step numbers differ")
    p.expect(all(math.isfinite(r["lm_loss"]) for r in resumed["records"]), "non-finite resumed loss")
    p.expect(set(resumed["optimizer_dtypes"].values()) <= {("torch.float32",) * 4}, "optimizer state not FP32")
    p.expect(resumed["masters_changed_by_load"] == sorted(resumed["optimizer_dtypes"]),
             "load_dcp left some FP32 master at its fresh initial value")
    weights = set(continuous["weights"])
    p.expect(resumed["load_refreshes"] == dict.fromkeys(weights, 1), "load did not rebuild each 8-bit shard exactly once")
    same_layout = {f: (i["cls"], tuple(i["local_shape"])) for f, i in resumed["weights"].items()} == {
        f: (i["cls"], tuple(i["local_shape"])) for f, i in continuous["weights"].items()}
    p.expect(same_layout, "rebuilt 8-bit shards differ in class / local shape")
    probe = resumed["probe"]
    for step in range(save_at, save_at + len(resumed["records"])):
        p.expect(sum(probe.refresh_counts(step).values()) == len(weights), f"step {step + 1}: refreshes != one per weight")
    diffs = {key: [abs(a[key] - b[key]) for a, b in zip(resumed["records"], later)] for key in ("lm_loss", "grad_norm")}
    master_diff = max((float((resumed["masters"][f].double() - m.double()).abs().max())
                       for f, m in continuous["masters"].items() if f in resumed.get("masters", {})), default=0.0)
    buffers = resumed.get("buffers", {})  # e.g. DeepSeek-V3's router biases, which move every step
    buffer_diff = max((float((buffers[f].double() - b.double()).abs().max())
                       for f, b in continuous.get("buffers", {}).items() if f in buffers), default=0.0)
    bitwise = (all(r[k] == c[k] for r, c in zip(resumed["records"], later) for k in ("lm_loss", "grad_norm", "lr"))
               and master_diff == 0.0 and buffer_diff == 0.0)
    measured = {"bitwise": bitwise, "max_abs_buffer_diff": buffer_diff, "first_loss": [resumed["records"][0]["lm_loss"], later[0]["lm_loss"]] if later else None,
                "max_abs_loss_diff": max(diffs["lm_loss"], default=0.0),
                "max_abs_grad_norm_diff": max(diffs["grad_norm"], default=0.0), "max_abs_master_diff": master_diff}
    return p, measured


# ---- Q3-10 (shard rows) -------------------------------------------------------------------------
def check_misaligned_shard(error: str | None, fqn: str, shape: str, had_model: bool) -> list[str]:
    """A weight with no MXFP8-legal shard dim fails setup naming its FQN, shape and the fallback key,
    before any model exists."""
    p = _Problems()
    if not p.expect(error is not None, f"{fqn} {shape} has no MXFP8 shard dim, but setup did not refuse it"):
        return p
    p.expect(fqn in error and shape in error and "fallback_to_unsharded" in error,
             f"refusal does not name {fqn} {shape} and fsdp_config.fallback_to_unsharded: {error}")
    p.expect(not had_model, "the model was built before the shard refusal")
    return p


# ---- Q3-11: steady-state throughput ---------------------------------------------------------------
def steady_ratios(records_by_fmt: dict[str, list[dict]], warmup: int) -> dict:
    """Per low-precision format: ``throughput_ratio`` (mean tokens/s / BF16's) and ``step_time_ratio``
    (mean step time / BF16's) over the steps after ``warmup``: Q3-11's verdict inputs (on the
    device, pass when ``throughput_ratio >= 1`` and ``step_time_ratio <= 1`` for each)."""
    def steady(records):
        rows = records[warmup:]
        return (sum(r["tokens_per_s"] for r in rows) / len(rows), sum(r["elapsed_ms"] for r in rows) / len(rows),
                len(rows))

    base_tps, base_ms, base_n = steady(records_by_fmt["bf16"])
    out = {"bf16": {"tokens_per_s": base_tps, "step_ms": base_ms, "steady_steps": base_n}}
    for fmt in ("mxfp8", "hif8"):
        if fmt in records_by_fmt:
            tps, ms, n = steady(records_by_fmt[fmt])
            out[fmt] = {"tokens_per_s": tps, "step_ms": ms, "steady_steps": n, "throughput_ratio": tps / base_tps,
                        "step_time_ratio": ms / base_ms}
    return out


def check_checkpoint_contents(path: str, result: dict, world: int) -> list[str]:
    """Q3-09: a DCP step holds exactly the model's parameters and buffers (8-bit weights as their BF16
    logical values) and the FP32 optimizer state (master, exp_avg, exp_avg_sq, step): nothing
    derived (no 8-bit data, scales or ``_extra_state``); per-rank extras are data position, RNG and
    counters only (``weights_only``-loadable)."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    p = _Problems()
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    keys = ("master", "exp_avg", "exp_avg_sq", "step")
    expected = ({f"model.{n}" for n in [*result["param_names"], *result["buffer_names"]]}
                | {f"optim.{f}.{k}" for f in result["optimizer_dtypes"] for k in keys})
    p.expect(set(metadata) == expected, lambda: f"checkpoint keys differ: extra {sorted(set(metadata) - expected)[:3]}, "
                                                f"missing {sorted(expected - set(metadata))[:3]}")
    for key, entry in metadata.items():
        if not p.expect(isinstance(entry, TensorStorageMetadata), f"{key}: not a tensor"):
            continue
        p.expect(entry.properties.dtype in (torch.bfloat16, torch.float32), f"{key}: dtype {entry.properties.dtype}")
        p.expect(not any(part in key for part in ("row_data", "col_data", "qdata", "scale", "_extra_state")),
                 f"{key}: derived 8-bit state saved")
    for fqn, info in result["weights"].items():
        entry = metadata.get(f"model.{fqn}")
        p.expect(entry is not None and entry.properties.dtype == torch.bfloat16 and tuple(entry.size) == tuple(info["shape"]),
                 f"model.{fqn}: not saved as its BF16 logical weight {tuple(info['shape'])}")
        master = metadata.get(f"optim.{fqn}.master")
        p.expect(master is not None and master.properties.dtype == torch.float32, f"optim.{fqn}.master: not FP32")
    for rank in range(world):
        extra = torch.load(os.path.join(path, f"extra_rank{rank}.pt"), weights_only=True)
        p.expect(set(extra) == {"data", "skipped_iterations", "rng"}, f"extra_rank{rank}.pt holds {sorted(extra)}")
    return p


# ---- Q3-10: every illegal configuration (docs/a5.md, acceptance matrix) ---------------------------
ILLEGAL_CONFIGS: tuple[tuple[str, str], ...] = (
    ("low_precision={enabled: true, format: hif8, scaling: delayed}", "low_precision.scaling"),
    ("low_precision={enabled: false, format: hif8, scaling: delayed}", "low_precision.scaling"),
    ("low_precision={enabled: true, format: mxfp8_e4m3, scaling: current}", "low_precision.scaling"),
    ("fsdp_config.comm_fusion=true", "fsdp_config.comm_fusion"),
    ("parallel.tensor_parallel_size=2", "parallel.tensor_parallel_size"),
    ("parallel.context_parallel_size=2", "parallel.context_parallel_size"),
    ("parallel.expert_parallel_size=2", "parallel.expert_parallel_size"),
    ("parallel.pipeline_parallel_size=2", "parallel.pipeline_parallel_size"),
    ("checkpoint.format=torch_save", "checkpoint.format"),
    ("checkpoint.format=safetensors", "checkpoint.format"),
    ("activation_checkpoint.mode=selective", "activation_checkpoint.mode"),
    ("model.preset=dsv3_671b", "model.preset"),  # the model task's section: the 16B structure is frozen
    ("model.overrides.num_nextn_predict_layers=-1", "num_nextn_predict_layers"),
)
"""(override, the key its one-line ``ConfigError`` must name): each fails in ``load_config``, before
any process group, model or tensor exists. The misaligned MXFP8 shard (an FQN and shape) fails in
setup's shard plan instead: :func:`check_misaligned_shard`."""


def check_illegal_config(load, override: str, key: str) -> list[str]:
    """``load(override)`` (a ``load_config`` call) must raise ``ConfigError`` naming ``key`` in one line."""
    from te_npu.errors import ConfigError

    try:
        load(override)
    except ConfigError as exc:
        message = str(exc)
        problems = [] if key in message and "\n" not in message else [f"{override}: error does not name {key} in one "
                                                                        f"line: {message}"]
        return problems
    return [f"{override}: accepted (expected a ConfigError naming {key})"]
