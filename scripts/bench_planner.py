"""Benchmark the GPU prefill planner against the host planner with the copies it needs.

    python scripts/bench_planner.py [--head-dim 128] [--json planner.json]

Lengths live on the GPU, as in an engine. "gpu planner (graph)" is one
planner launch inside a CUDA graph of many (CUDA-event median per launch: the
cost in a captured prefill step). "gpu planner (eager)" is the host time of
one eager call (launches back to back, one sync at the end). "host planner +
copies" is wall time of what the host path takes: lengths to the host (a
sync), the host plan into pinned plans, plans back to the GPU, synchronize.
"host planner only" is the host loop alone, on host lengths.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import flash_compress  # noqa: E402
from flash_compress.plan_rows import ROW_BYTES  # noqa: E402

BATCHES = (1, 64, 512, 4096)
_SCRIPTS = Path(__file__).resolve().parent


def random_lengths(batch: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A chunked-prefill-like batch: extends of 1..256 tokens after prefixes of up to 100k."""
    extend = [rng.choice([1, rng.randint(1, 64), rng.randint(1, 256)]) for _ in range(batch)]
    seq = [e + rng.randint(0, 100_000) for e in extend]
    return extend, seq


def _wall_median_us(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def gpu_graph_us(step, launches: int = 200, iters: int = 30) -> float:
    """Median time of one `step` from replays of a CUDA graph holding `launches` of them."""
    # scripts/bench.py, imported here so that bench.py may import this module.
    if str(_SCRIPTS) not in sys.path:
        sys.path.insert(0, str(_SCRIPTS))
    import bench

    return bench.graph_median_ms(step, launches=launches, iters=iters) * 1e3


def gpu_eager_us(step, calls: int = 200, iters: int = 10) -> float:
    """Host time of one eager call: `calls` calls back to back, then one synchronize."""

    def burst():
        for _ in range(calls):
            step()
        torch.cuda.synchronize()

    return _wall_median_us(burst, iters, warmup=1) / calls


def planner_rows(module, batches=BATCHES, seed: int = 0, iters: int = 30) -> list[dict]:
    """One dict per (batch, planner): ``case``, ``impl``, ``us``, ``batch``, ``num_tokens``, ``plan_bytes``."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for batch in batches:
        extend, seq = random_lengths(batch, rng)
        total = sum(extend)
        extend_gpu = torch.tensor(extend, dtype=torch.int64, device="cuda")
        seq_gpu = torch.tensor(seq, dtype=torch.int64, device="cuda")
        compress_gpu = torch.empty(total, ROW_BYTES, dtype=torch.uint8, device="cuda")
        write_gpu = torch.empty_like(compress_gpu)
        counts = torch.zeros(3, dtype=torch.int32, device="cuda")
        compress_host = torch.empty(total, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        write_host = torch.empty(total, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        extend_cpu, seq_cpu = extend_gpu.cpu(), seq_gpu.cpu()

        def gpu_step():
            module.plan_online_prefill_counted(extend_gpu, seq_gpu, compress_gpu, write_gpu, True, counts)

        def host_step_with_copies():
            lens_e, lens_s = extend_gpu.cpu(), seq_gpu.cpu()  # each a D2H copy and a sync
            module.plan_online_prefill(lens_e, lens_s, compress_host, write_host, True)
            compress_gpu.copy_(compress_host, non_blocking=True)
            write_gpu.copy_(write_host, non_blocking=True)
            torch.cuda.synchronize()

        def host_step_only():
            module.plan_online_prefill(extend_cpu, seq_cpu, compress_host, write_host, True)

        gpu_step()
        torch.cuda.synchronize()
        flag = int(counts[2])
        if flag != 0:
            raise RuntimeError(f"B={batch}: the GPU planner flagged the benchmark's lengths ({flag})")
        timings = {
            "gpu planner (graph)": gpu_graph_us(gpu_step, iters=iters),
            "gpu planner (eager)": gpu_eager_us(gpu_step),
            "host planner + copies": _wall_median_us(host_step_with_copies, iters),
            "host planner only": _wall_median_us(host_step_only, iters),
        }
        for impl, us in timings.items():
            rows.append({"case": f"plan B={batch}", "impl": impl, "us": us, "batch": batch, "num_tokens": total,
                         "plan_bytes": 2 * total * ROW_BYTES})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128, help="which variant's planner (all carry the same)")
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_planner.py needs a CUDA GPU", file=sys.stderr)
        return 2
    module = flash_compress.load_module(args.head_dim)
    rows = planner_rows(module)
    print(f"{'case':14} {'impl':24} {'us':>9} {'tokens':>9}")
    for r in rows:
        print(f"{r['case']:14} {r['impl']:24} {r['us']:9.2f} {r['num_tokens']:9d}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
