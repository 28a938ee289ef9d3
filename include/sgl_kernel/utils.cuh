// Device basics (PDL, warp size) and the host-side kernel launcher.
#pragma once

#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <sgl_kernel/utils.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>

#include <cstdint>

#define SGL_DEVICE __device__ __forceinline__

namespace device {

inline constexpr uint32_t kWarpThreads = 32;

/// \brief With PDL, a kernel may start while the previous kernel in the
/// stream is still running; this waits until that kernel has completed and
/// its writes are visible. Call it before the first read of anything an
/// earlier kernel may write. A no-op without PDL or below sm_90.
template <bool kUsePDL>
SGL_DEVICE void PDLWaitPrimary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kUsePDL) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// \brief Lets the next PDL kernel in the stream start launching. Safe at any
/// point for a next kernel that waits (PDLWaitPrimary) before it reads or
/// writes memory this one uses; one that writes before its wait needs this
/// called only once this kernel's inputs are consumed (docs/SPEC.md section 5).
template <bool kUsePDL>
SGL_DEVICE void PDLTriggerSecondary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kUsePDL) asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace device

namespace host {

inline void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) [[unlikely]] {
    detail::throw_error("RuntimeError",
                        std::string(what) + " failed: " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

/// \brief The stream the caller's framework set for `device` (tvm-ffi hands
/// it over); the legacy default stream when none was set.
inline cudaStream_t CurrentStream(DLDevice device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
}

/// \brief Launches a kernel on `device`'s current stream:
/// `LaunchKernel(grid, block, device).enable_pdl(flag)(kernel, params...)`.
/// The launch happens with `device` current (restored afterwards), so it
/// never depends on the caller's current device, and its error is checked.
class LaunchKernel {
 public:
  LaunchKernel(dim3 grid, dim3 block, DLDevice device, size_t dynamic_smem = 0)
      : grid_(grid), block_(block), device_(device), dynamic_smem_(dynamic_smem) {}

  LaunchKernel& enable_pdl(bool enable) {
    use_pdl_ = enable;
    return *this;
  }

  template <typename... KernelArgs, typename... Args>
  void operator()(void (*kernel)(KernelArgs...), Args&&... args) const {
    tvm::ffi::CUDADeviceGuard guard(device_.device_id);
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid_;
    config.blockDim = block_;
    config.dynamicSmemBytes = dynamic_smem_;
    config.stream = CurrentStream(device_);
    config.attrs = use_pdl_ ? &attribute : nullptr;
    config.numAttrs = use_pdl_ ? 1 : 0;
    CheckCuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "cudaLaunchKernelEx");
    CheckCuda(cudaGetLastError(), "kernel launch");
  }

 private:
  dim3 grid_;
  dim3 block_;
  DLDevice device_;
  size_t dynamic_smem_;
  bool use_pdl_ = false;
};

}  // namespace host
