"""An installed te_npu carries the native kernels' sources: every file of
``te_npu/ops/kernels/native/`` is package data of its package in ``pyproject.toml`` (setuptools
ships only what is declared there, so a moved source folder silently drops out of the wheel)."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import te_npu.ops.kernels.native_cpu as native_cpu

REPO = Path(__file__).resolve().parents[4]


def _declared(package: str) -> list[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    return list(data.get(package, ()))


def test_every_native_kernel_source_is_declared_package_data():
    sources = sorted(p.relative_to(native_cpu._NATIVE_DIR.parent).as_posix()
                     for p in native_cpu._NATIVE_DIR.iterdir() if p.suffix in (".cpp", ".h"))
    globs = _declared("te_npu.ops.kernels")
    assert sources and {".cpp", ".h"} <= {Path(s).suffix for s in sources}
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, g) for g in globs)]
    assert not missing, f"not shipped in a wheel: {missing} (package-data of te_npu.ops.kernels: {globs})"


def test_package_data_names_only_packages_that_exist():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, globs in data.items():
        folder = REPO / package.replace(".", "/")
        assert (folder / "__init__.py").is_file(), f"package-data names {package}, which is not a package"
        assert all(list(folder.glob(g)) for g in globs), f"{package}: a glob of {globs} matches no file"
