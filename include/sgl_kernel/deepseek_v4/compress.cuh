// The 16-byte plan row shared by DeepSeek-V4's compressor kernels, and the
// constants of its format (docs/SPEC.md section 4). This is the one C++ home
// of the format; python/flash_compress/plan_rows.py is the Python one.
#pragma once

#include <cstdint>

namespace device::compress {

/// \brief Bytes in one plan row: four uint32 fields, stored and loaded as one 16-byte vector.
inline constexpr uint32_t kPrefillPlanBytes = 16;

/// \brief One segment of a prefill: `{ragged_id, batch_id, position,
/// window_len}` of the segment's LAST token. Downstream kernels read a plan
/// tensor as rows of this type, so the layout is fixed: four little-endian
/// uint32 fields, 16 bytes, 16-byte aligned.
struct alignas(kPrefillPlanBytes) PrefillPlan {
  /// \brief Row of the segment's last token in the ragged input.
  uint32_t ragged_id;
  /// \brief Request index (into `indices` / `load_indices`).
  uint32_t batch_id;
  /// \brief Global position (within its request) of the segment's last token.
  uint32_t position;
  /// \brief Number of tokens in the segment (the online compressor: 1..kC128ChunkSize).
  uint32_t window_len;
};
static_assert(sizeof(PrefillPlan) == kPrefillPlanBytes && alignof(PrefillPlan) == kPrefillPlanBytes);

/// \brief Field value of padding rows (CUDA-graph plans): all bits set.
inline constexpr uint32_t kPlanSentinel = 0xFFFFFFFFu;

/// \brief Longest seq_len, largest sum(extend_lens) and most rows a plan can
/// describe: ragged ids and positions are uint32 and the all-ones value marks padding.
inline constexpr int64_t kMaxPlanLength = int64_t{kPlanSentinel} - 1;

/// \brief Token positions per chunk of the c128 compressor: a chunk closes at
/// `position % kC128ChunkSize == kC128ChunkSize - 1`, and a segment holds at
/// most this many tokens.
inline constexpr uint32_t kC128ChunkSize = 128;

}  // namespace device::compress

namespace host::compress {

using device::compress::PrefillPlan;
/// \brief Plan tensors are `[rows, kPrefillPlanDim]` uint8: one row of bytes per PrefillPlan.
using PrefillPlanTensorDtype = uint8_t;
inline constexpr int64_t kPrefillPlanDim = device::compress::kPrefillPlanBytes / sizeof(PrefillPlanTensorDtype);

}  // namespace host::compress
