"""Binding against the real torch_npu schemas, call recording, and the fixture extractor."""
import io
import zipfile

import pytest
import torch
import yaml

from tests.fakes.schemas import FIXTURE, all_schemas, load_fixture
from scripts.extract_npu_schemas import OPS, extract

EXPECTED_OPS = {"npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis", "npu_grouped_dynamic_mx_quant",
                "npu_dynamic_quant", "npu_quantize", "npu_quant_max", "npu_quant_matmul", "npu_grouped_matmul"}


def test_fixture_holds_the_wheel_schemas_of_every_modelled_op():
    fixture = load_fixture()
    assert fixture["source"]["torch_npu_version"] == "2.13.0" and set(fixture["ops"]) == EXPECTED_OPS
    names = {s.qualified for s in all_schemas()}
    assert names == EXPECTED_OPS | {"npu_grouped_matmul.List"}
    # the binary registers npu_quantize(Tensor input, ...) while the codegen yaml says `self`
    assert fixture["ops"]["npu_quantize"]["registered"][0].startswith("npu_quantize(Tensor input,")


def test_fake_exposes_exactly_the_fixture_ops_and_the_dtype_codes(npu):
    for op in EXPECTED_OPS:
        assert callable(getattr(npu, op))
    assert (npu.hifloat8, npu.float8_e8m0fnu, npu.float8_e4m3fn, npu.float4_e2m1fn_x2) == (290, 293, 292, 296)
    assert npu.__version__ == "2.13.0" and npu.version.__version__ == "2.13.0"


@pytest.mark.parametrize("call,match", [
    (lambda n, x: n.npu_dynamic_mx_quant(x, -1), "takes 1 positional argument"),
    (lambda n, x: n.npu_dynamic_mx_quant(x, axis="0"), "Expected a value of type 'int' for argument 'axis'"),
    (lambda n, x: n.npu_dynamic_mx_quant(x, block=32), "Unknown keyword argument 'block'"),
    (lambda n, x: n.npu_dynamic_mx_quant(x, dst_type_max="a"), "'float' for argument 'dst_type_max'"),
    (lambda n, x: n.npu_dynamic_mx_quant(), "missing value for argument 'input'"),
    (lambda n, x: n.npu_grouped_dynamic_mx_quant(x, group_index=[64]), "'Tensor' for argument 'group_index'"),
    (lambda n, x: n.npu_grouped_matmul(x, [x], group_type=0), "'List\\[Tensor\\]' for argument 'x'"),
    (lambda n, x: n.npu_quantize(x, x, None), "missing value for argument 'dtype'"),
    (lambda n, x: n.npu_quant_matmul(x, x, x, group_sizes=1.5), "group_sizes"),
], ids=["positional-kwonly", "axis-type", "unknown-kw", "float-type", "missing", "tensor-type", "list-type",
        "missing-positional", "int-list"])
def test_binding_errors_come_from_torch_schema_matching(npu, call, match):
    x = torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match=match):
        call(npu, x)


def test_calls_record_raw_and_schema_bound_arguments(npu):
    x = torch.randn(4, 64).bfloat16()
    npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=1)
    (call,) = npu.calls_of("npu_dynamic_mx_quant")
    defaults = {"axis": -1, "round_mode": "rint", "block_size": 32, "dst_type_max": 0.0, "max_low_bound": 0.0}
    assert call.args == (x,) and call.kwargs == dict(defaults, dst_type=torch.float8_e4m3fn, scale_alg=1)
    assert call.bound == dict(defaults, input=x, dst_type=24, scale_alg=1)
    npu.npu_quantize(torch.randn(2, 3), torch.tensor([1.0]), None, npu.hifloat8, axis=-1)
    (q,) = npu.calls_of("npu_quantize")
    assert q.args[3] is npu.hifloat8 and q.kwargs == {"axis": -1, "div_mode": True} and q.overload == "npu_quantize"


def test_fail_injects_errors_after_recording(npu):
    boom = RuntimeError("aclnnQuantMatmulV5 failed: 561103")
    npu.fail("npu_quant_matmul", boom)
    with pytest.raises(RuntimeError, match="561103"):
        npu.npu_quant_matmul(torch.zeros(1), torch.zeros(1), torch.zeros(1))
    assert len(npu.calls_of("npu_quant_matmul")) == 1 and npu.calls[-1].bound == {}


def test_a_dtype_passed_to_an_int_argument_binds_as_its_scalar_type(npu):
    x = torch.randn(4, 64).bfloat16()
    npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e5m2)
    assert npu.calls[-1].bound["dst_type"] == 23 and npu.calls[-1].kwargs["dst_type"] is torch.float8_e5m2


def _fake_wheel(registered: list[str], yaml_funcs: list[str]) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("torch_npu/version.py", "__version__ = '9.9.9'\ngit_version = 'abc'\n")
        zf.writestr("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
                    yaml.safe_dump({"backend": "NPU", "custom": [{"func": f} for f in yaml_funcs]}))
        zf.writestr("torch_npu/lib/libtorch_npu.so", b"\x00junk\x00" + b"\x00".join(s.encode() for s in registered) + b"\x00")
    buf.seek(0)
    return buf


def test_extractor_prefers_registered_schemas_and_records_yaml_differences(tmp_path):
    registered = [load_fixture()["ops"][op]["registered"][0] for op in OPS]
    yaml_funcs = list(registered)
    yaml_funcs[OPS.index("npu_quantize")] = yaml_funcs[OPS.index("npu_quantize")].replace("Tensor input", "Tensor self")
    wheel = tmp_path / "torch_npu-9.9.9.whl"
    wheel.write_bytes(_fake_wheel(registered, yaml_funcs).getvalue())
    fixture = extract(wheel)
    assert fixture["source"]["torch_npu_version"] == "9.9.9"
    assert fixture["ops"]["npu_quantize"]["registered"] == [registered[OPS.index("npu_quantize")]]
    assert "codegen_yaml" in fixture["ops"]["npu_quantize"] and "codegen_yaml" not in fixture["ops"]["npu_quant_matmul"]


def test_checked_in_fixture_is_what_the_extractor_writes():
    text = FIXTURE.read_text()
    assert text.startswith("# Generated by scripts/extract_npu_schemas.py")
