"""Seeded inputs and the independent reference for the autograd-function tests."""
import pytest
import torch



@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20250611)


@pytest.fixture
def rand(gen):
    """``rand(*shape, dtype=bf16, scale=1.0, requires_grad=False)`` -> seeded normal tensor."""

    def make(*shape, dtype=torch.bfloat16, scale=1.0, requires_grad=False):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_(requires_grad)

    return make
