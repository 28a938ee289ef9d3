// One wide register vector: a single 8- or 16-byte load or store per thread.
#pragma once

#include <sgl_kernel/utils.cuh>

#include <cstddef>
#include <cstdint>

namespace device {

namespace detail {
/// The word `__ldg` reads for a vector of `kBytes` bytes.
template <std::size_t kBytes>
struct ReadOnlyWord;
template <>
struct ReadOnlyWord<16> {
  using type = uint4;
};
template <>
struct ReadOnlyWord<8> {
  using type = uint2;
};
template <>
struct ReadOnlyWord<4> {
  using type = unsigned int;
};
template <>
struct ReadOnlyWord<2> {
  using type = unsigned short;
};
}  // namespace detail

template <typename T, uint32_t N>
struct alignas(sizeof(T) * N) AlignedVector {
  static_assert((N & (N - 1)) == 0, "vector width must be a power of two");
  static constexpr uint32_t kSize = N;
  T data[N];

  SGL_DEVICE T& operator[](uint32_t i) { return data[i]; }
  SGL_DEVICE const T& operator[](uint32_t i) const { return data[i]; }

  /// \brief Loads vector `i` of `ptr` (elements `i*N .. i*N+N-1`).
  SGL_DEVICE void load(const void* ptr, int64_t i = 0) { *this = reinterpret_cast<const AlignedVector*>(ptr)[i]; }
  /// \brief `load` through the read-only data path (`ld.global.nc`), for
  /// global memory that nothing writes while the kernel runs.
  SGL_DEVICE void load_read_only(const void* ptr, int64_t i = 0) {
    using Word = typename detail::ReadOnlyWord<sizeof(AlignedVector)>::type;
    *reinterpret_cast<Word*>(data) = __ldg(reinterpret_cast<const Word*>(ptr) + i);
  }
  /// \brief Stores into vector `i` of `ptr`.
  SGL_DEVICE void store(void* ptr, int64_t i = 0) const { reinterpret_cast<AlignedVector*>(ptr)[i] = *this; }

  SGL_DEVICE void fill(T value) {
#pragma unroll
    for (uint32_t k = 0; k < N; ++k) data[k] = value;
  }
};

}  // namespace device
