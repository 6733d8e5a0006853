"""The precision observer under FSDP2 on 2 gloo ranks: one collective per observed step, and
figures equal to a one-rank run on the gathered tensors (every rank's batch as a micro-batch of
the unsharded model, the full weights against their full masters)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import te_npu
from te_npu.distributed import MasterWeightOptimizer, shard_model
from te_npu.observer import ObserverConfig, PrecisionObserver, quantized_weights
from tests.distributed.harness import batch, build, loss_of, run_ranks

ON = ObserverConfig(enabled=True, freq=1)


def _worker(rank, world, workdir, fmt):
    mesh = init_device_mesh("cpu", (world,))
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    model, init = build(fmt)
    te_npu.assign_fqns(model)
    shard_model(model, mesh, reshard_after_forward=True)
    opt = MasterWeightOptimizer(model, init, lr=1e-2)
    observer = PrecisionObserver(ON, model)
    assert observer.begin_step(1, weights=quantized_weights(opt))
    loss_of(model, fmt, batch(rank)).backward()  # each rank its own batch
    calls = []
    real = {name: getattr(dist, name) for name in ("all_gather_single", "all_reduce", "all_gather", "broadcast")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    try:
        sharded = observer.end_step()  # the step's reduction: every collective it makes
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    reference, ref_init = build(fmt)
    te_npu.assign_fqns(reference)
    ref_opt = MasterWeightOptimizer(reference, ref_init, lr=1e-2)
    ref_observer = PrecisionObserver(ON)
    with ref_observer.step(1, weights=quantized_weights(ref_opt), group=alone) as gathered:
        for r in range(world):
            loss_of(reference, fmt, batch(r)).backward()
    return {"collectives": calls, "sharded": sharded.tensors, "gathered": gathered.figures.tensors}


@pytest.mark.parametrize("fmt", ["mxfp8", pytest.param("hif8", marks=pytest.mark.slow)])  # ~20 s each (spawn)
def test_fsdp2_figures_equal_one_rank_on_gathered_tensors(fmt, tmp_path):
    results = run_ranks(_worker, 2, tmp_path, fmt)
    for rank, res in enumerate(results):
        assert res["collectives"] == ["all_gather_single"], rank
        sharded, gathered = res["sharded"], res["gathered"]
        assert sorted(sharded) == sorted(gathered) and len(sharded) == 4 * 6  # up, mix, gate_up, down x roles
        for key, got in sharded.items():
            want = gathered[key]
            assert got.elements == want.elements, key
            for stat, value in got.as_dict().items():
                assert value == pytest.approx(want.as_dict()[stat], rel=1e-9, abs=0.0), (rank, key, stat)
    assert results[0]["sharded"] == results[1]["sharded"]  # every rank holds the reduced figures
