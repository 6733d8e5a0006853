"""``count_host_syncs`` sees every kind of host read it documents, and nothing else."""
from __future__ import annotations

import torch

from te_npu.testing import count_host_syncs


def test_counts_each_kind_of_host_read():
    t = torch.tensor([3, 0, 2])
    with count_host_syncs() as syncs:
        t.sum().item()
        int(t[0])
        bool(t.any())
        t.tolist()
        torch.equal(t, t)
        t.nonzero()
        t[t > 0]
        torch.repeat_interleave(t, t)
        torch.unique(t)
    assert syncs.calls == {"item": 3, "tolist": 1, "equal": 1, "nonzero": 1, "boolean_index": 1,
                           "repeat_interleave": 1, "unique": 1}
    assert syncs.total == 9


def test_ignores_device_side_work_and_sized_repeat_interleave():
    t = torch.tensor([3, 0, 2])
    with count_host_syncs() as syncs:
        u = torch.where(t > 0, t, -t).cumsum(0) * 2
        torch.repeat_interleave(t, t, output_size=5)
        u[torch.tensor([0, 2])]
    assert syncs.total == 0


def test_counts_backward_and_restores_tolist():
    x = torch.randn(4, requires_grad=True)
    with count_host_syncs() as syncs:
        (x * 2).sum().backward()
    assert syncs.total == 0
    assert torch.Tensor.tolist(torch.tensor([1])) == [1] and "count_host_syncs" not in repr(torch.Tensor.tolist)
