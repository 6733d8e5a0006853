"""data.kind megatron against megatron-core's own code: the sample index against its compiled
build_sample_idx, every GPTDataset / BlendedDataset sample token for token (single and
multi-sentence datasets, two seeds, two sequence lengths, one and several epochs, a weighted and a
weightless blend, train and valid), and the sampler's resume on another world size."""
import numpy as np
import pytest

from te_npu.training.data.megatron import gpt_index
from te_npu.training.data.megatron_data import read_global_samples
from te_npu.training.data import build_splits
from te_npu.training.config import DataConfig
from te_npu.training.data.sampling import make_batcher
from tests.megatron_reference import megatron, megatron_datasets, megatron_sample, write_with_megatron
from tests.system.megatron_files import random_documents

SPLIT = "90,10,0"  # Megatron loops forever on an empty test share given a size


def test_sample_index_equals_megatrons_build_sample_idx():
    helpers = megatron()[2]
    rng = np.random.default_rng(0)
    for _ in range(100):
        sizes = rng.integers(0, 60, size=int(rng.integers(1, 40))).astype(np.int32)
        if sizes.sum() < 3:
            continue
        seq, epochs = int(rng.integers(2, 50)), int(rng.integers(1, 4))
        doc = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc)
        ref = helpers.build_sample_idx(sizes, doc, seq, epochs, int(sizes.sum()), True, True)
        mine = gpt_index.build_sample_index(sizes, doc, seq)
        assert mine.dtype == ref.dtype and np.array_equal(mine, ref)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("mg")
    return {"single": write_with_megatron(d / "single", random_documents(1, 300, vocab=1000, min_len=5, max_len=120)),
            "multi": write_with_megatron(d / "multi", random_documents(2, 200, vocab=1000), sentences_per_doc=3)}


@pytest.mark.parametrize("kind", ["single", "multi"])
@pytest.mark.parametrize(("seed", "seq_len", "train_samples"), [(1234, 32, 3000), (7, 64, None)])
def test_gpt_dataset_samples_equal_megatrons(prefixes, tmp_path, kind, seed, seq_len, train_samples):
    prefix = prefixes[kind]
    train, valid, _ = megatron_datasets([prefix], seed=seed, seq_len=seq_len, sizes=(train_samples, 50, 0),
                                        split=SPLIT, cache=str(tmp_path / "mg_cache"))
    data = DataConfig(kind="megatron", path=str(prefix), cache_dir=str(tmp_path / "cache"), split=SPLIT)
    mine = read_global_samples(data, seq_len, seed, range(len(train)), train_samples=train_samples)
    assert np.array_equal(mine, np.stack([megatron_sample(train, i) for i in range(len(train))]))
    mine = read_global_samples(data, seq_len, seed, range(len(valid)), train_samples=50, split="valid")
    assert np.array_equal(mine, np.stack([megatron_sample(valid, i) for i in range(len(valid))]))
    splits = build_splits(data)  # split by sequence, as GPTDataset.numel_low_level_dataset
    assert (splits.train.sources[0].begin, splits.train.sources[0].end) == (int(train.indices[0]),
                                                                          int(train.indices[-1]) + 1)
    assert splits.val.sources[0].begin == int(valid.indices[0])


@pytest.mark.parametrize("weights", [(0.3, 0.7), None], ids=["weighted", "weightless"])
def test_blended_dataset_samples_equal_megatrons(prefixes, tmp_path, weights):
    p, q = prefixes["single"], prefixes["multi"]
    train, valid, _ = megatron_datasets(([p, q], list(weights) if weights else None), seed=5, seq_len=48,
                                        sizes=(2000, 40, 0), split=SPLIT)  # a cached BlendedDataset needs a process group
    blend = [[weights[0], str(p)], [weights[1], str(q)]] if weights else f"{p} {q}"
    data = DataConfig(kind="megatron", blend=blend, cache_dir=str(tmp_path / "cache"), split=SPLIT)
    mine = read_global_samples(data, 48, 5, range(len(train)), train_samples=2000)
    assert np.array_equal(mine, np.stack([megatron_sample(train, i) for i in range(len(train))]))
    mine = read_global_samples(data, 48, 5, range(len(valid)), train_samples=40, split="valid")
    assert np.array_equal(mine, np.stack([megatron_sample(valid, i) for i in range(len(valid))]))


def test_resume_and_start_sample_on_another_world_size(prefixes, tmp_path):
    """MegatronPretrainingSampler (megatron/training/datasets/data_samplers.py): each micro batch is
    the next B x W global samples, rank r taking [r B, (r + 1) B); the state is consumed_samples."""
    prefix = prefixes["single"]
    train, _, _ = megatron_datasets([prefix], seed=3, seq_len=32, sizes=(400, 10, 0), split=SPLIT,
                                    cache=str(tmp_path / "mg_cache"))
    splits = build_splits(DataConfig(kind="megatron", path=str(prefix), split=SPLIT, cache_dir=str(tmp_path / "c")))
    two = [make_batcher(splits.train, 2, 32, seed=3, rank=r, world_size=2, train_samples=400) for r in range(2)]
    served = []
    for _ in range(5):
        for b in two:
            x, y = next(b)
            served += [np.concatenate([row_x, row_y[-1:]]) for row_x, row_y in zip(x.numpy(), y.numpy())]
    state = two[0].state_dict()
    assert state["consumed_samples"] == 20
    one = make_batcher(splits.train, 3, 32, seed=3, rank=0, world_size=1, train_samples=400)
    one.load_state_dict(state)
    for _ in range(4):
        x, y = next(one)
        served += [np.concatenate([row_x, row_y[-1:]]) for row_x, row_y in zip(x.numpy(), y.numpy())]
    assert np.array_equal(np.stack(served), np.stack([megatron_sample(train, i) for i in range(32)]))
    fresh = make_batcher(splits.train, 4, 32, seed=3, start_sample=100, train_samples=400)
    x, y = next(fresh)
    assert np.array_equal(np.concatenate([x.numpy(), y.numpy()[:, -1:]], 1),
                          np.stack([megatron_sample(train, i) for i in range(100, 104)]))
    contradicting = make_batcher(splits.train, 4, 32, seed=3, start_sample=50, train_samples=400)
    with pytest.raises(ValueError, match=r"^data\.start_sample: 50 contradicts the checkpoint"):
        contradicting.position_for(fresh.state_dict())
