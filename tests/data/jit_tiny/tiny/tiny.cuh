// A deliberately tiny CUDA header for the JIT cache tests: it compiles in seconds.
#pragma once

#include <cstdint>

#include "tiny/value.h"

namespace jit_tiny {

// Never launched (the tests run without a GPU); it makes nvcc emit real device code.
__global__ void add_value_kernel(float* data, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += static_cast<float>(kValue);
}

// Host functions the tests call through the tvm-ffi module.
inline int64_t add_value(int64_t x) { return x + kValue; }

inline bool has_kernel() { return reinterpret_cast<const void*>(&add_value_kernel) != nullptr; }

}  // namespace jit_tiny
