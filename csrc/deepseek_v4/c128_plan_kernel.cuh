// The online c128 compressor's prefill planner, device side: the row formulas
// both planners share (`__host__ __device__`), and the GPU planner kernel that
// plans CUDA lengths on the current stream without a host sync (so it can be
// captured in a CUDA graph), reporting invalid input through an error flag.
// The host planner, the argument checks, the launch and the exports are in
// c128_plan.cuh.
#pragma once

#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/utils.cuh>

#include <cstdint>

namespace flash_compress::c128 {

using device::compress::kC128ChunkSize;
using device::compress::kMaxPlanLength;
using device::compress::kPlanSentinel;
using device::compress::PrefillPlan;

// ---------------------------------------------------------------------------
// Row formulas, shared by both planners. Request b's new tokens are positions
// [prefix, seq_len) and ragged rows [ragged_start, ragged_start + extend_len).
// A segment ends at a chunk's last position (a compress row) or at seq_len
// (the trailing partial segment, the request's only write row). 64-bit on
// purpose: the chunk end after a seq_len near 2^32 overflows uint32.
// ---------------------------------------------------------------------------

/// \brief Chunks the request closes: positions `128k + 127` in `[prefix, seq_len)`.
__host__ __device__ inline int64_t compress_rows_of(int64_t prefix, int64_t seq_len) {
  return seq_len / kC128ChunkSize - prefix / kC128ChunkSize;
}

/// \brief Whether the request ends inside a chunk, leaving a state to store.
__host__ __device__ inline bool has_write_row(int64_t seq_len) { return seq_len % kC128ChunkSize != 0; }

/// \brief The row of a segment `[begin, last]` that starts at or after `prefix`.
__host__ __device__ inline PrefillPlan segment_row(int64_t prefix, int64_t ragged_start, int64_t batch, int64_t begin,
                                                   int64_t last) {
  return PrefillPlan{
      .ragged_id = static_cast<uint32_t>(ragged_start + (last - prefix)),
      .batch_id = static_cast<uint32_t>(batch),
      .position = static_cast<uint32_t>(last),
      .window_len = static_cast<uint32_t>(last - begin + 1),
  };
}

/// \brief The request's k-th compress row (`0 <= k < compress_rows_of(...)`).
__host__ __device__ inline PrefillPlan compress_row_of(int64_t prefix, int64_t ragged_start, int64_t batch,
                                                       int64_t k) {
  const int64_t last = (prefix / kC128ChunkSize + k) * kC128ChunkSize + (kC128ChunkSize - 1);
  const int64_t chunk_begin = last - (kC128ChunkSize - 1);
  return segment_row(prefix, ragged_start, batch, prefix > chunk_begin ? prefix : chunk_begin, last);
}

/// \brief The request's write row (only when `has_write_row(seq_len)`).
__host__ __device__ inline PrefillPlan write_row_of(int64_t prefix, int64_t seq_len, int64_t ragged_start,
                                                    int64_t batch) {
  const int64_t last = seq_len - 1;
  const int64_t chunk_begin = last / kC128ChunkSize * kC128ChunkSize;
  return segment_row(prefix, ragged_start, batch, prefix > chunk_begin ? prefix : chunk_begin, last);
}


// ---------------------------------------------------------------------------
// GPU planner.
//
// One kernel. Every block scans the whole batch (in tiles of kPlanTile
// requests, carrying the running sums): request b's compress rows start at
// the exclusive prefix sum of closed-chunk counts, its write row at the prefix
// sum of has-write flags, its ragged rows at the prefix sum of extend_lens.
// Redundant scans cost L2 reads only and spare a grid-wide sync or a scratch
// buffer; the batch totals they end with tell every block whether the input
// is valid before it writes anything. Then the blocks share the writes: the
// rows of each tile (a binary search over the tile's row offsets maps a row
// to its request), then the sentinel padding up to M.
// ---------------------------------------------------------------------------

/// Error flag bits (counts[2]; 0 means the plan is valid), set independently
/// by whichever conditions hold. On any error both plans are all sentinel rows
/// and counts[0] = counts[1] = 0.
inline constexpr uint32_t kPlanErrorExtendNotPositive = 1;  // some extend_len < 1
inline constexpr uint32_t kPlanErrorExtendExceedsSeq = 2;   // some extend_len > seq_len
inline constexpr uint32_t kPlanErrorSeqTooLong = 4;         // some seq_len > 2^32 - 2
inline constexpr uint32_t kPlanErrorSumMismatch = 8;        // sum(extend_lens) != M

inline constexpr uint32_t kPlanThreads = 512;
inline constexpr uint32_t kPlanItems = 4;  // consecutive requests per thread in a tile
inline constexpr uint32_t kPlanTile = kPlanThreads * kPlanItems;
inline constexpr uint32_t kPlanWarps = kPlanThreads / device::kWarpThreads;

/// \brief A device array of int32 or int64 lengths, read as int64.
struct DeviceLengths {
  const void* data;
  bool is_int32;

  SGL_DEVICE int64_t operator[](int64_t i) const {
    return is_int32 ? static_cast<const int32_t*>(data)[i] : static_cast<const int64_t*>(data)[i];
  }
};

struct GpuPlanParams {
  DeviceLengths extend_lens;  // [B]
  DeviceLengths seq_lens;     // [B]
  PrefillPlan* __restrict__ compress_plan;  // [M]
  PrefillPlan* __restrict__ write_plan;     // [M]
  void* counts;                             // [3] int32 or int64 (num_compress, num_write, error), or null
  bool counts_int64;
  int64_t batch_size;
  int64_t num_rows;
};

/// \brief One request, checked: what the scan needs and the row formulas read.
/// An invalid request has no rows (its row fields are 0).
struct RequestCut {
  int64_t tokens;         // its extend_len, clamped so that any batch's sum fits int64
  uint32_t prefix;        // position of its first new token
  uint32_t extend_len;
  uint32_t compress_rows;
  uint32_t write_rows;    // 0 or 1
  uint32_t errors;        // kPlanError* bits
};

/// Beyond this magnitude an extend_len is flagged anyway (bit 1, 2 or 4); the
/// clamp keeps the sum over up to 2^29 requests within int64, and exact where
/// no term is clamped. Beside a clamped term the sum check may miss or fire
/// (terms of opposite signs cancel): the plan is all padding either way.
inline constexpr int64_t kTokenClamp = int64_t{1} << 33;
inline constexpr int64_t kMaxPlanBatch = int64_t{1} << 29;

SGL_DEVICE RequestCut cut_request(int64_t extend_len, int64_t seq_len) {
  uint32_t errors = 0;
  if (extend_len < 1) errors |= kPlanErrorExtendNotPositive;
  if (extend_len > seq_len) errors |= kPlanErrorExtendExceedsSeq;
  if (seq_len > kMaxPlanLength) errors |= kPlanErrorSeqTooLong;
  const int64_t tokens = max(-kTokenClamp, min(kTokenClamp, extend_len));
  if (errors != 0) return RequestCut{tokens, 0, 0, 0, 0, errors};
  const int64_t prefix = seq_len - extend_len;
  return RequestCut{
      .tokens = tokens,
      .prefix = static_cast<uint32_t>(prefix),
      .extend_len = static_cast<uint32_t>(extend_len),
      .compress_rows = static_cast<uint32_t>(compress_rows_of(prefix, seq_len)),
      .write_rows = has_write_row(seq_len) ? 1u : 0u,
      .errors = 0,
  };
}

/// \brief Prefix sums over requests. Row counts share one 64-bit word
/// (compress rows high, write rows low): the low half never carries, since
/// it counts at most one row per request.
struct PlanSums {
  int64_t tokens;
  uint64_t rows;
  uint32_t errors;

  SGL_DEVICE int64_t compress_rows() const { return static_cast<int64_t>(rows >> 32); }
  SGL_DEVICE int64_t write_rows() const { return static_cast<int64_t>(rows & 0xffffffffu); }
};

SGL_DEVICE PlanSums sums_of(const RequestCut& cut) {
  return PlanSums{cut.tokens, (static_cast<uint64_t>(cut.compress_rows) << 32) | cut.write_rows, cut.errors};
}

SGL_DEVICE PlanSums combine(const PlanSums& a, const PlanSums& b) {
  return PlanSums{a.tokens + b.tokens, a.rows + b.rows, a.errors | b.errors};
}

SGL_DEVICE PlanSums shuffle_up(const PlanSums& v, uint32_t delta) {
  constexpr uint32_t kAll = 0xffffffffu;
  return PlanSums{__shfl_up_sync(kAll, v.tokens, delta), __shfl_up_sync(kAll, v.rows, delta),
                  __shfl_up_sync(kAll, v.errors, delta)};
}

/// \brief Inclusive scan over the warp's lanes.
SGL_DEVICE PlanSums warp_inclusive_scan(PlanSums v) {
  const uint32_t lane = threadIdx.x % device::kWarpThreads;
#pragma unroll
  for (uint32_t delta = 1; delta < device::kWarpThreads; delta *= 2) {
    const PlanSums up = shuffle_up(v, delta);
    if (lane >= delta) v = combine(up, v);
  }
  return v;
}

struct ScanScratch {
  PlanSums warp_totals[kPlanWarps];
  PlanSums warp_prefixes[kPlanWarps];
  PlanSums block_total;
};

/// \brief Exclusive scan over the block's threads; `total` gets the block's sum.
/// Two barriers, and the two arrays are never written and read between the
/// same pair, so back-to-back scans need no extra barrier.
SGL_DEVICE PlanSums block_exclusive_scan(const PlanSums& v, ScanScratch& scratch, PlanSums& total) {
  const uint32_t lane = threadIdx.x % device::kWarpThreads;
  const uint32_t warp = threadIdx.x / device::kWarpThreads;
  const PlanSums inclusive = warp_inclusive_scan(v);
  PlanSums exclusive = shuffle_up(inclusive, 1);
  if (lane == 0) exclusive = PlanSums{0, 0, 0};
  if (lane == device::kWarpThreads - 1) scratch.warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const PlanSums mine = lane < kPlanWarps ? scratch.warp_totals[lane] : PlanSums{0, 0, 0};
    const PlanSums warps_inclusive = warp_inclusive_scan(mine);
    PlanSums warps_exclusive = shuffle_up(warps_inclusive, 1);
    if (lane == 0) warps_exclusive = PlanSums{0, 0, 0};
    if (lane < kPlanWarps) scratch.warp_prefixes[lane] = warps_exclusive;
    if (lane == kPlanWarps - 1) scratch.block_total = warps_inclusive;
  }
  __syncthreads();
  total = scratch.block_total;
  return combine(scratch.warp_prefixes[warp], exclusive);
}

/// \brief One thread's requests of a tile, with everything before each of them.
struct TileScan {
  RequestCut cuts[kPlanItems];
  PlanSums before[kPlanItems];  // sums over all earlier requests of the batch
  PlanSums end;                 // sums over the batch up to the tile's end
};

/// \brief Loads and scans tile `tile`; `carry` is the sum over earlier tiles.
SGL_DEVICE TileScan scan_tile(const GpuPlanParams& params, int64_t tile, const PlanSums& carry,
                              ScanScratch& scratch) {
  TileScan scan;
  const int64_t first = tile * kPlanTile + static_cast<int64_t>(threadIdx.x) * kPlanItems;
  PlanSums mine{0, 0, 0};
#pragma unroll
  for (uint32_t i = 0; i < kPlanItems; ++i) {
    const int64_t b = first + i;
    scan.cuts[i] = b < params.batch_size ? cut_request(params.extend_lens[b], params.seq_lens[b])
                                         : RequestCut{0, 0, 0, 0, 0, 0};
    mine = combine(mine, sums_of(scan.cuts[i]));
  }
  PlanSums tile_total;
  PlanSums before = combine(carry, block_exclusive_scan(mine, scratch, tile_total));
#pragma unroll
  for (uint32_t i = 0; i < kPlanItems; ++i) {
    scan.before[i] = before;
    before = combine(before, sums_of(scan.cuts[i]));
  }
  scan.end = combine(carry, tile_total);
  return scan;
}

/// \brief What the compress-row writers need of each request of a tile.
struct TileRequests {
  uint32_t first_compress_row[kPlanTile];
  uint32_t ragged_start[kPlanTile];
  uint32_t prefix[kPlanTile];
};

/// \brief The last request in `[0, count)` whose first compress row is at
/// most `row` (a request without compress rows shares its successor's first
/// row, so it is never the one found for a row inside the tile's range).
SGL_DEVICE uint32_t find_request(const uint32_t* first_row, uint32_t count, uint32_t row) {
  uint32_t lo = 0;
  while (count > 1) {
    const uint32_t half = count / 2;
    if (first_row[lo + half] <= row) {
      lo += half;
      count -= half;
    } else {
      count = half;
    }
  }
  return lo;
}

static_assert(sizeof(uint4) == device::compress::kPrefillPlanBytes, "a plan row is stored as one uint4");

SGL_DEVICE void store_row(PrefillPlan* plan, int64_t index, const PrefillPlan& row) {
  // One 16-byte store: rows are 16-byte aligned (checked on the host).
  *reinterpret_cast<uint4*>(plan + index) = make_uint4(row.ragged_id, row.batch_id, row.position, row.window_len);
}

/// \brief This thread's share of rows `[begin, end)` of a grid-wide range.
struct GridStride {
  int64_t first;
  int64_t step;

  SGL_DEVICE static GridStride of_thread() {
    return GridStride{static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                      static_cast<int64_t>(gridDim.x) * blockDim.x};
  }
};

SGL_DEVICE void fill_sentinel_rows_on_grid(PrefillPlan* plan, int64_t begin, int64_t end) {
  const GridStride stride = GridStride::of_thread();
  const uint4 padding = make_uint4(kPlanSentinel, kPlanSentinel, kPlanSentinel, kPlanSentinel);
  for (int64_t r = begin + stride.first; r < end; r += stride.step) {
    *reinterpret_cast<uint4*>(plan + r) = padding;
  }
}

/// \brief Writes the rows of one scanned tile. Write rows: one per request,
/// by the block the tile is assigned to. Compress rows: spread over the grid.
/// Starts and ends with the tile's requests published in / released from
/// shared memory (a barrier each).
SGL_DEVICE void write_tile_rows(const GpuPlanParams& params, int64_t tile, const TileScan& scan,
                                const PlanSums& tile_begin, TileRequests& requests) {
  const int64_t tile_first = tile * kPlanTile;
  const auto count = static_cast<uint32_t>(std::min<int64_t>(kPlanTile, params.batch_size - tile_first));
  const bool writes_write_rows = tile % gridDim.x == blockIdx.x;
#pragma unroll
  for (uint32_t i = 0; i < kPlanItems; ++i) {
    const uint32_t local = threadIdx.x * kPlanItems + i;
    if (local >= count) break;
    const RequestCut& cut = scan.cuts[i];
    const PlanSums& before = scan.before[i];
    requests.first_compress_row[local] = static_cast<uint32_t>(before.compress_rows());
    requests.ragged_start[local] = static_cast<uint32_t>(before.tokens);
    requests.prefix[local] = cut.prefix;
    if (writes_write_rows && cut.write_rows != 0) {
      const int64_t seq_len = static_cast<int64_t>(cut.prefix) + cut.extend_len;
      store_row(params.write_plan, before.write_rows(),
                write_row_of(cut.prefix, seq_len, before.tokens, tile_first + local));
    }
  }
  __syncthreads();
  const GridStride stride = GridStride::of_thread();
  for (int64_t r = tile_begin.compress_rows() + stride.first; r < scan.end.compress_rows(); r += stride.step) {
    const uint32_t local = find_request(requests.first_compress_row, count, static_cast<uint32_t>(r));
    const int64_t k = r - requests.first_compress_row[local];
    store_row(params.compress_plan, r,
              compress_row_of(requests.prefix[local], requests.ragged_start[local], tile_first + local, k));
  }
  __syncthreads();
}

SGL_DEVICE void store_counts(const GpuPlanParams& params, int64_t num_compress, int64_t num_write, uint32_t errors) {
  if (params.counts == nullptr || blockIdx.x != 0 || threadIdx.x != 0) return;
  if (params.counts_int64) {
    auto* counts = static_cast<int64_t*>(params.counts);
    counts[0] = num_compress;
    counts[1] = num_write;
    counts[2] = errors;
  } else {
    auto* counts = static_cast<int32_t*>(params.counts);
    counts[0] = static_cast<int32_t>(num_compress);
    counts[1] = static_cast<int32_t>(num_write);
    counts[2] = static_cast<int32_t>(errors);
  }
}

template <bool kUsePDL>
__global__ void __launch_bounds__(kPlanThreads)
    plan_online_prefill_kernel(const __grid_constant__ GpuPlanParams params) {
  __shared__ ScanScratch scratch;
  __shared__ TileRequests requests;
  // The lengths may come from the previous kernel, and that kernel may still
  // read the plans this one overwrites.
  device::PDLWaitPrimary<kUsePDL>();

  // Pass 1: batch totals. A one-tile batch keeps its scan for pass 2.
  const int64_t num_tiles = (params.batch_size + kPlanTile - 1) / kPlanTile;
  PlanSums total{0, 0, 0};
  TileScan first_tile{};
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    const TileScan scan = scan_tile(params, tile, total, scratch);
    if (tile == 0) first_tile = scan;
    total = scan.end;
  }
  // The next kernel may launch once the lengths are consumed (docs/SPEC.md
  // section 5): now for a one-tile batch, whose rows come from the scan it
  // keeps; after pass 2, which reads them again, for a larger one.
  if (num_tiles == 1) device::PDLTriggerSecondary<kUsePDL>();

  uint32_t errors = total.errors;
  if (total.tokens != params.num_rows) errors |= kPlanErrorSumMismatch;
  const int64_t num_compress = errors != 0 ? 0 : total.compress_rows();
  const int64_t num_write = errors != 0 ? 0 : total.write_rows();
  store_counts(params, num_compress, num_write, errors);
  fill_sentinel_rows_on_grid(params.compress_plan, num_compress, params.num_rows);
  fill_sentinel_rows_on_grid(params.write_plan, num_write, params.num_rows);
  if (errors != 0) return;  // block-uniform: every block scanned the same totals

  // Pass 2: the rows.
  if (num_tiles == 1) {
    write_tile_rows(params, 0, first_tile, PlanSums{0, 0, 0}, requests);
    return;
  }
  PlanSums carry{0, 0, 0};
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    const TileScan scan = scan_tile(params, tile, carry, scratch);
    write_tile_rows(params, tile, scan, carry, requests);
    carry = scan.end;
  }
  device::PDLTriggerSecondary<kUsePDL>();
}

}  // namespace flash_compress::c128
