"""The Transformer Engine / Megatron table (``docs/coming-from-te-megatron.md``) stays true: every
row has a check here (and every check a row); supported names import and work, refused ones raise
with their reason; and a typical TE training script runs after only the renames the table lists."""
from __future__ import annotations

import contextlib
import importlib
import io
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import te_npu
from te_npu import ConfigError, HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.recipe import Format

TE_TABLE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-te-megatron.md"
BF16 = dict(bias=False, params_dtype=torch.bfloat16)


def _rows() -> dict[str, tuple[str, str]]:
    text = TE_TABLE.read_text()
    table = text[text.index("<!-- te-compat-table: start -->"):text.index("<!-- te-compat-table: end -->")]
    rows = {}
    for line in table.splitlines()[3:]:  # marker, header, rule
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows[cells[0]] = (cells[1], cells[2])
    return rows


def _resolve(dotted: str):
    """``te_npu.a.b`` -> the object (modules imported on the way)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def _raises(fn, exc, reason):
    with pytest.raises(exc, match=reason):
        fn()


def _x(*shape, requires_grad=False):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_(requires_grad)


def _quantized_linear():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe()):
        return te_npu.TELinear(64, 64, **BF16)


def _optimizer_step():
    for options in ({}, {"foreach": True}, {"fused": True}):
        lin = _quantized_linear()
        lin.weight.grad = torch.ones(64, 64, dtype=torch.bfloat16)
        with pytest.warns(te_npu.tensor.QuantizedWeightUpdateWarning, match="MasterWeightOptimizer"):
            torch.optim.AdamW(lin.parameters(), lr=1e-3, **options).step()


def _load_weights_only():
    buffer = io.BytesIO()
    torch.save(_quantized_linear().state_dict(), buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=True)["weight"]) is te_npu.tensor.MXFP8Tensor


def _high_precision_init_val():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe(), preserve_high_precision_init_val=True):
        lin = te_npu.TELinear(64, 64, **BF16)
    assert lin.weight.get_high_precision_init_val().dtype == torch.bfloat16
    lin.weight.clear_high_precision_init_val()


def _forward(**kwargs):
    return te_npu.TELinear(64, 64, **kwargs)(_x(32, 64), is_first_microbatch=True)


def _torch_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16), te_npu.autocast():
        assert te_npu.TELinear(64, 64)(_x(32, 64)).dtype == torch.bfloat16


def _dtype_cast():
    assert te_npu.TELinear(64, 64, **BF16)(_x(32, 64)).dtype == torch.float32
    _raises(lambda: te_npu.TELinear(64, 64)(torch.ones(2, 64, dtype=torch.int64)), TypeError, "not a floating-point")


def _grouped():
    layer = te_npu.TEGroupedLinear(2, 64, 64)
    assert layer.weight.dtype == torch.float32 and layer.bias.shape == (2, 64)
    assert layer(_x(32, 64), [20, 12], is_first_microbatch=True).shape == (32, 64)
    _raises(lambda: layer(_x(32, 64), [20.0, 12.0]), TypeError, "integer group sizes")


def _te_defaults():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = _resolve("te_npu.TELinear")(64, 96)
        torch.manual_seed(0)
        want = torch.nn.init.normal_(torch.empty(96, 64), std=0.023)
    assert torch.equal(layer.weight, want) and torch.equal(layer.bias, torch.zeros(96))
    _raises(lambda: te_npu.TELinear(64, 96, False), TypeError, "sequence_parallel, not bias")


def _main_grad():
    layer = te_npu.TELinear(64, 64, fuse_wgrad_accumulation=True, **BF16)
    layer.weight.main_grad = torch.zeros(64, 64)
    layer(_x(32, 64, requires_grad=True)).sum().backward()
    assert layer.weight.grad is None and bool(layer.weight.main_grad.abs().sum() > 0)


def _rng_tracker():
    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            yield

    te_npu.TELinear(64, 64, get_rng_state_tracker=Tracker, rng_tracker_name="rng")
    assert forks == ["rng"]


def _name():
    layer = te_npu.TELinear(64, 64, name="fc1")
    _raises(lambda: layer(torch.ones(2, 64, dtype=torch.int64)), TypeError, r"^fc1: input dtype")


def _device_default():
    assert te_npu.TELinear(64, 64).weight.device == torch.empty(0).device


def _plain_torch_checkpoint():
    layer = te_npu.TELinear(64, 64, **BF16)
    for reentrant in (True, False):
        x = _x(32, 64, requires_grad=True)
        with te_npu.autocast(recipe=MXFP8BlockRecipe()):
            y = torch_checkpoint(layer, x, use_reentrant=reentrant)
        y.float().sum().backward()  # one recipe in sight: recomputed in it
    x = _x(32, 64, requires_grad=True)
    with te_npu.autocast(recipe=MXFP8BlockRecipe()):
        y = torch_checkpoint(layer, x, use_reentrant=True)
    with te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
        y2 = layer(x)
    _raises(lambda: (y.float().sum() + y2.float().sum()).backward(), RuntimeError, r"te_npu\.checkpoint")


def _te_state_dict_keys():
    layer = te_npu.TEGroupedLinear(2, 64, 64)
    te_keys = layer.te_state_dict()
    assert sorted(te_keys) == ["_extra_state", "bias0", "bias1", "weight0", "weight1"]
    te_npu.TEGroupedLinear(2, 64, 64).load_state_dict(te_keys)


def _extra_state():
    state = {**te_npu.TELinear(64, 64).state_dict(), "_extra_state": torch.empty(0, dtype=torch.uint8)}
    te_npu.TELinear(64, 64).load_state_dict(state)


def _recipe_predicates():
    recipe = _resolve("te_npu.recipe.Recipe")
    assert isinstance(MXFP8BlockRecipe(), recipe) and MXFP8BlockRecipe().mxfp8() and not MXFP8BlockRecipe().delayed()
    assert HiF8CurrentScalingRecipe().hif8() and te_npu.recipe.DelayedScaling.delayed()
    for kind in ("float8_current_scaling", "float8_per_tensor_scaling", "float8_block_scaling", "nvfp4", "custom"):
        assert not getattr(MXFP8BlockRecipe(), kind)()


def _writes_through():
    layer = _quantized_linear()
    value = _x(64, 64)
    layer.weight.data = value
    assert torch.equal(layer.weight.dequantize(), te_npu.tensor.quantize_weight(value, MXFP8BlockRecipe()).dequantize())
    torch.nn.utils.vector_to_parameters(_x(64 * 64), layer.parameters())
    with torch.no_grad():
        torch._foreach_copy_([layer.weight], [value])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.broadcast(layer.weight, src=0)  # the 2-rank payload check: tests/unit/tensor/test_weight_interop.py
    finally:
        dist.destroy_process_group()


def _safetensors():
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is a test extra")
    state = _quantized_linear().state_dict()
    tensors, metadata = te_npu.tensor.to_plain_state_dict(state)
    blob = safetensors_torch.save(tensors, metadata=metadata)
    back = te_npu.tensor.from_plain_state_dict(safetensors_torch.load(blob), metadata)
    assert torch.equal(back["weight"], state["weight"])


def _save_and_swap():
    layer = te_npu.TELinear(64, 64, init_method=torch.nn.init.ones_)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).weight, layer.weight)
    with te_npu.autocast():
        layer(_x(32, 64), is_first_microbatch=True)
    torch.utils.swap_tensors(layer.weight, torch.nn.Parameter(torch.zeros(64, 64)))


def _fp8_available():
    available, reason = _resolve("te_npu.is_fp8_available")(return_reason=True)
    assert isinstance(available, bool) and isinstance(reason, str) and te_npu.is_fp8_available() is available
    _resolve("te_npu.is_hif8_available")


def _distributed_checkpoint():
    assert _resolve("te_npu.distributed.checkpoint") is te_npu.checkpoint
    x = torch.zeros(2, requires_grad=True)
    te_npu.distributed.checkpoint(torch.sin, x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2))
    _resolve("te_npu.distributed.storage.dcp.save")


def _conversions():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe()):
        weight = te_npu.TELinear(64, 64, bias=False).weight  # FP32 logical
    value = weight.dequantize()
    for out in (weight.float(), weight.to(torch.float32), weight.cpu()):
        assert type(out) is torch.Tensor and torch.equal(out, value)
    assert (weight.detach().cpu().numpy() == value.detach().numpy()).all() and weight.float().t().shape == (64, 64)
    assert type(weight.to("cpu")) is te_npu.tensor.MXFP8Tensor


def _fallback():
    from torch.nn.parallel import DistributedDataParallel

    layer, seen = _quantized_linear(), []
    with te_npu.events.subscribe(seen.append, te_npu.events.DequantizeFallbackEvent):
        vector = torch.nn.utils.parameters_to_vector(layer.parameters())
        both = torch.cat([layer.weight, layer.weight])
    assert torch.equal(vector, layer.weight.dequantize().flatten()) and both.shape == (128, 64)
    assert [e.op for e in seen] == ["aten.cat.default"] * 2
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # the 2-rank sync: tests/unit/tensor/test_weight_te_contract.py
        DistributedDataParallel(layer)(_x(32, 64).bfloat16()).float().sum().backward()
    finally:
        dist.destroy_process_group()


# first table cell -> (status word the row must start with, check)
CHECKS = {
    "`transformer_engine.pytorch.autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)`": (
        "supported", lambda: (
            _resolve("te_npu.autocast")(True, False, MXFP8BlockRecipe(), None, False),
            _raises(lambda: te_npu.autocast(calibrating=True), ConfigError, "no scaling statistics"),
            _raises(lambda: te_npu.autocast(_graph=True), ConfigError, "does not capture"),
            _raises(lambda: te_npu.autocast(True, MXFP8BlockRecipe()), TypeError, "positional order"))),
    "`transformer_engine.pytorch.fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group, _graph)`": ("alias", lambda: (
        _resolve("te_npu.fp8_autocast")(True, False, MXFP8BlockRecipe(), None, False),
        _raises(lambda: te_npu.fp8_autocast(_graph=True), ConfigError, "does not capture"))),
    "`transformer_engine.pytorch.quantized_model_init(enabled, recipe, preserve_high_precision_init_val)`": (
        "supported", lambda: _resolve("te_npu.quantized_model_init")(True, MXFP8BlockRecipe(), True)),
    "`transformer_engine.pytorch.fp8_model_init`": (
        "alias", lambda: _resolve("te_npu.fp8_model_init") is te_npu.quantized_model_init or pytest.fail("not alias")),
    "`param.get_high_precision_init_val()` / `param.clear_high_precision_init_val()`": (
        "supported", _high_precision_init_val),
    "`transformer_engine.pytorch.checkpoint(fn, *args, **kwargs)`": (
        "supported", lambda: _resolve("te_npu.checkpoint")(torch.sin, torch.zeros(2, requires_grad=True))),
    "`checkpoint(..., use_reentrant=True)`": ("supported", lambda: (
        te_npu.checkpoint(torch.sin, torch.zeros(2, requires_grad=True), use_reentrant=True).sum().backward(),
        _raises(lambda: te_npu.checkpoint(torch.add, torch.zeros(2, requires_grad=True), use_reentrant=True,
                                          other=torch.ones(2, requires_grad=True)), ConfigError, "need gradients"))),
    "`checkpoint(..., distribute_saved_activations=True)` / `tp_group` / `get_rng_state_tracker` (also TE's deprecated "
    "positional form)": (
        "refused", lambda: [_raises(lambda k=k, v=v: te_npu.checkpoint(torch.sin, torch.zeros(2), **{k: v}),
                                    ConfigError, "tensor parallelism|RNG tracker")
                            for k, v in (("distribute_saved_activations", True), ("tp_group", object()),
                                         ("get_rng_state_tracker", object()))] + [
            _raises(lambda: te_npu.checkpoint(torch.sin, False, lambda: None, None, torch.zeros(2)), ConfigError,
                    "deprecated positional form")]),
    "`torch.utils.checkpoint.checkpoint` (either `use_reentrant`, torch's default, Megatron's reentrant checkpointing) "
    "around TE modules": ("supported", _plain_torch_checkpoint),
    "`transformer_engine.pytorch.Linear(in, out, bias=True, init_method=None, params_dtype=None)`": (
        "supported", _te_defaults),
    "`Linear(..., sequence_parallel, tp_group, tp_size, parallel_mode, ub_overlap_*, ub_bulk_*, ub_name, "
    "symmetric_ar_type)`": ("supported", lambda: (
        te_npu.TELinear(64, 64, sequence_parallel=True, tp_group=None, tp_size=1, parallel_mode="row",
                        ub_overlap_ag=True, ub_bulk_wgrad=True, ub_name="proj", symmetric_ar_type="two_shot"),
        _raises(lambda: te_npu.TELinear(64, 64, tp_size=2), ConfigError, "no tensor parallelism"))),
    "`Linear(..., parameters_split)` / `delay_wgrad_compute=True` / `save_original_input=True`": (
        "refused", lambda: [_raises(lambda k=k, v=v: te_npu.TELinear(64, 64, **{k: v}), ConfigError, reason)
                            for k, v, reason in (("parameters_split", ("q", "k"), "one weight parameter"),
                                                 ("delay_wgrad_compute", True, "backward_dw"),
                                                 ("save_original_input", True, "col-quantized input"))]),
    "`Linear(..., fuse_wgrad_accumulation=True)` (Megatron's `gradient_accumulation_fusion`, `weight.main_grad`)": (
        "supported", _main_grad),
    "`Linear(..., get_rng_state_tracker, rng_tracker_name)`": ("supported", _rng_tracker),
    "`Linear(..., name=...)`": ("supported", _name),
    "`Linear(..., device=\"cuda\")` (TE's default device)": ("differs", _device_default),
    "`Linear(..., return_bias=True)` (Megatron's `skip_bias_add`)": (
        "supported", lambda: len(_forward(bias=True, return_bias=True)) == 2 or pytest.fail("no (out, bias)")),
    "`Linear.forward(x, is_first_microbatch=...)`": ("supported", _forward),
    "`Linear.forward(x, fp8_output=True)` / `fp8_grad=True`": ("refused", lambda: [
        _raises(lambda k=k: te_npu.TELinear(64, 64)(_x(32, 64), **{k: True}), ConfigError, "high.precision")
        for k in ("fp8_output", "fp8_grad")]),
    "`transformer_engine.pytorch.GroupedLinear(num_gemms, in, out, bias=True, ...)`, "
    "`forward(x, m_splits, is_first_microbatch)`": ("supported", _grouped),
    "`GroupedLinear` parameters `weight0..weightN` / `bias0..biasN`": ("differs", _te_state_dict_keys),
    "`GroupedLinear(..., return_bias=True)`": ("supported", lambda: len(
        te_npu.TEGroupedLinear(2, 64, 64, return_bias=True)(_x(32, 64), [16, 16])[1]) == 2 or pytest.fail("no biases")),
    "`GroupedLinear(..., single_grouped_weight, single_grouped_bias, use_grouped_tensor)`": ("supported", lambda:
        te_npu.TEGroupedLinear(2, 64, 64, single_grouped_weight=True, single_grouped_bias=True,
                               use_grouped_tensor=False)),
    "`GroupedLinear(..., ub_overlap_rs=True)` / `ub_overlap_ag=True` / `delay_wgrad_compute=True` / "
    "`save_original_input=True`": ("refused", lambda: [
        _raises(lambda k=k: te_npu.TEGroupedLinear(2, 64, 64, **{k: True}), ConfigError, "is not supported: ")
        for k in ("ub_overlap_rs", "ub_overlap_ag", "delay_wgrad_compute", "save_original_input")]),
    "`GroupedLinear.forward(x, m_splits, out=..., dgrad_out=...)`": ("refused", lambda: [
        _raises(lambda k=k: te_npu.TEGroupedLinear(2, 64, 64)(_x(32, 64), [16, 16], **{k: torch.empty(32, 64)}),
                ConfigError, "preallocated") for k in ("out", "dgrad_out")]),
    "TE module state dicts' `_extra_state` entry": ("supported", _extra_state),
    "`transformer_engine.common.recipe.MXFP8BlockScaling(margin, fp8_format, ...)`": (
        "supported", lambda: (_resolve("te_npu.recipe.MXFP8BlockScaling") is MXFP8BlockRecipe
                              and te_npu.recipe.MXFP8BlockScaling(0, Format.E4M3) == MXFP8BlockRecipe())
        or pytest.fail("not the MXFP8 recipe")),
    "`recipe.Recipe`: `isinstance`, `.mxfp8()` / `.delayed()` / `.float8_current_scaling()` / "
    "`.float8_per_tensor_scaling()` / `.float8_block_scaling()` / `.nvfp4()` / `.custom()`": (
        "supported", _recipe_predicates),
    "`recipe.Format.E4M3`": ("supported", lambda: _resolve("te_npu.recipe.Format.E4M3")),
    "`MXFP8BlockScaling(fp8_format=Format.HYBRID)`": ("refused", lambda: _raises(
        lambda: te_npu.recipe.MXFP8BlockScaling(fp8_format=Format.HYBRID), ConfigError, "E5M2")),
    "`MXFP8BlockScaling(margin=1)` / `fp8_dpa` / `fp8_mha` / `backward_override` / `enable_2d_quantization`": (
        "refused", lambda: [_raises(lambda k=k, v=v: te_npu.recipe.MXFP8BlockScaling(**{k: v}), ConfigError,
                                    rf"MXFP8BlockScaling\.{k}: .* is not supported .*: \w+")
                            for k, v in (("margin", 1), ("fp8_dpa", True), ("fp8_mha", True),
                                         ("backward_override", "dequantized"), ("enable_2d_quantization", True))]),
    "`recipe.DelayedScaling`": ("refused", lambda: (
        _raises(te_npu.recipe.DelayedScaling, ConfigError, "delayed"),
        isinstance(MXFP8BlockRecipe(), te_npu.recipe.DelayedScaling) and pytest.fail("isinstance"))),
    "`recipe.Float8CurrentScaling`": ("refused", lambda: _raises(
        te_npu.recipe.Float8CurrentScaling, ConfigError, "HiF8CurrentScalingRecipe")),
    "`recipe.Float8BlockScaling`": ("refused", lambda: _raises(
        te_npu.recipe.Float8BlockScaling, ConfigError, "MXFP8BlockScaling")),
    "`recipe.NVFP4BlockScaling`": ("refused", lambda: _raises(te_npu.recipe.NVFP4BlockScaling, ConfigError, "FP4")),
    "`recipe.CustomRecipe`": ("refused", lambda: _raises(te_npu.recipe.CustomRecipe, ConfigError, "quantizer factories")),
    "`transformer_engine.pytorch.is_mxfp8_available(return_reason=True)`": (
        "supported", lambda: _resolve("te_npu.is_mxfp8_available")(return_reason=True)),
    "`transformer_engine.pytorch.is_fp8_available(return_reason=False)`": ("supported", _fp8_available),
    "`transformer_engine.pytorch.is_fp8_block_scaling_available` / `is_nvfp4_available`": ("supported", lambda: [
        _resolve(f"te_npu.{n}")(return_reason=True)[0] and pytest.fail(n)
        for n in ("is_fp8_block_scaling_available", "is_nvfp4_available")]),
    "`transformer_engine.pytorch.is_bf16_available`": (
        "supported", lambda: te_npu.is_bf16_available() is True or pytest.fail("bf16")),
    "`transformer_engine.pytorch.distributed.checkpoint(fn, *args, **kwargs)` (Megatron's TE checkpoint)": (
        "supported", _distributed_checkpoint),
    "TE modules under `torch.autocast(dtype=torch.bfloat16)`": ("supported", _torch_autocast),
    "TE's input / parameter dtype check outside `torch.autocast` (`TypeError`)": ("differs", _dtype_cast),
    "`torch.optim.AdamW` / `SGD` (`foreach=True`, `fused=True` too) on FP8 parameters": ("supported", _optimizer_step),
    "`param.data = t` / `nn.utils.vector_to_parameters` / `torch._foreach_copy_` / `dist.broadcast` on FP8 parameters": (
        "supported", _writes_through),
    "`w.float()` / `w.to(dtype)` / `w.cpu()` / `w.numpy()` / `w.dequantize()` on FP8 parameters": (
        "supported", _conversions),
    "an aten op the FP8 parameter does not implement (`torch.cat`, `nn.utils.parameters_to_vector`, "
    "`DistributedDataParallel`'s bucket flattening, `exp`, `mm`, ...)": ("supported", _fallback),
    "a view (`t()`, `transpose`, `unsqueeze`, `w[i]`, `view` to another shape) or an in-place / `out=` write "
    "without a handler on an FP8 parameter": ("refused", lambda: [
        _raises(lambda op=op: op(_quantized_linear().weight.detach()), NotImplementedError, rf"does not support aten\.{name}")
        for op, name in ((lambda w: w.t(), "t"), (lambda w: w.unsqueeze(0), "unsqueeze"), (lambda w: w[0], "select"),
                         (lambda w: w.view(32, 128), "view"), (lambda w: w.exp_(), "exp_"))]),
    "`torch.load(f)` (`weights_only=True`) of a quantized state dict": ("supported", _load_weights_only),
    "`safetensors.torch.save_file` of a quantized state dict": ("supported", _safetensors),
    "`torch.save(module)` / `torch.utils.swap_tensors` on TE modules": ("supported", _save_and_swap),
    "Megatron `megatron.core.extensions.transformer_engine.TEColumnParallelLinear` / `TERowParallelLinear`": (
        "not provided", lambda: [hasattr(te_npu, n) and pytest.fail(n)
                                 for n in ("TEColumnParallelLinear", "TERowParallelLinear")]),
}


def test_te_compat_table_rows_match_the_checks():
    rows = _rows()
    assert set(rows) == set(CHECKS), (sorted(set(rows) - set(CHECKS)), sorted(set(CHECKS) - set(rows)))
    for key, (_, status) in rows.items():
        assert status.startswith(CHECKS[key][0]), (key, status)


@pytest.mark.parametrize("row", list(CHECKS))
def test_te_compat_table_row_holds(row):
    te_npu_name = _rows()[row][0]
    for dotted in re.findall(r"`(te_npu(?:\.\w+)+)", te_npu_name):  # every te_npu name in the cell exists
        _resolve(dotted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        CHECKS[row][1]()


# ---- issue 20: a TE script ported with the table's renames only ---------------------------------

TE_SCRIPT = '''
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

fp8_recipe = recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3)
assert fp8_recipe.mxfp8() and isinstance(fp8_recipe, recipe.Recipe)
gen = torch.Generator().manual_seed(0)

with te.fp8_model_init(enabled=True, recipe=fp8_recipe):
    fc1 = te.Linear(64, 128, bias=True, params_dtype=torch.bfloat16)
experts = te.GroupedLinear(2, 128, 64, bias=True, params_dtype=torch.bfloat16)
params = list(fc1.parameters()) + list(experts.parameters())
optimizer = torch.optim.AdamW(params, lr=1e-3)

def block(x, m_splits, is_first_microbatch):
    return experts(torch.nn.functional.gelu(fc1(x, is_first_microbatch=is_first_microbatch)), m_splits,
                   is_first_microbatch=is_first_microbatch)

losses = []
for step in range(2):
    optimizer.zero_grad()
    for micro in range(2):
        x = torch.randn(64, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            y = te.checkpoint(block, x, [40, 24], micro == 0)
        loss = y.float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    optimizer.step()
assert all(l == l for l in losses) and losses[-1] != losses[0]
'''

# The renames the table lists: module paths and class names (nothing else changes).
RENAMES = [
    ("import transformer_engine.pytorch as te", "import te_npu as te"),
    ("from transformer_engine.common import recipe", "from te_npu import recipe"),
    ("te.Linear(", "te.TELinear("),
    ("te.GroupedLinear(", "te.TEGroupedLinear("),
]


@pytest.mark.filterwarnings("ignore::te_npu.tensor.QuantizedWeightUpdateWarning")
def test_te_script_runs_with_only_the_table_s_renames():
    """The issue's done-when: fp8_autocast + Linear + GroupedLinear with m_splits + fp8_model_init +
    an is_first_microbatch loop + checkpoint, written against TE, runs after the renames."""
    script = TE_SCRIPT
    for old, new in RENAMES:
        assert old in script, old
        script = script.replace(old, new)
    exec(compile(script, "<ported TE script>", "exec"), {})
    rows = _rows()
    assert any("transformer_engine.pytorch.Linear(" in row for row in rows)
    assert any("transformer_engine.pytorch.GroupedLinear(" in row for row in rows)
