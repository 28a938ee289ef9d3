// Asynchronous global -> shared copies (cp.async, sm_80+): loads whose bytes
// stay in flight without holding registers, so a thread can keep several
// rounds of a stream outstanding while it computes on an earlier one.
#pragma once

#include <sgl_kernel/utils.cuh>

#include <cstdint>

// Device passes only (__CUDA_ARCH__ is the arch being compiled): a build for an
// older arch stops here, with this line as nvcc's first error, not in ptxas.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "sgl_kernel/async_copy.cuh: cp.async needs sm_80 or newer; drop the older archs from the arch list"
#endif

namespace device::async_copy {

/// \brief Starts copying 16 bytes from global `src` to shared `dst` (both
/// 16-byte aligned). Cached in L2 only (cp.async.cg): the bytes are read
/// once, from shared. `kKeepInL1` (cp.async.ca) also keeps them in L1, for a
/// small read-only table that the SM's warps read again.
template <bool kKeepInL1 = false>
SGL_DEVICE void copy_16(void* dst, const void* src) {
  const auto shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (kKeepInL1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(src) : "memory");
  }
}

/// \brief Closes the group of copies this thread started since the last
/// commit (an empty group if none), so `wait` can count it.
SGL_DEVICE void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

/// \brief Returns once at most `kPending` of this thread's committed groups
/// are still in flight; the bytes of all older groups are then in shared
/// memory, visible to this thread.
template <uint32_t kPending>
SGL_DEVICE void wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

}  // namespace device::async_copy
