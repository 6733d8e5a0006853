"""MoE block fwd+bwd throughput: ours (te_npu.moe + TEGroupedSwiGLUExperts, no autocast) versus
transformers' DeepseekV3MoE with experts_implementation "grouped_mm" and "eager".

DeepSeek-V3-16B layer shapes (hidden 2048, 64 routed experts, top-6, moe_intermediate 1408,
2 shared experts); same weights, inputs and dtype for all three.

    python scripts/bench_moe.py                                   # CPU, fp32, 1024 tokens
    python scripts/bench_moe.py --device cuda --tokens 8192       # GPU, bf16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.deepseek_v3 import DSV3_16B  # noqa: E402
from models.deepseek_v3.config import to_hf_config_dict  # noqa: E402
from models.deepseek_v3.model import DeepSeekMoE  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_fwd_bwd(module, x, grad, warmup: int, iters: int) -> float:
    """Median seconds of one forward + backward (parameter grads cleared between runs)."""
    times = []
    for i in range(warmup + iters):
        module.zero_grad(set_to_none=True)
        x.grad = None
        _sync(x.device)
        start = time.perf_counter()
        module(x).backward(grad)
        _sync(x.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on CPU (bf16 matmul is ~6x slower there), bfloat16 elsewhere")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--impls", default="ours,grouped_mm,eager")
    args = parser.parse_args()
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    cfg = DSV3_16B.replace(num_hidden_layers=2)
    fields = to_hf_config_dict(cfg)
    for key in ("architectures", "model_type", "dtype"):
        fields.pop(key)
    hf_config = DeepseekV3Config(**fields)

    gen = torch.Generator().manual_seed(0)
    with torch.device(device):
        hf = DeepseekV3MoE(hf_config)
        ours = DeepSeekMoE(cfg, dtype)
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            std = 0.05 if name.endswith("e_score_correction_bias") else 0.02
            t.copy_(torch.randn(t.shape, generator=gen) * std)
    hf.to(dtype)
    hf.gate.float()  # FP32 router, as HF keeps it
    ours.load_state_dict(hf.state_dict())
    x = (torch.randn(1, args.tokens, cfg.hidden_size, generator=gen)).to(device, dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)

    def run_hf(impl):
        hf.config._experts_implementation = impl
        return _time_fwd_bwd(hf, x, grad, args.warmup, args.iters)

    runners = {"ours": lambda: _time_fwd_bwd(ours, x, grad, args.warmup, args.iters),
               "grouped_mm": lambda: run_hf("grouped_mm"), "eager": lambda: run_hf("eager")}
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"MoE block fwd+bwd | device={device} dtype={dtype_name} tokens={args.tokens} "
          f"hidden={cfg.hidden_size} experts={cfg.n_routed_experts} top{cfg.num_experts_per_tok} "
          f"moe_intermediate={cfg.moe_intermediate_size} shared={cfg.n_shared_experts} threads={torch.get_num_threads()}")
    tokens_per_s = {}
    for impl in args.impls.split(","):
        seconds = runners[impl]()
        tokens_per_s[impl] = args.tokens / seconds
        label = "ours" if impl == "ours" else f"HF {impl}"
        print(f"  {label:<14} {seconds * 1e3:10.1f} ms  {tokens_per_s[impl]:10.1f} tokens/s", flush=True)
    for ref in ("grouped_mm", "eager"):
        if "ours" in tokens_per_s and ref in tokens_per_s:
            print(f"  ours / HF {ref:<10} {tokens_per_s['ours'] / tokens_per_s[ref]:6.2f}x")


if __name__ == "__main__":
    main()
