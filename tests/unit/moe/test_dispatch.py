"""te_npu.moe.permute / unpermute versus hand examples and a per-token loop reference."""
import pytest
import torch

from te_npu import moe


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _loop_reference(hidden, topk_ids, topk_weights, expert_fn):
    """out[t] = sum_c w[t, c] * expert_fn(e, hidden[t]) computed token by token."""
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros(hidden.shape[1], dtype=torch.float64)
        for c in range(topk_ids.shape[1]):
            e = int(topk_ids[t, c])
            acc = acc + topk_weights[t, c].double() * expert_fn(e, hidden[t : t + 1])[0].double()
        rows.append(acc)
    return torch.stack(rows)


def test_permute_hand_example():
    hidden = torch.tensor([[0.0], [1.0], [2.0]])
    topk_ids = torch.tensor([[2, 0], [0, 1], [2, 0]])  # pairs: 0:e2 1:e0 2:e0 3:e1 4:e2 5:e0
    permuted, m_splits, row_map = moe.permute(hidden, topk_ids, num_experts=4)
    assert m_splits.tolist() == [3, 1, 2, 0]
    assert m_splits.dtype == torch.int64 and row_map.dtype == torch.int64
    # expert 0 gets pairs 1, 2, 5 (tokens 0, 1, 2), expert 1 pair 3 (token 1), expert 2 pairs 0, 4.
    assert permuted[:, 0].tolist() == [0.0, 1.0, 2.0, 1.0, 0.0, 2.0]
    assert row_map.tolist() == [4, 0, 1, 3, 5, 2]
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 0.0]])
    out = moe.unpermute(permuted * 10, row_map, weights)
    torch.testing.assert_close(out[:, 0], torch.tensor([0.0 * 7.5, 10.0 * 3.0, 20.0 * 3.0]), rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 2, 6], ids=lambda k: f"top{k}")
def test_permute_round_trip_identity(gen, k):
    T, H, E = 37, 16, 8
    hidden = torch.randn(T, H, generator=gen)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    permuted, m_splits, row_map = moe.permute(hidden, topk_ids, E)
    assert int(m_splits.sum()) == T * k
    assert sorted(row_map.tolist()) == list(range(T * k))
    expert_of_row = torch.repeat_interleave(torch.arange(E), m_splits)
    assert torch.equal(expert_of_row[row_map], topk_ids.reshape(-1))  # each row sits in its expert's block
    ones = torch.full((T, k), 1.0 / k)
    torch.testing.assert_close(moe.unpermute(permuted, row_map, ones), hidden, rtol=1e-6, atol=1e-6)


def test_permute_empty_experts(gen):
    hidden = torch.randn(5, 4, generator=gen)
    topk_ids = torch.tensor([[3], [3], [1], [3], [1]])
    permuted, m_splits, row_map = moe.permute(hidden, topk_ids, num_experts=6)
    assert m_splits.tolist() == [0, 2, 0, 3, 0, 0]
    torch.testing.assert_close(permuted, hidden[[2, 4, 0, 1, 3]], rtol=0, atol=0)
    out = moe.unpermute(permuted, row_map, torch.ones(5, 1))
    torch.testing.assert_close(out, hidden, rtol=0, atol=0)


def test_permute_rejects_bad_ids():
    with pytest.raises(ValueError, match="num_experts"):
        moe.permute(torch.zeros(2, 4), torch.tensor([[0], [4]]), num_experts=4)
    with pytest.raises(ValueError, match="num_experts"):
        moe.permute(torch.zeros(2, 4), torch.tensor([[0], [-1]]), num_experts=4)
    with pytest.raises(TypeError, match="integer"):
        moe.permute(torch.zeros(2, 4), torch.zeros(2, 1), num_experts=4)


@pytest.mark.parametrize("k", [1, 3], ids=lambda k: f"top{k}")
def test_dispatch_gradients_versus_loop_reference(gen, k):
    T, H, E = 11, 8, 5
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(T, k, generator=gen, dtype=torch.float64, requires_grad=True)
    w_experts = torch.randn(E, H, H, generator=gen, dtype=torch.float64, requires_grad=True)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    topk_ids[0] = torch.arange(k)  # expert E-1 may stay empty; make sure expert 0 is used

    def grouped_experts(x_sorted, m_splits):
        chunks = x_sorted.split(m_splits.tolist())
        return torch.cat([torch.tanh(c @ w_experts[e].T) for e, c in enumerate(chunks)])

    permuted, m_splits, row_map = moe.permute(hidden, topk_ids, E)
    out = moe.unpermute(grouped_experts(permuted, m_splits), row_map, weights)
    upstream = torch.randn(T, H, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * upstream).sum(), (hidden, weights, w_experts))

    ref = _loop_reference(hidden, topk_ids, weights, lambda e, x: torch.tanh(x @ w_experts[e].T))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (hidden, weights, w_experts))
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)  # unpermute sums in fp32
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_unpermute_bf16_sums_in_fp32(gen):
    T, k, H = 4, 6, 8
    expert_out = torch.randn(T * k, H, generator=gen).bfloat16()
    row_map = torch.randperm(T * k, generator=gen)
    weights = torch.rand(T, k, generator=gen)
    out = moe.unpermute(expert_out, row_map, weights)
    assert out.dtype == torch.bfloat16
    expected = (expert_out.float()[row_map].view(T, k, H) * weights[..., None]).sum(1).bfloat16()
    assert torch.equal(out, expected)


def test_dispatch_is_deterministic(gen):
    T, H, E, k = 64, 8, 4, 2
    hidden = torch.randn(T, H, generator=gen, requires_grad=True)
    topk_ids = torch.randint(0, E, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    grads = []
    for _ in range(2):
        permuted, m_splits, row_map = moe.permute(hidden, topk_ids, E)
        (moe.unpermute(permuted * 2, row_map, weights) ** 2).sum().backward()
        grads.append(hidden.grad.clone())
        hidden.grad = None
    assert torch.equal(grads[0], grads[1])
