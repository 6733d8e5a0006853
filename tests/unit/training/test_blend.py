"""Blends: Megatron's greedy dataset order, shares at every prefix, rank shards, exact resume on
any world size / micro batch, fixed validation batches."""
import json

import numpy as np
import pytest
import torch

from te_npu.training.data.blend import BlendBatcher, BlendPart, TokenBlend, blending_indices, normalize_weights
from te_npu.training.data.sampling import TokenBatcher, validation_batches
from te_npu.training.data.token_dataset import TokenDataset

SEQ = 8
TAG = 1_000_000  # token value = dataset * TAG + offset: a window names its dataset and sample


def tagged_blend(sizes, weights) -> TokenBlend:
    """Datasets of ``sizes[d]`` samples whose tokens are ``d * TAG + offset`` (int64 views)."""
    parts = []
    for d, (n, w) in enumerate(zip(sizes, weights)):
        tokens = d * TAG + np.arange(n * SEQ + 1, dtype=np.int64)
        parts.append(BlendPart(TokenDataset.view(f"ds{d}", tokens, {"num_tokens": tokens.size}), w, f"data.blend[{d}]"))
    return TokenBlend(parts)


def served(batch) -> list[tuple[int, int]]:
    """``(dataset, sample)`` of each row of a batch."""
    first = batch[0][:, 0]
    return [(int(v) // TAG, int(v) % TAG // SEQ) for v in first]


def test_blending_order_is_megatrons_for_a_hand_worked_case():
    # helpers.cpp build_blending_indices, by hand for weights 0.3 / 0.7: error_i = w_i * max(p, 1) - c_i
    # p=0: .3 vs .7 -> 1; p=1: .3 vs -.3 -> 0; p=2: -.4 vs .4 -> 1; p=3: -.1 vs .1 -> 1; p=4: .2 vs -.2 -> 0 ...
    dataset, sample = blending_indices([0.3, 0.7], [0, 0], 0, 10)
    assert dataset.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    # equal errors: the first dataset wins (strict >), as in the C++ loop
    assert blending_indices([0.5, 0.5], [0, 0], 0, 4)[0].tolist() == [0, 1, 0, 1]


def test_blending_continues_from_any_position_identically():
    weights = normalize_weights([3, 1, 1, 5])
    whole = blending_indices(weights, [0] * 4, 0, 5000)
    counts, parts = [0] * 4, []
    for start in range(0, 5000, 333):
        parts.append(blending_indices(weights, counts, start, min(333, 5000 - start)))
    assert np.array_equal(np.concatenate([p[0] for p in parts]), whole[0])
    assert np.array_equal(np.concatenate([p[1] for p in parts]), whole[1])


@pytest.mark.parametrize("num_datasets", [2, 3, 5, 8])
def test_blend_shares_match_weights_at_every_prefix(num_datasets):
    rng = np.random.default_rng(num_datasets)
    for _ in range(5):
        weights = normalize_weights(rng.random(num_datasets) + 0.01)
        dataset, _ = blending_indices(weights, [0] * num_datasets, 0, 4000)
        counts_NK = np.cumsum(np.eye(num_datasets)[dataset], axis=0)
        error_NK = counts_NK - np.outer(np.arange(1, 4001), weights)
        # never ahead of its share by a whole sample; behind by at most one (two datasets) or a little more
        assert error_NK.max() < 1.0
        assert -error_NK.min() <= (1.0 if num_datasets == 2 else 1.5)
        # so any block of a global batch (64 samples) holds round(w * 64) of each, give or take 2
        per_block = np.diff(counts_NK[63::64], axis=0) - 64 * np.asarray(weights)
        assert np.abs(per_block).max() < 2.5


def test_blend_batcher_ranks_split_each_step_of_the_blend_order():
    blend = tagged_blend([50, 30], [0.3, 0.7])
    ranks = [BlendBatcher(blend, 2, SEQ, seed=3, rank=r, world_size=2) for r in range(2)]
    reference = BlendBatcher(blend, 4, SEQ, seed=3, rank=0, world_size=1)
    for _ in range(20):
        rows = [served(next(b)) for b in ranks]
        interleaved = [rows[r][k] for k in range(2) for r in range(2)]  # rank r holds positions r, r + W
        assert interleaved == served(next(reference))
    assert ranks[0].consumed_samples == reference.consumed_samples == 80


def test_blend_batcher_orders_each_dataset_by_seeded_epochs():
    blend = tagged_blend([5, 200], [0.5, 0.5])
    batcher = BlendBatcher(blend, 10, SEQ, seed=9)
    small = [s for _ in range(3) for d, s in served(next(batcher)) if d == 0]  # 15 samples of a 5-sample dataset
    for epoch in range(3):
        assert sorted(small[5 * epoch : 5 * epoch + 5]) == list(range(5))  # each epoch a permutation
    assert small[:5] != small[5:10] or small[5:10] != small[10:]  # reshuffled per epoch
    again = BlendBatcher(blend, 10, SEQ, seed=9)
    assert [served(next(again)) for _ in range(3)] != [served(next(BlendBatcher(blend, 10, SEQ, seed=10)))
                                                      for _ in range(3)]
    unshuffled = BlendBatcher(blend, 10, SEQ, seed=9, shuffle=False)
    assert [s for d, s in served(next(unshuffled)) if d == 0] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("saved", "resumed"), [((2, 2), (1, 4)), ((2, 2), (4, 1)), ((1, 3), (2, 5))],
                         ids=["2x2->1x4", "2x2->4x1", "1x3->2x5"])
def test_blend_batcher_resumes_exactly_on_any_layout(saved, resumed):
    blend = tagged_blend([40, 25, 60], [0.2, 0.3, 0.5])
    (w0, b0), (w1, b1) = saved, resumed
    continuous = BlendBatcher(blend, 1, SEQ, seed=5)
    stream = [served(next(continuous))[0] for _ in range(400)]
    before = [BlendBatcher(blend, b0, SEQ, seed=5, rank=r, world_size=w0) for r in range(w0)]
    for _ in range(7):
        for b in before:
            next(b)
    state = json.loads(json.dumps(before[0].state_dict()))  # checkpoint-safe plain values
    assert state["consumed_samples"] == 7 * b0 * w0
    after = [BlendBatcher(blend, b1, SEQ, seed=5, rank=r, world_size=w1) for r in range(w1)]
    for b in after:
        b.load_state_dict(state)
    rows = [served(next(b)) for b in after]
    continued = [rows[r][k] for k in range(b1) for r in range(w1)]
    start = state["position"]
    assert continued == stream[start : start + b1 * w1]


def test_blend_state_refuses_another_blend_or_order():
    blend = tagged_blend([40, 25], [0.5, 0.5])
    state = BlendBatcher(blend, 2, SEQ, seed=1).state_dict()
    with pytest.raises(ValueError, match="mismatch on 'weights'"):
        BlendBatcher(tagged_blend([40, 25], [0.4, 0.6]), 2, SEQ, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="mismatch on 'num_samples'"):
        BlendBatcher(tagged_blend([41, 25], [0.5, 0.5]), 2, SEQ, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="mismatch on 'seed'"):
        BlendBatcher(blend, 2, SEQ, seed=2).load_state_dict(state)
    single = TokenBatcher(blend.parts[0].data, 2, SEQ, seed=1)
    with pytest.raises(ValueError, match="saved reading a blend, this run reads one dataset"):
        single.load_state_dict(state)
    with pytest.raises(ValueError, match="saved reading one dataset, this run reads a blend"):
        BlendBatcher(blend, 2, SEQ, seed=1).load_state_dict(single.state_dict())


def test_blend_validation_batches_fixed_and_in_file_order():
    blend = tagged_blend([10, 10], [0.5, 0.5])
    first = [served(b) for b in validation_batches(blend, 2, SEQ, num_batches=3, rank=1, world_size=2)]
    assert first == [served(b) for b in validation_batches(blend, 2, SEQ, num_batches=3, rank=1, world_size=2)]
    assert first[0] == [(1, 0), (1, 1)]  # positions 1, 3 of the 0.5/0.5 order 0, 1, 0, 1
    x, y = next(validation_batches(blend, 2, SEQ, num_batches=1))
    assert torch.equal(y, x + 1)  # labels shifted


def test_blend_with_an_empty_dataset_is_refused_naming_it():
    blend = tagged_blend([10, 0], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"data\.blend\[1\]: ds1\.bin \(1 tokens\) holds no sample of seq_len \+ 1 = 9 tokens"):
        BlendBatcher(blend, 2, SEQ, seed=0)
