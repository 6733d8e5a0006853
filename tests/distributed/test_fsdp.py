"""FSDP2 gather extension on 2 gloo ranks: equivalence with the unsharded model and gather schema."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from te_npu.distributed import shard_model
from te_npu.events import FSDPGatherEvent, subscribe
from te_npu.tensor import HiF8Tensor
from tests.distributed.harness import batch, build, local, loss_of, run_ranks

CONFIGS = [(reshard, recompute) for reshard in (True, False) for recompute in (False, True)]
MX_ROW = ("row_data", "row_scale")
MX_BOTH = ("row_data", "row_scale", "col_data", "col_scale")


def _equivalence_worker(rank, world, workdir, fmt):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for reshard, recompute in CONFIGS:
        reference, _ = build(fmt, recompute=recompute)
        sharded, _ = build(fmt, recompute=recompute)
        shard_model(sharded, mesh, reshard_after_forward=reshard)
        x = batch(0)  # the same batch on every rank: averaged grads equal the unsharded ones exactly
        ref_loss = loss_of(reference, fmt, x)
        ref_loss.backward()
        forward_gathers, backward_gathers = [], []
        with subscribe(forward_gathers.append, FSDPGatherEvent):
            loss = loss_of(sharded, fmt, x)
        with subscribe(backward_gathers.append, FSDPGatherEvent):
            loss.backward()
        grads_equal = {}
        for (fqn, p), (_, ref) in zip(sharded.named_parameters(), reference.named_parameters()):
            rows = p.shape[0] // world
            expected = ref.grad[rank * rows : (rank + 1) * rows]
            grads_equal[fqn] = torch.equal(local(p.grad), expected)
        out[(reshard, recompute)] = {
            "loss_equal": torch.equal(loss, ref_loss),
            "grads_equal": grads_equal,
            "forward": [(r.context, r.fields, r.bytes_per_element) for r in forward_gathers],
            "backward": [(r.context, r.fields) for r in backward_gathers],
        }
    # A forward-phase unshard (outside autograd) of an MXFP8 weight brings no col copy.
    model, _ = build(fmt)
    shard_model(model, mesh, reshard_after_forward=True)
    model.up.unshard()
    weight = model.up.weight
    try:
        weight.select("row")
        weight.select("col")
        out["col_select"] = "ok"
    except RuntimeError as exc:
        out["col_select"] = str(exc)
    out["unsharded_shape"] = list(weight.shape)
    model.up.reshard()
    return out


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_fsdp_sharded_versus_unsharded_and_gather_schema(fmt, tmp_path):
    results = run_ranks(_equivalence_worker, 2, tmp_path, fmt)
    for rank, res in enumerate(results):
        for (reshard, recompute), r in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
            where = f"rank {rank} reshard={reshard} recompute={recompute}"
            assert r["loss_equal"], where
            assert all(r["grads_equal"].values()), (where, r["grads_equal"])
            _check_schema(fmt, reshard, recompute, r, where)
        assert res["unsharded_shape"] == [128, 64]
        if fmt == "mxfp8":
            assert "not materialized" in res["col_select"]
        else:
            assert res["col_select"] == "ok"


def _check_schema(fmt, reshard, recompute, r, where):
    quantized = {"up.weight", "mix.weight", "moe.gate_up_proj", "moe.down_proj"}
    assert {c.param_fqn for c, _, _ in r["forward"]} == quantized, where
    assert all(c.phase == "forward" and c.reshard_after_forward == reshard for c, _, _ in r["forward"]), where
    assert all(c.phase == "backward" for c, _ in r["backward"]), where
    if fmt == "hif8":
        assert all(f == HiF8Tensor._inner_fields for _, f, _ in r["forward"]), where
        assert all(f == HiF8Tensor._inner_fields for _, f in r["backward"]), where
        return
    if reshard:
        assert all(f == MX_ROW for _, f, _ in r["forward"]), where
        # the forward copy costs 1 + 1/32 bytes per element: <= 0.55x BF16
        assert all(b <= 0.55 * 2 for _, _, b in r["forward"]), where
        assert {c.param_fqn for c, _ in r["backward"]} == quantized, where
        assert all(f == MX_BOTH for _, f in r["backward"]), where
    else:
        assert all(f == MX_BOTH for _, f, _ in r["forward"]), where
        assert r["backward"] == [], where  # still unsharded from forward: no second gather
