"""Seeded weights for the quantized-tensor tests (``gen``: tests/unit/conftest.py)."""
import pytest
import torch

from te_npu.tensor import HiF8Tensor, MXFP8Tensor
from tests.seeded import spread_values


@pytest.fixture
def make_weight(gen):
    """``make_weight(*shape)`` -> bf16 weight with a spread of magnitudes 2**U[-6, 6) (distinct block scales)."""
    return spread_values(gen, octaves=6)


# (id, class, shape): every weight kind the model holds.
WEIGHT_KINDS = [
    ("mxfp8_dense", MXFP8Tensor, (128, 64)),
    ("mxfp8_grouped", MXFP8Tensor, (4, 64, 32)),
    ("hif8_dense", HiF8Tensor, (128, 64)),
    ("hif8_grouped", HiF8Tensor, (4, 64, 32)),
]


@pytest.fixture(params=WEIGHT_KINDS, ids=[kind[0] for kind in WEIGHT_KINDS])
def weight_kind(request):
    return request.param[1], request.param[2]


def _inner_bits(tensor) -> dict:
    """Inner tensors as integer bit views, for exact comparisons (float8 has no torch.equal on NaN)."""
    return {
        name: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
        for name, t in tensor._inner().items()
    }


def _assert_same_payload(a, b) -> None:
    bits_a, bits_b = _inner_bits(a), _inner_bits(b)
    assert bits_a.keys() == bits_b.keys()
    for name in bits_a:
        assert torch.equal(bits_a[name], bits_b[name]), name


@pytest.fixture
def assert_same_payload():
    """``assert_same_payload(a, b)``: every inner tensor bit-identical."""
    return _assert_same_payload


@pytest.fixture
def inner_bits():
    return _inner_bits
