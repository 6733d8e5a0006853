"""Layered numerics report (spec 17.3.2): fprop / dgrad / wgrad of the dense and grouped 8-bit
linear versus an FP32 golden on DeepSeek-V3 shapes; writes docs/numerics_report.{md,png}.

Golden: FP32 GEMMs of the *same* bf16 inputs (X, W, dY). Rows: MXFP8 and HiF8 through
``te_npu.functional`` (emulation backend: exact decode + FP32 accumulation), plus the BF16
GEMM (bf16 inputs, bf16 output) as the reference row. dY is Gaussian (the hardest case for
HiF8's gradient range, see the notes in the output). MXFP8 runs under both E8M0 scale rules
(``ceil``: round-up, the default; ``floor``: the OCP rule), and for each rule and GEMM the
clipped fraction is counted: elements of the GEMM's two operands, blocked along its reduction
dim, with ``|x| > 448 * scale`` (saturated by the quantization).

    python scripts/numerics_report.py [--tokens 1024] [--seed 0]
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.functional import grouped_linear, linear
from te_npu.numerics import mxfp8
from te_npu.numerics.constants import E4M3_MAX, MX_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[1]
DENSE_OUT = (2048, 3136, 2816)  # DeepSeek-V3 16B: hidden 2048 -> q/o-ish 2048, q_b 3136, dense MLP 2 x 1408
HIDDEN, TOPK, MOE_FF = 2048, 6, 1408
RECIPES = {"MXFP8 ceil": MXFP8BlockRecipe(), "MXFP8 floor": MXFP8BlockRecipe(scale_alg="floor"),
           "HiF8": HiF8CurrentScalingRecipe()}
RULES = {"MXFP8 ceil": "ceil", "MXFP8 floor": "floor"}
# per GEMM: its two operands and the dim each is blocked along (the GEMM's reduction dim)
DENSE_OPERANDS = {"fprop": (("x", -1), ("w", -1)), "dgrad": (("dy", -1), ("w", 0)), "wgrad": (("dy", 0), ("x", 0))}


def clipped(x: torch.Tensor, axis: int, rule: str) -> tuple[int, int]:
    """(elements with |x| > 448 * block scale, elements) of ``x`` MXFP8-quantized along ``axis``."""
    _, codes = mxfp8.quantize(x, axis=axis, scale_alg=rule)
    scale = mxfp8.e8m0_to_float(codes).repeat_interleave(MX_BLOCK_SIZE, dim=axis)
    return int((x.float().abs() > E4M3_MAX * scale).sum()), x.numel()


def clipped_ragged(x: torch.Tensor, chunks, rule: str) -> tuple[int, int]:
    """``clipped`` of ``x [rows, K]`` blocked along rows, blocks restarting at every group (``chunks``:
    row indices per group), each group zero-padded to whole blocks (a zero never raises an amax)."""
    count = 0
    for rows in chunks:
        if len(rows):
            part = x[rows]
            pad = part.new_zeros(((-part.shape[0]) % MX_BLOCK_SIZE, part.shape[1]))
            count += clipped(torch.cat([part, pad]), 0, rule)[0]
    return count, x.numel()


def clip_fractions(pairs: dict) -> dict:
    """{rule name: clipped fraction} over each rule's (clipped, total) pairs."""
    return {name: sum(c for c, _ in counts) / sum(n for _, n in counts) for name, counts in pairs.items()}


def _clip_cell(value) -> str:
    return "—" if value is None else f"{100 * value:.3f}%"


def metrics(actual: torch.Tensor, golden: torch.Tensor) -> dict:
    a, g = actual.double(), golden.double()
    finite = torch.isfinite(a)
    err = torch.where(finite, a - g, torch.zeros_like(a))
    mse = float(err.pow(2).mean())
    signal = float(g.pow(2).mean())
    cos = float(torch.nn.functional.cosine_similarity(torch.where(finite, a, 0).flatten(), g.flatten(), dim=0))
    return {
        "max_abs": float(err.abs().max()),
        "mse": mse,
        "nrmse": math.sqrt(mse / signal) if signal > 0 else float("nan"),
        "cosine": cos,
        "sqnr_db": 10 * math.log10(signal / mse) if mse > 0 else float("inf"),
        "nonfinite": int((~finite).sum()),
    }


def dense_case(gen, tokens: int, n: int) -> list[dict]:
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    w = (torch.randn(n, HIDDEN, generator=gen) * HIDDEN**-0.5).bfloat16()
    dy = (torch.randn(tokens, n, generator=gen) * 1e-3).bfloat16()
    xf, wf, dyf = x.float(), w.float(), dy.float()
    golden = {"fprop": xf @ wf.T, "dgrad": dyf @ wf, "wgrad": dyf.T @ xf}
    results = {"BF16": {"fprop": x @ w.T, "dgrad": dy @ w, "wgrad": dy.T @ x}}
    for name, recipe in RECIPES.items():
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(xi, wi, recipe=recipe)
        y.backward(dy)
        results[name] = {"fprop": y.detach(), "dgrad": xi.grad, "wgrad": wi.grad}
    label = f"dense {tokens}x{HIDDEN}->{n}"
    operands = {"x": x, "w": w, "dy": dy}
    clip = {g: clip_fractions({name: [clipped(operands[o], axis, rule) for o, axis in DENSE_OPERANDS[g]]
                               for name, rule in RULES.items()}) for g in DENSE_OPERANDS}
    return [dict(case=label, fmt=f, gemm=k, clipped=clip[k].get(f), **metrics(v, golden[k]))
            for f, r in results.items() for k, v in r.items()]


def grouped_case(gen, tokens: int, k_in: int, n: int, label: str, experts: int) -> list[dict]:
    rows = tokens * TOPK
    topk = torch.stack([torch.randperm(experts, generator=gen)[:TOPK] for _ in range(tokens)])
    m_splits = torch.bincount(topk.flatten(), minlength=experts)
    x = torch.randn(rows, k_in, generator=gen).bfloat16()
    w = (torch.randn(experts, n, k_in, generator=gen) * k_in**-0.5).bfloat16()
    dy = (torch.randn(rows, n, generator=gen) * 1e-3).bfloat16()
    chunks = torch.split(torch.arange(rows), m_splits.tolist())

    def per_group(xx, ww, dd, dtype):
        xx, ww, dd = xx.to(dtype), ww.to(dtype), dd.to(dtype)
        return {"fprop": torch.cat([xx[c] @ ww[e].T for e, c in enumerate(chunks)]),
                "dgrad": torch.cat([dd[c] @ ww[e] for e, c in enumerate(chunks)]),
                "wgrad": torch.stack([dd[c].T @ xx[c] for e, c in enumerate(chunks)])}

    golden = per_group(x, w, dy, torch.float32)
    results = {"BF16": per_group(x, w, dy, torch.bfloat16)}
    for name, recipe in RECIPES.items():
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xi, wi, m_splits, recipe=recipe)
        y.backward(dy)
        results[name] = {"fprop": y.detach(), "dgrad": xi.grad, "wgrad": wi.grad}
    label = f"grouped {label} {rows}x{k_in}->{n} (E={experts}, top-{TOPK})"
    clip = {
        "fprop": {name: [clipped(x, -1, rule), clipped(w, -1, rule)] for name, rule in RULES.items()},
        "dgrad": {name: [clipped(dy, -1, rule), clipped(w, -2, rule)] for name, rule in RULES.items()},
        "wgrad": {name: [clipped_ragged(dy, chunks, rule), clipped_ragged(x, chunks, rule)] for name, rule in RULES.items()},
    }
    clip = {g: clip_fractions(pairs) for g, pairs in clip.items()}
    return [dict(case=label, fmt=f, gemm=k, clipped=clip[k].get(f), **metrics(v, golden[k]))
            for f, r in results.items() for k, v in r.items()]


def write_markdown(rows: list[dict], path: Path, args, seconds: float) -> None:
    lines = [
        "# Numerics report: 8-bit linear vs FP32 golden",
        "",
        f"Generated by `python scripts/numerics_report.py --tokens {args.tokens} --experts {args.experts} "
        f"--seed {args.seed}` "
        f"in {seconds:.0f} s on CPU (emulation backend: exact decode + FP32 accumulation).",
        "",
        "Golden: FP32 GEMMs of the same bf16 X, W, dY. X ~ N(0, 1), W ~ N(0, 1/K), dY ~ N(0, 1e-6)",
        f"(Gaussian). Grouped: {args.experts} experts, top-{TOPK} random routing "
        "(uneven, non-multiple-of-32 groups). BF16 = bf16 GEMM, bf16 output (reference row).",
        "Spec 17.3.2 asks for these metrics without fixed thresholds; the unit tests gate SQNR >= 25 dB",
        "on small shapes (HiF8 gradient GEMMs on Gaussian dY: >= 24 dB, see note).",
        "",
        "## MXFP8 scale rules side by side",
        "",
        "`ceil` (the default, torch_npu `scale_alg=1`): the block scale is the smallest power of two >= amax / 448,",
        "so no element is clipped. `floor` (OCP MX, torch_npu `scale_alg=0`): 2^(floor(log2 amax) - 8), which",
        "saturates a block's values above 448 * scale to 448. Clipped = elements of the GEMM's two operands,",
        "blocked along its reduction dim, with |x| > 448 * scale.",
        "",
        "| case | GEMM | SQNR ceil (dB) | SQNR floor (dB) | ceil - floor (dB) | clipped ceil | clipped floor |",
        "|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["case"], r["gemm"], r["fmt"]): r for r in rows}
    for case in dict.fromkeys(r["case"] for r in rows):
        for gemm in ("fprop", "dgrad", "wgrad"):
            c, f = by_key[(case, gemm, "MXFP8 ceil")], by_key[(case, gemm, "MXFP8 floor")]
            lines.append(f"| {case} | {gemm} | {c['sqnr_db']:.2f} | {f['sqnr_db']:.2f} | "
                         f"{c['sqnr_db'] - f['sqnr_db']:+.2f} | {_clip_cell(c['clipped'])} | {_clip_cell(f['clipped'])} |")
    lines += [
        "",
        "## Every format",
        "",
        "| case | format | GEMM | max abs err | MSE | NRMSE | cosine | SQNR (dB) | non-finite | clipped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['fmt']} | {r['gemm']} | {r['max_abs']:.3e} | {r['mse']:.3e} | "
                     f"{r['nrmse']:.4f} | {r['cosine']:.6f} | {r['sqnr_db']:.2f} | {r['nonfinite']} | "
                     f"{_clip_cell(r.get('clipped'))} |")
    lines += [
        "",
        "Notes",
        "- MXFP8 sits near 27-28.5 dB everywhere: E4M3 has 3 mantissa bits and each 32-block scale is a",
        "  power of two, so the relative error per element is ~2^-4 regardless of the tensor's range.",
        "  On these Gaussian operands the floor rule clips ~0.75-2 % of the elements (a block's top values",
        "  above 448 * scale) and costs ~1 dB against the round-up rule, which clips none.",
        "- HiF8 fprop (X and W scaled to amax 15, the 3-mantissa-bit band) is ~28.5 dB. Its gradient",
        "  GEMMs scale dY to amax 224 = 1.75 * 2^7, so most Gaussian values land in the |E| 4..7 band",
        "  with 2 mantissa bits: ~24.6 dB is the format's own limit for Gaussian gradients. Heavy-",
        "  tailed gradients (e.g. softmax cross-entropy) put more mass in the 3-bit bands (~29 dB).",
        "",
        "![SQNR per GEMM](numerics_report.png)",
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fmts = ["BF16", "MXFP8 ceil", "MXFP8 floor", "HiF8"]
    gemms = ["fprop", "dgrad", "wgrad"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4), sharey=True)
    for ax, case in zip(axes, cases):
        for i, fmt in enumerate(fmts):
            vals = [next(r["sqnr_db"] for r in rows if r["case"] == case and r["fmt"] == fmt and r["gemm"] == g)
                    for g in gemms]
            ax.bar([j + (i - 1.5) * 0.2 for j in range(3)], vals, width=0.2, label=fmt)
        ax.axhline(25, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(3), gemms)
        ax.set_title(case, fontsize=7)
    axes[0].set_ylabel("SQNR vs FP32 golden (dB)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="dense tokens T; grouped uses T/4 tokens x top-6")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=16,
                        help="routed experts (DeepSeek-V3 16B has 64; their [64, 2816, 2048] stack needs ~10 GB "
                             "of CPU memory here, so the default routes top-6 over 16)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gen = torch.Generator().manual_seed(args.seed)
    start = time.time()
    rows = []
    for n in DENSE_OUT:
        rows += dense_case(gen, args.tokens, n)
    moe_tokens = args.tokens // 4
    rows += grouped_case(gen, moe_tokens, HIDDEN, 2 * MOE_FF, "gate_up", args.experts)
    rows += grouped_case(gen, moe_tokens, MOE_FF, HIDDEN, "down", args.experts)
    seconds = time.time() - start
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(rows, args.out / "numerics_report.md", args, seconds)
    write_plot(rows, args.out / "numerics_report.png")
    for r in rows:
        print(f"{r['case']:<52} {r['fmt']:<6} {r['gemm']:<6} SQNR {r['sqnr_db']:6.2f} dB  cos {r['cosine']:.6f}  "
              f"nonfinite {r['nonfinite']}")
    print(f"wrote {args.out / 'numerics_report.md'} and .png in {seconds:.0f} s")


if __name__ == "__main__":
    main()
