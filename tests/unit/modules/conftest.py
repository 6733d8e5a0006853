"""Seeded inputs and weights for the TE module tests (never ``torch.manual_seed``)."""
import pytest

from tests.seeded import seeded_init, seeded_randn


@pytest.fixture
def rand():
    """``rand(*shape, dtype=bf16, scale=1.0, requires_grad=False)`` -> seeded normal tensor."""
    return seeded_randn(7)


@pytest.fixture
def init():
    """A seeded ``init_method`` for TELinear / TEGroupedLinear: U(+-1/sqrt(in)) per weight (their former default)."""
    return seeded_init(0)


@pytest.fixture
def experts_init():
    """A seeded ``init_method`` for TEGroupedSwiGLUExperts (its default N(0, 0.02))."""
    return seeded_init(1, std=0.02)
