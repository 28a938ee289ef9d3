#!/usr/bin/env python3
"""The slice widths and grids the prefill passes pick for bench.py's cases, on the CPU.

    python scripts/slice_widths.py [--head-dim 128 256 512] [--sms 132] [--shapes] [--loads | --graph-plans]

Plans each of ``bench.PREFILL_CASES`` (with ``--shapes``, ``bench_shapes.SHAPES``) as ``bench.py``
does (same lengths, same seed, exact plans) and prints, per pass, the width it runs, its grid, its
chain (rounds of dependent loads of its busiest warp, every segment taken as a full chunk) and
whether the write pass's grid fits in the slots the compress pass's leaves free, so that it runs
beside it, starts on the half or more of the GPU that a compress grid of at most half leaves free
("partly beside", what ``leaves_room_for_write_pass`` arranges), or must wait for its blocks to
finish. The write pass also gets its longest segment of this draw and the rounds one warp takes for
it at the width the pass runs (its real chain, where the rule assumes full chunks). The rule is
``choose_slice_width`` (``csrc/deepseek_v4/c128_slice_width.cuh``) through its Python mirror
``tests/schedule.py: prefill_pass`` (an exact plan's two passes as ``exact_plan_passes`` launches
them), which ``tests/test_headers_nvcc.py`` checks against the compiled rule; 8 blocks fit an SM
(every prefill kernel sits at its 128-register bound), and an H200 has 132 SMs.

``--graph-plans`` prints instead what each pass picks with CUDA-graph plans (a row per token, live rows
only bounded; ``schedule.graph_plan_passes``), and for a compress pass whose width the tie-break on its
likely rows moved, what it would pick without it.

``--loads`` adds, per pass, the rounds of loads of its busiest warp for this draw, its items (row,
slice) dealt to the grid's warps in turn as the kernel deals them, beside the mean over its warps,
and what the busiest warp would take if each block of 8 warps shared its items' rounds evenly
(``docs/experiments/balanced_write_pass.patch``'s rule, items dealt to such blocks in turn). Every
case here has fewer items than 32 a warp, so one round of plan decoding holds them all.
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
from schedule import exact_plan_passes, fills_at_most_half, graph_plan_passes, round_tokens  # noqa: E402

#: Prefill blocks (64 threads) an SM, as the host counts them for the width rule (at most
#: ``PrefillLayout::kMinBlocksPerSM``, whatever more fit) and as prefill_pass does.
BLOCKS_PER_SM = 8
#: Warps of a prefill block (PrefillLayout::kWarps).
WARPS_PER_BLOCK = 2


def case_segments(cases: list[tuple]) -> list[tuple[str, list[int], list[int], list[int]]]:
    """(case, its compress segments' tokens, its write segments' tokens, its requests' new tokens) of
    each of ``cases`` (``bench.PREFILL_CASES``'s form), planned with bench.run's seed and order."""
    gen = torch.Generator().manual_seed(0)
    segments = []
    for name, batch, extend, random_prefix, singles in cases:
        prefixes, extends = bench.case_lengths(batch, extend, random_prefix, gen, singles)
        compress, write = plan_segments(extends, [p + e for p, e in zip(prefixes, extends)])
        segments.append((name, compress[:, 3].tolist(), write[:, 3].tolist(), list(extends)))
    return segments


def item_rounds(segments: list[int], width: int, head_dim: int) -> list[int]:
    """Rounds of loads one warp takes for each item (segment, channel slice) of a pass, in item order."""
    slices = head_dim // width
    return [-(-tokens // round_tokens(width)) for tokens in segments for _ in range(slices)]


def dealt(rounds: list[int], takers: int) -> list[int]:
    """Each of ``takers``' rounds, item i going to taker i mod ``takers`` (a warp, or a block)."""
    per_taker = [0] * takers
    for item, item_rounds_ in enumerate(rounds):
        per_taker[item % takers] += item_rounds_
    return per_taker


def dealt_rounds(rounds: list[int], warps: int) -> tuple[int, float]:
    """The busiest warp's rounds and the mean over ``warps``, item i going to warp i mod ``warps``."""
    return max(dealt(rounds, warps)), sum(rounds) / warps


#: Warps of a block that shares its items' rounds evenly (--loads; the balanced experiments' blocks).
SHARING_WARPS = 8


def shared_rounds(rounds: list[int], blocks: int, block_warps: int = SHARING_WARPS) -> int:
    """The busiest warp's rounds where item i goes to block i mod ``blocks`` and each block shares its
    items' rounds evenly among its warps (an item of several slices is not split; none is here)."""
    return -(-max(dealt(rounds, blocks)) // block_warps)


def loads_line(label: str, segments: list[int], option: tuple[int, int, int], head_dim: int, sms: int) -> str:
    """A pass's ``--loads`` line; ``option``: its (width, grid, chain)."""
    width, blocks, _ = option
    rounds = item_rounds(segments, width, head_dim)
    busiest, mean = dealt_rounds(rounds, WARPS_PER_BLOCK * blocks)
    resident = BLOCKS_PER_SM * WARPS_PER_BLOCK * sms // SHARING_WARPS  # the sharing blocks that fit at once
    shared = shared_rounds(rounds, min(-(-len(rounds) // SHARING_WARPS), resident))
    return (f"    {label} loads: busiest warp {busiest} round{'s' * (busiest != 1)} (mean {mean:.2f}); "
            f"shared in blocks of {SHARING_WARPS}: {shared}")


def describe_graph_plans(head_dim: int, sms: int, cases: list[tuple]) -> list[str]:
    """What each case's passes pick with CUDA-graph plans (``graph_plan_passes``), beside what the
    compress pass would pick without the tie-break on its likely rows."""
    lines = [f"head_dim {head_dim}, CUDA-graph plans: slice width, grid, chain (compress: without the "
             "likely-rows tie-break)"]
    for name, compress_segments, _, extends in case_segments(cases):
        (compress, write), (at_bound, _) = (graph_plan_passes(extends, head_dim, sms, likely)
                                            for likely in (True, False))
        moved = "" if compress == at_bound else f" (without: {at_bound[0]}, {at_bound[1]} blocks)"
        lines.append(f"  {name:<22} {len(compress_segments)} live compress rows; compress {compress[0]}: "
                     f"{compress[1]} blocks, chain {compress[2]}{moved}  write {write[0]}: {write[1]} blocks")
    return lines


def describe(head_dim: int, sms: int, cases: list[tuple], loads: bool = False) -> list[str]:
    resident = BLOCKS_PER_SM * sms
    lines = [f"head_dim {head_dim}, {resident} resident blocks: rows x slice width, grid, chain"]
    for name, compress_segments, write_segments, extends in case_segments(cases):
        compress_rows, write_rows = len(compress_segments), len(write_segments)
        longest = max(write_segments, default=0)
        compress, write = exact_plan_passes(compress_rows, write_rows, extends, head_dim, sms)
        line = f"  {name:<22}"
        if compress:
            line += f" compress {compress_rows} x {compress[0]}: {compress[1]} blocks, chain {compress[2]}"
        if write:
            where = ("" if not compress else ", beside" if compress[1] + write[1] <= resident
                     else ", partly beside" if fills_at_most_half(compress[1], resident) else ", after")
            rounds = -(-longest // round_tokens(write[0]))
            line += (f"  write {write_rows} x {write[0]}: {write[1]} blocks, chain {write[2]}{where}; longest "
                     f"{longest} token{'s' * (longest != 1)}, {rounds} round{'s' * (rounds != 1)}")
        lines.append(line)
        if loads and compress:
            lines.append(loads_line("compress", compress_segments, compress, head_dim, sms))
        if loads and write_rows:
            lines.append(loads_line("write", write_segments, write, head_dim, sms))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS_TESTED))
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--shapes", action="store_true", help="bench_shapes.py's 16 shapes instead of bench.py's")
    parser.add_argument("--loads", action="store_true",
                        help="each pass's rounds of loads: its busiest warp, the mean, and shared in blocks of 8")
    parser.add_argument("--graph-plans", action="store_true",
                        help="the widths of CUDA-graph plans (a row per token) instead of exact ones")
    args = parser.parse_args()
    if args.graph_plans and args.loads:
        parser.error("--loads describes exact plans; drop it or --graph-plans")
    if args.shapes:
        from bench_shapes import SHAPES as cases
    else:
        cases = bench.PREFILL_CASES
    for head_dim in args.head_dim:
        lines = (describe_graph_plans(head_dim, args.sms, cases) if args.graph_plans
                 else describe(head_dim, args.sms, cases, args.loads))
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
