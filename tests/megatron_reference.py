"""Megatron-core's own dataset code as the reference for ``data.kind: megatron`` (the test extra
installs it: ``pip install -e ".[test]"`` pulls ``megatron-core``, whose wheel ships the compiled
``helpers_cpp``). Where it cannot be imported every test using it FAILS, naming the install line.

- ``write_with_megatron``: a dataset written by Megatron's ``IndexedDatasetBuilder``;
- ``megatron_datasets``: ``BlendedMegatronDatasetBuilder(GPTDataset, sizes, ...)`` for a blend /
  split / seed / sequence length, as ``pretrain_gpt.py`` builds them (mock tokenizer, pad -1);
- ``megatron_sample``: sample ``i`` of a built dataset as its ``S + 1`` raw tokens.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

INSTALL = 'pip install -e ".[test]"  (or: pip install "megatron-core==0.16.1")'


def megatron():
    """The megatron.core.datasets modules; a test failure naming the install line if they are missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import blended_megatron_dataset_builder as builder
            from megatron.core.datasets import gpt_dataset, helpers, indexed_dataset
    except ImportError as exc:  # the reference is required, never skipped
        pytest.fail(f"megatron-core is needed as the reference for data.kind megatron ({exc}); install it: {INSTALL}",
                    pytrace=False)
    return builder, gpt_dataset, helpers, indexed_dataset


class _Tokenizer:
    """The least a GPTDatasetConfig needs: no pad id (Megatron then pads with -1), an EOD."""

    vocab_size = None
    eod = 0
    unique_identifiers = {"class": "te_npu test tokenizer"}

    @property
    def pad(self):
        raise AttributeError("no pad token")


def write_with_megatron(prefix, documents, dtype=np.uint16, *, sentences_per_doc: int = 1) -> Path:
    """``documents`` written by Megatron's ``IndexedDatasetBuilder`` (``sentences_per_doc`` > 1: each
    document as that many sequences, like ``preprocess_data.py --split-sentences``)."""
    _, _, _, indexed = megatron()
    import torch

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        pieces = [torch.from_numpy(np.asarray(p, dtype=np.int64)) for p in np.array_split(np.asarray(doc),
                                                                                         sentences_per_doc)]
        builder.add_document(torch.cat(pieces), [len(p) for p in pieces])
    builder.finalize(f"{prefix}.idx")
    return prefix


def megatron_datasets(blend, *, seed: int, seq_len: int, split: str | None = "969,30,1", sizes=(None, None, None),
                      blend_per_split=None, cache: str | None = None):
    """``(train, valid, test)`` as Megatron builds them; ``blend``: prefixes, or (prefixes, weights)."""
    builder, gpt, _, _ = megatron()
    if blend is not None and not isinstance(blend, tuple):
        blend = ([str(p) for p in blend], None)
    elif blend is not None:
        blend = ([str(p) for p in blend[0]], blend[1])
    config = gpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, blend=blend,
                                  blend_per_split=blend_per_split, split=split if blend is not None else None,
                                  path_to_cache=cache, tokenizer=_Tokenizer(), reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builder.BlendedMegatronDatasetBuilder(gpt.GPTDataset, list(sizes), lambda: True, config).build()


def megatron_sample(dataset, i: int) -> np.ndarray:
    """Sample ``i`` of a ``GPTDataset`` / ``BlendedDataset``: its ``S + 1`` raw tokens (``tokens``
    then the last of ``labels``, exactly what ``__getitem__`` returns)."""
    item = dataset[i]
    return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])
