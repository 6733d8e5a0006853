"""fwd+bwd time and saved-for-backward bytes of TELinear / TEGroupedLinear (MXFP8, HiF8) vs BF16.

DeepSeek-V3 shapes: dense T x 2048 -> {2048, 3136, 2816}; grouped (routed experts) T*6 rows,
2048 -> 2 * 1408 over E experts (top-6). The weights are quantized once before timing and
reused (the cache hits, as between two optimizer steps in training). Saved bytes are counted
with ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's bytes (float8 / uint8
payloads included), each storage once (the weight is referenced, not counted twice).

    python scripts/bench_linear.py [--tokens 4096] [--experts 64] [--device cpu|cuda] [--iters 3]
"""
from __future__ import annotations

import argparse
import time

import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe

HIDDEN, TOPK, MOE_FF = 2048, 6, 1408
RECIPES = {"MXFP8": MXFP8BlockRecipe(), "HiF8": HiF8CurrentScalingRecipe()}


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


def bench(label, make_fn, dy, iters, device):
    rows = []
    for name in ["BF16", *RECIPES]:
        recipe = RECIPES.get(name)

        def fn():
            with te_npu.autocast(enabled=recipe is not None, recipe=recipe):
                return make_fn()

        rows.append((name, timed(fn, dy, iters, device), saved_bytes(fn)))
    base_t, base_b = rows[0][1], rows[0][2]
    for name, t, b in rows:
        print(f"{label:<40} {name:<6} fwd+bwd {t * 1e3:9.1f} ms  ({t / base_t:4.2f}x BF16)   "
              f"saved {b / 2**20:8.1f} MiB ({b / base_b:4.2f}x BF16)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--skip-grouped", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    t = args.tokens
    print(f"device={device} tokens={t} threads={torch.get_num_threads()} backend=emulation (not an NPU kernel)")
    for n in (2048, 3136, 2816):
        lin = te_npu.TELinear(HIDDEN, n, device=device)
        x = torch.randn(t, HIDDEN, device=device, generator=gen).bfloat16().requires_grad_()
        dy = torch.randn(t, n, device=device, generator=gen).bfloat16()
        bench(f"TELinear {t}x{HIDDEN}->{n}", lambda: lin(x), dy, args.iters, device)
        del lin, x, dy
    if args.skip_grouped:
        return
    rows = t * TOPK
    experts = te_npu.TEGroupedLinear(args.experts, HIDDEN, 2 * MOE_FF, device=device)
    topk = torch.stack([torch.randperm(args.experts)[:TOPK] for _ in range(t)])
    m_splits = torch.bincount(topk.flatten(), minlength=args.experts).tolist()
    x = torch.randn(rows, HIDDEN, device=device, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(rows, 2 * MOE_FF, device=device, generator=gen).bfloat16()
    bench(f"TEGroupedLinear E={args.experts} {rows}x{HIDDEN}->{2 * MOE_FF}", lambda: experts(x, m_splits), dy,
          args.iters, device)


if __name__ == "__main__":
    main()
