"""Everything te_npu writes to and reads from disk: the room of ``te_npu.distributed`` for files.

``dcp``: DCP checkpoints of the high-precision view (save / load / verify, ``latest``, pruning);
``folder``: a checkpoint folder's namespace (``step_N``, ``latest``, the lineage's history,
``abandoned/`` and ``diverged/``); ``lock``: the folder's one-owner lock; ``manifest``: every
file's size and CRC-32 (``python -m te_npu.distributed.storage.manifest adopt <step>``);
``metadata``: the restricted reader of DCP's ``.metadata`` pickle; ``disk_space``: the room a
save needs and the one-line ``DiskFullError``; ``hf_checkpoint`` and ``hf_layout``: Hugging Face
safetensors directories in and out of sharded tensors and their key plans; ``progress``: the
progress bar of long reads and writes. Named apart from ``te_npu.distributed.checkpoint``, which
is Transformer Engine's activation checkpoint, the same function as ``te_npu.checkpoint``.
"""
from te_npu.distributed.storage import dcp

__all__ = ["dcp"]
