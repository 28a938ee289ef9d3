#!/usr/bin/env python3
"""The slice widths and grids the prefill passes pick for bench.py's cases, on the CPU.

    python scripts/slice_widths.py [--head-dim 128 256 512] [--sms 132] [--shapes]

Plans each of ``bench.PREFILL_CASES`` (with ``--shapes``, ``bench_shapes.SHAPES``) as ``bench.py``
does (same lengths, same seed, exact plans) and prints, per pass, the width it runs, its grid, its
chain (rounds of dependent loads of its busiest warp, every segment taken as a full chunk) and
whether the write pass's grid fits in the slots the compress pass's leaves free, so that it runs
beside it, or must wait for its blocks to finish. The write pass also gets its longest segment of
this draw and the rounds one warp takes for it at the width the pass runs (its real chain, where the
rule assumes full chunks). The rule is ``choose_slice_width``
(``csrc/deepseek_v4/c128_slice_width.cuh``) through its Python mirror
``tests/schedule.py: prefill_pass``, which ``tests/test_headers_nvcc.py`` checks against the
compiled rule; 8 blocks fit an SM (every prefill kernel sits at its 128-register bound), and an H200
has 132 SMs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "scripts"), str(ROOT / "tests")]
import bench  # noqa: E402
from flash_compress.c128_online import HEAD_DIMS_TESTED  # noqa: E402
from flash_compress.host_planner import plan_segments  # noqa: E402
from schedule import prefill_pass, round_tokens  # noqa: E402

#: Prefill blocks (64 threads at 128 registers) that fit one SM at once, as prefill_pass counts them.
BLOCKS_PER_SM = 8


def case_rows(cases: list[tuple]) -> list[tuple[str, int, int, int]]:
    """(case, compress rows, write rows, the longest write segment's tokens) of each of ``cases``
    (``bench.PREFILL_CASES``'s form), with bench.run's seed and order."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, batch, extend, random_prefix, singles in cases:
        prefixes, extends = bench.case_lengths(batch, extend, random_prefix, gen, singles)
        compress, write = plan_segments(extends, [p + e for p, e in zip(prefixes, extends)])
        rows.append((name, len(compress), len(write), int(write[:, 3].max()) if len(write) else 0))
    return rows


def describe(head_dim: int, sms: int, cases: list[tuple]) -> list[str]:
    resident = BLOCKS_PER_SM * sms
    lines = [f"head_dim {head_dim}, {resident} resident blocks: rows x slice width, grid, chain"]
    for name, compress_rows, write_rows, longest in case_rows(cases):
        compress = prefill_pass(compress_rows, head_dim, sms) if compress_rows else None
        line = f"  {name:<22}"
        if compress:
            line += f" compress {compress_rows} x {compress[0]}: {compress[1]} blocks, chain {compress[2]}"
        if write_rows:
            write = prefill_pass(write_rows, head_dim, sms, beside=compress)
            where = "" if not compress else ", beside" if compress[1] + write[1] <= resident else ", after"
            rounds = -(-longest // round_tokens(write[0]))
            line += (f"  write {write_rows} x {write[0]}: {write[1]} blocks, chain {write[2]}{where}; longest "
                     f"{longest} token{'s' * (longest != 1)}, {rounds} round{'s' * (rounds != 1)}")
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS_TESTED))
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--shapes", action="store_true", help="bench_shapes.py's 16 shapes instead of bench.py's")
    args = parser.parse_args()
    if args.shapes:
        from bench_shapes import SHAPES as cases
    else:
        cases = bench.PREFILL_CASES
    for head_dim in args.head_dim:
        print("\n".join(describe(head_dim, args.sms, cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
