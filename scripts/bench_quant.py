"""Throughput of the MXFP8 / HiF8 quantizers versus the machine's copy bandwidth.

GB/s counts bytes read of the bf16 input plus bytes written of data + scale outputs; "ratio" is
that throughput over ``dst.copy_(src)`` of the same bf16 tensor (bytes read + written).

    python scripts/bench_quant.py [--device cpu|cuda] [--compile {both,eager,compile}]
"""
import argparse
import statistics
import time

import torch

from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import HIF8_INPUT_MAX


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn, device: str, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mx_row(x):
    return mxfp8.quantize(x, -1)


def mx_dual(x):
    return mxfp8.quantize_dual(x)


def hif8_current(x):
    scale = hif8.current_scale(x.abs().amax(), HIF8_INPUT_MAX)
    return hif8.quantize(x, scale), scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", default="both", choices=["both", "eager", "compile"])
    parser.add_argument("--shape", default="16384,2048")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    rows, cols = (int(s) for s in args.shape.split(","))
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(rows, cols, generator=gen, device=args.device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(x)
    n = x.numel()
    in_bytes = n * x.element_size()
    mx_scale = n // 32
    cases = {  # name -> (fn, bytes read + written)
        "mxfp8 row": (mx_row, in_bytes + n + mx_scale),
        "mxfp8 dual": (mx_dual, in_bytes + 2 * (n + mx_scale)),
        "hif8 amax+scale+quantize": (hif8_current, in_bytes + n + 4),
    }

    copy_s = median_seconds(lambda: dst.copy_(x), args.device, args.warmup, args.repeats)
    copy_gbs = 2 * in_bytes / copy_s / 1e9
    print(f"device={args.device} shape=[{rows}, {cols}] bf16 threads={torch.get_num_threads()} "
          f"torch={torch.__version__}")
    print(f"copy bandwidth: {copy_gbs:8.2f} GB/s  ({copy_s * 1e3:.2f} ms, dst.copy_(src), read+write)")

    modes = []
    if args.compile in ("both", "eager"):
        modes.append(("eager", lambda f: f))
    if args.compile in ("both", "compile"):
        modes.append(("compile", lambda f: torch.compile(f, dynamic=False)))

    print(f"{'kernel':<26} {'mode':<8} {'ms':>9} {'GB/s':>8} {'ratio':>7}")
    for mode, wrap in modes:
        for name, (fn, nbytes) in cases.items():
            try:
                compiled = wrap(fn)
                if mode == "compile":  # compiled output must equal eager, bit for bit
                    got, ref = compiled(x), fn(x)
                    for a, b in zip(got, ref):
                        a8, b8 = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (a, b))
                        assert torch.equal(a8, b8), f"{name}: compiled result differs from eager"
                seconds = median_seconds(lambda: compiled(x), args.device, args.warmup, args.repeats)
            except Exception as exc:  # noqa: BLE001 - report and keep benchmarking the rest
                print(f"{name:<26} {mode:<8} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                continue
            gbs = nbytes / seconds / 1e9
            print(f"{name:<26} {mode:<8} {seconds * 1e3:9.2f} {gbs:8.2f} {gbs / copy_gbs:7.3f}")


if __name__ == "__main__":
    main()
