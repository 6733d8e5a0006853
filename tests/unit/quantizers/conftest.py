"""Seeded inputs for the quantizer tests."""
import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20250901)


@pytest.fixture
def spread(gen):
    """``spread(*shape, dtype=bf16)``: normal values times 2**U[-8, 8), so blocks get distinct scales."""

    def make(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        values = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape, generator=gen).float())
        return values.to(dtype)

    return make
