#!/usr/bin/env python3
"""Runs one bench.py case a few times, for a profiler to pick a launch (needs a CUDA GPU).

    ncu --clock-control none --cache-control none --kernel-name-base mangled \\
        --kernel-name 'regex:prefill_kernel.*Lb0ELb1' --launch-skip 9 --launch-count 1 \\
        --section SpeedOfLight python scripts/profile_case.py prefill 512 1 32768
    python scripts/profile_case.py decode 512 4096 --state-dtype bfloat16

``prefill HEAD_DIM REQUESTS NEW_TOKENS [--random-prefix] [--singles S]`` is one of bench.py's
prefill cases (``bench.prefill_case``: S one-token requests ride beside); ``decode HEAD_DIM B`` is
its decode step. Each case runs ``--calls`` times (10) on the same tensors, as the benchmark's
replays do, so that the tenth launch of a kernel meets the caches a benchmark's would. In the
mangled kernel names, ``Lb0ELb1`` is the compress pass with PDL and ``Lb1ELb1`` the write pass.
The counters of docs/PERF_LOG.md's profiles came from such runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import flash_compress  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("prefill", "decode"))
    parser.add_argument("head_dim", type=int)
    parser.add_argument("batch", type=int, help="requests (prefill) or B (decode)")
    parser.add_argument("new_tokens", type=int, nargs="?", default=1, help="prefill: new tokens per request")
    parser.add_argument("--random-prefix", action="store_true", help="prefill: random prefixes, not from 0")
    parser.add_argument("--singles", type=int, default=0, help="prefill: one-token requests beside them")
    parser.add_argument("--state-dtype", choices=sorted(bench.STATE_DTYPES), default="float32")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_case.py needs a CUDA GPU")
    module = flash_compress.load_module(args.head_dim, state_dtype=args.state_dtype)
    dtype = bench.STATE_DTYPES[args.state_dtype]
    if args.kind == "decode":
        (state, *rest), _ = bench.decode_case(args.head_dim, args.batch)
        call_args = (state.to(dtype), *rest, None)
        run = module.run_decode
    else:
        gen = torch.Generator().manual_seed(0)
        data, plans, _, _ = bench.prefill_case(
            module, args.head_dim, args.batch, args.new_tokens, args.random_prefix, gen, args.singles)
        print(f"compress rows {plans[0].shape[0]}, write rows {plans[1].shape[0]}")
        call_args = (module, data, plans, data["state"].to(dtype))
        run = bench.run_prefill_case
    for _ in range(args.calls):
        run(*call_args)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
