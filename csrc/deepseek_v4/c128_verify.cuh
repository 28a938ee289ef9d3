// Speculative decoding for the online c128 compressor (docs/SPEC.md section 9):
// verify T draft tokens per request without touching the pool, recording the
// state after every token, then commit the state after the accepted prefix.
// Neither kernel needs the host to know how many tokens were accepted, so a
// whole verify step can be captured in a CUDA graph. Device code only: the
// launches and their checks are in c128_online.cuh.
#pragma once

#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/utils.cuh>

#include <cstdint>
#include <type_traits>

#include "c128_state.cuh"

namespace flash_compress::c128 {

using device::compress::kC128ChunkSize;

template <typename StateT>
struct VerifyParams {
  const StateT* __restrict__ state;      // [num_slots, 3D], read only
  const float* __restrict__ input;       // [B*T, 2D]  | kv | score |
  float* __restrict__ output;            // [B*T, D]
  const float* __restrict__ ape;         // [128, D]
  const int32_t* __restrict__ indices;   // [B]
  const int32_t* __restrict__ seq_lens;  // [B], counting all T tokens
  StateT* __restrict__ prefix_states;    // [B*T, 3D]
  uint32_t batch_size;
  uint32_t window;  // T
  int32_t num_slots;
};

template <int64_t kHeadDim>
struct VerifyLayout {
  static constexpr uint32_t kLanes = kHeadDim / kVecWidth;  // threads per request, 4 channels each
  /// As many requests as fit 128 threads, at least one. The block is their
  /// lanes exactly: where the lanes do not divide 128 (head dims that are not
  /// powers of two), 128 threads would put the last few onto the next
  /// block's request, computing its first channels twice.
  static constexpr uint32_t kRequestsPerBlock = kLanes >= 128 ? 1 : 128 / kLanes;
  static constexpr uint32_t kThreads = kRequestsPerBlock * kLanes;
  /// Tokens whose loads are in flight together.
  static constexpr uint32_t kAhead = 4;
};

/// \brief One thread: 4 channels of one request, through its T tokens in order.
template <int64_t kHeadDim, bool kUsePDL, typename StateT>
__global__ void __launch_bounds__(VerifyLayout<kHeadDim>::kThreads)
    c128_verify_kernel(const __grid_constant__ VerifyParams<StateT> params) {
  using Layout = VerifyLayout<kHeadDim>;
  constexpr uint32_t kAhead = Layout::kAhead;
  const uint32_t lane = threadIdx.x % Layout::kLanes;
  const uint32_t request = blockIdx.x * Layout::kRequestsPerBlock + threadIdx.x / Layout::kLanes;
  const uint32_t window = params.window;

  device::PDLWaitPrimary<kUsePDL>();
  // The next kernel's own wait holds it until this grid has completed; the
  // host keeps its blocks balanced (C128Online::smem_for_early_launch).
  device::PDLTriggerSecondary<kUsePDL>();
  if (request >= params.batch_size) return;
  const int32_t slot = __ldg(params.indices + request);
  const int32_t seq_len = __ldg(params.seq_lens + request);
  // Values the host cannot check without a sync: such a request is skipped.
  if (seq_len < static_cast<int32_t>(window) || slot < 0 || slot >= params.num_slots) return;
  const uint32_t first_pos = static_cast<uint32_t>(seq_len - static_cast<int32_t>(window)) % kC128ChunkSize;
  const int64_t first_row = static_cast<int64_t>(request) * window;
  const int64_t channel = lane * kVecWidth;
  const StateT* prior = params.state + static_cast<int64_t>(slot) * (3 * kHeadDim) + channel;
  // A bfloat16 state is widened as soon as it lands, which holds back any
  // load issued after it: it waits for the first tokens' loads to be issued
  // (head_dim 512, T=4, B=1536: 18.92 -> 17.78 us). A float32 state needs no
  // widening and goes first: after the tokens it measured up to 1.8% slower
  // (docs/PERF_LOG.md).
  constexpr bool kStateAfterFirstTokens = !std::is_same_v<StateT, float>;
  SoftmaxState state;
  if (!kStateAfterFirstTokens && first_pos != 0) state = load_state(prior, kHeadDim);

  for (uint32_t j0 = 0; j0 < window; j0 += kAhead) {
    Vec kv[kAhead], score[kAhead], bias[kAhead];
#pragma unroll
    for (uint32_t k = 0; k < kAhead; ++k) {
      if (j0 + k < window) {
        const float* token = params.input + (first_row + j0 + k) * (2 * kHeadDim) + channel;
        kv[k].load_read_only(token);
        score[k].load_read_only(token + kHeadDim);
        bias[k].load_read_only(params.ape + ((first_pos + j0 + k) % kC128ChunkSize) * kHeadDim + channel);
      }
    }
    if (kStateAfterFirstTokens && j0 == 0 && first_pos != 0) state = load_state(prior, kHeadDim);
#pragma unroll
    for (uint32_t k = 0; k < kAhead; ++k) {
      const uint32_t j = j0 + k;
      if (j >= window) break;
      const uint32_t pos = (first_pos + j) % kC128ChunkSize;
#pragma unroll
      for (uint32_t c = 0; c < kVecWidth; ++c) score[k][c] += bias[k][c];
      // Tokens build on the unrounded state; only what is stored is rounded.
      state = pos == 0 ? first_token_state(score[k], kv[k]) : add_token(state, score[k], kv[k]);
      store_state(params.prefix_states + (first_row + j) * (3 * kHeadDim) + channel, kHeadDim, state);
      if (pos == kC128ChunkSize - 1) state.kv.store(params.output + (first_row + j) * kHeadDim + channel);
    }
  }
}

template <typename StateT>
struct CommitParams {
  StateT* __restrict__ state;                // [num_slots, 3D]
  const StateT* __restrict__ prefix_states;  // [B*T, 3D]
  const int32_t* __restrict__ indices;       // [B]
  const int32_t* __restrict__ accept_lens;   // [B]
  uint32_t batch_size;
  uint32_t window;  // T
  int32_t num_slots;
};

/// \brief A state row moves as 16-byte pieces, kPiecesPerThread per thread:
/// after the dependent loads of `accept_lens` and `indices`, each thread has
/// that many independent copies in flight.
template <int64_t kHeadDim, typename StateT>
struct CommitLayout {
  using Piece = uint4;
  static constexpr uint32_t kPiecesPerRow = 3 * kHeadDim * sizeof(StateT) / sizeof(Piece);
  static_assert(3 * kHeadDim * sizeof(StateT) % sizeof(Piece) == 0);
  static constexpr uint32_t kPiecesPerThread = 4;
  static_assert(kPiecesPerRow % kPiecesPerThread == 0);
  static constexpr uint32_t kThreadsPerRow = kPiecesPerRow / kPiecesPerThread;
  static constexpr uint32_t kThreads = 256;
};

/// \brief Copies prefix state `accept_lens[b] - 1` of request b into its slot.
template <int64_t kHeadDim, bool kUsePDL, typename StateT>
__global__ void __launch_bounds__(CommitLayout<kHeadDim, StateT>::kThreads)
    c128_commit_kernel(const __grid_constant__ CommitParams<StateT> params) {
  using Layout = CommitLayout<kHeadDim, StateT>;
  using Piece = typename Layout::Piece;
  const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * Layout::kThreads + threadIdx.x;
  const uint64_t request = thread / Layout::kThreadsPerRow;
  // Thread t of a row copies pieces t, t + kThreadsPerRow, ...: each copy is contiguous across the warp.
  const uint32_t first_piece = static_cast<uint32_t>(thread % Layout::kThreadsPerRow);

  device::PDLWaitPrimary<kUsePDL>();
  if (request < params.batch_size) {
    const int32_t accepted = params.accept_lens[request];
    const int32_t slot = params.indices[request];
    if (accepted >= 1 && accepted <= static_cast<int32_t>(params.window) && slot >= 0 && slot < params.num_slots) {
      const int64_t row = static_cast<int64_t>(request) * params.window + (accepted - 1);
      const auto* from = reinterpret_cast<const Piece*>(params.prefix_states + row * (3 * kHeadDim));
      auto* to = reinterpret_cast<Piece*>(params.state + static_cast<int64_t>(slot) * (3 * kHeadDim));
      Piece pieces[Layout::kPiecesPerThread];
#pragma unroll
      for (uint32_t k = 0; k < Layout::kPiecesPerThread; ++k) pieces[k] = from[first_piece + k * Layout::kThreadsPerRow];
#pragma unroll
      for (uint32_t k = 0; k < Layout::kPiecesPerThread; ++k) to[first_piece + k * Layout::kThreadsPerRow] = pieces[k];
    }
  }
  device::PDLTriggerSecondary<kUsePDL>();
}

}  // namespace flash_compress::c128
