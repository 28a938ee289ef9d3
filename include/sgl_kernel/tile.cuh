// Strided tile access: thread `t` of a group of `n` threads touches vectors
// `t, t + n, t + 2n, ...`, so each access of the group is one coalesced span.
#pragma once

#include <sgl_kernel/utils.cuh>

#include <cstdint>

namespace device::tile {

template <typename Vec>
class Memory {
 public:
  SGL_DEVICE Memory(uint32_t thread_index, uint32_t num_threads) : thread_(thread_index), stride_(num_threads) {}

  /// \brief The whole CTA as one group of `n` threads (`threadIdx.x < n`).
  SGL_DEVICE static Memory cta(uint32_t n) { return Memory(threadIdx.x, n); }

  /// \brief Vector `thread + i*n` of `ptr`.
  SGL_DEVICE Vec load(const void* ptr, int64_t i = 0) const {
    Vec v;
    v.load(ptr, index(i));
    return v;
  }
  SGL_DEVICE void store(void* ptr, const Vec& v, int64_t i = 0) const { v.store(ptr, index(i)); }

 private:
  SGL_DEVICE int64_t index(int64_t i) const { return static_cast<int64_t>(thread_) + i * stride_; }
  uint32_t thread_;
  uint32_t stride_;
};

}  // namespace device::tile
