// Device queries, cached per device: they sit on every launch's path.
#pragma once

#include <cuda_runtime.h>
#include <sgl_kernel/utils.cuh>

#include <array>
#include <atomic>

namespace host::runtime {

inline constexpr int kMaxDevices = 64;

/// \brief Number of multiprocessors of CUDA device `device_id`.
inline int multiprocessor_count(int device_id) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  RuntimeCheck(device_id >= 0 && device_id < kMaxDevices, "CUDA device id ", device_id, " out of range");
  int count = cache[device_id].load(std::memory_order_relaxed);
  if (count == 0) {
    CheckCuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_id), "cudaDeviceGetAttribute");
    cache[device_id].store(count, std::memory_order_relaxed);
  }
  return count;
}

/// \brief Lets `kKernel` launch on `device_id` with up to `bytes` of dynamic
/// shared memory (more than 48 KiB needs this opt-in) and prefers the
/// largest shared-memory carveout. Cached per kernel: call it with one size.
template <auto kKernel>
inline void allow_dynamic_smem(int device_id, size_t bytes) {
  static std::array<std::atomic<bool>, kMaxDevices> done{};
  RuntimeCheck(device_id >= 0 && device_id < kMaxDevices, "CUDA device id ", device_id, " out of range");
  if (done[device_id].load(std::memory_order_relaxed)) return;
  tvm::ffi::CUDADeviceGuard guard(device_id);
  CheckCuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
            "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  CheckCuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
            "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  done[device_id].store(true, std::memory_order_relaxed);
}

/// \brief How many blocks of `kernel` (with `block_threads` threads) fit on
/// all multiprocessors of `device_id` at once. One cache per kernel.
template <auto kKernel>
inline int resident_blocks(int device_id, int block_threads, size_t dynamic_smem = 0) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  RuntimeCheck(device_id >= 0 && device_id < kMaxDevices, "CUDA device id ", device_id, " out of range");
  int blocks = cache[device_id].load(std::memory_order_relaxed);
  if (blocks == 0) {
    tvm::ffi::CUDADeviceGuard guard(device_id);
    int per_sm = 0;
    CheckCuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, block_threads, dynamic_smem),
              "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    blocks = (per_sm > 0 ? per_sm : 1) * multiprocessor_count(device_id);
    cache[device_id].store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

}  // namespace host::runtime
