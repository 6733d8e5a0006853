"""Megatron-LM's data formats, read in place: what ``data.kind: megatron`` (``megatron_data``) and
the ``hf`` kind's tokenized cache (``hf_data``) stand on.

- ``indexed_dataset``: ``<prefix>.bin`` + ``<prefix>.idx`` (Megatron's ``MMapIndexedDataset``),
  validated and memory-mapped;
- ``gpt_index``: Megatron's ``GPTDataset`` document / sample / shuffle indices, computed as it does;
- ``index_cache``: those indices on disk (``data.cache_dir``, Megatron's ``--data-cache-path``), with
  the check record that says when a cache no longer matches its dataset;
- ``gpt_samples``: ``MegatronSplit``, the samples in Megatron's order and data-parallel hand-out.
"""
