// Device queries, cached per device: they sit on every launch's path.
#pragma once

#include <cuda_runtime.h>
#include <sgl_kernel/utils.cuh>

#include <algorithm>
#include <array>
#include <atomic>

namespace host::runtime {

inline constexpr int kMaxDevices = 64;

/// \brief Attribute `kAttr` of CUDA device `device_id`.
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device_id) {
  // Stored plus one: 0 marks a value not yet read (an attribute may be 0).
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  RuntimeCheck(device_id >= 0 && device_id < kMaxDevices, "CUDA device id ", device_id, " out of range");
  int stored = cache[device_id].load(std::memory_order_relaxed);
  if (stored == 0) {
    int value = 0;
    CheckCuda(cudaDeviceGetAttribute(&value, kAttr, device_id), "cudaDeviceGetAttribute");
    stored = value + 1;
    cache[device_id].store(stored, std::memory_order_relaxed);
  }
  return stored - 1;
}

/// \brief Number of multiprocessors of CUDA device `device_id`.
inline int multiprocessor_count(int device_id) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(device_id);
}

/// \brief The most dynamic shared memory one block may opt in to on `device_id`.
inline size_t max_dynamic_smem(int device_id) {
  return static_cast<size_t>(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device_id));
}

/// \brief Dynamic shared memory per block with which at most `blocks_per_sm`
/// (>= 1) blocks fit on one multiprocessor of `device_id`, whatever else
/// would let more in; 0 where no size caps that low. Sizes over 48 KiB need
/// allow_dynamic_smem.
inline size_t smem_capping_residency(int device_id, int64_t blocks_per_sm) {
  RuntimeCheck(blocks_per_sm >= 1, "blocks_per_sm must be at least 1, got ", blocks_per_sm);
  const auto per_sm = static_cast<size_t>(device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device_id));
  const auto reserved = static_cast<size_t>(device_attribute<cudaDevAttrReservedSharedMemoryPerBlock>(device_id));
  // blocks_per_sm blocks of per_sm / blocks_per_sm bytes (reservation included) fit; one more does not.
  const size_t per_block = per_sm / static_cast<size_t>(blocks_per_sm);
  return per_block > reserved ? std::min(per_block - reserved, max_dynamic_smem(device_id)) : 0;
}

/// \brief Lets `kKernel` launch on `device_id` with up to `bytes` of dynamic
/// shared memory (more than 48 KiB needs this opt-in) and, with
/// `prefer_shared`, asks for the largest shared-memory carveout at every
/// launch (without, the driver sizes it to each launch's needs and leaves
/// the rest to L1). Cached per kernel: call it with one set of arguments.
template <auto kKernel>
inline void allow_dynamic_smem(int device_id, size_t bytes, bool prefer_shared = true) {
  static std::array<std::atomic<bool>, kMaxDevices> done{};
  RuntimeCheck(device_id >= 0 && device_id < kMaxDevices, "CUDA device id ", device_id, " out of range");
  if (done[device_id].load(std::memory_order_relaxed)) return;
  tvm::ffi::CUDADeviceGuard guard(device_id);
  CheckCuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
            "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (prefer_shared) {
    CheckCuda(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
        "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  }
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
