// The online c128 compressor's prefill planner: cuts each request's new tokens
// into per-chunk segments, as rows of the 16-byte plan in docs/SPEC.md section 4.
//
// Two planners write the same bytes from the same row formulas
// (c128_plan_kernel.cuh): a host loop for CPU / pinned lengths, which
// validates and raises, and a GPU kernel for CUDA lengths, which runs on the
// current stream without a host sync and reports invalid input through an
// error flag instead. This file holds the host loop, every argument check, the
// GPU planner's launch and the tvm-ffi exports.
#pragma once

#include <dlpack/dlpack.h>
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/container/tuple.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "c128_plan_kernel.cuh"

namespace flash_compress::c128 {

// ---------------------------------------------------------------------------
// Host planner.
// ---------------------------------------------------------------------------

struct PlanCounts {
  int64_t num_compress;
  int64_t num_write;
};

/// \brief Writes every request's compress rows and write row, requests in
/// order, packed from row 0 of each plan. Inputs must already be validated.
inline PlanCounts plan_segments(const int64_t* extend_lens, const int64_t* seq_lens, int64_t batch_size,
                                PrefillPlan* compress_plan, PrefillPlan* write_plan) {
  PlanCounts counts{0, 0};
  int64_t ragged_start = 0;  // ragged row of the request's first new token
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t seq_len = seq_lens[b];
    const int64_t prefix = seq_len - extend_lens[b];
    const int64_t num_compress = compress_rows_of(prefix, seq_len);
    for (int64_t k = 0; k < num_compress; ++k) {
      compress_plan[counts.num_compress++] = compress_row_of(prefix, ragged_start, b, k);
    }
    if (has_write_row(seq_len)) write_plan[counts.num_write++] = write_row_of(prefix, seq_len, ragged_start, b);
    ragged_start += extend_lens[b];
  }
  return counts;
}

inline void fill_sentinel_rows(PrefillPlan* plan, int64_t begin, int64_t end) {
  constexpr PrefillPlan kPadding{kPlanSentinel, kPlanSentinel, kPlanSentinel, kPlanSentinel};
  std::fill(plan + begin, plan + end, kPadding);
}

using PlanResult = tvm::ffi::Tuple<int64_t, int64_t>;

/// \brief A plan: uint8 `[rows, 16]`, contiguous, rows 16-byte aligned (the
/// kernels load whole rows), on `device`.
inline void verify_plan(const tvm::ffi::TensorView& plan, host::SymbolicSize& rows, host::SymbolicDevice& device,
                        const char* name) {
  host::TensorMatcher({rows, host::compress::kPrefillPlanDim})
      .with_dtype<host::compress::PrefillPlanTensorDtype>()
      .with_device(device)
      .with_alignment(alignof(PrefillPlan))
      .verify(plan, name);
}

/// \brief Both plans of a planner call, `[M, 16]` each.
inline void verify_plans(const tvm::ffi::TensorView& compress_plan, const tvm::ffi::TensorView& write_plan,
                         host::SymbolicSize& M, host::SymbolicDevice& device) {
  verify_plan(compress_plan, M, device, "compress_plan");
  verify_plan(write_plan, M, device, "write_plan");
}

/// \brief The host path: int64 [B] lengths and uint8 [M, 16] plans, all on
/// the CPU or pinned. Everything is validated before the first byte is
/// written; see `C128Planner::plan`.
inline PlanResult plan_on_host(const tvm::ffi::TensorView& extend_lens, const tvm::ffi::TensorView& seq_lens,
                               const tvm::ffi::TensorView& compress_plan, const tvm::ffi::TensorView& write_plan,
                               bool use_cuda_graph) {
  using namespace host;
  auto B = SymbolicSize{"batch_size"};
  auto M = SymbolicSize{"num_tokens"};
  // Each tensor is plain or pinned host memory on its own: an engine may pin
  // some of its lengths or plans (to copy them asynchronously) and not others.
  SymbolicDevice host[4];
  for (auto& device : host) device.set_options<kDLCPU, kDLCUDAHost>();
  TensorMatcher({B}).with_dtype<int64_t>().with_device(host[0]).verify(extend_lens, "extend_lens");
  TensorMatcher({B}).with_dtype<int64_t>().with_device(host[1]).verify(seq_lens, "seq_lens");
  verify_plan(compress_plan, M, host[2], "compress_plan");
  verify_plan(write_plan, M, host[3], "write_plan");
  verify_apart({{extend_lens, "extend_lens", false},
                {seq_lens, "seq_lens", false},
                {compress_plan, "compress_plan", true},
                {write_plan, "write_plan", true}});

  const int64_t batch_size = B.unwrap();
  const int64_t num_rows = M.unwrap();
  const auto* extend = data_ptr<const int64_t>(extend_lens);
  const auto* seq = data_ptr<const int64_t>(seq_lens);
  int64_t total = 0;
  for (int64_t b = 0; b < batch_size; ++b) {
    CheckAs("ValueError", 0 < extend[b] && extend[b] <= seq[b], "argument 'extend_lens': expected 0 < extend_lens[",
            b, "] <= seq_lens[", b, "], got extend_lens[", b, "] = ", extend[b], " and seq_lens[", b, "] = ", seq[b]);
    CheckAs("ValueError", seq[b] <= kMaxPlanLength, "argument 'seq_lens': expected seq_lens[", b,
            "] <= ", kMaxPlanLength, ", got ", seq[b]);
    total += extend[b];
    CheckAs("ValueError", total <= kMaxPlanLength, "argument 'extend_lens': expected a sum <= ", kMaxPlanLength,
            ", got ", total, " after the first ", b + 1, " entries");
  }
  constexpr int64_t kWidth = compress::kPrefillPlanDim;
  CheckAs("ValueError", total == num_rows, "argument 'compress_plan': expected [sum(extend_lens), ", kWidth, "] = [",
          total, ", ", kWidth, "] (write_plan too), got [", num_rows, ", ", kWidth, "]");

  auto* compress = data_ptr<PrefillPlan>(compress_plan);
  auto* write = data_ptr<PrefillPlan>(write_plan);
  const PlanCounts counts = plan_segments(extend, seq, batch_size, compress, write);
  if (!use_cuda_graph) return PlanResult(counts.num_compress, counts.num_write);
  fill_sentinel_rows(compress, counts.num_compress, num_rows);
  fill_sentinel_rows(write, counts.num_write, num_rows);
  return PlanResult(num_rows, num_rows);
}


// ---------------------------------------------------------------------------
// GPU planner: its checks and launch (the kernel is in c128_plan_kernel.cuh).
// ---------------------------------------------------------------------------

/// Rows each thread writes in a grid of the chosen size (a launch-size knob:
/// fewer blocks means fewer redundant scans).
inline constexpr int64_t kPlanRowsPerThread = 8;

/// \brief Checks a CUDA lengths tensor's dtype (int32 or int64); true for int32.
inline bool lengths_are_int32(const tvm::ffi::TensorView& lengths, const char* name) {
  using namespace host;
  const DLDataType dtype = lengths.dtype();
  const bool is_int32 = same_dtype(dtype, DTypeOf<int32_t>::value);
  CheckAs("TypeError", is_int32 || same_dtype(dtype, DTypeOf<int64_t>::value), "argument '", name,
          "': expected dtype int64 or int32, got ", dtype_to_string(dtype));
  return is_int32;
}

/// \brief The GPU path: int32 or int64 [B] CUDA lengths, uint8 [M, 16] plans
/// and optional int32 or int64 [3] counts, all on one CUDA device. Checks only
/// what the host sees without a sync; see `C128Planner::plan_counted`.
template <bool kUsePDL>
inline PlanResult plan_on_device(const tvm::ffi::TensorView& extend_lens, const tvm::ffi::TensorView& seq_lens,
                                 const tvm::ffi::TensorView& compress_plan, const tvm::ffi::TensorView& write_plan,
                                 const tvm::ffi::Optional<tvm::ffi::TensorView>& counts) {
  using namespace host;
  auto B = SymbolicSize{"batch_size"};
  auto M = SymbolicSize{"num_tokens"};
  auto device = SymbolicDevice{};
  device.set_options<kDLCUDA>();
  TensorMatcher({B}).with_device(device).verify(extend_lens, "extend_lens");
  TensorMatcher({B}).with_device(device).verify(seq_lens, "seq_lens");
  const bool extend_int32 = lengths_are_int32(extend_lens, "extend_lens");
  const bool seq_int32 = lengths_are_int32(seq_lens, "seq_lens");
  verify_plans(compress_plan, write_plan, M, device);
  bool counts_int64 = false;
  if (counts.has_value()) {
    TensorMatcher({3}).with_device(device).verify(*counts, "counts");
    counts_int64 = !lengths_are_int32(*counts, "counts");
  }
  const int64_t num_rows = M.unwrap();
  CheckAs("ValueError", B.unwrap() <= kMaxPlanBatch, "argument 'extend_lens': expected at most ", kMaxPlanBatch,
          " requests, got ", B.unwrap());
  CheckAs("ValueError", num_rows <= kMaxPlanLength, "argument 'compress_plan': expected at most ", kMaxPlanLength,
          " rows, got ", num_rows);
  CheckAs("ValueError", !counts.has_value() || counts_int64 || num_rows <= std::numeric_limits<int32_t>::max(),
          "argument 'counts': int32 counts hold at most 2^31-1 rows, got plans of ", num_rows,
          " rows (pass int64 counts)");
  verify_apart({{extend_lens, "extend_lens", false},
                {seq_lens, "seq_lens", false},
                {compress_plan, "compress_plan", true},
                {write_plan, "write_plan", true},
                {counts, "counts", true}});

  const GpuPlanParams params{
      .extend_lens = DeviceLengths{data_ptr<const void>(extend_lens), extend_int32},
      .seq_lens = DeviceLengths{data_ptr<const void>(seq_lens), seq_int32},
      .compress_plan = data_ptr<PrefillPlan>(compress_plan),
      .write_plan = data_ptr<PrefillPlan>(write_plan),
      .counts = counts.has_value() ? data_ptr<void>(*counts) : nullptr,
      .counts_int64 = counts_int64,
      .batch_size = B.unwrap(),
      .num_rows = num_rows,
  };
  const DLDevice dl_device = device.unwrap();
  // Enough blocks for the ~2M rows to write, at most one per SM: each block
  // also rescans the batch.
  const int64_t wanted = (2 * num_rows + kPlanThreads * kPlanRowsPerThread - 1) / (kPlanThreads * kPlanRowsPerThread);
  const int64_t max_blocks = runtime::multiprocessor_count(dl_device.device_id);
  const auto blocks = static_cast<uint32_t>(std::clamp<int64_t>(wanted, 1, max_blocks));
  LaunchKernel(blocks, kPlanThreads, dl_device).enable_pdl(kUsePDL)(plan_online_prefill_kernel<kUsePDL>, params);
  return PlanResult(num_rows, num_rows);
}

// ---------------------------------------------------------------------------
// Exports (in the planner variant of each use_pdl and in every kernel variant;
// only the GPU launch uses PDL).
// ---------------------------------------------------------------------------

template <bool kUsePDL>
struct C128Planner {
  /// \brief `plan_online_prefill(extend_lens, seq_lens, compress_plan,
  /// write_plan, use_cuda_graph) -> (num_compress, num_write)`.
  ///
  /// Host lengths (CPU or pinned): int64 [B]; plans uint8 [M, 16] host
  /// tensors with M = sum(extend_lens). Validated before the first byte is
  /// written (ValueError / TypeError). With `use_cuda_graph` both plans are
  /// padded to M rows with sentinel rows and (M, M) is returned.
  ///
  /// CUDA lengths: the GPU planner, as `plan_counted` without counts.
  static PlanResult plan(tvm::ffi::TensorView extend_lens, tvm::ffi::TensorView seq_lens,
                         tvm::ffi::TensorView compress_plan, tvm::ffi::TensorView write_plan, bool use_cuda_graph) {
    return plan_counted(extend_lens, seq_lens, compress_plan, write_plan, use_cuda_graph,
                        tvm::ffi::Optional<tvm::ffi::TensorView>());
  }

  /// \brief `plan_online_prefill(extend_lens, seq_lens, compress_plan,
  /// write_plan, use_cuda_graph, counts) -> (M, M)`.
  ///
  /// CUDA lengths (int32 or int64 [B], may differ) with CUDA plans, on one
  /// device: plans on the GPU on the current stream, with no host sync, and
  /// always in the CUDA-graph form (valid rows first, then sentinel rows up to
  /// M; `use_cuda_graph` is ignored). Returns (M, M). `counts` (None or an
  /// int32 / int64 [3] tensor on the same device) receives (num_compress,
  /// num_write, error flag). Values the host cannot see do not raise: on
  /// invalid lengths both plans are all sentinel rows (the prefill kernels
  /// then do nothing) and the flag is non-zero (kPlanError* bits).
  ///
  /// Host lengths: `counts` must be None (errors raise and the counts are returned).
  static PlanResult plan_counted(tvm::ffi::TensorView extend_lens, tvm::ffi::TensorView seq_lens,
                                 tvm::ffi::TensorView compress_plan, tvm::ffi::TensorView write_plan,
                                 bool use_cuda_graph, tvm::ffi::Optional<tvm::ffi::TensorView> counts) {
    if (extend_lens.device().device_type == kDLCUDA) {
      return plan_on_device<kUsePDL>(extend_lens, seq_lens, compress_plan, write_plan, counts);
    }
    host::CheckAs("ValueError", !counts.has_value(),
                  "argument 'counts': expected None with host lengths (the host planner returns the counts and "
                  "raises on invalid lengths); counts are for CUDA lengths");
    return plan_on_host(extend_lens, seq_lens, compress_plan, write_plan, use_cuda_graph);
  }
};

}  // namespace flash_compress::c128
