"""The capability gate on new hardware: a refusal says, in one line, what it read and what it
expected; ``capability_check="warn"`` runs anyway, warning once with every failed check; the
``low_precision.capability_check`` key chooses between them."""
from __future__ import annotations

import pytest
import torch

import te_npu
import te_npu.ops as ops
from te_npu.errors import ConfigError, LowPrecisionUnavailableError
from te_npu.ops import capability
from te_npu.training.config import LowPrecisionConfig
from tests.npu_backend import install_npu_backend


def test_a_refusal_is_one_line_with_what_was_read_and_expected(monkeypatch):
    install_npu_backend(monkeypatch, chip="Ascend910B3", cann_version="9.0.0")
    with pytest.raises(LowPrecisionUnavailableError) as info:
        ops.require_low_precision("mxfp8_e4m3", "npu:0")
    message = str(info.value)
    assert "\n" not in message
    # every failed check, each with its reading and its expectation
    assert "this chip is Ascend910B3 (SoC version 223; expected a name starting with 'Ascend950DT' and SoC version 260)" \
        in message
    assert "needs CANN >= 9.1.0" in message and "this CANN is 9.0.0" in message
    assert "aclnnGroupedDynamicMxQuantV2" in message
    assert "read: torch " in message and "Ascend910B3 (SoC version 223), CANN 9.0.0" in message
    assert "capability_check: warn" in message


def test_failed_checks_lists_each_check(monkeypatch):
    install_npu_backend(monkeypatch, chip="Ascend950PR_9579", without_kernels=["aclnnQuantize"])
    mx = capability.failed_checks("mxfp8_e4m3")
    assert len(mx) == 1 and "Ascend950DT" in mx[0]
    hif8 = capability.failed_checks("hif8")
    assert len(hif8) == 1 and "aclnnQuantize" in hif8[0]
    reading = capability.read_gate()
    assert reading.device_name == "Ascend950PR_9579" and reading.soc_version == 260
    assert reading.kernels["aclnnQuantize"] is False and reading.kernels["aclnnQuantMatmulV5"] is True


def test_warn_runs_anyway_with_a_loud_warning_naming_each_failed_check(monkeypatch):
    fake = install_npu_backend(monkeypatch)
    # a release string the gate cannot parse: CANN "unknown" fails MXFP8's CANN check only
    monkeypatch.setattr(fake.npu.utils, "get_cann_version", lambda module="CANN": "unreleased")
    monkeypatch.setattr(capability, "aclnn_kernel_available", lambda name: name != "aclnnDynamicMxQuant")
    with pytest.raises(LowPrecisionUnavailableError, match="CANN is unknown"):
        ops.require_low_precision("mxfp8_e4m3", "npu:0")
    with pytest.warns(RuntimeWarning, match="capability_check: warn") as warned:
        assert ops.require_low_precision("mxfp8_e4m3", "npu:0", capability_check="warn") == "npu"
    text = str(warned[0].message)
    assert "2 capability check(s) failed" in text and "this CANN is unknown" in text
    assert "aclnnDynamicMxQuant " in text and "python -m te_npu.selfcheck" in text


def test_the_waiver_lets_te_modules_run_after_the_warning(monkeypatch):
    fake = install_npu_backend(monkeypatch)
    monkeypatch.setattr(fake.npu.utils, "get_cann_version", lambda module="CANN": "unreleased")
    lin = te_npu.TELinear(64, 64, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with ops.force_backend("npu"), te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
        with pytest.raises(LowPrecisionUnavailableError, match="CANN"):
            lin(x)
        with capability.capability_waived("mxfp8_e4m3"):
            assert lin(x).shape == (32, 64)
    assert fake.calls_of("npu_quant_matmul")


@pytest.mark.parametrize("options, match", [(dict(device_count=0), "no NPU device is visible")])
def test_warn_still_refuses_when_nothing_could_run(monkeypatch, options, match):
    install_npu_backend(monkeypatch, **options)
    with pytest.raises(LowPrecisionUnavailableError, match=match):
        ops.require_low_precision("hif8", "npu:0", capability_check="warn")
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    with pytest.raises(LowPrecisionUnavailableError, match="not importable"):
        ops.require_low_precision("hif8", "npu:0", capability_check="warn")


def test_capability_check_key_defaults_to_strict_and_refuses_other_values():
    section = {"enabled": True, "format": "hif8", "scaling": "current"}
    assert LowPrecisionConfig.from_config(section, "low_precision").capability_check == "strict"
    warn = LowPrecisionConfig.from_config({**section, "capability_check": "warn"}, "low_precision")
    assert warn.capability_check == "warn" and warn.recipe is not None
    with pytest.raises(ConfigError, match="low_precision.capability_check: 'loose' is not supported"):
        LowPrecisionConfig.from_config({**section, "capability_check": "loose"}, "low_precision")
    with pytest.raises(ValueError, match="capability_check"):
        ops.require_low_precision("hif8", "cpu", capability_check="loose")


def test_capability_check_is_a_yaml_key_of_the_run():
    from te_npu.training.config import load_config

    cfg = load_config("recipes/dsv3_tiny_hif8.yaml", ["low_precision.capability_check=warn"])
    assert cfg.low_precision.capability_check == "warn" and cfg.low_precision.format == "hif8"
    assert load_config("recipes/dsv3_tiny_hif8.yaml").low_precision.capability_check == "strict"
    with pytest.raises(ConfigError, match="low_precision.capability_check"):
        load_config("recipes/dsv3_tiny_hif8.yaml", ["low_precision.capability_check=off"])
