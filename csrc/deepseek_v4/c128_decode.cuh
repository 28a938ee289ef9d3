// Decode for the online c128 compressor: one new token per request updates
// that request's running softmax state, and a chunk's compressed row is
// emitted when its 128th token arrives (docs/SPEC.md sections 1 and 4).
//
// Channels are independent, so a thread owns 4 consecutive channels of one
// request and works on float4 vectors. Device code only: the launch and its
// checks are in c128_online.cuh.
#pragma once

#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/utils.cuh>

#include <cstdint>

#include "c128_state.cuh"

namespace flash_compress::c128 {

using device::compress::kC128ChunkSize;

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
  /// Lets the next kernel launch before this grid's loads. The host
  /// always sets it (C128Online::smem_for_early_launch keeps that
  /// balanced): the same kernel with an unconditional trigger measured
  /// 0.03-0.08 us slower at B <= 512 (docs/PERF_LOG.md).
  bool trigger_early;
};

template <int64_t kHeadDim, typename StateT>
struct DecodeLayout {
  static constexpr uint32_t kLanes = kHeadDim / kVecWidth;  // threads per request
  /// A block holds blockDim.x / kLanes requests, chosen per launch
  /// (C128Online::run_decode) up to this many threads.
  static constexpr uint32_t kMaxThreads = kLanes > 256 ? kLanes : 256;
  static constexpr uint32_t kMaxRequestsPerBlock = kMaxThreads / kLanes;
  /// At least a warp per block.
  static constexpr uint32_t kMinRequestsPerBlock = kLanes >= device::kWarpThreads ? 1 : device::kWarpThreads / kLanes;
  /// With bfloat16 states the kernel fits 32 registers without spills, so a
  /// full SM of threads: fewer waves at large batches (bf16, head_dim 128
  /// B=4096 3.65 -> 2.97 us, head_dim 1024 B=512 3.68 -> 3.05 us, head_dim 512
  /// within 1%; docs/PERF_LOG.md). Only where the lanes per request are a
  /// power of two: other head dims spill at 32 registers. float32 states
  /// spill there too, and measured slower. Elsewhere three quarters of an
  /// SM (40 registers), what the kernel took before add_token moved its
  /// divisions last (46 registers unbounded).
  static constexpr bool kFullOccupancy = !std::is_same_v<StateT, float> && (kLanes & (kLanes - 1)) == 0;
  static constexpr uint32_t kMinBlocksPerSM = kFullOccupancy ? 2048 / kMaxThreads : 1536 / kMaxThreads;
};

/// \brief What one thread reads for one request's 4 channels.
template <typename StateT>
struct DecodeLoads {
  Vec kv, score, bias;
  StoredState<StateT> old;  // widened only once every load has landed
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
  // waiting a round trip for them. All but the state slot is read through
  // the read-only path: 1-3% off bfloat16 steps that fill the GPU (docs/PERF_LOG.md).
  const float* token = params.input + static_cast<int64_t>(request) * (2 * kHeadDim) + lane * kVecWidth;
  in.kv.load_read_only(token);
  in.score.load_read_only(token + kHeadDim);
  const int32_t slot = __ldg(params.indices + request);
  const int32_t seq_len = __ldg(params.seq_lens + request);
  // Values the host cannot check without a sync: such a request is skipped.
  if (seq_len < 1 || slot < 0 || slot >= params.num_slots) return in;
  in.pos = static_cast<uint32_t>(seq_len - 1) % kC128ChunkSize;
  in.state = params.state + static_cast<int64_t>(slot) * (3 * kHeadDim) + lane * kVecWidth;
  in.bias.load_read_only(params.ape + in.pos * kHeadDim + lane * kVecWidth);
  // The first token of a chunk replaces the state unread.
  if (in.pos != 0) in.old = StoredState<StateT>::load(in.state, kHeadDim);
  return in;
}

template <int64_t kHeadDim, typename StateT>
SGL_DEVICE void finish_decode_request(const DecodeParams<StateT>& params, const DecodeLoads<StateT>& in,
                                      uint32_t request, uint32_t lane) {
  if (in.state == nullptr) return;
  const SoftmaxState old = in.old.widen();
  Vec s;
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) s[c] = in.score[c] + in.bias[c];
  const SoftmaxState next = in.pos == 0 ? first_token_state(s, in.kv) : add_token(old, s, in.kv);
  if (in.pos == kC128ChunkSize - 1) {
    // The chunk is complete: emit it. The state is left alone because the
    // next chunk's first token replaces it unread.
    next.kv.store(params.output + static_cast<int64_t>(request) * kHeadDim + lane * kVecWidth);
  } else {
    store_state(in.state, kHeadDim, next);
  }
}

template <int64_t kHeadDim, bool kUsePDL, typename StateT>
__global__ void __launch_bounds__(DecodeLayout<kHeadDim, StateT>::kMaxThreads,
                                  DecodeLayout<kHeadDim, StateT>::kMinBlocksPerSM)
    c128_decode_kernel(const __grid_constant__ DecodeParams<StateT> params) {
  using Layout = DecodeLayout<kHeadDim, StateT>;
  const uint32_t lane = threadIdx.x % Layout::kLanes;
  const uint32_t request = blockIdx.x * (blockDim.x / Layout::kLanes) + threadIdx.x / Layout::kLanes;

  device::PDLWaitPrimary<kUsePDL>();
  // The next kernel's own wait holds it until this whole grid has completed,
  // so an early trigger only hides its launch. Without one it launches as
  // the last block exits.
  if (params.trigger_early) device::PDLTriggerSecondary<kUsePDL>();
  const DecodeLoads<StateT> loads = load_decode_request<kHeadDim>(params, request, lane);
  finish_decode_request<kHeadDim>(params, loads, request, lane);
}

}  // namespace flash_compress::c128
