// DeepSeek-V4's online 128-token KV compressor: decode and two-pass prefill
// (the planner that feeds prefill is c128_plan.cuh).
//
// Every request slot keeps a running softmax state `[max | sum | kv]` of
// 3*D values (kv is the normalised weighted mean), float32 or bfloat16
// (docs/SPEC.md section 8): arithmetic is float32 either way, and a bfloat16
// state is rounded once per store. Channels are independent, so every thread
// owns 4 consecutive channels and works on float4 vectors.
#pragma once

#include <dlpack/dlpack.h>
#include <sgl_kernel/async_copy.cuh>
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include "c128_plan.cuh"
#include "c128_state.cuh"
#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/tensor.h>
#include <sgl_kernel/tile.cuh>
#include <sgl_kernel/type.cuh>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>
#include <sgl_kernel/vec.cuh>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/container/tuple.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace flash_compress::c128 {

using device::compress::kC128ChunkSize;
using device::compress::kPlanSentinel;
using device::compress::PrefillPlan;

// ---------------------------------------------------------------------------
// Decode: one token per request.
// ---------------------------------------------------------------------------

template <typename StateT>
struct DecodeParams {
  StateT* __restrict__ state;              // [num_slots, 3D]
  const float* __restrict__ input;         // [B, 2D]  | kv | score |
  float* __restrict__ output;              // [B, D]
  const float* __restrict__ ape;           // [128, D]
  const int32_t* __restrict__ indices;     // [B]
  const int32_t* __restrict__ seq_lens;    // [B]
  uint32_t batch_size;
  int32_t num_slots;
};

template <int64_t kHeadDim>
struct DecodeLayout {
  static constexpr uint32_t kLanes = kHeadDim / kVecWidth;  // threads per request
  /// A block holds blockDim.x / kLanes requests, chosen per launch
  /// (C128Online::run_decode) up to this many threads.
  static constexpr uint32_t kMaxThreads = kLanes > 256 ? kLanes : 256;
  static constexpr uint32_t kMaxRequestsPerBlock = kMaxThreads / kLanes;
  /// At least a warp per block.
  static constexpr uint32_t kMinRequestsPerBlock = kLanes >= device::kWarpThreads ? 1 : device::kWarpThreads / kLanes;
};

/// \brief What one thread reads for one request's 4 channels.
template <typename StateT>
struct DecodeLoads {
  Vec kv, score, bias;
  SoftmaxState old;
  StateT* state;  // the request's slot; null if the request is skipped
  uint32_t pos;   // position of the new token in its chunk
};

template <int64_t kHeadDim, typename StateT>
SGL_DEVICE DecodeLoads<StateT> load_decode_request(const DecodeParams<StateT>& params, uint32_t request,
                                                   uint32_t lane) {
  DecodeLoads<StateT> in;
  in.state = nullptr;
  if (request >= params.batch_size) return in;
  // The token's row is read before its slot and position are known (and
  // even if they turn out bad): its loads then overlap theirs instead of
  // waiting a round trip for them.
  const float* token = params.input + static_cast<int64_t>(request) * (2 * kHeadDim) + lane * kVecWidth;
  in.kv.load(token);
  in.score.load(token + kHeadDim);
  const int32_t slot = params.indices[request];
  const int32_t seq_len = params.seq_lens[request];
  // Values the host cannot check without a sync: such a request is skipped.
  if (seq_len < 1 || slot < 0 || slot >= params.num_slots) return in;
  in.pos = static_cast<uint32_t>(seq_len - 1) % kC128ChunkSize;
  in.state = params.state + static_cast<int64_t>(slot) * (3 * kHeadDim) + lane * kVecWidth;
  in.bias.load(params.ape + in.pos * kHeadDim + lane * kVecWidth);
  // The first token of a chunk replaces the state unread.
  if (in.pos != 0) in.old = load_state(in.state, kHeadDim);
  return in;
}

template <int64_t kHeadDim, typename StateT>
SGL_DEVICE void finish_decode_request(const DecodeParams<StateT>& params, const DecodeLoads<StateT>& in,
                                      uint32_t request, uint32_t lane) {
  if (in.state == nullptr) return;
  Vec s;
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) s[c] = in.score[c] + in.bias[c];
  const SoftmaxState next = in.pos == 0 ? first_token_state(s, in.kv) : add_token(in.old, s, in.kv);
  if (in.pos == kC128ChunkSize - 1) {
    // The chunk is complete: emit it. The state is left alone because the
    // next chunk's first token replaces it unread.
    next.kv.store(params.output + static_cast<int64_t>(request) * kHeadDim + lane * kVecWidth);
  } else {
    store_state(in.state, kHeadDim, next);
  }
}

template <int64_t kHeadDim, bool kUsePDL, typename StateT>
__global__ void __launch_bounds__(DecodeLayout<kHeadDim>::kMaxThreads)
    c128_decode_kernel(const __grid_constant__ DecodeParams<StateT> params) {
  using Layout = DecodeLayout<kHeadDim>;
  const uint32_t lane = threadIdx.x % Layout::kLanes;
  const uint32_t request = blockIdx.x * (blockDim.x / Layout::kLanes) + threadIdx.x / Layout::kLanes;

  device::PDLWaitPrimary<kUsePDL>();
  // The next kernel may launch at once: its own wait holds it until this
  // whole grid has completed, so an early trigger only hides its launch.
  // (Measured: 512-request bf16 decode 2.48 -> 2.09 us, 64-request float32
  // 1.56 -> 1.40 us, the rest within noise; docs/PERF_LOG.md.)
  device::PDLTriggerSecondary<kUsePDL>();
  const DecodeLoads<StateT> loads = load_decode_request<kHeadDim>(params, request, lane);
  finish_decode_request<kHeadDim>(params, loads, request, lane);
}

// ---------------------------------------------------------------------------
// Prefill: two passes over plans of segments (each inside one chunk).
// ---------------------------------------------------------------------------

template <typename StateT>
struct PrefillParams {
  StateT* __restrict__ state;               // [num_slots, 3D]
  const float* __restrict__ input;          // [num_tokens, 2D]  | kv | score |
  float* __restrict__ output;               // [num_tokens, D], or [compress rows, D] if compact_output
  const float* __restrict__ ape;            // [128, D]
  const int32_t* __restrict__ indices;      // [B] slot each request stores to
  const int32_t* __restrict__ load_indices; // [B] slot each request reads from
  const PrefillPlan* __restrict__ plan;     // [num_rows] this pass's plan
  uint32_t num_rows;
  /// Rows [0, num_split_rows) are split into channel slices spread over
  /// warps. Rows past it can only be live in a plan whose CUDA-graph
  /// padding does not all trail its rows (the planners put it last): each
  /// costs one lane of one load, and a live one runs all its slices on the
  /// warp that found it.
  uint32_t num_split_rows;
  uint32_t num_tokens;
  uint32_t batch_size;
  int32_t num_slots;
  /// The compress pass writes plan row i's result to output row i
  /// (run_prefill_compact) instead of row ragged_id.
  bool compact_output;
  /// Set on both passes when both run. The compress pass then lets the write
  /// pass launch as soon as its own PDL wait returns, and the write pass
  /// waits only before it stores states: whatever it reads was complete
  /// before the compress pass passed that wait, and the compress pass
  /// writes nothing the write pass reads. Its blocks thus fill the SMs the
  /// compress pass's tail leaves idle.
  bool overlap_passes;
};

/// \brief Work items of a pass whose rows split into `slices` channel slices.
template <typename StateT>
__host__ __device__ inline uint64_t pass_items(const PrefillParams<StateT>& params, uint32_t slices) {
  return static_cast<uint64_t>(params.num_split_rows) * slices + (params.num_rows - params.num_split_rows);
}

template <int64_t kHeadDim, uint32_t kSliceDim_>
struct PrefillLayout {
  static_assert(kSupportedHeadDim<kHeadDim>, "head_dim must be a multiple of 64 in [64, 1024]");
  /// A warp computes one slice of channels of one segment: no block-wide
  /// merge, no barrier, and every warp streams independently. The slice is
  /// chosen per pass (see C128Online::launch_pass): wide slices when there
  /// are many items, narrow ones when a pass has few rows, so that its warps
  /// split each segment's tokens over more lanes and finish in fewer rounds
  /// of dependent loads.
  static constexpr uint32_t kSliceDim = kSliceDim_;
  static_assert(kHeadDim % kSliceDim == 0 && kSliceDim % kVecWidth == 0);
  static constexpr uint32_t kSlices = kHeadDim / kSliceDim;
  static constexpr uint32_t kLanes = kSliceDim / kVecWidth;            // lanes per token of a slice
  static_assert(kLanes <= device::kWarpThreads && device::kWarpThreads % kLanes == 0);
  static constexpr uint32_t kTokenLanes = device::kWarpThreads / kLanes;  // tokens a warp reads at once
  /// Small blocks: a warp runs its own items, so a block holds its SM's
  /// registers until its slowest warp is done. Two warps per block hand them
  /// to the next pass (or call) almost as soon as each pair finishes.
  static constexpr uint32_t kThreads = 64;
  static constexpr uint32_t kWarps = kThreads / device::kWarpThreads;
  /// Tokens a lane computes on at once (a round).
  static constexpr uint32_t kBatch = 4;
  /// Rounds of token loads a lane has issued ahead, the one it computes on
  /// included: asynchronous copies into shared memory keep them in flight
  /// without registers, so the stream does not stall while a lane computes.
  static constexpr uint32_t kStages = 2;
  /// Dynamic shared memory of a block: every thread's ring of kStages
  /// rounds of kBatch (kv, score) vectors.
  static constexpr uint32_t kRingBytes = kStages * kBatch * 2 * sizeof(Vec) * kThreads;
  /// Keeps registers at or under 128, so that 16 warps fit per SM.
  static constexpr uint32_t kMinBlocksPerSM = 16 / kWarps;
};

/// Slice widths a pass may run with, widest first.
inline constexpr uint32_t kWideSliceDim = 64;
inline constexpr uint32_t kNarrowSliceDim = 16;
/// Rounds of plan decoding (32 items per warp each) a narrow pass may spend
/// on a padded plan before its extra rounds cost more than they save.
inline constexpr int64_t kMaxNarrowScanRounds = 4;

/// \brief One (segment, channel slice) a warp has to compute, decoded and
/// checked from its plan row.
struct SegmentWork {
  uint32_t last_row;     // ragged row of the segment's last token
  uint32_t first_pos;    // position in the chunk of the segment's first token
  uint32_t window_len;   // tokens in the segment
  uint32_t first_slice;  // channel slices [first_slice, end_slice)
  uint32_t end_slice;
  int32_t prior_slot;   // slot of the chunk's earlier tokens; -1 if the segment starts the chunk
  int32_t target;       // compress pass: output row; write pass: slot the state goes to
};

/// \brief Decodes a plan row. Sentinel rows (CUDA-graph padding) and rows the
/// kernel cannot execute safely (out-of-range rows, slots or request ids,
/// a segment that leaves its chunk, a row of the other pass) yield false and
/// are skipped: the host cannot see these values without a sync.
template <bool kWritePass, typename StateT>
SGL_DEVICE bool decode_segment(uint32_t row_index, uint32_t first_slice, uint32_t end_slice,
                               const PrefillParams<StateT>& params, SegmentWork& work) {
  const PrefillPlan row = params.plan[row_index];
  if (row.ragged_id == kPlanSentinel) return false;
  const uint32_t last_pos = row.position % kC128ChunkSize;
  const bool closes_chunk = last_pos == kC128ChunkSize - 1;
  if (closes_chunk == kWritePass) return false;
  if (row.window_len == 0 || row.window_len > last_pos + 1) return false;
  if (row.ragged_id >= params.num_tokens || row.ragged_id + 1 < row.window_len) return false;
  if (row.batch_id >= params.batch_size) return false;
  work.last_row = row.ragged_id;
  work.first_pos = last_pos + 1 - row.window_len;
  work.window_len = row.window_len;
  work.first_slice = first_slice;
  work.end_slice = end_slice;
  work.prior_slot = -1;
  if (work.first_pos != 0) {
    work.prior_slot = params.load_indices[row.batch_id];
    if (work.prior_slot < 0 || work.prior_slot >= params.num_slots) return false;
  }
  if constexpr (kWritePass) {
    work.target = params.indices[row.batch_id];
    if (work.target < 0 || work.target >= params.num_slots) return false;
  } else {
    work.target = static_cast<int32_t>(params.compact_output ? row_index : row.ragged_id);
  }
  return true;
}

/// \brief A thread's ring of token rounds in shared memory. Vector (stage, k,
/// part) of thread i sits at [(stage * kBatch + k) * 2 + part][i], so a warp's
/// 32 copies of one vector land in 512 contiguous bytes (no bank conflicts).
template <class Layout>
struct TokenRing {
  Vec* thread_base;

  SGL_DEVICE Vec* at(uint32_t round, uint32_t k, uint32_t part) const {
    return thread_base + (((round % Layout::kStages) * Layout::kBatch + k) * 2 + part) * Layout::kThreads;
  }
};

/// \brief Every lane gets lane `src`'s `work`.
SGL_DEVICE SegmentWork broadcast_work(const SegmentWork& work, uint32_t src) {
  constexpr uint32_t kAll = 0xffffffffu;
  return SegmentWork{
      .last_row = __shfl_sync(kAll, work.last_row, src),
      .first_pos = __shfl_sync(kAll, work.first_pos, src),
      .window_len = __shfl_sync(kAll, work.window_len, src),
      .first_slice = __shfl_sync(kAll, work.first_slice, src),
      .end_slice = __shfl_sync(kAll, work.end_slice, src),
      .prior_slot = __shfl_sync(kAll, work.prior_slot, src),
      .target = __shfl_sync(kAll, work.target, src),
  };
}

/// \brief Merges the partials of the warp's token lanes (lanes `kLanes`
/// apart hold the same channels); every lane gets the union.
template <uint32_t kLanes>
SGL_DEVICE void merge_token_lanes(SoftmaxPartial& part) {
#pragma unroll
  for (uint32_t offset = kLanes; offset < device::kWarpThreads; offset *= 2) {
    SoftmaxPartial other;
#pragma unroll
    for (uint32_t c = 0; c < kVecWidth; ++c) {
      other.max[c] = __shfl_xor_sync(0xffffffffu, part.max[c], offset);
      other.sum[c] = __shfl_xor_sync(0xffffffffu, part.sum[c], offset);
      other.acc[c] = __shfl_xor_sync(0xffffffffu, part.acc[c], offset);
    }
    merge_partial(part, other);  // short segments leave some token lanes empty
  }
}

/// \brief Computes one segment slice with one warp and stores it: the
/// compressed row (compress pass) or the new state (write pass).
template <class Layout, int64_t kHeadDim, bool kWritePass, bool kUsePDL, typename StateT>
SGL_DEVICE void compress_segment(const SegmentWork& work, uint32_t slice, const TokenRing<Layout>& ring,
                                 const PrefillParams<StateT>& params) {
  namespace async_copy = device::async_copy;
  constexpr uint32_t kBatch = Layout::kBatch;
  constexpr uint32_t kStride = Layout::kTokenLanes;
  constexpr uint32_t kRoundTokens = kStride * kBatch;
  const uint32_t lane = threadIdx.x % device::kWarpThreads;
  const uint32_t token_lane = lane / Layout::kLanes;
  const uint32_t channel = slice * Layout::kSliceDim + (lane % Layout::kLanes) * kVecWidth;

  // Issued first so that its latency hides under the token loads.
  SoftmaxState prior;
  if (work.prior_slot >= 0) {
    prior = load_state(params.state + static_cast<int64_t>(work.prior_slot) * (3 * kHeadDim) + channel, kHeadDim);
  }

  // Round r of this lane holds its tokens token_lane + r * kRoundTokens + k * kStride, k < kBatch.
  const uint32_t rounds =
      token_lane < work.window_len ? (work.window_len - token_lane + kRoundTokens - 1) / kRoundTokens : 0;
  const float* first_token = params.input + (static_cast<int64_t>(work.last_row) + 1 - work.window_len) * (2 * kHeadDim) + channel;
  const float* first_bias = params.ape + static_cast<int64_t>(work.first_pos) * kHeadDim + channel;
  const auto fetch_tokens = [&](uint32_t round) {
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      const uint32_t t = token_lane + round * kRoundTokens + k * kStride;
      if (t < work.window_len) {
        const float* token = first_token + static_cast<int64_t>(t) * (2 * kHeadDim);
        async_copy::copy_16(ring.at(round, k, 0), token);
        async_copy::copy_16(ring.at(round, k, 1), token + kHeadDim);
      }
    }
    async_copy::commit();  // empty past the last round, so that every round counts one group
  };
  // The bias rows are few and stay in cache; they are loaded one round ahead.
  const auto load_bias = [&](uint32_t round, Vec(&bias)[kBatch]) {
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      const uint32_t t = token_lane + round * kRoundTokens + k * kStride;
      if (t < work.window_len) bias[k].load(first_bias + static_cast<int64_t>(t) * kHeadDim);
    }
  };

#pragma unroll
  for (uint32_t round = 0; round + 1 < Layout::kStages; ++round) fetch_tokens(round);
  Vec bias[kBatch];
  load_bias(0, bias);
  SoftmaxPartial part = SoftmaxPartial::empty();
  for (uint32_t round = 0; round < rounds; ++round) {
    fetch_tokens(round + Layout::kStages - 1);
    Vec next_bias[kBatch];
    load_bias(round + 1, next_bias);
    async_copy::wait<Layout::kStages - 1>();  // this round's group has landed
    const uint32_t t0 = token_lane + round * kRoundTokens;
    const uint32_t count = min(kBatch, (work.window_len - t0 + kStride - 1) / kStride);
    Vec kv[kBatch], score[kBatch];
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      if (k < count) {
        kv[k].load(ring.at(round, k, 0));
        score[k].load(ring.at(round, k, 1));
#pragma unroll
        for (uint32_t c = 0; c < kVecWidth; ++c) score[k][c] += bias[k][c];
      }
    }
    absorb_tokens<kBatch>(part, kv, score, count);
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) bias[k] = next_bias[k];
  }
  if constexpr (kStride > 1) merge_token_lanes<Layout::kLanes>(part);
  if (token_lane != 0) return;

  const SoftmaxState out = work.prior_slot >= 0 ? finish_state(part, prior) : finish_state(part);
  if constexpr (kWritePass) {
    // The compress pass may still be reading this slot (overlap_passes).
    device::PDLWaitPrimary<kUsePDL>();
    store_state(params.state + static_cast<int64_t>(work.target) * (3 * kHeadDim) + channel, kHeadDim, out);
  } else {
    out.kv.store(params.output + static_cast<int64_t>(work.target) * kHeadDim + channel);
  }
}

/// \brief One prefill pass. Work items are (plan row, channel slice) for the
/// first num_split_rows rows, then one per remaining row; warp w of W owns
/// items w, w + W, w + 2W, ... Its lanes decode 32 of its plan rows at once
/// and the warp runs the live ones, so the sentinel rows of a CUDA-graph
/// plan cost one parallel load per 32 rows, not a dependent chain.
template <int64_t kHeadDim, uint32_t kSliceDim, bool kWritePass, bool kUsePDL, typename StateT>
__global__ void __launch_bounds__(PrefillLayout<kHeadDim, kSliceDim>::kThreads,
                                  PrefillLayout<kHeadDim, kSliceDim>::kMinBlocksPerSM)
    c128_prefill_kernel(const __grid_constant__ PrefillParams<StateT> params) {
  using Layout = PrefillLayout<kHeadDim, kSliceDim>;
  constexpr uint32_t kWarp = device::kWarpThreads;
  extern __shared__ __align__(16) unsigned char token_ring_bytes[];
  const TokenRing<Layout> ring{reinterpret_cast<Vec*>(token_ring_bytes) + threadIdx.x};
  if (!(kWritePass && params.overlap_passes)) device::PDLWaitPrimary<kUsePDL>();
  if (!kWritePass && params.overlap_passes) device::PDLTriggerSecondary<kUsePDL>();
  const uint64_t split_items = static_cast<uint64_t>(params.num_split_rows) * Layout::kSlices;
  const uint64_t num_items = pass_items(params, Layout::kSlices);
  const uint64_t num_warps = static_cast<uint64_t>(gridDim.x) * Layout::kWarps;
  const uint32_t lane = threadIdx.x % kWarp;
  const uint64_t warp = static_cast<uint64_t>(blockIdx.x) * Layout::kWarps + threadIdx.x / kWarp;
  for (uint64_t base = warp; base < num_items; base += num_warps * kWarp) {
    const uint64_t item = base + lane * num_warps;
    SegmentWork work;
    bool live = false;
    if (item < split_items) {
      const auto slice = static_cast<uint32_t>(item % Layout::kSlices);
      live = decode_segment<kWritePass>(static_cast<uint32_t>(item / Layout::kSlices), slice, slice + 1, params, work);
    } else if (item < num_items) {
      live = decode_segment<kWritePass>(static_cast<uint32_t>(params.num_split_rows + (item - split_items)), 0,
                                        Layout::kSlices, params, work);
    }
    for (uint32_t pending = __ballot_sync(0xffffffffu, live); pending != 0; pending &= pending - 1) {
      const SegmentWork next = broadcast_work(work, __ffs(pending) - 1);
      for (uint32_t slice = next.first_slice; slice < next.end_slice; ++slice) {
        compress_segment<Layout, kHeadDim, kWritePass, kUsePDL>(next, slice, ring, params);
      }
    }
  }
  // Every thread waits before it exits, so that this grid completes only
  // after the one before it: a kernel that waits on this one then waits on
  // both passes.
  device::PDLWaitPrimary<kUsePDL>();
  device::PDLTriggerSecondary<kUsePDL>();
}

// ---------------------------------------------------------------------------
// Kernel exports for one (head_dim, use_pdl, state dtype) variant.
// ---------------------------------------------------------------------------

template <int64_t kHeadDim, bool kUsePDL, typename StateT>
struct C128Online {
  static_assert(kSupportedHeadDim<kHeadDim>, "head_dim must be a multiple of 64 in [64, 1024]");
  static_assert(kSupportedState<StateT>, "the state is float32 or bfloat16");
  static constexpr auto kDecodeKernel = c128_decode_kernel<kHeadDim, kUsePDL, StateT>;
  using PrefillArgs = PrefillParams<StateT>;

  /// \brief Checks the tensors every kernel shares; returns the slot count.
  static int32_t verify_common(const tvm::ffi::TensorView& kv_score_buffer, const tvm::ffi::TensorView& kv_score_input,
                               const tvm::ffi::TensorView& kv_compressed_output, const tvm::ffi::TensorView& ape,
                               host::SymbolicSize& input_rows, host::SymbolicSize& output_rows,
                               host::SymbolicDevice& device) {
    using namespace host;
    auto S = SymbolicSize{"num_slots"};
    TensorMatcher({S, 1, 3 * kHeadDim})
        .with_dtype<StateT>()
        .with_device(device)
        .with_alignment(16)
        .verify(kv_score_buffer, "kv_score_buffer");
    TensorMatcher({input_rows, 2 * kHeadDim})
        .with_dtype<float>()
        .with_device(device)
        .with_alignment(16)
        .verify(kv_score_input, "kv_score_input");
    TensorMatcher({output_rows, kHeadDim})
        .with_dtype<float>()
        .with_device(device)
        .with_alignment(16)
        .verify(kv_compressed_output, "kv_compressed_output");
    TensorMatcher({static_cast<int64_t>(kC128ChunkSize), kHeadDim})
        .with_dtype<float>()
        .with_device(device)
        .with_alignment(16)
        .verify(ape, "ape");
    CheckAs("ValueError", S.unwrap() <= std::numeric_limits<int32_t>::max(),
            "argument 'kv_score_buffer': expected at most 2^31-1 slots, got ", S.unwrap());
    return static_cast<int32_t>(S.unwrap());
  }

  static void run_decode(tvm::ffi::TensorView kv_score_buffer, tvm::ffi::TensorView kv_score_input,
                         tvm::ffi::TensorView kv_compressed_output, tvm::ffi::TensorView ape,
                         tvm::ffi::TensorView indices, tvm::ffi::TensorView seq_lens,
                         tvm::ffi::Optional<tvm::ffi::TensorView> /*extra: unused*/) {
    using namespace host;
    auto B = SymbolicSize{"batch_size"};
    auto device = SymbolicDevice{};
    device.set_options<kDLCUDA>();
    const int32_t num_slots =
        verify_common(kv_score_buffer, kv_score_input, kv_compressed_output, ape, B, B, device);
    TensorMatcher({B}).with_dtype<int32_t>().with_device(device).verify(indices, "indices");
    TensorMatcher({B}).with_dtype<int32_t>().with_device(device).verify(seq_lens, "seq_lens");

    const int64_t batch_size = B.unwrap();
    if (batch_size == 0) return;
    using Layout = DecodeLayout<kHeadDim>;
    const DecodeParams<StateT> params{
        .state = data_ptr<StateT>(kv_score_buffer),
        .input = data_ptr<const float>(kv_score_input),
        .output = data_ptr<float>(kv_compressed_output),
        .ape = data_ptr<const float>(ape),
        .indices = data_ptr<const int32_t>(indices),
        .seq_lens = data_ptr<const int32_t>(seq_lens),
        .batch_size = static_cast<uint32_t>(batch_size),
        .num_slots = num_slots,
    };
    // A small batch spreads over as many multiprocessors as it can fill
    // (it is latency-bound); a large one packs requests into bigger blocks.
    const int64_t sms = runtime::multiprocessor_count(device.unwrap().device_id);
    const int64_t per_block = std::clamp<int64_t>((batch_size + sms - 1) / sms, Layout::kMinRequestsPerBlock,
                                                  Layout::kMaxRequestsPerBlock);
    const auto blocks = (batch_size + per_block - 1) / per_block;
    LaunchKernel(static_cast<uint32_t>(blocks), static_cast<uint32_t>(per_block * Layout::kLanes), device.unwrap())
        .enable_pdl(kUsePDL)(kDecodeKernel, params);
  }

  /// \brief `kv_compressed_output` is `[N, D]`: a chunk's row goes to its closing token's row.
  static void run_prefill(tvm::ffi::TensorView kv_score_buffer, tvm::ffi::TensorView kv_score_input,
                          tvm::ffi::TensorView kv_compressed_output, tvm::ffi::TensorView ape,
                          tvm::ffi::TensorView indices, tvm::ffi::TensorView compress_plan,
                          tvm::ffi::TensorView write_plan, tvm::ffi::Optional<tvm::ffi::TensorView> load_indices) {
    prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan,
            load_indices, /*compact_output=*/false);
  }

  /// \brief `kv_compressed_output` is `[compress_plan rows, D]`: compress row i's chunk goes to row i.
  static void run_prefill_compact(tvm::ffi::TensorView kv_score_buffer, tvm::ffi::TensorView kv_score_input,
                                  tvm::ffi::TensorView kv_compressed_output, tvm::ffi::TensorView ape,
                                  tvm::ffi::TensorView indices, tvm::ffi::TensorView compress_plan,
                                  tvm::ffi::TensorView write_plan,
                                  tvm::ffi::Optional<tvm::ffi::TensorView> load_indices) {
    prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan,
            load_indices, /*compact_output=*/true);
  }

 private:
  static void prefill(const tvm::ffi::TensorView& kv_score_buffer, const tvm::ffi::TensorView& kv_score_input,
                      const tvm::ffi::TensorView& kv_compressed_output, const tvm::ffi::TensorView& ape,
                      const tvm::ffi::TensorView& indices, const tvm::ffi::TensorView& compress_plan,
                      const tvm::ffi::TensorView& write_plan,
                      const tvm::ffi::Optional<tvm::ffi::TensorView>& load_indices, bool compact_output) {
    using namespace host;
    using compress::kPrefillPlanDim;
    using compress::PrefillPlanTensorDtype;
    auto N = SymbolicSize{"num_tokens"};
    auto B = SymbolicSize{"batch_size"};
    auto num_compress = SymbolicSize{"num_compress_rows"};
    auto num_write = SymbolicSize{"num_write_rows"};
    auto device = SymbolicDevice{};
    device.set_options<kDLCUDA>();
    const auto verify_plan = [&](const tvm::ffi::TensorView& plan, SymbolicSize& rows, const char* name) {
      TensorMatcher({rows, kPrefillPlanDim})
          .with_dtype<PrefillPlanTensorDtype>()
          .with_device(device)
          .with_alignment(alignof(PrefillPlan))
          .verify(plan, name);
    };
    // A compact output must have the compress plan's rows: the plan binds the
    // count first, so a mismatch names the output.
    if (compact_output) verify_plan(compress_plan, num_compress, "compress_plan");
    const int32_t num_slots = verify_common(kv_score_buffer, kv_score_input, kv_compressed_output, ape, N,
                                            compact_output ? num_compress : N, device);
    TensorMatcher({B}).with_dtype<int32_t>().with_device(device).verify(indices, "indices");
    const auto load_from = load_indices.value_or(indices);
    TensorMatcher({B}).with_dtype<int32_t>().with_device(device).verify(load_from, "load_indices");
    verify_plan(compress_plan, num_compress, "compress_plan");
    verify_plan(write_plan, num_write, "write_plan");
    CheckAs("ValueError", N.unwrap() < kPlanSentinel, "argument 'kv_score_input': expected fewer than 2^32-1 rows, got ",
            N.unwrap());
    CheckAs("ValueError", num_compress.unwrap() < kPlanSentinel,
            "argument 'compress_plan': expected fewer than 2^32-1 rows, got ", num_compress.unwrap());
    CheckAs("ValueError", num_write.unwrap() < kPlanSentinel,
            "argument 'write_plan': expected fewer than 2^32-1 rows, got ", num_write.unwrap());

    PrefillArgs params{
        .state = data_ptr<StateT>(kv_score_buffer),
        .input = data_ptr<const float>(kv_score_input),
        .output = data_ptr<float>(kv_compressed_output),
        .ape = data_ptr<const float>(ape),
        .indices = data_ptr<const int32_t>(indices),
        .load_indices = data_ptr<const int32_t>(load_from),
        .plan = nullptr,
        .num_rows = 0,
        .num_split_rows = 0,
        .num_tokens = static_cast<uint32_t>(N.unwrap()),
        .batch_size = static_cast<uint32_t>(B.unwrap()),
        .num_slots = num_slots,
        .compact_output = compact_output,
        .overlap_passes = num_compress.unwrap() > 0 && num_write.unwrap() > 0,
    };
    const DLDevice dl_device = device.unwrap();
    // Pass 1 only reads states; pass 2 then overwrites them. Stream order
    // (PDL waits included) keeps every read of a slot before its write.
    params.plan = data_ptr<const PrefillPlan>(compress_plan);
    params.num_rows = static_cast<uint32_t>(num_compress.unwrap());
    launch_pass</*kWritePass=*/false>(params, dl_device);
    params.plan = data_ptr<const PrefillPlan>(write_plan);
    params.num_rows = static_cast<uint32_t>(num_write.unwrap());
    launch_pass</*kWritePass=*/true>(params, dl_device);
  }

  /// \brief Launches one pass over `params.num_rows` plan rows. Wide slices
  /// read whole 256-byte runs per token, but give a pass of few rows few
  /// items, each a long chain of dependent loads. Narrow slices split each
  /// segment over 4x the warps and 4x the token lanes. The wide form runs
  /// whenever its items could fill at least half the resident warps.
  template <bool kWritePass>
  static void launch_pass(PrefillArgs params, DLDevice device) {
    if (params.num_rows == 0) return;
    // A request has at most one write row, and a compress row per chunk its
    // tokens close, so however far a CUDA-graph plan is padded a planned
    // pass has no more live rows than this, and all of them come first.
    const int64_t max_live_rows = kWritePass ? int64_t{params.batch_size}
                                             : int64_t{params.num_tokens} / kC128ChunkSize + params.batch_size;
    params.num_split_rows = static_cast<uint32_t>(std::min<int64_t>(params.num_rows, max_live_rows));
    constexpr auto kWide = c128_prefill_kernel<kHeadDim, kWideSliceDim, kWritePass, kUsePDL, StateT>;
    using Wide = PrefillLayout<kHeadDim, kWideSliceDim>;
    const int64_t wide_blocks = resident_blocks<kWide, Wide>(device);
    const int64_t wide_warps = wide_blocks * Wide::kWarps;
    constexpr auto kNarrow = c128_prefill_kernel<kHeadDim, kNarrowSliceDim, kWritePass, kUsePDL, StateT>;
    using Narrow = PrefillLayout<kHeadDim, kNarrowSliceDim>;
    const int64_t narrow_blocks = resident_blocks<kNarrow, Narrow>(device);
    const int64_t narrow_warps = narrow_blocks * Narrow::kWarps;
    // Every warp decodes 32 items per round, padding rows included.
    const auto narrow_scan_rounds = static_cast<int64_t>(pass_items(params, Narrow::kSlices) / (narrow_warps * 32));
    if (int64_t{params.num_split_rows} * Wide::kSlices * 2 >= wide_warps ||
        narrow_scan_rounds > kMaxNarrowScanRounds) {
      launch_grid<kWide, Wide>(params, device, wide_blocks);
    } else {
      launch_grid<kNarrow, Narrow>(params, device, narrow_blocks);
    }
  }

  template <auto kKernel, class Layout>
  static void launch_grid(const PrefillArgs& params, DLDevice device, int64_t max_blocks) {
    // One warp per item up to a full GPU; beyond that warps loop (a grid of
    // mostly-idle blocks would only cost launch and scheduling time).
    const auto num_items = static_cast<int64_t>(pass_items(params, Layout::kSlices));
    const int64_t wanted = (num_items + Layout::kWarps - 1) / Layout::kWarps;
    const auto blocks = static_cast<uint32_t>(std::min(wanted, max_blocks));
    host::LaunchKernel(blocks, Layout::kThreads, device, Layout::kRingBytes).enable_pdl(kUsePDL)(kKernel, params);
  }

  /// \brief Blocks of a prefill kernel that fit on the GPU at once, with
  /// their token rings.
  template <auto kKernel, class Layout>
  static int64_t resident_blocks(DLDevice device) {
    host::runtime::allow_dynamic_smem<kKernel>(device.device_id, Layout::kRingBytes);
    return host::runtime::resident_blocks<kKernel>(device.device_id, Layout::kThreads, Layout::kRingBytes);
  }
};

}  // namespace flash_compress::c128
