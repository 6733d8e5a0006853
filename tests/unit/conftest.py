"""Seeded randomness for the unit tests (never a module-level seed); a folder may override ``gen``."""
import numpy as np
import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20240611)


@pytest.fixture
def np_rng() -> np.random.Generator:
    return np.random.default_rng(20240611)
