// How a prefill pass picks its channel slice width: host arithmetic on the
// counts the host knows (plan rows, resident blocks), apart from the launch so
// that it can be checked without a GPU (tests/test_headers_nvcc.py). The
// launch that uses it is C128Online::launch_pass in c128_online.cuh; the
// measurements behind it are in docs/PERF_LOG.md.
#pragma once

#include <sgl_kernel/utils.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "c128_prefill.cuh"

namespace flash_compress::c128 {

/// Channel slice widths a prefill pass may run with (PrefillLayout), widest
/// first, where a pass may run them (slice_fits). Every list of per-width
/// values below is indexed like this one.
inline constexpr std::array<uint32_t, 5> kSliceDims = {128, 64, 32, 16, 8};
inline constexpr size_t kNumSliceDims = kSliceDims.size();

/// The widest slice a write pass runs. Its segments are partial chunks, and
/// when it overlaps the compress pass's tail, its end is set by its longest
/// segment's chain of dependent loads, which 128-channel slices double
/// (head_dim 1024, 256 x 300 tokens on an H100: 224.9 -> 228.6 us in graph,
/// though each pass alone got faster). Compress passes stream whole chunks,
/// where 128-channel slices read 512 contiguous bytes a token and merge no
/// token lanes (8 x 16384: 369.7 -> 364.8 us). docs/PERF_LOG.md has the runs.
inline constexpr uint32_t kWidestWriteSlice = 64;

/// \brief Whether a pass at this head_dim may run slices of this width: they
/// must divide head_dim (128 needs a multiple of 128; every supported head_dim
/// is one of 64), and a write pass runs none wider than kWidestWriteSlice.
template <int64_t kHeadDim, bool kWritePass>
constexpr bool slice_fits(uint32_t slice_dim) {
  return kHeadDim % slice_dim == 0 && (!kWritePass || slice_dim <= kWidestWriteSlice);
}

/// \brief The widest slice a pass may run: the one it may always run.
template <int64_t kHeadDim, bool kWritePass>
constexpr uint32_t widest_slice() {
  for (const uint32_t slice_dim : kSliceDims) {
    if (slice_fits<kHeadDim, kWritePass>(slice_dim)) return slice_dim;
  }
  return 0;
}

/// \brief The width kSliceDims[kIndex] as a type, for code that needs it at
/// compile time (a kernel template argument).
template <size_t kIndex>
struct SliceWidth {
  static constexpr size_t kPosition = kIndex;
  static constexpr uint32_t kDim = kSliceDims[kIndex];
};

/// \brief `{f(SliceWidth<0>{}), f(SliceWidth<1>{}), ...}`: one value per width.
template <class F>
auto per_slice_width(F&& f) {
  return [&]<size_t... kIndex>(std::index_sequence<kIndex...>) {
    return std::array{f(SliceWidth<kIndex>{})...};
  }(std::make_index_sequence<kNumSliceDims>{});
}

/// \brief `f(SliceWidth<i>{})` for the i with kSliceDims[i] == `slice_dim`, where
/// `f` returns whether it could use that width; false if `slice_dim` is none of them.
template <class F>
bool with_slice_width(uint32_t slice_dim, F&& f) {
  return [&]<size_t... kIndex>(std::index_sequence<kIndex...>) {
    bool used = false;
    ((slice_dim == kSliceDims[kIndex] && (used = f(SliceWidth<kIndex>{}), true)) || ...);
    return used;
  }(std::make_index_sequence<kNumSliceDims>{});
}

/// \brief Whether a grid of `blocks` blocks, out of `resident` that fit the
/// GPU at once, leaves room for a second grid as large beside it: the test
/// behind a write pass starting beside its compress pass, a padding scan by
/// lanes, and an early launch that only hides the next kernel's.
constexpr bool fills_at_most_half(int64_t blocks, int64_t resident) { return 2 * blocks <= resident; }

/// \brief The rows of a pass that may be live (split into slices) and, of
/// those, the ones likely live, for a plan of `num_rows` rows over a call of
/// `num_tokens` tokens from `batch_size` requests.
struct PassRows {
  int64_t split;
  int64_t likely;
};

/// \brief PassRows of a compress or a write pass. A request has at most one
/// write row, and a compress row per chunk its tokens close, so however far
/// a CUDA-graph plan is padded its pass has no more live rows than that, all
/// of them first. Such a plan has a row per token; its compress pass then
/// likely has about a row per chunk of tokens, where the bound also counts a
/// row per request, and its write pass a row per request. An exact plan with
/// a row per token (every token closing a chunk) is taken for one: the
/// likely rows only break ties in chain, so it keeps its chain.
template <bool kWritePass>
constexpr PassRows pass_rows(int64_t num_rows, int64_t num_tokens, int64_t batch_size) {
  const int64_t bound = kWritePass ? batch_size : num_tokens / kC128ChunkSize + batch_size;
  const int64_t split = std::min(num_rows, bound);
  const bool padded = num_rows == num_tokens;
  const int64_t chunks_of_tokens = (num_tokens + kC128ChunkSize - 1) / kC128ChunkSize;
  return PassRows{.split = split, .likely = padded && !kWritePass ? std::min(split, chunks_of_tokens) : split};
}

/// \brief Whether the compress pass of a call whose write pass follows it
/// leaves half the GPU to that write pass (choose_slice_width's `leave_half`):
/// an exact plan (not a row per token) of `num_tokens` tokens from more
/// requests than it has chunks of tokens, whose write rows then average under a
/// chunk and are mostly short. Its write pass, launched early, starts on the
/// free half instead of waiting for a compress grid that fills the GPU. A
/// padded plan is left as it is: its compress grid's blocks that hold only
/// padding exit at once, which gives the write pass the same room. Head_dim
/// 512, 1 x 8192 + 255 x 1 tokens: the compress pass at 32 channels on 512
/// blocks instead of 16 on 1024, 13.77 -> 11.09 us on an H100 (the padded
/// plan's 12.20); shapes with many short requests within 1.5% but head_dim 128
/// 512 x 64, 10.82 -> 9.53 (docs/PERF_LOG.md).
constexpr bool leaves_room_for_write_pass(int64_t num_rows, int64_t num_tokens, int64_t batch_size) {
  return num_rows != num_tokens && batch_size > num_tokens / kC128ChunkSize;
}

/// Rounds of plan decoding (32 items per warp each) a narrow pass may spend
/// on a padded plan before its extra rounds cost more than they save.
inline constexpr int64_t kMaxNarrowScanRounds = 4;

/// The most rows a compress pass may split into 8-channel slices (its split
/// rows: a padded plan's bound, since its likely rows only break ties). Their
/// chain is half that of 16-channel slices, yet past a few rows they measured
/// slower: on an H200, head_dim 128 1 x 128 + 1 x 1 tokens (one compress row)
/// took 3.48 us at 8 channels against 4.11 at 16, head_dim 256 8 x 130 (8
/// rows) 5.75 against 6.01, but head_dim 128 1 x 2048 + 63 x 1 (16 rows) 5.64
/// against 5.20, and head_dim 256's 6.35 against 5.90. Write passes, whose
/// segments are partial chunks, kept the gain past that (head_dim 128, 16 x
/// 2048 tokens, 16 write rows: 10.87 against 11.72). Landed on an H100: the
/// moved passes 0.2-0.55 us faster, but 2 x 1000 + 100 x 1 (17 rows) 0.1
/// slower at head_dim 128 and 256. docs/PERF_LOG.md.
inline constexpr int64_t kMaxEightChannelCompressRows = 8;

/// \brief How a pass would run at one slice width, as the host can judge
/// it from counts alone (the segments' lengths are on the device).
struct SliceOption {
  uint32_t slice_dim;
  int64_t blocks;    // its grid
  int64_t resident;  // its blocks that fit the GPU at once
  /// Rounds of dependent token loads of its busiest warp, every segment a
  /// full chunk: waves of items times the rounds one item takes.
  int64_t chain;
  /// The same with only the pass's likely live rows (those of a padded plan
  /// are only bounded): what breaks a tie in chain.
  int64_t likely_chain;
  /// Whether the likely rows' items fill at most half the warps: a pass
  /// that small waits on load latency rather than bandwidth.
  bool few_likely_items;
  /// Whether the pass may run it: its warps must skip the padding rows of
  /// a CUDA-graph plan quickly enough (the widest always may), and 8-channel
  /// slices need a pass so small that their items fill at most a quarter of
  /// the warps (and a compress pass of at most kMaxEightChannelCompressRows
  /// split rows). Where they fill more, the pass moves enough bytes that
  /// 32-byte runs cost more than the rounds they save, and its grid leaves
  /// no room for a write pass beside it (head_dim 256, 1 x 8192 + 255 x 1
  /// tokens: 10.1 -> 13.3 us).
  bool eligible;
};

/// \brief The grid of a pass of `items` items, the first `split_items` of
/// them split rows, at `warps_per_block`: one warp per item up to a full GPU;
/// beyond that warps loop (a grid of mostly-idle blocks would only cost
/// launch and scheduling time). Where that grid takes over half the GPU, so
/// that no write pass fits beside it, padding rows get lanes instead of
/// warps: a warp's 32 lanes decode 32 of them a round, so one warp per split
/// item, or per 32 items if more, covers them in a round. Smaller grids keep
/// a warp per item: shrinking them frees no room a write pass lacks (head_dim
/// 128, 1 x 128 + 1 x 1 tokens in a CUDA-graph plan, 87 + 80 blocks: 3.74 ->
/// 3.99 us on an H100 when both shrank; docs/PERF_LOG.md).
inline int64_t pass_blocks(int64_t split_items, int64_t items, int64_t warps_per_block, int64_t resident) {
  using host::div_ceil;
  const int64_t per_item = std::min(div_ceil(items, warps_per_block), resident);
  if (fills_at_most_half(per_item, resident)) return per_item;
  const int64_t scanning_warps = std::max<int64_t>(split_items, div_ceil(items, ::device::kWarpThreads));
  return std::min(div_ceil(scanning_warps, warps_per_block), resident);
}

/// \brief A pass of `split_rows` rows split into slices (every live row
/// among them, `likely_rows` of them likely live) and `other_rows` rows
/// that are not (CUDA-graph padding) at `kSliceDim` channels, `resident` of
/// whose blocks fit the GPU at once.
template <int64_t kHeadDim, bool kWritePass, uint32_t kSliceDim>
SliceOption slice_option(int64_t split_rows, int64_t likely_rows, int64_t other_rows, int64_t resident) {
  if constexpr (!slice_fits<kHeadDim, kWritePass>(kSliceDim)) {
    return SliceOption{
        .slice_dim = kSliceDim,
        .blocks = 0,
        .resident = resident,
        .chain = 0,
        .likely_chain = 0,
        .few_likely_items = false,
        .eligible = false};
  } else {
    using Layout = PrefillLayout<kHeadDim, kSliceDim>;
    constexpr int64_t kRoundTokens = Layout::kTokenLanes * Layout::kBatch;
    constexpr int64_t kRoundsPerChunk = host::div_ceil(kC128ChunkSize, kRoundTokens);
    const int64_t warps = resident * Layout::kWarps;
    const auto chain_of = [&](int64_t rows) {
      return host::div_ceil(rows * Layout::kSlices, warps) * kRoundsPerChunk;
    };
    const auto items = static_cast<int64_t>(pass_items(split_rows, other_rows, Layout::kSlices));
    // Every warp decodes 32 items per round, padding rows included.
    const int64_t scan_rounds = items / (warps * ::device::kWarpThreads);
    const bool eight_channels_fit =
        4 * items <= warps && (kWritePass || split_rows <= kMaxEightChannelCompressRows);
    return SliceOption{
        .slice_dim = kSliceDim,
        .blocks = pass_blocks(split_rows * Layout::kSlices, items, Layout::kWarps, resident),
        .resident = resident,
        .chain = chain_of(split_rows),
        .likely_chain = chain_of(likely_rows),
        .few_likely_items = 2 * likely_rows * Layout::kSlices <= warps,
        .eligible = kSliceDim == widest_slice<kHeadDim, kWritePass>() ||
                    (scan_rounds <= kMaxNarrowScanRounds && (kSliceDim != kSliceDims.back() || eight_channels_fit)),
    };
  }
}

/// \brief Of the options that `fits`, widest first, the one with the
/// shortest chain: a narrower slice must cut it, and one of 64-byte runs
/// or shorter (16 or 8 float32 channels) must halve the shortest chain of
/// the longer-run widths, because where a pass streams at the bandwidth
/// limit such runs move fewer bytes per DRAM burst (head_dim 512, 8 x
/// 16384 tokens: 127 us with 64-channel slices, 131 with 32, 173 with 16).
/// A tie in chain goes to the shorter likely chain, which 64-byte runs must
/// halve in the same way, and only for a pass whose likely items fill at
/// most half the warps. A padded plan's bound ties where its likely rows do
/// not: head_dim 512, 1 x 2048 + 63 x 1 tokens, 80 rows bound, 17 likely, ran
/// 9.60 -> 8.40 us at 16 channels instead of 32 on an H100; head_dim 1024,
/// 1 x 4096 + 31 x 1, whose 16-channel items would fill every warp, went
/// 13.50 -> 15.41 at 16 channels (docs/PERF_LOG.md).
/// Null if none fits.
template <class Fits>
const SliceOption* shortest_chain(const std::array<SliceOption, kNumSliceDims>& options, Fits fits) {
  const SliceOption* best = nullptr;
  for (const SliceOption& option : options) {
    if (!option.eligible || !fits(option)) continue;
    if (best == nullptr) {
      best = &option;
      continue;
    }
    const bool short_runs = option.slice_dim * sizeof(float) <= 64;
    const bool best_short_runs = best->slice_dim * sizeof(float) <= 64;
    const bool shorter = short_runs && !best_short_runs
                             ? 2 * option.chain <= best->chain ||
                                   (option.chain == best->chain && option.few_likely_items &&
                                    2 * option.likely_chain <= best->likely_chain)
                             : option.chain < best->chain ||
                                   (option.chain == best->chain && option.likely_chain < best->likely_chain);
    if (shorter) best = &option;
  }
  return best;
}

/// \brief The width a pass of `split_rows` + `other_rows` rows runs with,
/// `likely_rows` of the split ones likely live, `resident[i]` blocks of
/// width kSliceDims[i] fitting the GPU at once.
/// Wide slices read whole 256-byte runs per token, but give a pass of few
/// rows few items, each a long chain of dependent loads; each halving of the
/// width doubles the items and the token lanes per segment, and halves the
/// rounds of loads one item takes. The width is the one whose busiest warp
/// has the shortest chain (shortest_chain): this counts waves as well, so
/// that 593 compress rows at head_dim 512 run 32-channel slices (5 waves of
/// 8 rounds; 64-channel ones would take 3 waves of 16), 256 rows 64-channel
/// ones (one wave of 16 either way). A write pass that starts `beside` a
/// compress pass runs alongside it where its grid fits in the slots that
/// pass leaves free, if the two chains side by side take no longer than
/// the two in turn (head_dim 128, 256 x 300 tokens: 28.6 -> 25.9 us with
/// 64-channel slices beside the compress pass where 16-channel ones ran
/// after it). A padded plan's split rows are a bound on its live ones, and
/// where the bound fills the GPU in whole waves every width has the same
/// chain; such a tie goes to the width with the shortest chain for its
/// likely rows (head_dim 1024, 4 x 300 + 1000 x 1 tokens from random
/// prefixes in a CUDA-graph plan, 20 live compress rows of a bound of 1021:
/// 43.8 -> 35.9 us on an H100 as 32-channel slices replaced 128-channel ones).
/// A compress pass told to `leave_half` (leaves_room_for_write_pass) takes
/// the shortest chain among the widths whose grid fills at most half the
/// GPU, where one does.
template <int64_t kHeadDim, bool kWritePass>
SliceOption choose_slice_width(int64_t split_rows, int64_t likely_rows, int64_t other_rows,
                               const std::array<int64_t, kNumSliceDims>& resident, const SliceOption* beside,
                               bool leave_half) {
  const auto options = per_slice_width([&]<class Width>(Width) {
    return slice_option<kHeadDim, kWritePass, Width::kDim>(split_rows, likely_rows, other_rows,
                                                           resident[Width::kPosition]);
  });
  const auto leaves_half = [](const SliceOption& o) { return fills_at_most_half(o.blocks, o.resident); };
  const SliceOption* chosen = leave_half ? shortest_chain(options, leaves_half) : nullptr;
  if (chosen == nullptr) chosen = shortest_chain(options, [](const SliceOption&) { return true; });
  if (beside != nullptr && beside->blocks > 0) {
    const SliceOption* fitting =
        shortest_chain(options, [&](const SliceOption& o) { return o.blocks + beside->blocks <= o.resident; });
    if (fitting != nullptr && std::max(fitting->chain, beside->chain) <= beside->chain + chosen->chain) {
      chosen = fitting;
    }
  }
  return *chosen;
}

}  // namespace flash_compress::c128
