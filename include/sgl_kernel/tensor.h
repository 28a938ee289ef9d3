// Host-side tensor checks for kernel export boundaries.
//
// A kernel's export describes each argument once (rank, sizes, dtype, device)
// and `TensorMatcher::verify` refuses anything else with a message that names
// the argument, what was expected and what came. Sizes shared between
// arguments are `SymbolicSize`s: the first tensor binds them, later ones must
// agree. Devices likewise: a `SymbolicDevice` binds to the first tensor's
// device and refuses tensors on another device type or another device id.
#pragma once

#include <dlpack/dlpack.h>
#include <sgl_kernel/utils.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

namespace host {

inline const char* device_type_name(int32_t device_type) {
  switch (device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda";
    case kDLCUDAHost:
      return "cuda_host";
    case kDLCUDAManaged:
      return "cuda_managed";
    case kDLROCM:
      return "rocm";
    case kDLMetal:
      return "metal";
    case kDLVulkan:
      return "vulkan";
    case kDLOpenCL:
      return "opencl";
    default:
      return "unknown_device";
  }
}

inline std::string device_to_string(DLDevice device) {
  std::string out = device_type_name(device.device_type);
  if (device.device_type == kDLCUDA || device.device_type == kDLROCM) {
    out += ":" + std::to_string(device.device_id);
  }
  return out;
}

inline std::string dtype_to_string(DLDataType dtype) {
  std::string out;
  switch (dtype.code) {
    case kDLInt:
      out = "int";
      break;
    case kDLUInt:
      out = "uint";
      break;
    case kDLFloat:
      out = "float";
      break;
    case kDLBfloat:
      out = "bfloat";
      break;
    case kDLBool:
      return "bool";
    default:
      out = "dtype" + std::to_string(static_cast<int>(dtype.code)) + "_";
  }
  out += std::to_string(static_cast<int>(dtype.bits));
  if (dtype.lanes != 1) out += "x" + std::to_string(static_cast<int>(dtype.lanes));
  return out;
}

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DLDataType value{kDLFloat, 32, 1};
};
template <>
struct DTypeOf<double> {
  static constexpr DLDataType value{kDLFloat, 64, 1};
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DLDataType value{kDLInt, 32, 1};
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DLDataType value{kDLInt, 64, 1};
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DLDataType value{kDLUInt, 8, 1};
};
template <>
struct DTypeOf<uint32_t> {
  static constexpr DLDataType value{kDLUInt, 32, 1};
};
}  // namespace host
struct __nv_bfloat16;  // cuda_bf16.h's type; only its DLPack dtype is needed here
namespace host {
template <>
struct DTypeOf<__nv_bfloat16> {
  static constexpr DLDataType value{kDLBfloat, 16, 1};
};

inline bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

/// \brief The first byte of a tensor's data. DLPack allows a non-zero
/// `byte_offset`; ignoring it would read the wrong memory.
template <typename T = void>
inline T* data_ptr(const tvm::ffi::TensorView& tensor) {
  auto base = static_cast<char*>(tensor.data_ptr()) + tensor.byte_offset();
  return reinterpret_cast<T*>(base);
}

/// \brief A size that several tensors share. It binds to the first size it
/// is checked against; later checks must match it.
class SymbolicSize {
 public:
  explicit SymbolicSize(const char* name) : name_(name) {}
  SymbolicSize(const SymbolicSize&) = delete;
  SymbolicSize& operator=(const SymbolicSize&) = delete;

  const char* name() const { return name_; }
  bool bound() const { return bound_; }
  /// \brief The bound value. Throws if no tensor has bound it yet.
  int64_t unwrap() const {
    RuntimeCheck(bound_, "internal: size '", name_, "' was never bound");
    return value_;
  }
  void bind(int64_t value) {
    value_ = value;
    bound_ = true;
  }
  /// \brief "batch_size=4" once bound, "batch_size" before.
  std::string describe() const { return bound_ ? std::string(name_) + "=" + std::to_string(value_) : name_; }

 private:
  const char* name_;
  int64_t value_ = 0;
  bool bound_ = false;
  const char* bound_by_ = nullptr;
  friend class TensorMatcher;
};

/// \brief A device that several tensors share: an allowed set of device
/// types, bound to the first tensor's exact device.
class SymbolicDevice {
 public:
  SymbolicDevice() = default;
  SymbolicDevice(const SymbolicDevice&) = delete;
  SymbolicDevice& operator=(const SymbolicDevice&) = delete;

  template <DLDeviceType... kTypes>
  SymbolicDevice& set_options() {
    allowed_.clear();
    (allowed_.push_back(kTypes), ...);
    return *this;
  }
  bool bound() const { return bound_; }
  DLDevice unwrap() const {
    RuntimeCheck(bound_, "internal: device was never bound");
    return device_;
  }
  std::string describe_allowed() const {
    std::string out;
    for (size_t i = 0; i < allowed_.size(); ++i) {
      if (i) out += " or ";
      out += device_type_name(allowed_[i]);
    }
    return out;
  }

 private:
  friend class TensorMatcher;
  std::vector<int32_t> allowed_;
  DLDevice device_{kDLCPU, 0};
  bool bound_ = false;
  std::string bound_by_;
};

/// \brief One dimension of an expected shape: a fixed size, `-1` for any
/// size, or a shared `SymbolicSize`.
class DimSpec {
 public:
  DimSpec(int64_t fixed) : fixed_(fixed) {}  // NOLINT(google-explicit-constructor)
  DimSpec(int fixed) : fixed_(fixed) {}      // NOLINT(google-explicit-constructor)
  DimSpec(SymbolicSize& symbol) : symbol_(&symbol) {}  // NOLINT(google-explicit-constructor)

  std::string describe() const {
    if (symbol_ != nullptr) return symbol_->describe();
    return fixed_ < 0 ? std::string("*") : std::to_string(fixed_);
  }

 private:
  friend class TensorMatcher;
  int64_t fixed_ = -1;
  SymbolicSize* symbol_ = nullptr;
};

/// \brief Checks tensors against an expected rank, sizes, dtype, device,
/// contiguity and alignment. Every failure throws a Python-typed error
/// (ValueError, or TypeError for dtype) naming the argument.
class TensorMatcher {
 public:
  TensorMatcher(std::initializer_list<DimSpec> dims) : dims_(dims) {}

  template <typename T>
  TensorMatcher& with_dtype() {
    dtype_ = DTypeOf<T>::value;
    has_dtype_ = true;
    return *this;
  }
  TensorMatcher& with_device(SymbolicDevice& device) {
    device_ = &device;
    return *this;
  }
  /// \brief Requires the data pointer to be a multiple of `bytes` (vector loads).
  TensorMatcher& with_alignment(int64_t bytes) {
    alignment_ = bytes;
    return *this;
  }

  /// \brief The one-argument form the reference design calls (scripts/reference_design.py
  /// builds it against these headers); its messages can only say "tensor", so exports
  /// name the argument with the two-argument form.
  const TensorMatcher& verify(const tvm::ffi::TensorView& tensor) const { return verify(tensor, "tensor"); }
  const TensorMatcher& verify(const tvm::ffi::TensorView& tensor, const char* name) const {
    if (tensor.ndim() != static_cast<int32_t>(dims_.size())) {
      fail("ValueError", name, "a " + std::to_string(dims_.size()) + "-D tensor of shape " + expected_shape(),
           "a " + std::to_string(tensor.ndim()) + "-D tensor of shape " + actual_shape(tensor));
    }
    // DLPack's sizes are signed; a producer's negative one would pass every
    // upper bound below and wrap in a kernel's unsigned arithmetic.
    for (int32_t i = 0; i < tensor.ndim(); ++i) {
      if (tensor.size(i) < 0) fail("ValueError", name, "non-negative sizes", "shape " + actual_shape(tensor));
    }
    // Compare fixed sizes first so that a symbol is never bound by a tensor
    // whose other dimensions are already wrong.
    for (size_t i = 0; i < dims_.size(); ++i) {
      const auto& dim = dims_[i];
      if (dim.symbol_ == nullptr && dim.fixed_ >= 0 && tensor.size(i) != dim.fixed_) {
        fail("ValueError", name, "shape " + expected_shape() + " (dimension " + std::to_string(i) + " is " +
                                     std::to_string(dim.fixed_) + ")",
             "shape " + actual_shape(tensor));
      }
    }
    for (size_t i = 0; i < dims_.size(); ++i) {
      const auto& dim = dims_[i];
      if (dim.symbol_ == nullptr) continue;
      const int64_t size = tensor.size(i);
      if (!dim.symbol_->bound_) {
        dim.symbol_->bind(size);
        dim.symbol_->bound_by_ = name;
      } else if (dim.symbol_->value_ != size) {
        fail("ValueError", name,
             "shape " + expected_shape() + " (dimension " + std::to_string(i) + " is " + dim.symbol_->name_ +
                 ", bound to " + std::to_string(dim.symbol_->value_) + " by '" + dim.symbol_->bound_by_ + "')",
             "shape " + actual_shape(tensor));
      }
    }
    if (has_dtype_ && !same_dtype(tensor.dtype(), dtype_)) {
      fail("TypeError", name, "dtype " + dtype_to_string(dtype_), "dtype " + dtype_to_string(tensor.dtype()));
    }
    if (device_ != nullptr) check_device(tensor, name);
    if (!tensor.IsContiguous()) {
      fail("ValueError", name, "a contiguous tensor", "a non-contiguous view with strides " + actual_strides(tensor));
    }
    if (alignment_ > 1 && tensor.numel() > 0 && reinterpret_cast<uintptr_t>(data_ptr(tensor)) % alignment_ != 0) {
      fail("ValueError", name, "data aligned to " + std::to_string(alignment_) + " bytes",
           "a pointer offset by " + std::to_string(reinterpret_cast<uintptr_t>(data_ptr(tensor)) % alignment_) +
               " bytes (a view that starts mid-row?)");
    }
    return *this;
  }

 private:
  void check_device(const tvm::ffi::TensorView& tensor, const char* name) const {
    const DLDevice got = tensor.device();
    bool allowed = device_->allowed_.empty();
    for (const auto type : device_->allowed_) allowed |= (type == got.device_type);
    if (!allowed) {
      fail("ValueError", name, "a tensor on " + device_->describe_allowed(), "a tensor on " + device_to_string(got));
    }
    if (!device_->bound_) {
      device_->device_ = got;
      device_->bound_ = true;
      device_->bound_by_ = name;
    } else if (device_->device_.device_type != got.device_type || device_->device_.device_id != got.device_id) {
      fail("ValueError", name,
           "a tensor on " + device_to_string(device_->device_) + " (the device of '" + device_->bound_by_ + "')",
           "a tensor on " + device_to_string(got));
    }
  }

  std::string expected_shape() const {
    std::string out = "[";
    for (size_t i = 0; i < dims_.size(); ++i) {
      if (i) out += ", ";
      out += dims_[i].describe();
    }
    return out + "]";
  }
  static std::string actual_shape(const tvm::ffi::TensorView& tensor) {
    std::string out = "[";
    for (int32_t i = 0; i < tensor.ndim(); ++i) {
      if (i) out += ", ";
      out += std::to_string(tensor.size(i));
    }
    return out + "]";
  }
  static std::string actual_strides(const tvm::ffi::TensorView& tensor) {
    std::string out = "[";
    for (int32_t i = 0; i < tensor.ndim(); ++i) {
      if (i) out += ", ";
      out += std::to_string(tensor.stride(i));
    }
    return out + "]";
  }
  [[noreturn]] static void fail(const char* kind, const char* name, const std::string& expected,
                                const std::string& got) {
    detail::throw_error(kind, std::string("argument '") + name + "': expected " + expected + ", got " + got);
  }

  std::vector<DimSpec> dims_;
  DLDataType dtype_{};
  bool has_dtype_ = false;
  SymbolicDevice* device_ = nullptr;
  int64_t alignment_ = 0;
};

/// \brief One argument of an export as `verify_apart` sees it; an optional
/// argument passed as None is no tensor and overlaps nothing.
struct NamedTensor {
  NamedTensor(const tvm::ffi::TensorView& tensor, const char* name, bool written)
      : tensor(&tensor), name(name), written(written) {}
  NamedTensor(const tvm::ffi::Optional<tvm::ffi::TensorView>& tensor, const char* name, bool written)
      : tensor(tensor.has_value() ? &*tensor : nullptr), name(name), written(written) {}

  const tvm::ffi::TensorView* tensor;
  const char* name;
  bool written;  // the call stores into it
};

/// \brief The bytes `[begin, end)` a contiguous tensor's elements occupy; empty without elements.
struct ByteRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;

  static ByteRange of(const tvm::ffi::TensorView& tensor) {
    const int64_t numel = tensor.numel();
    if (numel == 0) return {};
    const DLDataType dtype = tensor.dtype();
    const auto bytes = static_cast<uintptr_t>((static_cast<uint64_t>(numel) * dtype.bits * dtype.lanes + 7) / 8);
    const auto begin = reinterpret_cast<uintptr_t>(data_ptr(tensor));
    return {begin, begin + bytes};
  }
  bool overlaps(const ByteRange& other) const {
    return begin < end && other.begin < other.end && begin < other.end && other.begin < end;
  }
};

/// \brief Refuses two arguments that share memory where the call writes
/// either: its threads would read what another thread writes, or store one
/// result over another, in an order no one chose. Arguments that are only
/// read may share memory (the same `seq_lens` as `extend_lens`). Call it once
/// the arguments are verified: it assumes contiguous tensors on one device.
inline void verify_apart(std::initializer_list<NamedTensor> arguments) {
  for (auto later = arguments.begin(); later != arguments.end(); ++later) {
    for (auto earlier = arguments.begin(); earlier != later; ++earlier) {
      if (!earlier->written && !later->written) continue;
      if (earlier->tensor == nullptr || later->tensor == nullptr) continue;
      if (!ByteRange::of(*earlier->tensor).overlaps(ByteRange::of(*later->tensor))) continue;
      const std::string writes = earlier->written && later->written ? std::string("both")
                                 : std::string("'") + (later->written ? later->name : earlier->name) + "'";
      detail::throw_error("ValueError", std::string("argument '") + later->name + "': expected memory apart from '" +
                                            earlier->name + "' (the call writes " + writes +
                                            "), got a tensor that overlaps it");
    }
  }
}

}  // namespace host
