// The 16-byte plan row shared by DeepSeek-V4's compressor kernels.
#pragma once

#include <cstdint>

namespace device::compress {

/// \brief One segment of a prefill: `{ragged_id, batch_id, position,
/// window_len}` of the segment's LAST token. Downstream kernels read a plan
/// tensor as rows of this type, so the layout is fixed: four little-endian
/// uint32 fields, 16 bytes, 16-byte aligned.
struct alignas(16) PrefillPlan {
  /// \brief Row of the segment's last token in the ragged input.
  uint32_t ragged_id;
  /// \brief Request index (into `indices` / `load_indices`).
  uint32_t batch_id;
  /// \brief Global position (within its request) of the segment's last token.
  uint32_t position;
  /// \brief Number of tokens in the segment (the online compressor: 1..128).
  uint32_t window_len;
};
static_assert(sizeof(PrefillPlan) == 16 && alignof(PrefillPlan) == 16);

/// \brief Field value of padding rows (CUDA-graph plans): all bits set.
inline constexpr uint32_t kPlanSentinel = 0xFFFFFFFFu;

}  // namespace device::compress

namespace host::compress {

using device::compress::PrefillPlan;
/// \brief Plan tensors are `[rows, 16]` uint8.
using PrefillPlanTensorDtype = uint8_t;
inline constexpr int64_t kPrefillPlanDim = sizeof(PrefillPlan);

}  // namespace host::compress
