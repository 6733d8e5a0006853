"""The FSDP2 / optimizer / sharding layer asks the weight classes and never branches on a format:
no ``Format.`` anywhere in ``optim.py``, ``sharding.py`` and ``fsdp.py``, and no private attribute
of another module's object read there (only ``self`` / ``cls`` own attributes)."""
from __future__ import annotations

import ast
import pathlib

import pytest

import te_npu.distributed

FILES = ["optim.py", "sharding.py", "fsdp.py"]
DISTRIBUTED = pathlib.Path(te_npu.distributed.__file__).parent


@pytest.mark.parametrize("name", FILES)
def test_distributed_file_names_no_format(name):
    source = (DISTRIBUTED / name).read_text()
    assert "Format." not in source and "import Format" not in source


@pytest.mark.parametrize("name", FILES)
def test_distributed_file_reads_no_private_attribute_of_another_object(name):
    tree = ast.parse((DISTRIBUTED / name).read_text())
    reads = [
        f"{name}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert reads == []


def test_weight_classes_declare_their_shard_alignment():
    from te_npu.numerics.constants import MX_BLOCK_SIZE
    from te_npu.tensor import HiF8Tensor, MXFP8Tensor

    assert MXFP8Tensor.shard_alignment.rows == 2 * MX_BLOCK_SIZE  # one NPU scale pair (spec 9.1)
    assert HiF8Tensor.shard_alignment.rows == 1
    assert all(a.reason for a in (MXFP8Tensor.shard_alignment, HiF8Tensor.shard_alignment))


def test_shard_violation_follows_the_declared_alignment(monkeypatch):
    import torch
    from torch import nn

    import te_npu
    from te_npu.distributed import plan_shards
    from te_npu.tensor import MXFP8Tensor, ShardAlignment, quantize_weight

    param = nn.Parameter(quantize_weight(torch.zeros(128, 64, dtype=torch.bfloat16), te_npu.MXFP8BlockRecipe()))
    assert plan_shards([("w", param)], 2, fallback_to_unsharded=False).sharded == ("w",)  # 64 local rows
    monkeypatch.setattr(MXFP8Tensor, "shard_alignment", ShardAlignment(rows=128, reason="a test's rule"))
    plan = plan_shards([("w", param)], 2, fallback_to_unsharded=True)
    assert "N_local=64 = 64 is not a multiple of 128 (a test's rule)" in plan.replicated["w"]
