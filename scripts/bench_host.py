#!/usr/bin/env python3
"""Host time per call of the raw kernels (needs a CUDA GPU): where a single call's event time goes.

    python scripts/bench_host.py [--reference ../shared/seed/c128_online.cuh.txt] [NAME=PATH ...]

Each figure is the host's wall clock per call, the median of 5 loops of 1000 calls (after
100 warm-ups), without waiting on the GPU in between: decode B=1, a prefill
with empty plans (the tvm-ffi call and the argument checks, no launch) and a
prefill of 1 x 200 tokens from a random prefix (both passes launch). Beside
them: the same prefill timed between CUDA events and in a CUDA graph of 10
calls, and torch's own ``x.add_(1)`` as the floor of one launch from Python.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from bench_api import per_call_us  # noqa: E402
from bench_variants import load_variant, parse_variant  # noqa: E402
import flash_compress  # noqa: E402
from flash_compress.plan_rows import CHUNK_SIZE  # noqa: E402

HEAD_DIM = 512


def host_us_per_call(fn) -> float:
    """Median of 5 samples of 1000 calls, after 100 warm-ups."""
    return per_call_us(fn, calls=1000, repeats=5, warmup=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default=None, metavar="SEED", help="also time the reference design")
    parser.add_argument("variants", nargs="*", type=parse_variant, metavar="NAME=PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_host.py needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = {"flash_compress": flash_compress.load_module(HEAD_DIM)}
    with tempfile.TemporaryDirectory(prefix="flash-compress-variants-") as source_root:
        for name, files in args.variants:
            impls[name] = load_variant(name, files, HEAD_DIM, Path(source_root), "float32")
    if args.reference:
        from reference_design import load_reference

        impls["reference design"] = load_reference(args.reference, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    d, _, _, _ = bench.prefill_case(impls["flash_compress"], HEAD_DIM, 1, 200, True, gen)
    state = torch.randn(1, 1, 3 * HEAD_DIM, device="cuda")
    token = torch.randn(1, 2 * HEAD_DIM, device="cuda")
    out = torch.empty(1, HEAD_DIM, device="cuda")
    ape = torch.randn(CHUNK_SIZE, HEAD_DIM, device="cuda")
    indices = torch.zeros(1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((1,), 7, dtype=torch.int32, device="cuda")
    for name, module in impls.items():
        plans = bench.plan(module, [200], d["seq_lens"], False)
        empty_plans = (plans[0][:0], plans[1][:0])

        def prefill(p, m=module):
            return lambda: m.run_prefill(d["state"], d["input"], d["out"], d["ape"], d["indices"], *p, None)

        decode_us = host_us_per_call(lambda m=module: m.run_decode(state, token, out, ape, indices, seq_lens, None))
        print(f"{name}: decode B=1 {decode_us:.2f} us/call, prefill empty plans "
              f"{host_us_per_call(prefill(empty_plans)):.2f}, prefill 2 passes {host_us_per_call(prefill(plans)):.2f}, "
              f"events around one small prefill {bench.median_ms(prefill(plans), iters=200) * 1e3:.2f} us, "
              f"in graph {bench.graph_median_ms(prefill(plans), launches=10) * 1e3:.2f} us")
    x = torch.empty(1, device="cuda")
    print(f"torch x.add_(1): {host_us_per_call(lambda: x.add_(1)):.2f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
