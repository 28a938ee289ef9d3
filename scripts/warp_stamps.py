#!/usr/bin/env python3
"""Where a one-request prefill call's time goes, from per-warp GPU timestamps (needs a GPU).

    python scripts/warp_stamps.py [--head-dim 128 256 512] [--tokens 8192 32768 131072] [--replays 5]
                                  [--variant NAME=FOLDER]

Builds an instrumented copy of ``csrc/deepseek_v4/c128_prefill.cuh`` (the edits are EDITS below,
applied to a temporary copy; the tree is not touched): every warp of the compress pass reads
``%globaltimer`` on entry, after its PDL wait, when its first round of tokens has landed, and
after its last store, and writes these four stamps and its SM (``%smid``) into output rows that
a 1 x N-from-0 call never writes (rows 127 mod 128 are skipped). The pass also keeps the latest
end of any warp, which the next call reads after its PDL wait. The script then replays a CUDA
graph of 10 calls of one request of N new tokens from 0 (float32 state; the write plan is empty,
so a call is one kernel) and reports, for the last call of each replay, in us from its first
warp's entry:

- gap: from the previous call's last warp end to this call's first warp entry (launch);
- first landed (min / median / max): when warps' first round of tokens arrived;
- end (min / median / p90 / max): when warps finished; max - median is the tail;
- period: previous call's end to this call's end, the call's share of the graph;
- SM-balanced end: the latest of the SMs' mean warp ends, when the call would end if each SM's
  warps shared its work evenly (a queue per SM); all-balanced end: the mean of all warp ends (a
  queue over the GPU). Both assume the same rate, so they bound what rebalancing could save.

The instrumented kernel is not the tree's (it spills up to 16 bytes); its graph time is printed
beside the stamps. With ``--variant NAME=FOLDER`` a second build, FOLDER's kernel files replacing
the tree's (its own ``c128_prefill.cuh``, if any, is the one instrumented), runs the same calls in
the same process. docs/PERF_LOG.md (fourteenth session) has a result.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "scripts")]
import bench  # noqa: E402
import bench_variants  # noqa: E402
from flash_compress.c128_online import HEAD_DIMS_TESTED  # noqa: E402

#: Warps with stamps (more than any one-wave pass of an H200 has); then the latest end and the
#: previous call's latest end.
STAMP_WARPS = 4096
#: Stamps per warp: entry, after the PDL wait, first tokens landed, done, SM.
PER_WARP = 5
KERNEL = ROOT / "csrc" / "deepseek_v4" / "c128_prefill.cuh"

#: (anchor, replacement): each anchor must occur exactly once in the kernel file.
EDITS = [
    ("/// \\brief Work items of a pass of `split_rows`", f"""SGL_DEVICE uint64_t global_ns() {{
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
SGL_DEVICE uint64_t* stamp_at(float* output, uint64_t index, int64_t head_dim) {{
  const uint64_t per_row = static_cast<uint64_t>(head_dim) / 2;
  const uint64_t row = index / per_row;
  return reinterpret_cast<uint64_t*>(output + (row + row / 127) * head_dim) + index % per_row;
}}
inline constexpr uint64_t kStampWarps = {STAMP_WARPS};
inline constexpr uint64_t kPerWarp = {PER_WARP};
SGL_DEVICE uint64_t sm_id() {{
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}}

/// \\brief Work items of a pass of `split_rows`"""),
    ("const PrefillParams<StateT>& params) {\n  namespace async_copy",
     "const PrefillParams<StateT>& params, uint64_t& first_landed) {\n  namespace async_copy"),
    ("    async_copy::wait<Layout::kStages - 1>();  // this round's group has landed\n",
     "    async_copy::wait<Layout::kStages - 1>();  // this round's group has landed\n"
     "    if (first_landed == 0) first_landed = global_ns();\n"),
    ("  if (!(kWritePass && params.overlap_passes)) device::PDLWaitPrimary<kUsePDL>();\n",
     """  const uint64_t t_entry = global_ns();
  uint64_t first_landed = 0;
  if (!(kWritePass && params.overlap_passes)) device::PDLWaitPrimary<kUsePDL>();
  const uint64_t t_waited = global_ns();
  if constexpr (!kWritePass) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      *stamp_at(params.output, kPerWarp * kStampWarps + 1, kHeadDim) =
          *stamp_at(params.output, kPerWarp * kStampWarps, kHeadDim);
    }
  }
"""),
    ("(next, slice, ring, params);", "(next, slice, ring, params, first_landed);"),
    ("  // Nothing after the item loop (has_wait_block)",
     """  if constexpr (!kWritePass) {
    const uint64_t t_done = global_ns();
    if (lane == 0 && warp < kStampWarps) {
      *stamp_at(params.output, kPerWarp * warp + 0, kHeadDim) = t_entry;
      *stamp_at(params.output, kPerWarp * warp + 1, kHeadDim) = t_waited;
      *stamp_at(params.output, kPerWarp * warp + 2, kHeadDim) = first_landed;
      *stamp_at(params.output, kPerWarp * warp + 3, kHeadDim) = t_done;
      *stamp_at(params.output, kPerWarp * warp + 4, kHeadDim) = sm_id();
      atomicMax(reinterpret_cast<unsigned long long*>(stamp_at(params.output, kPerWarp * kStampWarps, kHeadDim)),
                static_cast<unsigned long long>(t_done));
    }
  }
  // Nothing after the item loop (has_wait_block)"""),
]


def instrumented_kernel(folder: Path, source: Path = KERNEL) -> Path:
    """`folder` (created, or made by the caller) with `source`, the prefill kernel file, edited by EDITS."""
    text = source.read_text()
    for anchor, replacement in EDITS:
        count = text.count(anchor)
        if count != 1:
            raise SystemExit(f"warp_stamps.py: expected one {anchor!r} in {source}, found {count}")
        text = text.replace(anchor, replacement)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / KERNEL.name).write_text(text)
    return folder


def stamp_position(index: int, head_dim: int) -> tuple[int, int]:
    """(output row, 64-bit word in it) of stamp `index`: EDITS' `stamp_at`, which skips rows 127 mod 128."""
    row, col = divmod(index, head_dim // 2)
    return row + row // 127, col


def stamp(out_rows: torch.Tensor, head_dim: int, index: int) -> int:
    row, col = stamp_position(index, head_dim)
    return int(out_rows[row].view(torch.int64)[col])


def breakdown(out: torch.Tensor, head_dim: int) -> dict[str, float]:
    rows = out[: stamp_position(PER_WARP * STAMP_WARPS + 1, head_dim)[0] + 1].cpu()
    warps = [[stamp(rows, head_dim, PER_WARP * w + j) for j in range(PER_WARP)] for w in range(STAMP_WARPS)]
    live = [w for w in warps if w[2] != 0]  # warps that ran an item
    entry = min(w[0] for w in live)
    landed = sorted(w[2] - entry for w in live)
    ends = sorted(w[3] - entry for w in live)
    ends_by_sm: dict[int, list[int]] = {}
    for w in live:
        ends_by_sm.setdefault(w[4], []).append(w[3] - entry)
    previous_end = stamp(rows, head_dim, PER_WARP * STAMP_WARPS + 1) - entry
    return {
        "gap": -previous_end / 1e3,
        "landed min": landed[0] / 1e3, "landed med": statistics.median(landed) / 1e3, "landed max": landed[-1] / 1e3,
        "end min": ends[0] / 1e3, "end med": statistics.median(ends) / 1e3,
        "end p90": ends[int(0.9 * len(ends))] / 1e3, "end max": ends[-1] / 1e3,
        "period": (ends[-1] - previous_end) / 1e3,
        "SM-balanced end": max(statistics.fmean(e) for e in ends_by_sm.values()) / 1e3,
        "all-balanced end": statistics.fmean(ends) / 1e3,
        "warps": float(len(live)), "SMs": float(len(ends_by_sm)),
    }


def stamped_call(module, data, exact, head_dim: int, replays: int) -> tuple[float, dict[str, float]]:
    """The call's time in a graph of 10, and the medians of `breakdown` over `replays` replays."""

    def call():
        bench.run_prefill_case(module, data, exact)

    us = bench.graph_median_ms(call, launches=10, iters=20) * 1e3
    runs = []
    for _ in range(replays):
        data["out"].zero_()
        bench.graph_median_ms(call, launches=10, iters=1)
        torch.cuda.synchronize()
        runs.append(breakdown(data["out"], head_dim))
    return us, {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS_TESTED))
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--variant", type=bench_variants.parse_variant, metavar="NAME=PATH",
                        help="also stamp the tree with these kernel files replacing theirs (an edited "
                             "c128_online.cuh, say), in the same process")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("warp_stamps.py needs a CUDA GPU", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp())
    builds = {"tree": instrumented_kernel(scratch / "tree")}
    if args.variant:
        name, files = args.variant
        shutil.copytree(files, scratch / name)
        # The variant's own prefill kernel, if it has one, is the one stamped.
        builds[name] = instrumented_kernel(scratch / name, files / KERNEL.name if (files / KERNEL.name).is_file()
                                           else KERNEL)
    gen = torch.Generator().manual_seed(0)
    for head_dim in args.head_dim:
        modules = {name: bench_variants.load_variant(f"stamped_{name}", files, head_dim,
                                                     scratch / f"build_{name}_{head_dim}", "float32")
                   for name, files in builds.items()}
        for tokens in args.tokens:
            data, exact, _, _ = bench.prefill_case(modules["tree"], head_dim, 1, tokens, False, gen)
            for name, module in modules.items():
                us, medians = stamped_call(module, data, exact, head_dim, args.replays)
                print(f"head_dim {head_dim} 1 x {tokens} {name}: {us:.2f} us a call in graph (instrumented); "
                      f"medians of {args.replays} replays, us from the first warp's entry:")
                print("  " + "  ".join(f"{key} {value:.2f}" if key not in ("warps", "SMs") else f"{key} {value:.0f}"
                                       for key, value in medians.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
