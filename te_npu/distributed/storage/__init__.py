"""On-disk checkpoints: what te_npu writes into and reads from a checkpoint folder.

``dcp``: DCP checkpoints of the high-precision view (save / load / verify, ``latest``, pruning).
(Named apart from ``te_npu.distributed.checkpoint``, which is Transformer Engine's activation
checkpoint, the same function as ``te_npu.checkpoint``.)
"""
from te_npu.distributed.storage import dcp

__all__ = ["dcp"]
