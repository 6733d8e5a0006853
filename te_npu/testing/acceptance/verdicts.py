"""A case's verdict from its jobs' per-rank results: ``pass``, ``fail`` (with reasons) or ``not judged``.

Every case (docs/a5.md, acceptance matrix): ``fail`` when any phase it reads (``NEEDS``) has no
result from every rank, an error on some rank, or a problem in one of the rules that count for it;
besides, Q3-06 checks the HiF8 weight scales across ranks and Q3-10 every illegal configuration
(``rules.ILLEGAL_CONFIGS``). Otherwise ``pass``, except:

- Q3-09: a resume that is not bitwise equal to the continuous run is ``not judged``: its
  differences are measured (``measured``), no tolerance is agreed yet.
- Q3-11: on the CPU emulation ``not judged`` (CPU step times say nothing about the A5 kernels;
  the ratios are reported); on the device ``pass`` when each 8-bit format's steady throughput is
  at least BF16's (``throughput_ratio >= 1``) and its steady step time at most BF16's
  (``step_time_ratio <= 1``), ``fail`` naming the ratios otherwise.
"""
from __future__ import annotations

from te_npu.testing.acceptance import rules as R
from te_npu.testing.acceptance.job_files import JobFiles
from te_npu.testing.acceptance.matrix import CASES, FAIL, NEEDS, NOT_JUDGED, PASS, REPORTED
from te_npu.testing.acceptance.run_config import FORMATS, RunSettings

__all__ = ["judge", "illegal_config_problems"]


def illegal_config_problems(settings: RunSettings) -> list[str]:
    """Q3-10's configuration rows: each ``rules.ILLEGAL_CONFIGS`` override on the MXFP8 recipe."""
    problems = []
    for override, key in R.ILLEGAL_CONFIGS:
        load = lambda o: settings.config("mxfp8", settings.out / "illegal", (o,))  # noqa: E731
        problems += R.check_illegal_config(load, override, key)
    return problems


def judge(settings: RunSettings, case: str) -> dict:
    """``case``'s verdict (module doc) as the JSON of ``cases/<id>.json``."""
    files = JobFiles(settings.out, settings.nproc)
    reasons, evidence, measured = [], [], {}
    results = {}
    for job, phase, counted in NEEDS[case]:
        ranks = files.read(job, phase)
        evidence.append(f"jobs/{job}/{phase}/")
        if ranks is None:
            partial = files.read_partial(job, phase)
            reasons += [f"{job}/{phase} rank {r}: {d['error']}" for r, d in partial.items() if "error" in d]
            reasons.append(f"{job}/{phase}: no result from every rank (see jobs/{job}/launch_*.log)")
            continue
        results[(job, phase)] = ranks
        for r, data in enumerate(ranks):
            if "error" in data:
                reasons.append(f"{job}/{phase} rank {r}: {data['error']}")
            for rule, problems in data.get("rules", {}).items():
                if counted is None or rule in counted:
                    reasons += [f"{job}/{phase} rank {r} {rule}: {p}" for p in problems[:3]]
    if case == "Q3-06":
        for phase in ("main", "reshard_false"):
            ranks = results.get(("train-hif8", phase))
            if ranks and all("weights" in d for d in ranks):
                reasons += [f"train-hif8/{phase} ranks: {p}" for p in R.check_hif8_weight_scales(
                    [d["weights"] for d in ranks], settings.nproc)]
    if case == "Q3-10":
        reasons += illegal_config_problems(settings)
    if case == "Q3-09":
        measured = {job: ranks[0].get("measured") for (job, _), ranks in results.items() if job.startswith("resume")}
    if case == "Q3-11" and len(results) == 3 and all("records" in r[0] for r in results.values()):
        measured = R.steady_ratios({f: results[("perf", f)][0]["records"] for f in FORMATS},
                                   results[("perf", "bf16")][0]["warmup"])
    verdict, why = (FAIL, reasons) if reasons else (PASS, [])
    if not reasons and case == "Q3-09" and not all(m and m["bitwise"] for m in measured.values()):
        verdict, why = NOT_JUDGED, ["resume differs from the continuous run (measured in `measured`); no "
                                    "tolerance for a non-bitwise resume is agreed yet"]
    if case == "Q3-11":
        evidence += [f"jobs/{job}/{phase}/" for job, phase in REPORTED[case]]
    if not reasons and case == "Q3-11":
        verdict, why = _throughput_verdict(settings, measured)
    return {"id": case, "title": CASES[case], "verdict": verdict, "reasons": why, "evidence": evidence,
            "measured": measured}


def _throughput_verdict(settings: RunSettings, measured: dict) -> tuple[str, list[str]]:
    """Q3-11 once nothing failed (module doc)."""
    if not settings.npu:
        return NOT_JUDGED, ["emulation: CPU step times say nothing about the A5 kernels (ratios reported)"]
    bad = [f"{f}: throughput_ratio {m['throughput_ratio']:.3f}, step_time_ratio {m['step_time_ratio']:.3f}"
           for f, m in measured.items() if f != "bf16" and not (m["throughput_ratio"] >= 1.0
                                                                 and m["step_time_ratio"] <= 1.0)]
    return (FAIL, bad) if bad else (PASS, [])
