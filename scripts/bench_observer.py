"""Overhead of the precision observer (``te_npu.observer``) on fwd+bwd steps, against the same
steps without it, measured in the same run.

Model: a dense ``TELinear`` (hidden -> ffn) and routed ``TEGroupedSwiGLUExperts`` (E experts,
tokens spread evenly) under MXFP8 and HiF8, ``--micro-batches`` per step. Columns (each a ratio
to the plain step, median of ``--iters``):

- ``off``: an observer built with the defaults (``enabled: false``) wrapped around the step;
- ``unselected``: enabled, on a step its frequency does not select (nothing subscribed);
- ``observed``: a selected step (every layer, every role, every statistic; one reduction);
- ``at freq N``: the average step at the default frequency, ``(N - 1 + observed) / N``.

    python scripts/bench_observer.py [--tokens 2048] [--hidden 1024] [--ffn 2048] [--experts 8]
        [--micro-batches 2] [--iters 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import te_npu
from te_npu.observer import DEFAULT_FREQ, ObserverConfig, PrecisionObserver


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.up = te_npu.TELinear(hidden, ffn, bias=False, params_dtype=torch.bfloat16)
        self.down = te_npu.TELinear(ffn, hidden, bias=False, params_dtype=torch.bfloat16)
        self.experts = te_npu.TEGroupedSwiGLUExperts(experts, hidden, ffn // 2, params_dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        h = self.down(self.up(x))
        return self.experts(h, m_splits)


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    model = Block(args.hidden, args.ffn, args.experts)
    te_npu.assign_fqns(model)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16)
    m_splits = [args.tokens // args.experts] * args.experts
    m_splits[-1] += args.tokens - sum(m_splits)
    print(f"tokens {args.tokens}, hidden {args.hidden}, ffn {args.ffn}, experts {args.experts}, "
          f"{args.micro_batches} micro-batches per step, median of {args.iters}; ratios to the plain step")
    print(f"{'recipe':7s} {'plain s':>8s} {'off':>6s} {'unselected':>10s} {'observed':>9s} {'at freq ' + str(DEFAULT_FREQ):>12s}")
    for name, recipe in (("MXFP8", te_npu.MXFP8BlockRecipe()), ("HiF8", te_npu.HiF8CurrentScalingRecipe())):
        def step():
            model.zero_grad(set_to_none=True)
            for _ in range(args.micro_batches):
                with te_npu.autocast(recipe=recipe):
                    y = model(x, m_splits)
                y.float().pow(2).mean().backward()

        def observed_by(observer: PrecisionObserver, number: int):
            def run():
                with observer.step(number):
                    step()
            return run

        plain = timed(step, args.iters)
        off = timed(observed_by(PrecisionObserver(ObserverConfig(), model), 1), args.iters)
        on = PrecisionObserver(ObserverConfig(enabled=True), model)
        unselected = timed(observed_by(on, 1), args.iters)
        observed = timed(observed_by(on, DEFAULT_FREQ), args.iters)
        ratio = observed / plain
        print(f"{name:7s} {plain:8.3f} {off / plain:6.3f} {unselected / plain:10.3f} {ratio:9.3f} "
              f"{(DEFAULT_FREQ - 1 + ratio) / DEFAULT_FREQ:12.4f}")


if __name__ == "__main__":
    main()
