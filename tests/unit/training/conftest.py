"""Fixtures for the training-piece tests: the repo root and a loader for scripts/*.py."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def load_script():
    """``load_script("prepare_data")`` imports ``scripts/prepare_data.py`` as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
