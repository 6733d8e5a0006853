"""``python -m te_npu.selfcheck`` through the vendor-faithful fake torch_npu (tests/fakes): every op
agrees with the emulation and it exits 0; a fake that is wrong by one HiF8 ulp or one MX scale
step is named, with a non-zero exit. The fake's documented differences (the Limits of
docs/numerics-and-limits.md) show as "known difference", never as a pass or a failure."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models.deepseek_v3.config import DSV3_16B, expected_parameter_shapes
from te_npu.selfcheck import main
from te_npu.selfcheck.cases import OPS, SCALE_ALGS, block_mask
from te_npu.selfcheck.compare import AGREES, DIFFERS, KNOWN, compare_bits, compare_gemm
from te_npu.selfcheck.shapes import DSV3_16B_DIMS, SHAPE_SETS
from tests.npu_backend import install_npu_backend

ARGS = ["--device", "npu", "--tensor-device", "cpu", "--shapes", "small"]


def _run(tmp_path, *extra):
    lines = []
    code = main([*ARGS, "--json", str(tmp_path / "selfcheck.json"), *extra], print_fn=lines.append)
    return code, json.loads((tmp_path / "selfcheck.json").read_text()), "\n".join(lines)


def test_selfcheck_through_the_fake_agrees_on_every_op_and_exits_0(monkeypatch, tmp_path):
    fake = install_npu_backend(monkeypatch)
    code, report, out = _run(tmp_path)
    assert code == 0, out
    assert report["summary"]["differs"] == report["summary"]["error"] == 0
    assert set(report["ops"]) == set(OPS)  # every torch_npu op the wrappers call has cases
    for op in OPS:
        assert any(r["op"] == op and r["verdict"] == AGREES and not r["limit"] for r in report["results"]), op
    # every MX quantization kernel ran under both scale rules (torch_npu scale_alg 1 = ceil, 0 = floor)
    for op in ("npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis", "npu_grouped_dynamic_mx_quant"):
        assert {c.bound["scale_alg"] for c in fake.calls_of(op)} == {0, 1}, op
    assert all(any(alg in r["name"] for alg in SCALE_ALGS) for r in report["results"] if "MX " in r["name"])
    # grouped GEMMs ran with ragged, empty and single groups, in all three directions
    grouped = [r["name"] for r in report["results"] if r["op"] == "npu_grouped_matmul"]
    for kind in ("ragged", "with empty groups", "single group"):
        for direction in ("fprop", "dgrad", "wgrad"):
            assert any(kind in n and direction in n for n in grouped), (kind, direction)
    # documented differences are reported as such, never silently: only on cases tagged with a Limits line
    known = [r for r in report["results"] if r["verdict"] == KNOWN]
    assert known and all(r["limit"] in report["limits"] for r in known)
    assert {r["limit"] for r in known} >= {"mx-tiny-amax", "mx-nonfinite-block", "hif8-dynamic-nonfinite",
                                           "hif8-quantize-sat-inf"}
    # what the gate read, printed and in the report; the markdown page beside the JSON
    assert "Ascend950DT_9571 (SoC version 260), CANN 9.2.0" in out and "aclnnQuantMatmulV5" in out
    page = (tmp_path / "selfcheck.md").read_text()
    assert "**PASS**" in page and "known difference" in page and "`npu_grouped_matmul`" in page


def _off_by_one_ulp_hif8_scale(real):
    def npu_dynamic_quant(*args, **kwargs):
        codes, scale = real(*args, **kwargs)
        return codes, (scale.view(torch.int32) + 1).view(torch.float32)

    return npu_dynamic_quant


def _shifted_mx_scale(real):
    def npu_dynamic_mx_quant(*args, **kwargs):
        data, scale = real(*args, **kwargs)
        bits = scale.view(torch.uint8)
        return data, torch.where(bits < 254, bits + 1, bits).view(scale.dtype)

    return npu_dynamic_mx_quant


@pytest.mark.parametrize("op, wrong", [("npu_dynamic_quant", _off_by_one_ulp_hif8_scale),
                                       ("npu_dynamic_mx_quant", _shifted_mx_scale)], ids=["hif8_ulp", "mx_scale"])
def test_selfcheck_names_a_wrong_kernel_and_exits_non_zero(monkeypatch, tmp_path, op, wrong):
    fake = install_npu_backend(monkeypatch)
    monkeypatch.setattr(fake, op, wrong(getattr(fake, op)))
    code, report, out = _run(tmp_path, "--ops", op)
    assert code == 1
    differing = [r for r in report["results"] if r["verdict"] == DIFFERS]
    assert differing and all(r["op"] == op for r in differing)
    assert f"DIFFERS: {op} |" in out and "scale" in differing[0]["detail"]
    assert "**FAIL**" in (tmp_path / "selfcheck.md").read_text()


def test_selfcheck_reports_a_kernel_error_by_op(monkeypatch, tmp_path):
    fake = install_npu_backend(monkeypatch)
    fake.fail("npu_quant_matmul", RuntimeError("aclnnQuantMatmulV5 failed: 561103"))
    code, report, _ = _run(tmp_path, "--ops", "npu_quant_matmul")
    assert code == 1
    assert {r["verdict"] for r in report["results"]} == {"error"}
    assert "561103" in report["results"][0]["detail"]


def test_selfcheck_on_cpu_is_a_smoke_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    lines = []
    code = main(["--device", "cpu", "--shapes", "small", "--ops", "npu_quantize", "--json", str(tmp_path / "r.json")],
                print_fn=lines.append)
    assert code == 0 and any(line.startswith("SMOKE:") for line in lines)
    assert "torch_npu not importable" in "\n".join(lines)
    assert json.loads((tmp_path / "r.json").read_text())["smoke"] is True


def test_selfcheck_npu_without_torch_npu_exits_2(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    lines = []
    assert main(["--device", "npu", "--json", str(tmp_path / "r.json")], print_fn=lines.append) == 2
    assert "cannot run" in lines[-1]


def test_16b_shapes_are_the_model_configs():
    """te_npu may not import models/: the 16B dims written out in the self-check are the config's."""
    for name, value in DSV3_16B_DIMS.items():
        if name != "tokens":
            assert getattr(DSV3_16B, name) == value, name
    weights = {shape for name, shape in expected_parameter_shapes(DSV3_16B).items()
               if "_proj" in name and name.endswith(".weight") and len(shape) == 2}
    shapes = SHAPE_SETS["16b"]
    assert {(n, k) for _, n, k in shapes.dense} == weights
    experts = {shape for name, shape in expected_parameter_shapes(DSV3_16B).items() if len(shape) == 3}
    assert {(e, n, k) for _, e, n, k in shapes.grouped} == experts


def test_block_mask_marks_blocks_along_the_blocked_axis_and_restarts_at_groups():
    special = torch.zeros(64, 64, dtype=torch.bool)
    special[3, 40] = True
    row, col = block_mask(special, "row"), block_mask(special, "col")
    assert row.sum() == 32 and row[3, 32:].all() and col.sum() == 32 and col[:32, 40].all()
    grouped = block_mask(special, "col", group_sizes=torch.tensor([2, 0, 62]))
    assert grouped[2:34, 40].all() and grouped.sum() == 32
    assert block_mask(special, "row", rule="all").sum() == 0


def test_compare_bits_and_gemm_verdicts():
    a = {"codes": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    b = {"codes": torch.tensor([1, 2, 4], dtype=torch.uint8)}
    assert compare_bits(a, a).verdict == AGREES
    assert compare_bits(a, b).verdict == DIFFERS
    inside = {"codes": torch.tensor([False, False, True])}
    outside = {"codes": torch.tensor([True, False, False])}
    assert compare_bits(a, b, inside, "mx-nonfinite-block").verdict == KNOWN
    assert compare_bits(a, b, outside, "mx-nonfinite-block").verdict == DIFFERS
    y = torch.randn(64, 64)
    one_ulp = (y.view(torch.int32) + 1).view(torch.float32)
    close = compare_gemm(one_ulp, y, torch.float32)
    assert close.verdict == AGREES and close.metrics["max_ulp"] == 1 and close.metrics["differing"] == 64 * 64
    assert compare_gemm(y * 1.01, y, torch.float32).verdict == DIFFERS
    nan = y.clone()
    nan[0, 0] = float("nan")
    assert compare_gemm(nan, y, torch.float32).verdict == DIFFERS
    assert compare_gemm(nan, y, torch.float32, "mx-gemm-range").verdict == KNOWN
