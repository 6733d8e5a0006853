"""FormatSpec rules: the current-scaling amax per scale group (HiF8: per tensor, per expert in 3D)."""
import math

import torch

from te_npu.formats import Format, spec
from te_npu.quantizers.hif8 import hif8_amax


def test_formats_hif8_amax_per_tensor_and_per_expert():
    x = torch.tensor([[1.0, -3.5], [2.0, 0.25]], dtype=torch.bfloat16, requires_grad=True)
    amax = spec(Format.HIF8).amax(x)
    assert amax.dtype == torch.float32 and amax.shape == () and amax.item() == 3.5 and not amax.requires_grad
    w = torch.tensor([[[0.5, -1.0]], [[-8.0, 2.0]], [[0.0, -0.0]]])  # [E=3, 1, 2]
    assert torch.equal(spec(Format.HIF8).amax(w), torch.tensor([1.0, 8.0, 0.0]))
    w[1, 0, 1] = float("nan")
    per_expert = hif8_amax(w)  # the quantizers' name is the same function
    assert per_expert[0] == 1.0 and math.isnan(per_expert[1]) and per_expert[2] == 0.0
    assert spec(Format.HIF8).amax(torch.tensor([-6.0, 4.0])).item() == 6.0  # 1D: one scale
