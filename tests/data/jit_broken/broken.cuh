// A header that does not compile: the compile-error and prebuild-failure tests use it.
#pragma once

#include <cstdint>

namespace jit_broken {
inline int64_t broken(int64_t x) { return x + this_identifier_is_undefined; }
}  // namespace jit_broken
