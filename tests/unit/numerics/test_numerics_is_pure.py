"""``te_npu.numerics`` holds pure functions only: no caches, no mutable globals, no device /
platform / environment branches, no import of anything above it (kernels, ops, formats)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import te_npu

NUMERICS_DIR = Path(te_npu.__file__).parent / "numerics"
ALLOWED_IMPORTS = ("torch", "te_npu.numerics", "collections.abc", "struct", "__future__")
FORBIDDEN_NAMES = {"lru_cache", "cache", "cached_property", "environ", "getenv", "platform", "is_cuda"}
FORBIDDEN_ATTRS = {"type", "is_cuda", "environ", "platform", "get_cpu_capability"}


def _modules():
    return sorted(NUMERICS_DIR.glob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_numerics_imports_only_torch_and_itself(path):
    tree = ast.parse(path.read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    bad = [m for m in imported if not m.startswith(ALLOWED_IMPORTS)]
    assert not bad, f"numerics/{path.name} imports {bad}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_numerics_has_no_cache_global_or_device_branch(path):
    tree = ast.parse(path.read_text())
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global | ast.Nonlocal):
            problems.append(f"line {node.lineno}: global state")
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            problems.append(f"line {node.lineno}: {node.id}")
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS | FORBIDDEN_NAMES:
            problems.append(f"line {node.lineno}: .{node.attr}")
    for node in tree.body:  # module level: constants only (upper-case names, never containers to fill)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            if [getattr(t, "id", None) for t in getattr(node, "targets", [])] == ["__all__"]:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id.lstrip("_") != target.id.lstrip("_").upper():
                    problems.append(f"line {node.lineno}: module-level variable {target.id}")
            if isinstance(node.value, ast.Dict | ast.List | ast.Set) or (
                    isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") in {"dict", "list", "set"}):
                problems.append(f"line {node.lineno}: module-level mutable container")
    assert not problems, f"numerics/{path.name}: {problems}"
