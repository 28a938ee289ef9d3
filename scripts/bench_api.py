#!/usr/bin/env python3
"""Python overhead per call of the torch API against the raw tvm-ffi function (needs a CUDA GPU).

    python scripts/bench_api.py [--head-dim 512] [--batch 4] [--calls 100] [--repeats 200]

Wall clock on the host, no CUDA graphs, tiny batch (so the launch, not the
kernel, is what is measured): each sample times ``--calls`` back-to-back calls
with ``time.perf_counter``; the queue is drained with ``torch.cuda.synchronize()``
between samples, outside the timed part. Reported: the median per call of each
way to call, and its overhead over the raw function.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

try:
    import flash_compress as fc
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import flash_compress as fc

from flash_compress.plan_rows import CHUNK_SIZE  # noqa: E402


def per_call_us(call: Callable[[], object], calls: int, repeats: int, warmup: int | None = None) -> float:
    """Median over ``repeats`` samples of the wall time of ``calls`` calls, per call, in microseconds,
    after ``warmup`` calls (default ``calls``)."""
    for _ in range(calls if warmup is None else warmup):  # warm up: the variant is loaded, caches are hot
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_api: needs a CUDA GPU", file=sys.stderr)
        return 2
    d, b, dev = args.head_dim, args.batch, "cuda"
    module = fc.load_module(head_dim=d)
    state = torch.randn(2 * b, 1, 3 * d, device=dev)
    ape = torch.randn(CHUNK_SIZE, d, device=dev)
    indices = torch.arange(b, dtype=torch.int32, device=dev)
    seq_lens = torch.full((b,), 70, dtype=torch.int32, device=dev)
    dec_inp = torch.randn(b, 2 * d, device=dev)
    dec_out = torch.empty(b, d, device=dev)
    extend = 8
    plan = fc.plan_prefill(torch.full((b,), 300), torch.full((b,), extend), device=dev)
    pre_inp = torch.randn(b * extend, 2 * d, device=dev)
    pre_out = torch.empty(b * extend, d, device=dev)
    c, w = plan.compress_plan, plan.write_plan

    ways = {
        "decode": [
            ("raw module.run_decode", lambda: module.run_decode(state, dec_inp, dec_out, ape, indices, seq_lens, None)),
            ("fc.decode(out=...)", lambda: fc.decode(state, dec_inp, ape, indices, seq_lens, out=dec_out)),
            ("fc.decode() allocating out", lambda: fc.decode(state, dec_inp, ape, indices, seq_lens)),
            ("torch.ops.flash_compress.decode",
             lambda: torch.ops.flash_compress.decode(state, dec_inp, dec_out, ape, indices, seq_lens, None, None)),
        ],
        "prefill": [
            ("raw module.run_prefill", lambda: module.run_prefill(state, pre_inp, pre_out, ape, indices, c, w, None)),
            ("fc.prefill(out=...)", lambda: fc.prefill(state, pre_inp, ape, indices, plan, out=pre_out)),
            ("fc.prefill() allocating out", lambda: fc.prefill(state, pre_inp, ape, indices, plan)),
            ("torch.ops.flash_compress.prefill",
             lambda: torch.ops.flash_compress.prefill(state, pre_inp, pre_out, ape, indices, c, w, None, None)),
        ],
    }
    print(f"bench_api on {torch.cuda.get_device_name()}: head_dim {d}, batch {b}, "
          f"median of {args.repeats} x {args.calls} calls (wall clock, host)")
    for kind, rows in ways.items():
        raw_us = 0.0
        for i, (label, call) in enumerate(rows):  # rows[0] is the raw function
            us = per_call_us(call, args.calls, args.repeats)
            raw_us = us if i == 0 else raw_us
            extra = f"  (+{us - raw_us:.2f} us over raw)" if i else ""
            print(f"  {kind:8s} {label:34s} {us:7.2f} us/call{extra}")
    plan_us = per_call_us(lambda: fc.plan_prefill(torch.full((b,), 300), torch.full((b,), extend), device=dev),
                          args.calls, max(10, args.repeats // 10))
    print(f"  plan     fc.plan_prefill (host, pinned, 2 copies) {plan_us:7.2f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
