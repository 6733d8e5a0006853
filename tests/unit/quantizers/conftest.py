"""Seeded inputs for the quantizer tests."""
import pytest
import torch

from tests.seeded import spread_values


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20250901)


@pytest.fixture
def spread(gen):
    """``spread(*shape, dtype=bf16)``: normal values times 2**U[-8, 8), so blocks get distinct scales."""
    return spread_values(gen, octaves=8)
