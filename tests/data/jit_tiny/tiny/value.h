// The constant the header-edit test changes: a new value must mean a new build.
#pragma once

namespace jit_tiny {
constexpr int kValue = 1;
}  // namespace jit_tiny
