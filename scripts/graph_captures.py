#!/usr/bin/env python3
"""Launch-bound decode timed in several CUDA graph captures (needs a CUDA GPU).

    python scripts/graph_captures.py [--head-dim 512] [--batch 1] [--captures 6] [--state-dtype float32]

A decode step of one request takes one of two times on an H100 (1.2 or 1.4 us), and which one a
benchmark reports changed between processes. This script separates the possible causes. It
captures several graphs of 100 identical launches and prints, for each state dtype:

- each graph's median per launch with the graphs replayed in turn (a property of the capture shows
  as graphs that differ while they interleave in time);
- each graph's median again, one graph after the other;
- one step at chunk positions 0, 5, 126 and 127 (a step at position 0 reads no state);
- every graph once more after 5 s of prefill traffic at full bandwidth (8 x 16384 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import flash_compress  # noqa: E402
from flash_compress.plan_rows import CHUNK_SIZE  # noqa: E402

LAUNCHES = 100


def us_per_launch(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / LAUNCHES


def in_turn(graphs, replays: int = 20) -> list[float]:
    """Each graph's median, the graphs replayed round-robin."""
    times = [[] for _ in graphs]
    for _ in range(replays):
        for graph, graph_times in zip(graphs, times):
            graph_times.append(us_per_launch(graph))
    return [statistics.median(t) for t in times]


def one_after_another(graphs, replays: int = 20) -> list[float]:
    return [statistics.median(us_per_launch(graph) for _ in range(replays)) for graph in graphs]


def bandwidth_load(module, head_dim: int, state_dtype: torch.dtype, seconds: float) -> None:
    """Replays prefill calls of 8 x 16384 tokens for `seconds`."""
    planner = flash_compress.c128_online.load_planner()
    data, exact, _, _ = bench.prefill_case(planner, head_dim, 8, 16384, False, torch.Generator().manual_seed(0))
    state = data["state"].to(state_dtype)
    graph = bench.capture_graph(
        lambda: module.run_prefill(state, data["input"], data["out"], data["ape"], data["indices"], *exact, None), 1)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        graph.replay()
    torch.cuda.synchronize()


def line(label: str, values: list[float]) -> None:
    print(f"  {label:34} " + " ".join(f"{v:.3f}" for v in values), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--captures", type=int, default=6)
    parser.add_argument("--state-dtype", nargs="+", default=list(bench.STATE_DTYPES), choices=list(bench.STATE_DTYPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("graph_captures.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}; decode B={args.batch}, head_dim {args.head_dim}, "
          f"us per launch in graphs of {LAUNCHES}")
    for dtype in args.state_dtype:
        module = flash_compress.load_module(args.head_dim, state_dtype=dtype)
        step, _ = bench.decode_case(args.head_dim, args.batch)
        step = (step[0].to(bench.STATE_DTYPES[dtype]), *step[1:])
        positions = ((step[5].long() - 1) % CHUNK_SIZE)[:4].tolist()
        print(f"{dtype} (first positions {positions}):")
        graphs = [bench.capture_graph(lambda: module.run_decode(*step, None), LAUNCHES) for _ in range(args.captures)]
        one_after_another(graphs, replays=3)
        line("graphs in turn", in_turn(graphs))
        line("graphs one after another", one_after_another(graphs))
        for position in (0, 5, CHUNK_SIZE - 2, CHUNK_SIZE - 1):
            at = step[:5] + (torch.full_like(step[5], position + 1 + 7 * CHUNK_SIZE),)
            line(f"all at position {position}, 3 graphs", one_after_another(
                [bench.capture_graph(lambda at=at: module.run_decode(*at, None), LAUNCHES) for _ in range(3)]))
        bandwidth_load(module, args.head_dim, bench.STATE_DTYPES[dtype], seconds=5)
        line("after 5 s of prefill traffic", one_after_another(graphs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
