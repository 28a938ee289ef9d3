// The online c128 compressor's prefill planner: cuts each request's new tokens
// into per-chunk segments, as rows of the 16-byte plan in SPEC.md section 4.
#pragma once

#include <dlpack/dlpack.h>
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/container/tuple.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace flash_compress::c128 {

using device::compress::kPlanSentinel;
using device::compress::PrefillPlan;

inline constexpr int64_t kPlanChunk = 128;

struct PlanCounts {
  int64_t num_compress;
  int64_t num_write;
};

/// \brief Cuts each request's new tokens `[seq_len - extend_len, seq_len)`
/// at chunk boundaries. A segment that closes a chunk becomes a compress row;
/// a request's trailing partial segment becomes its (only) write row. Rows
/// hold the segment's last token. Inputs must already be validated.
inline PlanCounts plan_segments(const int64_t* extend_lens, const int64_t* seq_lens, int64_t batch_size,
                                PrefillPlan* compress_plan, PrefillPlan* write_plan) {
  PlanCounts counts{0, 0};
  // 64-bit on purpose: the chunk end after a seq_len near 2^32 overflows uint32.
  int64_t ragged_start = 0;  // ragged row of the request's first new token
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t seq_len = seq_lens[b];
    const int64_t prefix_len = seq_len - extend_lens[b];
    for (int64_t begin = prefix_len; begin < seq_len;) {
      const int64_t chunk_end = (begin / kPlanChunk + 1) * kPlanChunk;
      const int64_t end = std::min(seq_len, chunk_end);
      const PrefillPlan row{
          .ragged_id = static_cast<uint32_t>(ragged_start + (end - 1 - prefix_len)),
          .batch_id = static_cast<uint32_t>(b),
          .position = static_cast<uint32_t>(end - 1),
          .window_len = static_cast<uint32_t>(end - begin),
      };
      if (end == chunk_end) {
        compress_plan[counts.num_compress++] = row;
      } else {
        write_plan[counts.num_write++] = row;
      }
      begin = end;
    }
    ragged_start += extend_lens[b];
  }
  return counts;
}

inline void fill_sentinel_rows(PrefillPlan* plan, int64_t begin, int64_t end) {
  constexpr PrefillPlan kPadding{kPlanSentinel, kPlanSentinel, kPlanSentinel, kPlanSentinel};
  std::fill(plan + begin, plan + end, kPadding);
}

/// \brief `plan_online_prefill(extend_lens, seq_lens, compress_plan,
/// write_plan, use_cuda_graph) -> (num_compress, num_write)`.
/// Lengths are int64 [B] host tensors (CPU or pinned); plans are uint8 [M, 16]
/// host tensors with M = sum(extend_lens). Everything is validated before the
/// first byte is written. With `use_cuda_graph` both plans are padded to M
/// rows with sentinel rows and (M, M) is returned.
using PlanResult = tvm::ffi::Tuple<int64_t, int64_t>;

inline PlanResult plan_online_prefill(tvm::ffi::TensorView extend_lens,
                                                             tvm::ffi::TensorView seq_lens,
                                                             tvm::ffi::TensorView compress_plan,
                                                             tvm::ffi::TensorView write_plan, bool use_cuda_graph) {
  using namespace host;
  using compress::kPrefillPlanDim;
  using compress::PrefillPlanTensorDtype;
  auto B = SymbolicSize{"batch_size"};
  auto M = SymbolicSize{"num_tokens"};
  auto lens_device = SymbolicDevice{};
  auto plan_device = SymbolicDevice{};
  lens_device.set_options<kDLCPU, kDLCUDAHost>();
  plan_device.set_options<kDLCPU, kDLCUDAHost>();
  TensorMatcher({B}).with_dtype<int64_t>().with_device(lens_device).verify(extend_lens, "extend_lens");
  TensorMatcher({B}).with_dtype<int64_t>().with_device(lens_device).verify(seq_lens, "seq_lens");
  const auto plan_matcher = TensorMatcher({M, kPrefillPlanDim})
                                .with_dtype<PrefillPlanTensorDtype>()
                                .with_device(plan_device)
                                .with_alignment(alignof(PrefillPlan));
  plan_matcher.verify(compress_plan, "compress_plan");
  plan_matcher.verify(write_plan, "write_plan");

  const int64_t batch_size = B.unwrap();
  const int64_t num_rows = M.unwrap();
  const auto* extend = data_ptr<const int64_t>(extend_lens);
  const auto* seq = data_ptr<const int64_t>(seq_lens);
  // Ragged ids and positions are uint32 and all-ones marks padding.
  constexpr int64_t kMaxLength = std::numeric_limits<uint32_t>::max() - 1;
  int64_t total = 0;
  for (int64_t b = 0; b < batch_size; ++b) {
    CheckAs("ValueError", 0 < extend[b] && extend[b] <= seq[b], "argument 'extend_lens': expected 0 < extend_lens[",
            b, "] <= seq_lens[", b, "], got extend_lens[", b, "] = ", extend[b], " and seq_lens[", b, "] = ", seq[b]);
    CheckAs("ValueError", seq[b] <= kMaxLength, "argument 'seq_lens': expected seq_lens[", b, "] <= ", kMaxLength,
            ", got ", seq[b]);
    total += extend[b];
    CheckAs("ValueError", total <= kMaxLength, "argument 'extend_lens': expected a sum <= ", kMaxLength,
            ", got more");
  }
  CheckAs("ValueError", total == num_rows, "argument 'compress_plan': expected [sum(extend_lens), 16] = [", total,
          ", 16] (write_plan too), got [", num_rows, ", 16]");

  auto* compress = data_ptr<PrefillPlan>(compress_plan);
  auto* write = data_ptr<PrefillPlan>(write_plan);
  const PlanCounts counts = plan_segments(extend, seq, batch_size, compress, write);
  if (!use_cuda_graph) return PlanResult(counts.num_compress, counts.num_write);
  fill_sentinel_rows(compress, counts.num_compress, num_rows);
  fill_sentinel_rows(write, counts.num_write, num_rows);
  return PlanResult(num_rows, num_rows);
}

}  // namespace flash_compress::c128
