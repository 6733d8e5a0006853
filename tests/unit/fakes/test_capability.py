"""Device and capability queries of the fake, shaped like torch_npu's real APIs."""
import sys

import pytest
import torch

from tests.fakes import install_fake_torch_npu
from tests.fakes.capability import ASCEND950, kernels_of_cann, soc_version_of


def test_install_registers_modules_and_torch_npu_device_module(monkeypatch):
    fake = install_fake_torch_npu(monkeypatch)
    import torch_npu
    from torch_npu.npu.utils import get_cann_version

    assert torch_npu is fake and sys.modules["torch_npu.npu"] is fake.npu and torch.npu is fake.npu
    assert get_cann_version() == "9.2.0" and torch.npu.utils._is_gte_cann_version("9.1.0")
    assert not torch.npu.utils._is_gte_cann_version("9.3.0")


def test_uninstall_restores_the_environment(monkeypatch):
    with monkeypatch.context() as m:
        install_fake_torch_npu(m)
        assert "torch_npu" in sys.modules
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")


@pytest.mark.parametrize("chip,soc", [("Ascend950DT_9571", 260), ("Ascend950PR_9579", 260), ("Ascend910B3", 223),
                                      ("Ascend910_9392", 251), ("Ascend310P3", -1)])
def test_device_name_and_soc_version(monkeypatch, chip, soc):
    fake = install_fake_torch_npu(monkeypatch, chip=chip, device_count=2)
    assert torch.npu.get_device_name() == chip == torch.npu.get_device_properties(1).name
    assert fake.npu.get_soc_version() == soc == soc_version_of(chip)
    assert torch.npu.device_count() == 2 and torch.npu.is_available()


def test_no_device_means_invalid_device_id(monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=0)
    assert not torch.npu.is_available()
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.npu.get_device_name()


def test_kernels_follow_the_cann_release():
    assert "aclnnDynamicMxQuantV3" not in kernels_of_cann("9.1.0") and "aclnnDynamicMxQuantV3" in kernels_of_cann("9.2.0")
    assert "aclnnDynamicQuantV4" in kernels_of_cann("9.1.0") and "aclnnDynamicQuantV4" not in kernels_of_cann("9.0.0")
    assert "aclnnDynamicMxQuantWithDualAxis" not in kernels_of_cann("8.5.0") and not kernels_of_cann("8.3.RC1")
    assert "aclnnGroupedDynamicMxQuantV2" in kernels_of_cann("9.1.0.beta.1")


def test_kernel_overrides(monkeypatch):
    fake = install_fake_torch_npu(monkeypatch, without_kernels=("aclnnQuantMatmulV5",))
    assert not fake.aclnn_kernel_available("aclnnQuantMatmulV5") and fake.aclnn_kernel_available("aclnnGroupedMatmulV4")
    only = install_fake_torch_npu(monkeypatch, kernels={"aclnnQuantize"})
    assert only.config.kernels == {"aclnnQuantize"} and only.config.soc_version == ASCEND950


def test_compat_queries_carry_no_capability(monkeypatch):
    install_fake_torch_npu(monkeypatch)
    monkeypatch.delenv("TORCH_NPU_DEVICE_CAPABILITY", raising=False)
    with pytest.warns(UserWarning, match="does not represent the actual capability"):
        assert torch.npu.get_device_capability() is None
    with pytest.warns(UserWarning, match="isn't implemented"):
        assert torch.npu.aclnn.version() is None
