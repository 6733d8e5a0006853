"""Group sizes carry a host mirror (``te_npu.ops.group_sizes``), so shapes and checks never read the device tensor."""
from __future__ import annotations

import pytest
import torch

from te_npu import ops
from te_npu.ops import emulation
from te_npu.ops.group_sizes import group_sizes_tensor, host_group_sizes, with_mirror_of
from te_npu.testing import count_host_syncs


def test_mirror_is_read_without_touching_the_values():
    sizes = group_sizes_tensor([5, 0, 40])
    assert sizes.dtype == torch.int64 and sizes.tolist() == [5, 0, 40]
    with count_host_syncs() as syncs:
        assert host_group_sizes(sizes) == (5, 0, 40)
    assert syncs.total == 0


def test_tensor_without_mirror_is_read_once():
    with count_host_syncs() as syncs:
        assert host_group_sizes(torch.tensor([1, 2])) == (1, 2)
    assert syncs.calls == {"tolist": 1}


def test_in_place_change_drops_the_mirror():
    sizes = group_sizes_tensor([5, 0, 40])
    sizes[1] = 7
    assert host_group_sizes(sizes) == (5, 7, 40)


def test_with_mirror_of_copies_a_current_mirror_only():
    src = group_sizes_tensor([3, 4])
    copy = with_mirror_of(src.to(torch.int32), src)
    with count_host_syncs() as syncs:
        assert host_group_sizes(copy) == (3, 4)
    assert syncs.total == 0
    src.add_(1)
    assert host_group_sizes(with_mirror_of(src.clone(), src)) == (4, 5)


@pytest.mark.parametrize("kernel", ["eager", "native"])
def test_ragged_layout_from_mirror_makes_no_host_read(kernel):
    x = torch.randn(77, 64)
    sizes = group_sizes_tensor([40, 0, 37])
    with ops.use_quant_kernel(kernel), count_host_syncs() as syncs:
        op = ops.quantize_mxfp8(x, "col", group_sizes=sizes)
        emulation.decode(op)
    assert syncs.total == 0
    assert op.scale.shape == (2 + 0 + 2, 64)


def test_ragged_layout_still_checks_the_row_count():
    with pytest.raises(ValueError, match="sum to 70, operand has 77 rows"):
        ops.quantize_mxfp8(torch.randn(77, 64), "col", group_sizes=group_sizes_tensor([40, 30]))


def test_mirror_works_for_inference_tensors():
    with torch.inference_mode():
        sizes = group_sizes_tensor([3, 4])
        assert host_group_sizes(with_mirror_of(sizes.clone(), sizes)) == (3, 4)
