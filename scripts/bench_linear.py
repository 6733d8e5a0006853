"""fwd+bwd time and saved-for-backward bytes of TELinear / TEGroupedLinear (MXFP8, HiF8) vs BF16.

DeepSeek-V3 shapes: dense T x 2048 -> {2048, 3136, 2816}; grouped (routed experts) T*6 rows,
2048 -> 2 * 1408 over E experts (top-6). In this section the weights are quantized once before
timing and reused (``is_first_microbatch=False``, as within one optimizer step). Saved bytes are counted
with ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's bytes (float8 / uint8
payloads included), each storage once (the weight is referenced, not counted twice). Host syncs
per step (``te_npu.testing.count_host_syncs``: reads that would drain a CUDA / NPU stream) are counted
by op, outside the timed loop, so the column means the same on every device.

Weight caching section (``--only weight-cache`` runs just this one): the cost of te_npu's
default for a high-precision weight -- quantized by every forward (``is_first_microbatch=None``,
always fresh) -- against TE's cached path (``True`` on the first micro-batch of a step,
``False`` on the others), per optimizer step of 1 and 4 micro-batches (gradient accumulation),
TELinear and TEGroupedLinear, MXFP8 and HiF8, as the ratio default / cached measured in the
same run, with the weight quantizations per step counted. (te_npu's training path holds
quantized weights and refreshes them once per step, outside forward: the cached column is its
forward/backward cost plus one quantization.)

    python scripts/bench_linear.py [--tokens 4096] [--experts 64] [--device cpu|cuda] [--iters 3]
        [--quant-kernel eager|compiled|native] [--only recipes|weight-cache]

``--quant-kernel`` picks the emulation backend's bit-identical quantization kernels for the whole
run (``te_npu.ops.use_quant_kernel``: eager torch, torch.compile of it, or the C++ CPU kernels;
default eager, the reference); a kernel that cannot run here stops the script with the reason.
"""
from __future__ import annotations

import argparse
import time

import torch

import te_npu
from te_npu.events import QuantEvent, subscribe
from te_npu.testing import count_host_syncs
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
                return module(x_in, is_first_microbatch=False)  # the weight: quantized once, then kept

        rows.append((name, timed(fn, dy_in, iters, device), saved_bytes(fn), host_syncs(fn, dy_in)))
        del module
    base = {name: (t, b) for name, t, b, _ in rows if name in baselines}
    for name, t, b, syncs in rows:
        ratios = "  ".join(f"{t / base[k][0]:5.2f}x {k} time, {b / base[k][1]:4.2f}x {k} saved" for k in base)
        print(f"{label:<44} {name:<6} fwd+bwd {t * 1e3:9.1f} ms  saved {b / 2**20:7.1f} MiB  host syncs {syncs}   "
              f"{ratios}", flush=True)
    return rows


def bench_weight_caching(label, make_module, x, dy, iters, device, extra=()) -> None:
    """Per optimizer step of ``accumulation`` micro-batches: default (quantize the weight every
    forward) vs cached (is_first_microbatch True, then False); ratio default / cached. The two
    alternate step by step and the fastest of ``iters`` steps counts (a shared host is noisy)."""
    x_in = x.detach().to(torch.bfloat16).requires_grad_()
    dy_in = dy.to(torch.bfloat16)

    def step(module, recipe, accumulation, cached):
        for micro in range(accumulation):
            flag = (micro == 0) if cached else None
            with te_npu.autocast(recipe=recipe):
                out = module(x_in, *extra, is_first_microbatch=flag)
            out.backward(dy_in)
        with torch.no_grad():  # the optimizer step: the weight changes, the next step starts with True
            module.weight.add_(1e-3)

    def seconds(module, recipe, accumulation, cached):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(module, recipe, accumulation, cached)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for name, recipe in RECIPES.items():
        module = make_module()
        weight_shape = tuple(module.weight.shape)
        for accumulation in (1, 4):
            counts = []
            for cached in (False, True):  # warm-up, counting the weight quantizations of one step
                quants = []
                with subscribe(quants.append, QuantEvent):
                    step(module, recipe, accumulation, cached)
                counts.append(sum(e.shape == weight_shape for e in quants))
            times = {False: [], True: []}
            for _ in range(iters):
                for cached in (False, True):
                    times[cached].append(seconds(module, recipe, accumulation, cached))
            default, cached = min(times[False]), min(times[True])
            print(f"{label:<44} {name:<6} grad-accum {accumulation}: default {default * 1e3:9.1f} ms/step "
                  f"({counts[0]} weight quantizations), cached {cached * 1e3:9.1f} ms/step ({counts[1]})   "
                  f"default/cached {default / cached:5.2f}x", flush=True)
        del module


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
    parser.add_argument("--quant-kernel", choices=list(te_npu.ops.KERNELS), default="eager")
    parser.add_argument("--only", choices=["recipes", "weight-cache"], default=None,
                        help="run one section: 8-bit vs high precision, or the weight-caching cost")
    args = parser.parse_args()
    with te_npu.ops.use_quant_kernel(args.quant_kernel):
        run(args)


def run(args) -> None:
    baselines = [b for b in args.baselines.split(",") if b]
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    t = args.tokens
    print(f"device={device} tokens={t} threads={torch.get_num_threads()} backend=emulation (not an NPU kernel) "
          f"quant_kernel={args.quant_kernel}; "
          "8-bit modules hold bf16 parameters")
    dense = []
    for n in (2048, 3136, 2816):
        weight = torch.randn(n, HIDDEN, device=device, generator=gen) / HIDDEN**0.5

        def make_dense(dtype, weight=weight, n=n):
            lin = te_npu.TELinear(HIDDEN, n, params_dtype=dtype, device=device, bias=False)
            with torch.no_grad():
                lin.weight.copy_(weight)
            return lin

        x = torch.randn(t, HIDDEN, device=device, generator=gen)
        dy = torch.randn(t, n, device=device, generator=gen)
        dense.append((f"TELinear {t}x{HIDDEN}->{n}", make_dense, x, dy))
    rows = t * TOPK
    topk = torch.stack([torch.randperm(args.experts)[:TOPK] for _ in range(t)])
    m_splits = torch.bincount(topk.flatten(), minlength=args.experts).tolist()
    weight = torch.randn(args.experts, 2 * MOE_FF, HIDDEN, device=device, generator=gen) / HIDDEN**0.5

    class Experts(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.inner = te_npu.TEGroupedLinear(args.experts, HIDDEN, 2 * MOE_FF, params_dtype=dtype, device=device, bias=False)
            with torch.no_grad():
                self.inner.weight.copy_(weight)

        def forward(self, x, is_first_microbatch=None):
            return self.inner(x, m_splits, is_first_microbatch=is_first_microbatch)

    grouped_label = f"TEGroupedLinear E={args.experts} top-{TOPK} {rows}x{HIDDEN}->{2 * MOE_FF}"
    if args.only in (None, "recipes"):
        for label, make_dense, x, dy in dense:
            bench(label, make_dense, x, dy, args.iters, device, baselines)
        if not args.skip_grouped:
            x = torch.randn(rows, HIDDEN, device=device, generator=gen)
            dy = torch.randn(rows, 2 * MOE_FF, device=device, generator=gen)
            bench(grouped_label, Experts, x, dy, args.iters, device, baselines)
    if args.only in (None, "weight-cache"):
        print("weight caching: high-precision bf16 weight, one optimizer step = grad-accum micro-batches fwd+bwd")
        label, make_dense, x, dy = dense[1]  # 2048 -> 3136
        bench_weight_caching(label, lambda: make_dense(torch.bfloat16), x, dy, args.iters, device)
        if not args.skip_grouped:
            x = torch.randn(rows, HIDDEN, device=device, generator=gen)
            dy = torch.randn(rows, 2 * MOE_FF, device=device, generator=gen)
            bench_weight_caching(grouped_label, lambda: Experts(torch.bfloat16).inner, x, dy, args.iters, device,
                                 (m_splits,))


if __name__ == "__main__":
    main()
