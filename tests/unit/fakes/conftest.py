import pytest
import torch

from tests.fakes import install_fake_torch_npu


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def npu(monkeypatch):
    """The fake torch_npu on an Ascend 950DT with CANN 9.2.0 (every kernel the fake knows)."""
    return install_fake_torch_npu(monkeypatch)
