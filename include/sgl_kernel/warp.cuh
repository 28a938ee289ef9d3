// Reductions across aligned groups of N lanes of a warp, by butterfly shuffles.
#pragma once

#include <sgl_kernel/utils.cuh>

#include <cstdint>

namespace device::warp {

template <uint32_t N, typename T, typename Op>
SGL_DEVICE T reduce(T value, Op op) {
  static_assert(N >= 1 && N <= kWarpThreads && (N & (N - 1)) == 0, "group size must be a power of two <= 32");
#pragma unroll
  for (uint32_t offset = N / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

/// \brief Maximum over each aligned group of N lanes; every lane gets it.
template <uint32_t N, typename T>
SGL_DEVICE T reduce_max(T value) {
  return reduce<N>(value, [](T a, T b) { return a > b ? a : b; });
}

/// \brief Sum over each aligned group of N lanes; every lane gets it.
template <uint32_t N, typename T>
SGL_DEVICE T reduce_sum(T value) {
  return reduce<N>(value, [](T a, T b) { return a + b; });
}

}  // namespace device::warp
