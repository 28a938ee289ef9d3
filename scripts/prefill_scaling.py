#!/usr/bin/env python3
"""How a prefill call's time grows with its tokens: a fixed part and a streaming rate (needs a GPU).

    python scripts/prefill_scaling.py [--head-dim 128 256 512] [--tokens 8192 16384 ...]

Times one request of N new tokens from position 0 (bench.py's "1xN from 0") in a CUDA graph of
10 calls (the kernels alone), float32 state, for each N; beside it a device-to-device copy of the
same bytes (half read, half written) timed the same way. A least-squares line through each
series, time = fixed + bytes / rate, splits the call into what does not grow with N (launch,
PDL wait, the first round trips, the wave's tail) and the rate at which it streams. "% of copy"
is bench.py's: the call's bytes over its time, against a 2 GiB copy's rate measured in the same
run. docs/PERF_LOG.md (fourteenth session) has a result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "scripts")]
import bench  # noqa: E402
import flash_compress  # noqa: E402
from flash_compress.c128_online import HEAD_DIMS_TESTED  # noqa: E402


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS_TESTED))
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("prefill_scaling.py needs a CUDA GPU", file=sys.stderr)
        return 2
    ceiling = bench.copy_gbps()
    print(f"device: {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s (read + write)")
    gen = torch.Generator().manual_seed(0)
    for head_dim in args.head_dim:
        module = flash_compress.load_module(head_dim, state_dtype="float32")
        print(f"\nhead_dim {head_dim}, 1 x N from 0, in graph\n"
              f"{'N':>8} {'MB':>8} {'call us':>9} {'% copy':>7} {'copy us':>9} {'call / copy':>11}")
        megabytes, call_us, copy_us = [], [], []
        for tokens in args.tokens:
            data, exact, _, traffic = bench.prefill_case(module, head_dim, 1, tokens, False, gen)

            def call(data=data, exact=exact):
                bench.run_prefill_case(module, data, exact)

            nbytes = traffic.bytes(torch.float32)
            src = torch.empty(nbytes // 8, dtype=torch.float32, device="cuda").uniform_()
            dst = torch.empty_like(src)
            us = bench.graph_median_ms(call, launches=10, iters=20) * 1e3
            copy = bench.graph_median_ms(lambda dst=dst, src=src: dst.copy_(src), launches=10, iters=20) * 1e3
            pct = 100 * nbytes / (us * 1e-6) / 1e9 / ceiling
            print(f"{tokens:8} {nbytes / 1e6:8.1f} {us:9.2f} {pct:6.1f}% {copy:9.2f} {us / copy:11.2f}", flush=True)
            megabytes.append(nbytes / 1e6)
            call_us.append(us)
            copy_us.append(copy)
            del data, src, dst
        for name, series in (("call", call_us), ("copy of the same bytes", copy_us)):
            fixed, us_per_mb = fit_line(megabytes, series)
            print(f"fit, {name}: {fixed:.2f} us fixed + {1e3 / us_per_mb:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
