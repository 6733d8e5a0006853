"""Launch budget of the NPU path: host-side torch ops per TELinear / TEGroupedLinear fwd+bwd.

Runs one forward + backward of each module through te_npu's NPU wrappers (``force_backend("npu")``)
on CPU, with the vendor-faithful fake ``torch_npu`` (tests/fakes) standing in for the kernels,
and counts with a ``TorchDispatchMode`` every torch op te_npu itself dispatches around the
torch_npu calls: the fake's own ops run with the mode switched off, so the count is what the host
would launch on an A5 besides the torch_npu kernels (reported apart). Views are not counted
(no launch). Weights are quantized parameters (``quantized_model_init``, the Trainer's path),
activations BF16, routing ragged (some empty groups, sizes not multiples of 32), at G = 8 and
G = 64. Target (issue 11): no growth with G, <= 20 ops per TELinear and <= 30 per
TEGroupedLinear fwd+bwd.

    PYTHONPATH=$PWD python3 scripts/bench_npu_dispatch.py [--top 8]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import te_npu  # noqa: E402
from tests.npu_backend import npu_backend_process  # noqa: E402

TOKENS, HIDDEN, FFN = 512, 128, 256
LIMITS = {"TELinear": 20, "TEGroupedLinear": 30}
RECIPES = {"mxfp8": te_npu.MXFP8BlockRecipe, "hif8": te_npu.HiF8CurrentScalingRecipe}


@dataclass
class Launches:
    """Host-side torch ops (op name -> count, views excluded) and torch_npu kernel calls."""

    ops: Counter = field(default_factory=Counter)
    npu_calls: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class _CountOps(TorchDispatchMode):
    def __init__(self, launches: Launches) -> None:
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.launches.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches(fake):
    """Count ops dispatched in the block; calls into ``fake``'s ops run uncounted (they stand for
    the device kernels) and are tallied in ``npu_calls``."""
    launches = Launches()
    originals = {}
    for name in fake._ops.ops():
        op = getattr(fake, name)
        originals[name] = op

        @functools.wraps(op)
        def kernel(*args, _op=op, _name=name, **kwargs):
            launches.npu_calls[_name] += 1
            with _disable_current_modes():
                return _op(*args, **kwargs)

        setattr(fake, name, kernel)
    try:
        with _CountOps(launches):
            yield launches
    finally:
        for name, op in originals.items():
            setattr(fake, name, op)


def ragged_splits(groups: int, tokens: int, seed: int = 0) -> list[int]:
    """Group sizes summing to ``tokens``: about a quarter of the groups empty, the rest uneven."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=gen)
    weights[torch.randperm(groups, generator=gen)[: groups // 4]] = 0.0
    sizes = (weights / weights.sum() * tokens).floor().to(torch.int64)
    sizes[int(torch.argmax(weights))] += tokens - int(sizes.sum())
    return sizes.tolist()


def measure(kind: str, fmt: str, groups: int, tokens: int = TOKENS, hidden: int = HIDDEN, ffn: int = FFN) -> Launches:
    """Launches of one fwd+bwd of ``kind`` ("TELinear" / "TEGroupedLinear") in ``fmt``."""
    recipe = RECIPES[fmt]()
    torch.manual_seed(0)
    with npu_backend_process() as fake:
        with te_npu.quantized_model_init(recipe=recipe):
            if kind == "TELinear":
                module = te_npu.TELinear(hidden, ffn, bias=False, params_dtype=torch.bfloat16)
            else:
                module = te_npu.TEGroupedLinear(groups, hidden, ffn, bias=False, params_dtype=torch.bfloat16)
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, ffn, dtype=torch.bfloat16)
        splits = ragged_splits(groups, tokens)
        args = (x,) if kind == "TELinear" else (x, splits)
        with te_npu.autocast(recipe=recipe):  # warm-up: quantizers built, capability checked
            module(*args).backward(dy)
        with count_launches(fake) as launches:
            with te_npu.autocast(recipe=recipe):
                y = module(*args)
            y.backward(dy)
    return launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=8, help="ops to list per case")
    args = parser.parse_args()
    print(f"tokens {TOKENS}, {HIDDEN} -> {FFN}, bf16 activations, quantized weights; host ops per fwd+bwd "
          "(views not counted; torch_npu kernels apart)")
    for kind in ("TELinear", "TEGroupedLinear"):
        for fmt in RECIPES:
            counts = {g: measure(kind, fmt, g) for g in ((8, 64) if kind == "TEGroupedLinear" else (1,))}
            for g, launches in counts.items():
                where = f"G={g:<3d}" if kind == "TEGroupedLinear" else "     "
                ok = "ok" if launches.total <= LIMITS[kind] else f"OVER {LIMITS[kind]}"
                top = ", ".join(f"{name} {n}" for name, n in launches.ops.most_common(args.top))
                print(f"{kind:16s} {fmt:6s} {where} host ops {launches.total:3d} ({ok}); "
                      f"torch_npu kernels {sum(launches.npu_calls.values())}; top: {top}")
            if len(counts) > 1:
                totals = {g: c.total for g, c in counts.items()}
                print(f"{'':16s} {fmt:6s} growth with G: {totals[64] - totals[8]:+d}")


if __name__ == "__main__":
    main()
