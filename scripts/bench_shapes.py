"""Time prefill shapes that no bench.py case has, ours against the reference design, in graph.

    python scripts/bench_shapes.py --reference SEED [--head-dim 512] [--rounds 3] [--state-dtype float32]

Each shape runs in a CUDA graph of 10 calls (kernels only), on the same tensors for both
designs, in rounds that visit both in turn; the table shows medians (us) and the reference's
time over ours. A check against overfitting the launch rules to bench.py's cases.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "scripts")]
import bench  # noqa: E402
import bench_variants  # noqa: E402
import flash_compress  # noqa: E402

# (name, requests, new tokens each, random prefixes, one-token requests), as bench.PREFILL_CASES.
SHAPES = [("2x16384 from 0", 2, 16384, False, 0), ("1x65536 from 0", 1, 65536, False, 0),
          ("4x4096 random", 4, 4096, True, 0), ("16x2048 random", 16, 2048, True, 0),
          ("32x512 random", 32, 512, True, 0), ("128x128 random", 128, 128, True, 0),
          ("512x64 random", 512, 64, True, 0), ("1024x17 random", 1024, 17, True, 0),
          ("1x4096 + 31x1", 1, 4096, True, 31), ("2x1000 + 100x1", 2, 1000, True, 100),
          ("4x300 + 1000x1", 4, 300, True, 1000), ("512x1", 0, 1, True, 512),
          ("1x500 random", 1, 500, True, 0), ("8x130 random", 8, 130, True, 0),
          ("1x32768 random", 1, 32768, True, 0), ("3x8000 + 13x1", 3, 8000, True, 13)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, metavar="SEED", help="the reference design's source")
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state-dtype", choices=list(bench.STATE_DTYPES), default="float32")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_shapes.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from reference_design import load_reference

    bench.PREFILL_CASES = SHAPES
    impls = {"ours": flash_compress.load_module(args.head_dim, use_pdl=True, state_dtype=args.state_dtype),
             "reference": load_reference(args.reference, args.head_dim)}
    state_dtypes = {"ours": bench.STATE_DTYPES[args.state_dtype], "reference": torch.float32}
    timed = {case: per_impl for case, per_impl in
             bench_variants.cases(impls, args.head_dim, False, state_dtypes, prefill_only=True).items()
             if case.endswith(" in graph") and " graph-plan " not in case}  # exact plans
    rows = [(case, impl, call, launches) for case, per_impl in timed.items()
            for impl, (call, _, launches) in per_impl.items()]
    # bench.py's rounds, forwards then backwards: neither design always runs first.
    results = bench.timed_in_rounds(
        [lambda call=call, launches=launches: bench.graph_median_ms(call, launches=launches, iters=20) * 1e3
         for _, _, call, launches in rows], args.rounds)
    timings: dict[str, dict[str, list[float]]] = {}
    for (case, impl, _, _), us in zip(rows, results):
        timings.setdefault(case, {})[impl] = us
    print(f"head_dim {args.head_dim}, {args.state_dtype} state (ours), in graph, us")
    for case, per_impl in timings.items():
        ours, ref = statistics.median(per_impl["ours"]), statistics.median(per_impl["reference"])
        print(f"{case:36} ours {ours:8.2f}  reference {ref:8.2f}  {ref / ours:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
