"""MemoryTracker: every storage counted once, from creation to free or resize, on real and fake
tensors; kernel scratch left out of the device account; labels move bytes between categories."""
from __future__ import annotations

import pytest
import torch

from te_npu import compat
from te_npu.training.capacity.memory_tracker import MemoryTracker


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_tracker_counts_each_storage_once_until_freed(fake):
    mode = compat.fake_tensor_mode() if fake else torch.no_grad()
    tracker = MemoryTracker()
    with mode, tracker:
        tracker.start_stage("a")
        x = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        view = x[10:20]  # same storage: not counted again
        y = torch.empty(250, dtype=torch.bfloat16)  # 500 bytes
        assert tracker.device_bytes == 4500
        del x, view
        assert tracker.device_bytes == 500
        tracker.start_stage("b")
        del y
    assert tracker.stages[1].peak_bytes == 4500 and tracker.stages[1].end_bytes == 500
    assert tracker.stages[2].peak_bytes == 500 and tracker.stages[2].end_bytes == 0


def test_tracker_leaves_kernel_scratch_out_of_the_device_account():
    tracker = MemoryTracker()
    with compat.fake_tensor_mode(), tracker:
        tracker.start_stage("kernel")
        with tracker.kernel():
            scratch = torch.empty(1_000_000)  # 4 MB decoded operand, freed inside the call
            out = torch.empty(1000)           # 4 kB result, outlives the call
            del scratch
        assert tracker.device_bytes == 4000
    stage = tracker.stages[-1]
    assert stage.peak_bytes == 4000 and stage.emulation_peak_bytes == 4_004_000
    del out


def test_tracker_follows_storage_resize_as_fsdp2_frees_and_reallocates():
    tracker = MemoryTracker()
    with tracker:
        tracker.start_stage("resize")
        buffer = torch.empty(256, dtype=torch.uint8)
        buffer.untyped_storage().resize_(0)
        assert tracker.device_bytes == 0
        buffer.untyped_storage().resize_(1024)
        assert tracker.device_bytes == 1024
    assert tracker.stages[-1].peak_bytes == 1024
    assert torch.UntypedStorage.resize_.__name__ == "resize_" and not hasattr(torch.UntypedStorage.resize_, "__wrapped__")


def test_tracker_labels_move_bytes_and_exact_stages_use_final_labels():
    tracker = MemoryTracker()
    with compat.fake_tensor_mode(), tracker:
        tracker.start_stage("setup", exact=True)
        w = torch.empty(100)
        tracker.start_stage("later")
        tracker.label([w], "FP32 masters")
    assert tracker.totals["FP32 masters"] == 400 and tracker.totals["temporaries"] == 0
    assert tracker.stages[1].peak_by_category == {"FP32 masters": 400}  # filed when created, relabelled later


def test_tracker_answers_host_reads_of_fake_values_and_refuses_integers():
    tracker = MemoryTracker()
    with compat.fake_tensor_mode(), tracker:
        t = torch.randn(4)
        assert bool(torch.isfinite(t).all()) is True and float(t.sum()) == 1.0
        with pytest.raises(RuntimeError, match="integer value"):
            int(torch.ones(3, dtype=torch.int64).sum())
    with tracker:  # real tensors read their values
        assert int(torch.arange(4).sum()) == 6
