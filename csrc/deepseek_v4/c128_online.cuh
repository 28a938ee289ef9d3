// The tvm-ffi exports of DeepSeek-V4's online 128-token KV compressor, one
// struct per (head_dim, use_pdl, state dtype) variant (docs/SPEC.md sections
// 3, 9 and 10). Every argument is checked here, before any launch, and every
// launch shape is chosen here; the kernels know neither. Kernels:
// c128_decode.cuh, c128_prefill.cuh, c128_verify.cuh; a prefill pass's
// slice width comes from c128_slice_width.cuh. The planner's exports are in
// c128_plan.cuh.
#pragma once

#include <dlpack/dlpack.h>
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "c128_decode.cuh"
#include "c128_plan.cuh"
#include "c128_prefill.cuh"
#include "c128_slice_width.cuh"
#include "c128_state.cuh"
#include "c128_verify.cuh"

namespace flash_compress::c128 {

/// Most tokens per request (T: the last accepted token and T-1 drafts) one
/// verify step takes (reference.MAX_VERIFY_TOKENS).
inline constexpr int64_t kMaxVerifyTokens = 16;

/// \brief The argument checks the exports share: each binds the sizes and the
/// device it names, so that a later mismatch names both tensors.
template <int64_t kHeadDim, typename StateT>
struct ArgumentChecks {
  using TensorView = tvm::ffi::TensorView;

  /// \brief `kv_score_buffer`: `[num_slots, 1, 3D]` states; returns the slot count.
  static int32_t state_pool(const TensorView& pool, host::SymbolicDevice& device) {
    using namespace host;
    auto S = SymbolicSize{"num_slots"};
    TensorMatcher({S, 1, 3 * kHeadDim}).with_dtype<StateT>().with_device(device).with_alignment(16).verify(
        pool, "kv_score_buffer");
    CheckAs("ValueError", S.unwrap() <= std::numeric_limits<int32_t>::max(),
            "argument 'kv_score_buffer': expected at most 2^31-1 slots, got ", S.unwrap());
    return static_cast<int32_t>(S.unwrap());
  }

  /// \brief A `[rows, width]` float32 tensor of 16-byte aligned rows.
  static void float_rows(const TensorView& tensor, host::DimSpec rows, int64_t width,
                         host::SymbolicDevice& device, const char* name) {
    host::TensorMatcher({rows, width}).with_dtype<float>().with_device(device).with_alignment(16).verify(tensor, name);
  }

  /// \brief `kv_score_input` `[rows, 2D]`, `kv_compressed_output` `[output_rows, D]` and `ape` `[128, D]`.
  static void tokens_output_ape(const TensorView& input, const TensorView& output, const TensorView& ape,
                                host::SymbolicSize& input_rows, host::SymbolicSize& output_rows,
                                host::SymbolicDevice& device) {
    float_rows(input, input_rows, 2 * kHeadDim, device, "kv_score_input");
    float_rows(output, output_rows, kHeadDim, device, "kv_compressed_output");
    float_rows(ape, static_cast<int64_t>(kC128ChunkSize), kHeadDim, device, "ape");
  }

  /// \brief A `[B]` int32 tensor, one value per request.
  static void per_request(const TensorView& tensor, host::SymbolicSize& batch, host::SymbolicDevice& device,
                          const char* name) {
    host::TensorMatcher({batch}).with_dtype<int32_t>().with_device(device).verify(tensor, name);
  }

  /// \brief What decode and verify share: the pool, `rows` tokens in and out,
  /// `ape`, and `indices` / `seq_lens` per request; returns the slot count.
  static int32_t token_step(const TensorView& pool, const TensorView& input, const TensorView& output,
                            const TensorView& ape, const TensorView& indices, const TensorView& seq_lens,
                            host::SymbolicSize& rows, host::SymbolicSize& batch, host::SymbolicDevice& device) {
    const int32_t num_slots = state_pool(pool, device);
    tokens_output_ape(input, output, ape, rows, rows, device);
    per_request(indices, batch, device, "indices");
    per_request(seq_lens, batch, device, "seq_lens");
    return num_slots;
  }

  /// \brief `prefix_states`: `[rows, 3D]` states.
  static void state_rows(const TensorView& tensor, host::SymbolicSize& rows, host::SymbolicDevice& device) {
    host::TensorMatcher({rows, 3 * kHeadDim}).with_dtype<StateT>().with_device(device).with_alignment(16).verify(
        tensor, "prefix_states");
  }
};

template <int64_t kHeadDim, bool kUsePDL, typename StateT>
struct C128Online {
  static_assert(kSupportedHeadDim<kHeadDim>, "head_dim must be a multiple of 64 in [64, 1024]");
  static_assert(kSupportedState<StateT>, "the state is float32 or bfloat16");
  static constexpr auto kDecodeKernel = c128_decode_kernel<kHeadDim, kUsePDL, StateT>;
  using PrefillArgs = PrefillParams<StateT>;
  using Checks = ArgumentChecks<kHeadDim, StateT>;

  static void run_decode(tvm::ffi::TensorView kv_score_buffer, tvm::ffi::TensorView kv_score_input,
                         tvm::ffi::TensorView kv_compressed_output, tvm::ffi::TensorView ape,
                         tvm::ffi::TensorView indices, tvm::ffi::TensorView seq_lens,
                         tvm::ffi::Optional<tvm::ffi::TensorView> /*extra: unused*/) {
    using namespace host;
    auto B = SymbolicSize{"batch_size"};
    auto device = SymbolicDevice{};
    device.set_options<kDLCUDA>();
    const int32_t num_slots =
        Checks::token_step(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, B, B, device);
    // The kernel counts requests in 32 bits (and such a batch is terabytes of input).
    CheckAs("ValueError", B.unwrap() <= std::numeric_limits<int32_t>::max(), "argument 'indices': expected at most ",
            std::numeric_limits<int32_t>::max(), " requests, got ", B.unwrap());
    verify_apart({{kv_score_buffer, "kv_score_buffer", true},
                  {kv_score_input, "kv_score_input", false},
                  {kv_compressed_output, "kv_compressed_output", true},
                  {ape, "ape", false},
                  {indices, "indices", false},
                  {seq_lens, "seq_lens", false}});

    const int64_t batch_size = B.unwrap();
    if (batch_size == 0) return;
    using Layout = DecodeLayout<kHeadDim, StateT>;
    // A small batch spreads over as many multiprocessors as it can fill
    // (it is latency-bound); a large one packs requests into bigger blocks.
    const int32_t device_id = device.unwrap().device_id;
    const int64_t sms = runtime::multiprocessor_count(device_id);
    const int64_t per_block = std::clamp<int64_t>(div_ceil(batch_size, sms), Layout::kMinRequestsPerBlock,
                                                  Layout::kMaxRequestsPerBlock);
    const auto blocks = div_ceil(batch_size, per_block);
    const size_t early_launch_smem = smem_for_early_launch<kDecodeKernel>(
        device_id, blocks, runtime::resident_blocks<kDecodeKernel>(device_id, Layout::kMaxThreads));
    const DecodeParams<StateT> params{
        .state = data_ptr<StateT>(kv_score_buffer),
        .input = data_ptr<const float>(kv_score_input),
        .output = data_ptr<float>(kv_compressed_output),
        .ape = data_ptr<const float>(ape),
        .indices = data_ptr<const int32_t>(indices),
        .seq_lens = data_ptr<const int32_t>(seq_lens),
        .batch_size = static_cast<uint32_t>(batch_size),
        .num_slots = num_slots,
        .trigger_early = true,
    };
    LaunchKernel(static_cast<uint32_t>(blocks), static_cast<uint32_t>(per_block * Layout::kLanes), device.unwrap(),
                 early_launch_smem)
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

  /// \brief `run_verify(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens,
  /// prefix_states)`: docs/SPEC.md section 9.
  static void run_verify(tvm::ffi::TensorView kv_score_buffer, tvm::ffi::TensorView kv_score_input,
                         tvm::ffi::TensorView kv_compressed_output, tvm::ffi::TensorView ape,
                         tvm::ffi::TensorView indices, tvm::ffi::TensorView seq_lens,
                         tvm::ffi::TensorView prefix_states) {
    using namespace host;
    auto B = SymbolicSize{"batch_size"};
    auto R = SymbolicSize{"num_tokens"};
    auto device = SymbolicDevice{};
    device.set_options<kDLCUDA>();
    const int32_t num_slots =
        Checks::token_step(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens, R, B, device);
    Checks::state_rows(prefix_states, R, device);
    const int64_t window = tokens_per_request(R.unwrap(), B.unwrap(), "kv_score_input");
    verify_apart({{kv_score_buffer, "kv_score_buffer", false},
                  {kv_score_input, "kv_score_input", false},
                  {kv_compressed_output, "kv_compressed_output", true},
                  {ape, "ape", false},
                  {indices, "indices", false},
                  {seq_lens, "seq_lens", false},
                  {prefix_states, "prefix_states", true}});
    if (B.unwrap() == 0) return;
    using Layout = VerifyLayout<kHeadDim>;
    constexpr auto kKernel = c128_verify_kernel<kHeadDim, kUsePDL, StateT>;
    const int32_t device_id = device.unwrap().device_id;
    const auto blocks = div_ceil(B.unwrap(), Layout::kRequestsPerBlock);
    const size_t early_launch_smem = smem_for_early_launch<kKernel>(
        device_id, blocks, runtime::resident_blocks<kKernel>(device_id, Layout::kThreads));
    const VerifyParams<StateT> params{
        .state = data_ptr<const StateT>(kv_score_buffer),
        .input = data_ptr<const float>(kv_score_input),
        .output = data_ptr<float>(kv_compressed_output),
        .ape = data_ptr<const float>(ape),
        .indices = data_ptr<const int32_t>(indices),
        .seq_lens = data_ptr<const int32_t>(seq_lens),
        .prefix_states = data_ptr<StateT>(prefix_states),
        .batch_size = static_cast<uint32_t>(B.unwrap()),
        .window = static_cast<uint32_t>(window),
        .num_slots = num_slots,
    };
    LaunchKernel(static_cast<uint32_t>(blocks), Layout::kThreads, device.unwrap(), early_launch_smem)
        .enable_pdl(kUsePDL)(kKernel, params);
  }

  /// \brief `run_commit(kv_score_buffer, prefix_states, indices, accept_lens)`: docs/SPEC.md section 9.
  static void run_commit(tvm::ffi::TensorView kv_score_buffer, tvm::ffi::TensorView prefix_states,
                         tvm::ffi::TensorView indices, tvm::ffi::TensorView accept_lens) {
    using namespace host;
    auto B = SymbolicSize{"batch_size"};
    auto R = SymbolicSize{"num_tokens"};
    auto device = SymbolicDevice{};
    device.set_options<kDLCUDA>();
    const int32_t num_slots = Checks::state_pool(kv_score_buffer, device);
    Checks::state_rows(prefix_states, R, device);
    Checks::per_request(indices, B, device, "indices");
    Checks::per_request(accept_lens, B, device, "accept_lens");
    const int64_t window = tokens_per_request(R.unwrap(), B.unwrap(), "prefix_states");
    verify_apart({{kv_score_buffer, "kv_score_buffer", true},
                  {prefix_states, "prefix_states", false},
                  {indices, "indices", false},
                  {accept_lens, "accept_lens", false}});
    if (B.unwrap() == 0) return;
    const CommitParams<StateT> params{
        .state = data_ptr<StateT>(kv_score_buffer),
        .prefix_states = data_ptr<const StateT>(prefix_states),
        .indices = data_ptr<const int32_t>(indices),
        .accept_lens = data_ptr<const int32_t>(accept_lens),
        .batch_size = static_cast<uint32_t>(B.unwrap()),
        .window = static_cast<uint32_t>(window),
        .num_slots = num_slots,
    };
    using Layout = CommitLayout<kHeadDim, StateT>;
    const int64_t threads = B.unwrap() * Layout::kThreadsPerRow;
    const auto blocks = div_ceil(threads, Layout::kThreads);
    LaunchKernel(static_cast<uint32_t>(blocks), Layout::kThreads, device.unwrap())
        .enable_pdl(kUsePDL)(c128_commit_kernel<kHeadDim, kUsePDL, StateT>, params);
  }

 private:
  /// \brief T = rows / B, which must divide evenly, with 1 <= T <= kMaxVerifyTokens (B = 0: no rows).
  static int64_t tokens_per_request(int64_t rows, int64_t batch, const char* name) {
    using host::CheckAs;
    if (batch == 0) {
      CheckAs("ValueError", rows == 0, "argument '", name, "': expected 0 rows for an empty batch, got ", rows);
      return 0;
    }
    CheckAs("ValueError", rows % batch == 0, "argument '", name, "': expected B*T rows with B = ", batch,
            " requests (indices), got ", rows, " rows, not a multiple of ", batch);
    const int64_t window = rows / batch;
    CheckAs("ValueError", window >= 1 && window <= kMaxVerifyTokens, "argument '", name,
            "': expected T = rows / B in [1, ", kMaxVerifyTokens, "] tokens per request, got T = ", window);
    CheckAs("ValueError", batch <= std::numeric_limits<int32_t>::max() / kMaxVerifyTokens, "argument 'indices': ",
            "expected at most ", std::numeric_limits<int32_t>::max() / kMaxVerifyTokens, " requests, got ", batch);
    return window;
  }

  static void prefill(const tvm::ffi::TensorView& kv_score_buffer, const tvm::ffi::TensorView& kv_score_input,
                      const tvm::ffi::TensorView& kv_compressed_output, const tvm::ffi::TensorView& ape,
                      const tvm::ffi::TensorView& indices, const tvm::ffi::TensorView& compress_plan,
                      const tvm::ffi::TensorView& write_plan,
                      const tvm::ffi::Optional<tvm::ffi::TensorView>& load_indices, bool compact_output) {
    using namespace host;
    auto N = SymbolicSize{"num_tokens"};
    auto B = SymbolicSize{"batch_size"};
    auto num_compress = SymbolicSize{"num_compress_rows"};
    auto num_write = SymbolicSize{"num_write_rows"};
    auto device = SymbolicDevice{};
    device.set_options<kDLCUDA>();
    // A compact output must have the compress plan's rows: the plan binds the
    // count first, so a mismatch names the output.
    if (compact_output) verify_plan(compress_plan, num_compress, device, "compress_plan");
    const int32_t num_slots = Checks::state_pool(kv_score_buffer, device);
    Checks::tokens_output_ape(kv_score_input, kv_compressed_output, ape, N, compact_output ? num_compress : N, device);
    Checks::per_request(indices, B, device, "indices");
    const auto load_from = load_indices.value_or(indices);
    Checks::per_request(load_from, B, device, "load_indices");
    verify_plan(compress_plan, num_compress, device, "compress_plan");
    verify_plan(write_plan, num_write, device, "write_plan");
    CheckAs("ValueError", N.unwrap() <= kMaxPlanLength, "argument 'kv_score_input': expected at most ",
            kMaxPlanLength, " rows, got ", N.unwrap());
    // A plan row's batch_id is 32-bit, and every planned request has a token.
    CheckAs("ValueError", B.unwrap() <= kMaxPlanLength, "argument 'indices': expected at most ", kMaxPlanLength,
            " requests, got ", B.unwrap());
    CheckAs("ValueError", num_compress.unwrap() <= kMaxPlanLength, "argument 'compress_plan': expected at most ",
            kMaxPlanLength, " rows, got ", num_compress.unwrap());
    CheckAs("ValueError", num_write.unwrap() <= kMaxPlanLength, "argument 'write_plan': expected at most ",
            kMaxPlanLength, " rows, got ", num_write.unwrap());
    verify_apart({{kv_score_buffer, "kv_score_buffer", true},
                  {kv_score_input, "kv_score_input", false},
                  {kv_compressed_output, "kv_compressed_output", true},
                  {ape, "ape", false},
                  {indices, "indices", false},
                  {load_indices, "load_indices", false},
                  {compress_plan, "compress_plan", false},
                  {write_plan, "write_plan", false}});

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
        .trigger_early = false,
    };
    const DLDevice dl_device = device.unwrap();
    // Pass 1 only reads states; pass 2 then overwrites them. Stream order
    // (PDL waits included) keeps every read of a slot before its write.
    params.plan = data_ptr<const PrefillPlan>(compress_plan);
    params.num_rows = static_cast<uint32_t>(num_compress.unwrap());
    const SliceOption compress_pass = launch_pass</*kWritePass=*/false>(params, dl_device);
    params.plan = data_ptr<const PrefillPlan>(write_plan);
    params.num_rows = static_cast<uint32_t>(num_write.unwrap());
    launch_pass</*kWritePass=*/true>(params, dl_device, params.overlap_passes ? &compress_pass : nullptr);
  }

  /// \brief Launches one pass over `params.num_rows` plan rows at the slice
  /// width choose_slice_width (c128_slice_width.cuh) picks for it; returns
  /// the option it ran. `beside`: the compress pass a write pass starts
  /// beside, if any.
  template <bool kWritePass>
  static SliceOption launch_pass(PrefillArgs params, DLDevice device, const SliceOption* beside = nullptr) {
    if (params.num_rows == 0) return SliceOption{};
    const PassRows rows = pass_rows<kWritePass>(params.num_rows, params.num_tokens, params.batch_size);
    params.num_split_rows = static_cast<uint32_t>(rows.split);
    const auto resident = per_slice_width(
        [&]<class Width>(Width) { return pass_resident_blocks<kWritePass, Width::kDim>(device); });
    const bool leave_half = !kWritePass && params.overlap_passes &&
                            leaves_room_for_write_pass(params.num_rows, params.num_tokens, params.batch_size);
    const SliceOption chosen = choose_slice_width<kHeadDim, kWritePass>(
        rows.split, rows.likely, int64_t{params.num_rows} - rows.split, resident, beside, leave_half);
    // A compress pass that a write pass follows lets it launch at once, so
    // that its blocks fill the SMs this pass's tail leaves idle.
    const bool starts_write_pass = !kWritePass && params.overlap_passes;
    const bool launched = with_slice_width(chosen.slice_dim, [&]<class Width>(Width) {
      if constexpr (slice_fits<kHeadDim, kWritePass>(Width::kDim)) {
        launch_grid<kWritePass, Width::kDim>(params, device, chosen, starts_write_pass);
        return true;
      } else {
        return false;
      }
    });
    host::RuntimeCheck(launched, "prefill slice width ", chosen.slice_dim, " has no kernel");
    return chosen;
  }

  /// \brief Whether a grid of `grid` blocks, out of `resident` that fit
  /// the GPU at once, lets the next kernel launch right after its
  /// PDL wait. The next kernel's blocks then take the slots this grid's
  /// blocks free as they finish: where they cannot all be placed at once,
  /// they pile onto the SMs that finished first and that kernel runs
  /// unbalanced. Where both grids fit at once, or this one runs in several
  /// waves anyway, the early launch only hides the next one's.
  static bool trigger_next_early(int64_t grid, int64_t resident) {
    return fills_at_most_half(grid, resident) || grid > resident;
  }

  /// \brief Dynamic shared memory (unused by its threads) for a decode or
  /// verify grid of `blocks` blocks of `kKernel`, `resident` of which fit
  /// the GPU at once, that launches the next kernel right after its PDL
  /// wait. Where trigger_next_early says no, it caps each SM at this grid's
  /// share of blocks, so that the next kernel's blocks cannot pile up
  /// either (float32 decode of 512 requests at head_dim 1024 3.55 -> 3.36
  /// us against no early launch, 1024 at head_dim 512 3.50 -> 3.34 us;
  /// docs/PERF_LOG.md); a share of all of an SM's slots needs no cap, nor
  /// does a launch without PDL. The carveout is left to the driver:
  /// preferring shared memory slowed the grids of more than one wave.
  template <auto kKernel>
  static size_t smem_for_early_launch(int32_t device_id, int64_t blocks, int64_t resident) {
    if (!kUsePDL || trigger_next_early(blocks, resident)) return 0;
    const int64_t sms = host::runtime::multiprocessor_count(device_id);
    const int64_t share = host::div_ceil(blocks, sms);
    if (share >= resident / sms) return 0;
    host::runtime::allow_dynamic_smem<kKernel>(device_id, host::runtime::max_dynamic_smem(device_id),
                                               /*prefer_shared=*/false);
    return host::runtime::smem_capping_residency(device_id, share);
  }

  template <bool kWritePass, uint32_t kSliceDim>
  static void launch_grid(PrefillArgs params, DLDevice device, const SliceOption& option, bool starts_write_pass) {
    using Layout = PrefillLayout<kHeadDim, kSliceDim>;
    constexpr auto kKernel = c128_prefill_kernel<kHeadDim, kSliceDim, kWritePass, kUsePDL, StateT>;
    params.trigger_early = starts_write_pass || trigger_next_early(option.blocks, option.resident);
    const int64_t blocks = option.blocks + (has_wait_block<kUsePDL, kWritePass>(params.overlap_passes) ? 1 : 0);
    host::LaunchKernel(static_cast<uint32_t>(blocks), Layout::kThreads, device, ring_smem<Layout>(device))
        .enable_pdl(kUsePDL)(kKernel, params);
  }

  /// \brief A prefill block's dynamic shared memory: its token ring, padded
  /// so that no more than Layout::kMinBlocksPerSM blocks fit an SM, the
  /// residency the width rule counts. Where registers and ring would let a
  /// ninth in, the next pass's blocks took that slot early and slowed the
  /// pass they overlapped: bf16 head_dim 512 1 x 32768 tokens of a padded
  /// plan ran 50.1 us against 48.1 with the padding (H100; docs/PERF_LOG.md).
  template <class Layout>
  static size_t ring_smem(DLDevice device) {
    return std::max<size_t>(Layout::kRingBytes,
                            host::runtime::smem_capping_residency(device.device_id, Layout::kMinBlocksPerSM));
  }

  /// \brief Blocks of one pass's kernel at one slice width that fit on the GPU at once.
  template <bool kWritePass, uint32_t kSliceDim>
  static int64_t pass_resident_blocks(DLDevice device) {
    if constexpr (!slice_fits<kHeadDim, kWritePass>(kSliceDim)) {
      return 0;
    } else {
      return resident_blocks<c128_prefill_kernel<kHeadDim, kSliceDim, kWritePass, kUsePDL, StateT>,
                             PrefillLayout<kHeadDim, kSliceDim>>(device);
    }
  }

  /// \brief Blocks of a prefill kernel that fit on the GPU at once, with
  /// their token rings, counted at most Layout::kMinBlocksPerSM an SM: the
  /// slice-width rule was tuned at that residency, and its grids (so which
  /// warps sum which tokens) then do not move with a kernel's registers or
  /// ring. ring_smem holds the hardware to the same count where it can.
  template <auto kKernel, class Layout>
  static int64_t resident_blocks(DLDevice device) {
    const size_t smem = ring_smem<Layout>(device);
    host::runtime::allow_dynamic_smem<kKernel>(device.device_id, smem);
    const int64_t fit = host::runtime::resident_blocks<kKernel>(device.device_id, Layout::kThreads, smem);
    const int64_t planned = int64_t{Layout::kMinBlocksPerSM} * host::runtime::multiprocessor_count(device.device_id);
    return std::min(fit, planned);
  }
};

}  // namespace flash_compress::c128
