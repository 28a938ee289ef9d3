// Host functions for the overloaded-export test: one export, two arities
// (a trailing optional argument that callers may leave out).
#pragma once

#include <tvm/ffi/optional.h>

#include <cstdint>

namespace jit_overloads {

inline int64_t scale(int64_t x, tvm::ffi::Optional<int64_t> factor) { return x * factor.value_or(10); }

inline int64_t scale_default(int64_t x) { return scale(x, tvm::ffi::Optional<int64_t>()); }

inline int64_t plain(int64_t x) { return x + 1; }

}  // namespace jit_overloads
