"""On-device self-check: every torch_npu op te_npu calls, against the emulation, one command.

``python -m te_npu.selfcheck [--device npu|cpu|cuda] [--shapes 16b|small] [--json PATH]`` runs
each MX quantization kind (dense row / col, dual-axis, grouped; both scale rules), HiF8
``npu_dynamic_quant`` / ``npu_quantize`` (maxima 15 and 224), ``npu_quant_matmul`` (fprop,
dgrad, wgrad) and ``npu_grouped_matmul`` (ragged, empty and single groups) through te_npu's
wrappers on the device and through the emulation on CPU copies of the same inputs, at the 16B's
GEMM shapes (or small ones) plus one input per "Limits" line about kernels
(docs/numerics-and-limits.md). It prints what the capability gate read and writes a JSON report and a one-page markdown beside it.

Layering: a diagnostics tool on top of ``te_npu.ops`` (README "Architecture", layer 13); no
production module imports it.
"""
from te_npu.selfcheck.run import main, run_selfcheck, write_report

__all__ = ["main", "run_selfcheck", "write_report"]
