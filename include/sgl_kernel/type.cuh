// Element types and conversions between them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <sgl_kernel/utils.cuh>

namespace device {

using fp16_t = __half;
using bf16_t = __nv_bfloat16;

/// \brief Converts between float, fp16 and bf16 (and any pair that
/// static_cast handles) with round-to-nearest.
template <typename To, typename From>
SGL_DEVICE To cast(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, fp16_t>) {
    return static_cast<To>(__half2float(x));
  } else if constexpr (std::is_same_v<From, bf16_t>) {
    return static_cast<To>(__bfloat162float(x));
  } else if constexpr (std::is_same_v<To, fp16_t>) {
    return __float2half_rn(static_cast<float>(x));
  } else if constexpr (std::is_same_v<To, bf16_t>) {
    return __float2bfloat16_rn(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

}  // namespace device
