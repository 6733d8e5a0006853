"""Layering is one-way: ``te_npu.ops`` (with ``QuantizedOperand``) imports only lower layers;
``te_npu.events`` sits below everything; no production module imports ``te_npu.testing``."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import te_npu

PACKAGE_DIR = Path(te_npu.__file__).parent
OPS_DIR = PACKAGE_DIR / "ops"
LOWER = ("te_npu.ops", "te_npu.events", "te_npu.formats", "te_npu.numerics", "te_npu.errors", "te_npu.compat")
PRODUCTION = sorted(p for p in PACKAGE_DIR.rglob("*.py") if "testing" not in p.relative_to(PACKAGE_DIR).parts)


def _te_npu_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("te_npu"):
            names.append(node.module if node.module != "te_npu" else f"te_npu.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("te_npu")]
    return names


@pytest.mark.parametrize("path", sorted(OPS_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(OPS_DIR)))
def test_ops_module_imports_only_lower_layers(path):
    upward = [m for m in _te_npu_imports(path) if not m.startswith(LOWER)]
    assert not upward, f"{path.name} imports {upward}: te_npu.ops must not depend on quantizers / tensor / functional"


def test_events_imports_only_formats():
    assert set(_te_npu_imports(PACKAGE_DIR / "events.py")) == {"te_npu.formats"}


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_production_module_never_imports_testing(path):
    """Test instruments (``te_npu.testing``: the probe, the host-sync counter and its process-wide
    ``Tensor.tolist`` patch) stay out of every production import graph."""
    testing = [m for m in _te_npu_imports(path) if m == "te_npu.testing" or m.startswith("te_npu.testing.")]
    assert not testing, f"{path.relative_to(PACKAGE_DIR)} imports {testing}"


def test_importing_te_npu_and_its_trainer_loads_no_test_instrument():
    """(In a fresh interpreter, ``te_npu.events`` first: it imports on its own too.)"""
    code = ("import te_npu.events, sys, te_npu.distributed, te_npu.training.trainer; "
            "assert not [m for m in sys.modules if m.startswith('te_npu.testing')], sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("path", sorted((OPS_DIR / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_only_numerics_and_ops_below_the_emulation(path):
    allowed = ("te_npu.numerics", "te_npu.ops.kernels", "te_npu.ops.group_sizes", "te_npu.compat")
    other = [m for m in _te_npu_imports(path) if not m.startswith(allowed)]
    assert not other, f"kernels/{path.name} imports {other}: the kernels sit between ops.emulation and numerics"


@pytest.mark.parametrize("module", ["te_npu.ops.checks", "te_npu.quantizers"])
def test_module_imports_first_in_a_fresh_interpreter(module):
    """No import-order dependence: each module imports on its own (the old quantizers ->
    tensor.operand -> tensor/__init__ -> quantizers cycle failed for some orders)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)


def test_tensor_operand_alias_is_the_ops_class():
    from te_npu.ops import QuantizedOperand
    from te_npu.tensor import QuantizedOperand as alias

    assert alias is QuantizedOperand
