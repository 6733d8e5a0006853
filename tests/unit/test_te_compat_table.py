"""README's Transformer Engine / Megatron table stays true: every row has a check here (and
every check a row); supported names import and work, refused ones raise with their reason."""
from __future__ import annotations

import importlib
import io
import re
import warnings
from pathlib import Path

import pytest
import torch

import te_npu
from te_npu import ConfigError, MXFP8BlockRecipe
from te_npu.recipe import Format

README = Path(__file__).resolve().parents[2] / "README.md"


def _rows() -> dict[str, tuple[str, str]]:
    text = README.read_text()
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


def _quantized_linear():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe()):
        return te_npu.TELinear(64, 64, bias=False, params_dtype=torch.bfloat16)


def _optimizer_step():
    lin = _quantized_linear()
    lin.weight.grad = torch.ones(64, 64, dtype=torch.bfloat16)
    with pytest.warns(te_npu.tensor.QuantizedWeightUpdateWarning, match="MasterWeightOptimizer"):
        torch.optim.AdamW(lin.parameters(), lr=1e-3).step()


def _load_weights_only():
    buffer = io.BytesIO()
    torch.save(_quantized_linear().state_dict(), buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=True)["weight"]) is te_npu.tensor.MXFP8Tensor


def _high_precision_init_val():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe(), preserve_high_precision_init_val=True):
        lin = te_npu.TELinear(64, 64, bias=False, params_dtype=torch.bfloat16)
    assert lin.weight.get_high_precision_init_val().dtype == torch.bfloat16
    lin.weight.clear_high_precision_init_val()


def _forward(**kwargs):
    return te_npu.TELinear(64, 64, **kwargs)(torch.randn(32, 64).to(torch.bfloat16), is_first_microbatch=True)


def _torch_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16), te_npu.autocast():
        assert te_npu.TELinear(64, 64, params_dtype=torch.float32, bias=False)(torch.randn(32, 64)).dtype == torch.bfloat16


def _dtype_cast():
    assert te_npu.TELinear(64, 64, bias=False, params_dtype=torch.bfloat16)(torch.randn(32, 64)).dtype == torch.float32


def _grouped():
    layer = te_npu.TEGroupedLinear(2, 64, 64, bias=False, params_dtype=torch.bfloat16)
    assert layer(torch.randn(32, 64).to(torch.bfloat16), [20, 12], is_first_microbatch=True).shape == (32, 64)


# first README cell -> (status word the row must start with, check)
CHECKS = {
    "`transformer_engine.pytorch.autocast(enabled, recipe, amax_reduction_group)`": ("supported", lambda: (
        _resolve("te_npu.autocast")(True, MXFP8BlockRecipe(), None),
        _raises(lambda: te_npu.autocast(calibrating=True), ConfigError, "nothing|no scaling statistics"))),
    "`transformer_engine.pytorch.fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`": ("alias", lambda: (
        _resolve("te_npu.fp8_autocast")(True, False, MXFP8BlockRecipe(), None),
        _raises(lambda: te_npu.fp8_autocast(_graph=True), ConfigError, "does not capture"))),
    "`transformer_engine.pytorch.quantized_model_init(enabled, recipe, preserve_high_precision_init_val)`": (
        "supported", lambda: _resolve("te_npu.quantized_model_init")(True, MXFP8BlockRecipe(), True)),
    "`transformer_engine.pytorch.fp8_model_init`": (
        "alias", lambda: _resolve("te_npu.fp8_model_init") is te_npu.quantized_model_init or pytest.fail("not alias")),
    "`param.get_high_precision_init_val()` / `param.clear_high_precision_init_val()`": (
        "supported", _high_precision_init_val),
    "`transformer_engine.pytorch.checkpoint(fn, *args, **kwargs)`": (
        "supported", lambda: _resolve("te_npu.checkpoint")(torch.sin, torch.zeros(2, requires_grad=True))),
    "`checkpoint(..., use_reentrant=True)`": ("refused", lambda: _raises(
        lambda: te_npu.checkpoint(torch.sin, torch.zeros(2), use_reentrant=True), ConfigError, "non-reentrant")),
    "`checkpoint(..., distribute_saved_activations=True)` / `tp_group` / `get_rng_state_tracker`": (
        "refused", lambda: [_raises(lambda k=k, v=v: te_npu.checkpoint(torch.sin, torch.zeros(2), **{k: v}),
                                    ConfigError, "tensor parallelism|RNG tracker")
                            for k, v in (("distribute_saved_activations", True), ("tp_group", object()),
                                         ("get_rng_state_tracker", object()))]),
    "`transformer_engine.pytorch.Linear(in, out, bias=..., params_dtype=..., init_method=...)`": (
        "supported", lambda: _resolve("te_npu.TELinear")(64, 64, bias=True, params_dtype=torch.float32,
                                                         init_method=torch.nn.init.zeros_)),
    "`Linear(..., return_bias=True)` (Megatron's `skip_bias_add`)": (
        "supported", lambda: len(_forward(bias=True, return_bias=True)) == 2 or pytest.fail("no (out, bias)")),
    "`Linear.forward(x, is_first_microbatch=...)`": ("supported", _forward),
    "`transformer_engine.pytorch.GroupedLinear(num_gemms, in, out)`, `forward(x, m_splits, is_first_microbatch)`": (
        "supported", _grouped),
    "`GroupedLinear(..., bias=True)`": ("refused", lambda: _raises(
        lambda: te_npu.TEGroupedLinear(2, 64, 64, bias=True, params_dtype=torch.bfloat16), ValueError, "carry no bias")),
    "`transformer_engine.common.recipe.MXFP8BlockScaling(margin, fp8_format, ...)`": (
        "supported", lambda: _resolve("te_npu.recipe.MXFP8BlockScaling")(0, Format.E4M3) == MXFP8BlockRecipe()
        or pytest.fail("not the MXFP8 recipe")),
    "`recipe.Format.E4M3`": ("supported", lambda: _resolve("te_npu.recipe.Format.E4M3")),
    "`MXFP8BlockScaling(fp8_format=Format.HYBRID)`": ("refused", lambda: _raises(
        lambda: te_npu.recipe.MXFP8BlockScaling(fp8_format=Format.HYBRID), ConfigError, "E5M2")),
    "`MXFP8BlockScaling(margin=1)` / `fp8_dpa` / `fp8_mha` / `backward_override` / `enable_2d_quantization`": (
        "refused", lambda: [_raises(lambda k=k, v=v: te_npu.recipe.MXFP8BlockScaling(**{k: v}), ConfigError,
                                    rf"MXFP8BlockScaling\.{k}: .* is not supported .*: \w+")
                            for k, v in (("margin", 1), ("fp8_dpa", True), ("fp8_mha", True),
                                         ("backward_override", "dequantized"), ("enable_2d_quantization", True))]),
    "`recipe.DelayedScaling`": ("refused", lambda: _raises(te_npu.recipe.DelayedScaling, ConfigError, "delayed")),
    "`recipe.Float8CurrentScaling`": ("refused", lambda: _raises(
        te_npu.recipe.Float8CurrentScaling, ConfigError, "HiF8CurrentScalingRecipe")),
    "`recipe.Float8BlockScaling`": ("refused", lambda: _raises(
        te_npu.recipe.Float8BlockScaling, ConfigError, "MXFP8BlockScaling")),
    "`recipe.NVFP4BlockScaling`": ("refused", lambda: _raises(te_npu.recipe.NVFP4BlockScaling, ConfigError, "FP4")),
    "`transformer_engine.pytorch.is_mxfp8_available(return_reason=True)`": (
        "supported", lambda: _resolve("te_npu.is_mxfp8_available")(return_reason=True)),
    "TE modules under `torch.autocast(dtype=torch.bfloat16)`": ("supported", _torch_autocast),
    "TE's input / parameter dtype check outside `torch.autocast` (`TypeError`)": ("differs", _dtype_cast),
    "`torch.optim.AdamW` / `SGD` on FP8 parameters": ("supported", _optimizer_step),
    "`torch.load(f)` (`weights_only=True`) of a quantized state dict": ("supported", _load_weights_only),
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
