"""fwd+bwd time and saved-for-backward bytes of TELinear / TEGroupedLinear (MXFP8, HiF8) vs BF16.

DeepSeek-V3 shapes: dense T x 2048 -> {2048, 3136, 2816}; grouped (routed experts) T*6 rows,
2048 -> 2 * 1408 over E experts (top-6). The weights are quantized once before timing and
reused (the cache hits, as between two optimizer steps in training). Saved bytes are counted
with ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's bytes (float8 / uint8
payloads included), each storage once (the weight is referenced, not counted twice). Host syncs
per step (``te_npu.ops.host_syncs``: reads that would drain a CUDA / NPU stream) are counted
by op, outside the timed loop, so the column means the same on every device.

    python scripts/bench_linear.py [--tokens 4096] [--experts 64] [--device cpu|cuda] [--iters 3]
        [--quant-kernel eager|compiled|native]

``--quant-kernel`` sets ``TE_NPU_QUANT_KERNEL`` (bit-identical quantization kernels of the emulation
backend: eager torch, torch.compile, or the C++ CPU kernels); the default keeps the environment's.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import te_npu
from te_npu.ops.host_syncs import count_host_syncs
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe

HIDDEN, TOPK, MOE_FF = 2048, 6, 1408
RECIPES = {"MXFP8": MXFP8BlockRecipe(), "HiF8": HiF8CurrentScalingRecipe()}
BASELINE_DTYPES = {"BF16": torch.bfloat16, "FP32": torch.float32}


def saved_bytes(fn) -> int:
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def timed(fn, dy, iters: int, device) -> float:
    def step():
        out = fn()
        out.backward(dy)

    step()  # warm-up (and weight quantization into the cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def host_syncs(fn, dy) -> int:
    with count_host_syncs() as syncs:
        fn().backward(dy)
    return syncs.total


def bench(label, make_module, x, dy, iters, device, baselines):
    """Time ``baselines`` (high-precision dtypes) and both 8-bit recipes on the same inputs."""
    rows = []
    for name in [*baselines, *RECIPES]:
        recipe = RECIPES.get(name)
        dtype = BASELINE_DTYPES.get(name, torch.bfloat16)
        module = make_module(dtype)
        x_in = x.detach().to(dtype).requires_grad_()
        dy_in = dy.to(dtype)

        def fn():
            with te_npu.autocast(enabled=recipe is not None, recipe=recipe):
                return module(x_in)

        rows.append((name, timed(fn, dy_in, iters, device), saved_bytes(fn), host_syncs(fn, dy_in)))
        del module
    base = {name: (t, b) for name, t, b, _ in rows if name in baselines}
    for name, t, b, syncs in rows:
        ratios = "  ".join(f"{t / base[k][0]:5.2f}x {k} time, {b / base[k][1]:4.2f}x {k} saved" for k in base)
        print(f"{label:<44} {name:<6} fwd+bwd {t * 1e3:9.1f} ms  saved {b / 2**20:7.1f} MiB  host syncs {syncs}   "
              f"{ratios}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--skip-grouped", action="store_true")
    parser.add_argument("--baselines", default="BF16,FP32",
                        help="high-precision references, comma-separated from BF16,FP32 (on CPUs without bf16 "
                             "GEMM units the BF16 GEMM is pathologically slow; FP32 is the fair CPU reference)")
    parser.add_argument("--quant-kernel", choices=["eager", "compiled", "native"], default=None)
    args = parser.parse_args()
    if args.quant_kernel:
        os.environ["TE_NPU_QUANT_KERNEL"] = args.quant_kernel
    baselines = [b for b in args.baselines.split(",") if b]
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    t = args.tokens
    print(f"device={device} tokens={t} threads={torch.get_num_threads()} backend=emulation (not an NPU kernel) "
          f"quant_kernel={os.environ.get('TE_NPU_QUANT_KERNEL', 'eager')}; "
          "8-bit modules hold bf16 parameters, quantized once before timing")
    for n in (2048, 3136, 2816):
        weight = torch.randn(n, HIDDEN, device=device, generator=gen) / HIDDEN**0.5

        def make_dense(dtype, weight=weight, n=n):
            lin = te_npu.TELinear(HIDDEN, n, params_dtype=dtype, device=device)
            with torch.no_grad():
                lin.weight.copy_(weight)
            return lin

        x = torch.randn(t, HIDDEN, device=device, generator=gen)
        dy = torch.randn(t, n, device=device, generator=gen)
        bench(f"TELinear {t}x{HIDDEN}->{n}", make_dense, x, dy, args.iters, device, baselines)
    if args.skip_grouped:
        return
    rows = t * TOPK
    topk = torch.stack([torch.randperm(args.experts)[:TOPK] for _ in range(t)])
    m_splits = torch.bincount(topk.flatten(), minlength=args.experts).tolist()
    weight = torch.randn(args.experts, 2 * MOE_FF, HIDDEN, device=device, generator=gen) / HIDDEN**0.5

    class Experts(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.inner = te_npu.TEGroupedLinear(args.experts, HIDDEN, 2 * MOE_FF, params_dtype=dtype, device=device)
            with torch.no_grad():
                self.inner.weight.copy_(weight)

        def forward(self, x):
            return self.inner(x, m_splits)

    x = torch.randn(rows, HIDDEN, device=device, generator=gen)
    dy = torch.randn(rows, 2 * MOE_FF, device=device, generator=gen)
    bench(f"TEGroupedLinear E={args.experts} top-{TOPK} {rows}x{HIDDEN}->{2 * MOE_FF}", Experts, x, dy,
          args.iters, device, baselines)


if __name__ == "__main__":
    main()
