"""The fake is built from Ascend's sources only: nothing in tests/fakes imports te_npu."""
import ast
import subprocess
import sys
from pathlib import Path

FAKES = Path(__file__).resolve().parents[2] / "fakes"
ROOT = FAKES.parents[1]


def test_no_fake_module_imports_the_library_under_test():
    offenders = []
    for path in sorted(FAKES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "te_npu"]
    assert offenders == []


def test_importing_and_using_the_fake_loads_no_te_npu_module():
    code = ("import sys, torch; from tests.fakes.torch_npu import FakeTorchNpu; f = FakeTorchNpu(); "
            "f.npu_dynamic_mx_quant(torch.randn(2, 64).bfloat16(), dst_type=torch.float8_e4m3fn); "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'te_npu']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
