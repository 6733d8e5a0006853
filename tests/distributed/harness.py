"""Spawn gloo ranks from a test, and the tiny TE model every distributed test trains.

``run_ranks(fn, world_size, workdir, *args)`` starts ``world_size`` fresh processes
(``torch.multiprocessing`` spawn), each joining a gloo group on a free port, runs
``fn(rank, world_size, workdir, *args)`` and returns the per-rank results, passed back
through ``workdir/result_{rank}.pt`` files. ``fn`` must be a module-level function.

Toy model (hidden 64, ffn 128, 2 experts), sized so every quantized weight shards legally
over 2 ranks (MXFP8: 64 local rows):

    x [T, 64] -> * norm [64] (high precision)
      -> up    TELinear                 weight [128, 64]
      -> mix   TEGroupedLinear(2)       weight [2, 64, 128]
      -> moe   TEGroupedSwiGLUExperts   gate_up [2, 128, 64], down [2, 64, 64]
"""
from __future__ import annotations

import contextlib
import os
import socket
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

import te_npu
from tests.seeded import BF16_NO_BIAS, fan_in_uniform_init, nn_linear_init

HIDDEN, FFN, EXPERTS, TOKENS = 64, 128, 2, 64
M_SPLITS = [40, 24]
RECIPES = {"mxfp8": te_npu.MXFP8BlockRecipe, "hif8": te_npu.HiF8CurrentScalingRecipe}


def run_ranks(fn, world_size: int, workdir, *args) -> list:
    """Run ``fn`` on ``world_size`` fresh gloo ranks; return their results in rank order."""
    workdir = os.fspath(workdir)
    mp.spawn(_entry, args=(fn, world_size, _free_port(), workdir, args), nprocs=world_size, join=True)
    return [torch.load(os.path.join(workdir, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]


def _entry(rank, fn, world_size, port, workdir, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, workdir, *args)
        torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ToyModel(nn.Module):
    """The model of the module docstring; ``recompute=True`` checkpoints the whole body."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.norm = nn.Parameter(torch.ones(HIDDEN, dtype=torch.bfloat16))
        self.up = te_npu.TELinear(HIDDEN, FFN, init_method=nn_linear_init, **BF16_NO_BIAS)
        self.mix = te_npu.TEGroupedLinear(EXPERTS, FFN, HIDDEN, init_method=fan_in_uniform_init, **BF16_NO_BIAS)
        self.moe = te_npu.TEGroupedSwiGLUExperts(EXPERTS, HIDDEN, HIDDEN)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.up(x * self.norm), M_SPLITS)
        return self.moe(h, M_SPLITS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recompute:
            return self.body(x)
        recipe = te_npu.get_autocast_recipe()
        recompute_ctx = partial(_contexts, recipe)
        return checkpoint(self.body, x, use_reentrant=False, context_fn=recompute_ctx)


def _contexts(recipe):
    return contextlib.nullcontext(), te_npu.autocast(recipe=recipe) if recipe else contextlib.nullcontext()


def build(fmt: str, *, seed: int = 0, recompute: bool = False):
    """Toy model initialised from ``seed`` with TE weights quantized; returns (model, init values)."""
    from te_npu.distributed import finalize_low_precision_weights

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ToyModel(recompute)
        with torch.no_grad():
            model.norm.add_(torch.randn(HIDDEN, dtype=torch.bfloat16) * 0.1)
    return model, finalize_low_precision_weights(model, RECIPES[fmt]())


def batch(step: int) -> torch.Tensor:
    """The batch of ``step`` (identical on every rank)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)


def loss_of(model: nn.Module, fmt: str, x: torch.Tensor) -> torch.Tensor:
    with te_npu.autocast(recipe=RECIPES[fmt]()):
        y = model(x)
    return y.float().pow(2).mean()


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)
