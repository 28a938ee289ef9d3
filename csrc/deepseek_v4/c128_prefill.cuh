// Prefill for the online c128 compressor: many ragged tokens per request, in
// two passes over plans of segments, each segment inside one chunk (docs/SPEC.md
// sections 2, 3 and 10). The compress pass emits the rows of the chunks the new
// tokens close; the write pass stores the state of every request's open chunk.
// Device code only: the launch, its choice of slice width and its checks are in
// c128_online.cuh; the planner that writes the plans is c128_plan.cuh.
#pragma once

#include <sgl_kernel/async_copy.cuh>
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/utils.cuh>

#include <cstdint>

#include "c128_state.cuh"

namespace flash_compress::c128 {

using device::compress::kC128ChunkSize;
using device::compress::kPlanSentinel;
using device::compress::PrefillPlan;

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
  /// Lets the next kernel launch as soon as this pass starts (after its
  /// PDL wait, where it waits there): the write pass, when overlap_passes;
  /// else where C128Online::trigger_next_early says so.
  bool trigger_early;
};

/// \brief Whether a pass's grid ends in one block that only waits on the
/// kernel before it (PDL) and exits. A write pass that overlaps its compress
/// pass waits only before its stores, so without that block it could
/// complete before the compress pass (a pass of padding rows alone stores
/// nothing), and a kernel waiting on it would not wait on both. Every other
/// pass waits first. One block rather than a wait in every thread after its
/// item loop: code after that loop made ptxas keep the global memory
/// descriptor in vector registers and convert it (R2UR) before each load, 24
/// instructions in each round of two token loads (head_dim 512, 16 channels).
template <bool kUsePDL, bool kWritePass>
__host__ __device__ constexpr bool has_wait_block(bool overlap_passes) {
  return kUsePDL && kWritePass && overlap_passes;
}

/// \brief Work items of a pass of `split_rows` rows split into `slices`
/// channel slices each and `other_rows` rows that are not.
__host__ __device__ inline uint64_t pass_items(uint64_t split_rows, uint64_t other_rows, uint32_t slices) {
  return split_rows * slices + other_rows;
}

/// \brief Work items of the pass `params` describes.
template <typename StateT>
__host__ __device__ inline uint64_t pass_items(const PrefillParams<StateT>& params, uint32_t slices) {
  return pass_items(params.num_split_rows, params.num_rows - params.num_split_rows, slices);
}

template <int64_t kHeadDim, uint32_t kSliceDim_>
struct PrefillLayout {
  static_assert(kSupportedHeadDim<kHeadDim>, "head_dim must be a multiple of 64 in [64, 1024]");
  /// A warp computes one slice of channels of one segment: no block-wide
  /// merge, no barrier, and every warp streams independently. The slice is
  /// chosen per pass (choose_slice_width in c128_slice_width.cuh): wide
  /// slices when there are many items, narrower ones when a pass has few
  /// rows, so that its warps split each segment's tokens over more lanes and
  /// finish in fewer rounds of dependent loads.
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
  /// Whether each token's ape bias row is a third copy of the ring, landing
  /// with its kv and score, rather than a read-only load into registers a
  /// round ahead. In a pass bound by its chains (few rows, narrow slices)
  /// that load landed after the round's copies and stalled the round's first
  /// add. 128-channel slices at head_dim 256 or less keep the registers: with
  /// the ring's copies from L2, as head_dim 256 takes them (kBiasInL1), its
  /// 8 x 16384 tokens ran 96.2 us against 92.4 (H100; docs/PERF_LOG.md).
  static constexpr bool kBiasInRing = kHeadDim >= 512 || kSliceDim < 128;
  /// Whether the ring's bias copies also allocate in L1 (cp.async.ca), as
  /// measured, not derived: they pay at head_dim 128 (1 x 32768 tokens: 8.1 us
  /// against 10.3 from L2); from head_dim 256 on, the rows come faster from
  /// L2 (cp.async.cg; head_dim 1024 256 x 300 tokens: 220.7 against 231.7).
  static constexpr bool kBiasInL1 = kHeadDim <= 128;
  /// Vectors a token keeps in the ring: kv, score and, with kBiasInRing, bias.
  static constexpr uint32_t kTokenParts = kBiasInRing ? 3 : 2;
  /// Dynamic shared memory of a block: every thread's ring of kStages
  /// rounds of kBatch tokens.
  static constexpr uint32_t kRingBytes = kStages * kBatch * kTokenParts * sizeof(Vec) * kThreads;
  /// Keeps registers at or under 128, so that 16 warps fit per SM.
  static constexpr uint32_t kMinBlocksPerSM = 16 / kWarps;
  /// Whether the token loop takes its exponentials from exp_approx, which
  /// speeds up the passes bound by their chains, not their bytes (few rows: head_dim
  /// 512 1 x 2048 + 63 x 1 tokens 6.94 -> 6.28 us on an H100). 128-channel
  /// slices, which the rule gives to streaming compress passes of many rows,
  /// keep expf: head_dim 1024 8 x 16384 tokens ran 354.6 -> 358.6 us with it
  /// (docs/PERF_LOG.md).
  static constexpr bool kApproxExp = kSliceDim < 128;
};

/// \brief One (segment, channel slice) a warp has to compute, decoded and
/// checked from its plan row.
struct SegmentWork {
  uint32_t last_row;     // ragged row of the segment's last token
  uint32_t first_pos;    // position in the chunk of the segment's first token
  uint32_t window_len;   // tokens in the segment
  uint32_t first_slice;  // channel slices [first_slice, end_slice)
  uint32_t end_slice;
  uint32_t batch_id;    // the request, whose slots compress_segment reads
  uint32_t output_row;  // compress pass: the row the chunk goes to
};

/// \brief Decodes a plan row. Sentinel rows (CUDA-graph padding) and rows the
/// kernel cannot execute safely (out-of-range rows or request ids, a segment
/// that leaves its chunk, a row of the other pass) yield false and are
/// skipped: the host cannot see these values without a sync. (A bad slot
/// skips the segment's store, in compress_segment.)
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
  work.batch_id = row.batch_id;
  work.output_row = params.compact_output ? row_index : row.ragged_id;
  return true;
}

/// \brief A thread's ring of token rounds in shared memory. Vector (stage, k,
/// part) of thread i sits at [(stage * kBatch + k) * kTokenParts + part][i], so
/// a warp's 32 copies of one vector land in 512 contiguous bytes (no bank
/// conflicts). Parts: 0 kv, 1 score, 2 bias (Layout::kBiasInRing).
template <class Layout>
struct TokenRing {
  Vec* thread_base;

  SGL_DEVICE Vec* at(uint32_t round, uint32_t k, uint32_t part) const {
    const uint32_t vector = ((round % Layout::kStages) * Layout::kBatch + k) * Layout::kTokenParts + part;
    return thread_base + vector * Layout::kThreads;
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
      .batch_id = __shfl_sync(kAll, work.batch_id, src),
      .output_row = __shfl_sync(kAll, work.output_row, src),
  };
}

/// \brief Merges the partials of the warp's token lanes (lanes `kLanes`
/// apart hold the same channels); every lane gets the union. The maximum is
/// reduced first, then each lane rescales its sums to it once and the sums
/// are added: a step is a shuffle and an add per field, where merging
/// partials pairwise rescaled both sides at every step (exponentials included).
template <uint32_t kLanes>
SGL_DEVICE void merge_token_lanes(SoftmaxPartial& part) {
  constexpr uint32_t kAll = 0xffffffffu;
  Vec max = part.max;
#pragma unroll
  for (uint32_t offset = kLanes; offset < device::kWarpThreads; offset *= 2) {
#pragma unroll
    for (uint32_t c = 0; c < kVecWidth; ++c) max[c] = fmaxf(max[c], __shfl_xor_sync(kAll, max[c], offset));
  }
  rescale_partial(part, max);  // short segments leave some lanes empty
#pragma unroll
  for (uint32_t offset = kLanes; offset < device::kWarpThreads; offset *= 2) {
#pragma unroll
    for (uint32_t c = 0; c < kVecWidth; ++c) {
      part.sum[c] += __shfl_xor_sync(kAll, part.sum[c], offset);
      part.acc[c] += __shfl_xor_sync(kAll, part.acc[c], offset);
    }
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

  // The slots are read here, not where the plan row is decoded, so that the
  // token loads need not wait for them: only the prior state and the store
  // do. A bad slot (the host cannot see it without a sync) skips the store.
  const bool has_prior = work.first_pos != 0;
  const int32_t prior_slot = has_prior ? params.load_indices[work.batch_id] : -1;
  const int32_t target_slot = kWritePass ? params.indices[work.batch_id] : 0;
  // Held as the words its loads return and widened after the token loop:
  // widened where loaded, a bf16 state made the warp wait for its load
  // before the loop's first round (SASS).
  StoredState<StateT> prior;

  // Round r of this lane holds its tokens round_start(r) + k * kStride, k < kBatch.
  const auto round_start = [&](uint32_t round) { return token_lane + round * kRoundTokens; };
  const uint32_t rounds =
      token_lane < work.window_len ? (work.window_len - token_lane + kRoundTokens - 1) / kRoundTokens : 0;
  const float* first_token = params.input + (static_cast<int64_t>(work.last_row) + 1 - work.window_len) * (2 * kHeadDim) + channel;
  const float* first_bias = params.ape + static_cast<int64_t>(work.first_pos) * kHeadDim + channel;
  // The bias row of token t0; those of its round sit k * kStride rows on.
  const auto round_bias = [&](uint32_t t0) { return first_bias + static_cast<int64_t>(t0) * kHeadDim; };
  const auto fetch_tokens = [&](uint32_t round) {
    // One 64-bit address a round: the batch's tokens sit at constant offsets
    // from it, which the copies take as immediates (16% fewer instructions
    // in the token loop than an address per token, SASS; off the round's
    // chain of dependent work, so worth little time: docs/PERF_LOG.md).
    const uint32_t t0 = round_start(round);
    const float* round_token = first_token + static_cast<int64_t>(t0) * (2 * kHeadDim);
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      if (t0 + k * kStride < work.window_len) {
        const float* token = round_token + k * kStride * (2 * kHeadDim);
        async_copy::copy_16(ring.at(round, k, 0), token);
        async_copy::copy_16(ring.at(round, k, 1), token + kHeadDim);
        if constexpr (Layout::kBiasInRing) {
          async_copy::copy_16<Layout::kBiasInL1>(ring.at(round, k, 2), round_bias(t0) + k * kStride * kHeadDim);
        }
      }
    }
    async_copy::commit();  // empty past the last round, so that every round counts one group
  };
  // Without kBiasInRing: a round's bias rows, loaded into registers.
  const auto load_bias = [&](uint32_t round, Vec(&bias)[kBatch]) {
    const uint32_t t0 = round_start(round);
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      if (t0 + k * kStride < work.window_len) bias[k].load_read_only(round_bias(t0) + k * kStride * kHeadDim);
    }
  };

#pragma unroll
  for (uint32_t round = 0; round + 1 < Layout::kStages; ++round) fetch_tokens(round);
  // Checked only once the first round's copies are issued: the check waits for the slots.
  const bool slots_ok = (!has_prior || (prior_slot >= 0 && prior_slot < params.num_slots)) &&
                        (!kWritePass || (target_slot >= 0 && target_slot < params.num_slots));
  // Issued once the first round of tokens is in flight (it waits for the
  // slot), and only by the lanes that finish the state.
  if (token_lane == 0 && has_prior && slots_ok) {
    prior = StoredState<StateT>::load(params.state + static_cast<int64_t>(prior_slot) * (3 * kHeadDim) + channel,
                                      kHeadDim);
  }
  SoftmaxPartial part = SoftmaxPartial::empty();
  // Folds round `round` once its copies have landed; `bias_row(k)` is the
  // bias row of its token k.
  const auto fold_round = [&](uint32_t round, const auto& bias_row) {
    async_copy::wait<Layout::kStages - 1>();  // this round's group has landed
    const uint32_t t0 = round_start(round);
    const uint32_t count = min(kBatch, (work.window_len - t0 + kStride - 1) / kStride);
    // Every vector of the round is read, those past `count` stale (absorb_tokens masks them).
    Vec kv[kBatch], score[kBatch];
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      kv[k].load(ring.at(round, k, 0));
      score[k].load(ring.at(round, k, 1));
      const Vec bias = bias_row(k);
#pragma unroll
      for (uint32_t c = 0; c < kVecWidth; ++c) score[k][c] += bias[c];
    }
    absorb_tokens<kBatch, Layout::kApproxExp>(part, kv, score, count);
  };
  if constexpr (Layout::kBiasInRing) {
    for (uint32_t round = 0; round < rounds; ++round) {
      fetch_tokens(round + Layout::kStages - 1);
      fold_round(round, [&](uint32_t k) {
        Vec bias;
        bias.load(ring.at(round, k, 2));
        return bias;
      });
    }
  } else {
    // Two sets of bias registers that take turns, rounds two at a time: a
    // round's bias rows are loaded one round ahead into the set the round
    // after it does not use, so no register copy waits for a load in flight
    // (with one set, `bias = next_bias` at the end of each round waited for the
    // next round's rows: a load latency a round for a warp alone on a segment).
    Vec even_bias[kBatch], odd_bias[kBatch];
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      even_bias[k].fill(0.0f);  // rows past the segment's end keep a defined value
      odd_bias[k].fill(0.0f);
    }
    load_bias(0, even_bias);
    for (uint32_t round = 0; round < rounds; round += 2) {
      fetch_tokens(round + Layout::kStages - 1);
      load_bias(round + 1, odd_bias);
      fold_round(round, [&](uint32_t k) { return even_bias[k]; });
      if (round + 1 == rounds) break;
      fetch_tokens(round + Layout::kStages);
      load_bias(round + 2, even_bias);
      fold_round(round + 1, [&](uint32_t k) { return odd_bias[k]; });
    }
  }
  if constexpr (kStride > 1) merge_token_lanes<Layout::kLanes>(part);
  if (token_lane != 0 || !slots_ok) return;

  const SoftmaxState out = has_prior ? finish_state(part, prior.widen()) : finish_state(part);
  if constexpr (kWritePass) {
    // The compress pass may still be reading this slot (overlap_passes).
    device::PDLWaitPrimary<kUsePDL>();
    store_state(params.state + static_cast<int64_t>(target_slot) * (3 * kHeadDim) + channel, kHeadDim, out);
  } else {
    out.kv.store(params.output + static_cast<int64_t>(work.output_row) * kHeadDim + channel);
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
  const bool wait_block = has_wait_block<kUsePDL, kWritePass>(params.overlap_passes);
  if (wait_block && blockIdx.x + 1 == gridDim.x) {
    if (params.trigger_early) device::PDLTriggerSecondary<kUsePDL>();
    device::PDLWaitPrimary<kUsePDL>();
    return;
  }
  if (!(kWritePass && params.overlap_passes)) device::PDLWaitPrimary<kUsePDL>();
  if (params.trigger_early) device::PDLTriggerSecondary<kUsePDL>();
  const uint64_t split_items = static_cast<uint64_t>(params.num_split_rows) * Layout::kSlices;
  const uint64_t num_items = pass_items(params, Layout::kSlices);
  const uint64_t num_warps = static_cast<uint64_t>(gridDim.x - (wait_block ? 1 : 0)) * Layout::kWarps;
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
  // Nothing after the item loop (has_wait_block): a block that exits counts
  // as having let the next kernel launch.
}

}  // namespace flash_compress::c128
