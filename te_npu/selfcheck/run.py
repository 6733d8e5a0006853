"""Run every case on the device and on the CPU emulation, compare, and write the report.

Device side: ``npu`` runs te_npu's torch_npu wrappers (``te_npu.ops.force_backend("npu")``) on
tensors on the current NPU (or on ``tensor_device``, e.g. ``cpu`` for a CPU-running torch_npu
such as the tests' fake); ``cuda`` runs the emulation on CUDA tensors (its BF16 GEMM plan);
``cpu`` runs the emulation against itself, a smoke of the tool only. The reference side is
always the emulation on CPU copies of the same inputs.

Exit code of :func:`main`: 0 when every case agrees (a documented Limits difference counts as
agreeing and is reported as "known difference"), 1 when any case differs or raised, 2 when the
device side cannot run at all (e.g. no torch_npu for ``--device npu``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

import te_npu.ops as ops
from te_npu.selfcheck.cases import OPS, Case, SCALE_ALGS, build_cases, move
from te_npu.selfcheck.compare import AGREES, DIFFERS, ERROR, GEMM_NRMSE_TOLERANCE, KNOWN, Outcome, compare_bits, compare_gemm
from te_npu.selfcheck.environment import gate_report
from te_npu.selfcheck.limits import LIMITS
from te_npu.selfcheck.shapes import SHAPE_SETS

__all__ = ["Result", "run_selfcheck", "write_report", "main"]

SMOKE_NOTE = "SMOKE: --device cpu compares the emulation with itself (no kernel is checked)"


@dataclass
class Result:
    """One case's outcome (``limit``: the Limits id it may show, ``seconds``: both sides)."""

    op: str
    kind: str
    name: str
    verdict: str
    detail: str
    metrics: dict
    limit: str | None
    seconds: float


def _side(device: str, tensor_device: str | None) -> tuple[str, str]:
    """(backend, tensor device) of the device side."""
    if device == "npu":
        import torch_npu  # noqa: F401 - the device side needs it; ImportError is reported by main

        return "npu", tensor_device or f"npu:{torch.npu.current_device()}"
    if device == "cuda":
        return "emulation", tensor_device or "cuda"
    return "emulation", tensor_device or "cpu"


def _run_case(case: Case, backend: str, tensor_device: str) -> Result:
    start = time.perf_counter()
    try:
        with ops.force_backend(backend):
            got = case.fn(*(move(a, tensor_device) for a in case.inputs))
            got = {k: v.cpu() for k, v in got.items()}
    except Exception as exc:  # noqa: BLE001 - the kernel's error is the finding
        outcome = Outcome(ERROR, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    else:
        try:
            with ops.force_backend("emulation"):
                want = case.fn(*case.inputs)
        except Exception as exc:  # noqa: BLE001
            outcome = Outcome(ERROR, f"the emulation raised {type(exc).__name__}: {exc}")
        else:
            if case.kind == "gemm":
                outcome = compare_gemm(got["out"], want["out"], case.output_dtype, case.limit)
            else:
                outcome = compare_bits(got, want, case.allowed, case.limit)
    return Result(case.op, case.kind, case.name, outcome.verdict, outcome.detail, outcome.metrics, case.limit,
                  round(time.perf_counter() - start, 3))


def run_selfcheck(device: str = "npu", shapes: str = "small", tensor_device: str | None = None,
                  ops_only: tuple[str, ...] = (), print_fn=print) -> dict:
    """Run every case (or those of the torch_npu ops ``ops_only``); returns the report (see
    :func:`write_report`): environment, results, summary."""
    gate = gate_report()
    print_fn(f"te_npu.selfcheck: --device {device} --shapes {shapes}")
    print_fn(f"capability gate {gate['summary']}")
    for fmt, failures in gate["failed_checks"].items():
        print_fn(f"  {fmt}: " + ("all checks pass" if not failures else "; ".join(failures)))
    found = [k for k, ok in gate["reading"]["kernels"].items() if ok]
    missing = [k for k, ok in gate["reading"]["kernels"].items() if not ok]
    if gate["reading"]["torch_npu"] is not None:
        print_fn(f"  aclnn symbols found: {', '.join(found) or 'none'}; missing: {', '.join(missing) or 'none'}")
    if device == "cpu":
        print_fn(SMOKE_NOTE)
    backend, where = _side(device, tensor_device)
    unknown = sorted(set(ops_only) - set(OPS))
    if unknown:
        raise ValueError(f"no case runs torch_npu op(s) {unknown}; known: {sorted(OPS)}")
    results = []
    for case in build_cases(SHAPE_SETS[shapes]):
        if ops_only and case.op not in ops_only:
            continue
        result = _run_case(case, backend, where)
        results.append(result)
        if result.verdict in (DIFFERS, ERROR):
            print_fn(f"  {result.verdict.upper()}: {result.op} | {result.name} | {result.detail}")
    summary = Counter(r.verdict for r in results)
    failed = summary[DIFFERS] + summary[ERROR]
    report = {
        "tool": "te_npu.selfcheck", "device": device, "backend": backend, "tensor_device": where, "shapes": shapes,
        "ops": sorted({r.op for r in results}), "smoke": device == "cpu", "note": SMOKE_NOTE if device == "cpu" else None,
        "scale_algs": list(SCALE_ALGS), "gemm_nrmse_tolerance": {str(k): v for k, v in GEMM_NRMSE_TOLERANCE.items()},
        "environment": gate, "limits": LIMITS,
        "summary": {v: summary[v] for v in (AGREES, KNOWN, DIFFERS, ERROR)},
        "exit_code": 0 if not failed else 1,
        "results": [r.__dict__ for r in results],
    }
    print_fn(f"{len(results)} cases: " + ", ".join(f"{summary[v]} {v}" for v in (AGREES, KNOWN, DIFFERS, ERROR)))
    return report


def _per_op(results: list[dict]) -> dict[str, Counter]:
    table: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        table[r["op"]][r["verdict"]] += 1
    return table


def markdown(report: dict) -> str:
    """The one-page summary: environment, per-op verdict counts, every case that is not plainly agreeing."""
    env = report["environment"]
    lines = [f"# te_npu self-check: {report['device']} ({report['backend']} backend, inputs on "
             f"{report['tensor_device']}), shapes {report['shapes']}", ""]
    if report["smoke"]:
        lines += [f"**{report['note']}**", ""]
    lines += [f"- capability gate {env['summary']}"]
    for fmt, failures in env["failed_checks"].items():
        lines.append(f"- gate, {fmt}: " + ("all checks pass" if not failures else "; ".join(failures)))
    kernels = env["reading"]["kernels"]
    if kernels:
        lines.append("- aclnn symbols: " + ", ".join(f"{k} {'found' if ok else 'MISSING'}" for k, ok in kernels.items()))
    lines.append(f"- MX scale rules checked: {', '.join(report['scale_algs'])}; GEMM NRMSE tolerance: "
                 + ", ".join(f"{k.replace('torch.', '')} {v:.3g}" for k, v in report["gemm_nrmse_tolerance"].items()))
    s = report["summary"]
    lines += ["", f"**{'PASS' if report['exit_code'] == 0 else 'FAIL'}**: " + ", ".join(f"{n} {v}" for v, n in s.items()),
              "", "| torch_npu op | " + " | ".join(s) + " |", "|---|" + "---|" * len(s)]
    for op, counts in _per_op(report["results"]).items():
        lines.append(f"| `{op}` | " + " | ".join(str(counts[v]) for v in s) + " |")
    failing = [r for r in report["results"] if r["verdict"] in (DIFFERS, ERROR)]
    if failing:
        lines += ["", "| verdict | op | case | detail |", "|---|---|---|---|"]
        lines += [f"| {r['verdict']} | `{r['op']}` | {r['name']} | {r['detail']} |" for r in failing[:30]]
        if len(failing) > 30:
            lines.append(f"| ... | | {len(failing) - 30} more in the JSON | |")
    by_limit: dict[tuple, Counter] = defaultdict(Counter)
    for r in report["results"]:
        if r["limit"]:
            by_limit[(r["limit"], r["op"])][r["verdict"]] += 1
    if by_limit:
        lines += ["", "Inputs for \"Limits\" lines (docs/numerics-and-limits.md; known difference = differs exactly "
                      "where documented):", "",
                  "| Limits line | op | known difference | agrees (did not show) | differs / error |", "|---|---|---|---|---|"]
        for (limit, op), c in sorted(by_limit.items()):
            lines.append(f"| `{limit}` | `{op}` | {c[KNOWN]} | {c[AGREES]} | {c[DIFFERS] + c[ERROR]} |")
    used = sorted({r["limit"] for r in report["results"] if r["limit"]})
    if used:
        lines += ["", "Limits lines checked (docs/numerics-and-limits.md, \"Limits\"):"] + \
            [f"- `{k}`: {LIMITS[k]}" for k in used]
    return "\n".join(lines) + "\n"


def write_report(report: dict, json_path: str | Path) -> tuple[Path, Path]:
    """Write ``json_path`` and the markdown page beside it (same name, ``.md``)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(markdown(report))
    return json_path, md_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m te_npu.selfcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("npu", "cpu", "cuda"), default="npu",
                   help="the side checked against the CPU emulation (cpu: the emulation against itself, a smoke)")
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="16b",
                   help="16b: the DeepSeek-V3 16B's GEMM shapes; small: reduced shapes for a fast run")
    p.add_argument("--json", default="selfcheck/selfcheck.json",
                   help="the JSON report; the markdown page is written beside it (.md)")
    p.add_argument("--ops", nargs="+", default=(), choices=sorted(OPS), metavar="OP",
                   help=f"only the cases of these torch_npu ops (default: all: {', '.join(sorted(OPS))})")
    p.add_argument("--tensor-device", default=None,
                   help="where the device side's inputs live (default: the --device's current device; "
                        "cpu for a torch_npu that runs on CPU tensors, such as the tests' fake)")
    return p


def main(argv: list[str] | None = None, print_fn=print) -> int:
    """The command line; returns the exit code (see the module docstring)."""
    args = _parser().parse_args(argv)
    try:
        report = run_selfcheck(args.device, args.shapes, args.tensor_device, tuple(args.ops), print_fn=print_fn)
    except ImportError as exc:
        print_fn(f"te_npu.selfcheck: --device {args.device} cannot run: {exc}")
        return 2
    json_path, md_path = write_report(report, args.json)
    print_fn(f"report: {json_path} and {md_path}")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
