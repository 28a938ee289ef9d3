// Host-side helpers: checks that throw typed tvm-ffi errors, and integer ranges.
#pragma once

#include <tvm/ffi/error.h>

#include <cstdint>
#include <source_location>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace host {

namespace detail {

template <typename... Args>
std::string stream_all(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

/// \brief Throws a tvm-ffi error of Python type `kind`. Internal checks pass
/// their location, which goes into the message (not only the backtrace) so
/// that a Python user sees where a check fired; argument checks do not, since
/// their message already names the argument.
[[noreturn]] inline void throw_error(const char* kind, std::string message,
                                     const std::source_location* loc = nullptr) {
  if (loc != nullptr) {
    message += " [";
    message += loc->file_name();
    message += ":";
    message += std::to_string(loc->line());
    message += "]";
  }
  const auto where = loc != nullptr ? *loc : std::source_location::current();
  throw tvm::ffi::Error(kind, std::move(message),
                        TVMFFIBacktrace(where.file_name(), where.line(), where.function_name(), 0));
}

}  // namespace detail

/// \brief Throws `kind` (a Python exception name such as "ValueError") when
/// `cond` is false; the streamed `args` form the message. Meant for argument
/// checks, whose message names the argument, so no source location is added.
template <typename... Args>
inline void CheckAs(const char* kind, bool cond, Args&&... args) {
  if (!cond) [[unlikely]] {
    detail::throw_error(kind, detail::stream_all(std::forward<Args>(args)...));
  }
}

/// \brief A check's condition and the place it was written: converting to it
/// at a call records that call's location, which lets RuntimeCheck be a plain
/// function (as a class template with a deduction guide, `RuntimeCheck(ok);`
/// would declare a variable named `ok`).
struct CheckedCondition {
  /// Any condition a `bool` parameter would take (a pointer, an integer, a
  /// class with an implicit `operator bool`): one conversion, made here.
  template <typename Condition>
    requires std::is_convertible_v<const Condition&, bool>
  CheckedCondition(const Condition& value, std::source_location where = std::source_location::current())
      : value(static_cast<bool>(value)), where(where) {}
  bool value;
  std::source_location where;
};

/// \brief The first part of a panic's message, streamed, and where it was written.
struct PanicMessage {
  template <typename T>
  PanicMessage(const T& first, std::source_location where = std::source_location::current())
      : text(detail::stream_all(first)), where(where) {}
  std::string text;
  std::source_location where;
};

/// \brief Throws RuntimeError with file:line and the streamed `args` when `cond` is false.
template <typename... Args>
void RuntimeCheck(CheckedCondition cond, Args&&... args) {
  if (!cond.value) [[unlikely]] {
    detail::throw_error("RuntimeError", detail::stream_all(std::forward<Args>(args)...), &cond.where);
  }
}

/// \brief Unconditionally throws RuntimeError with file:line and the streamed message.
template <typename... Args>
[[noreturn]] void Panic(PanicMessage first, Args&&... rest) {
  detail::throw_error("RuntimeError", first.text + detail::stream_all(std::forward<Args>(rest)...), &first.where);
}

/// \brief Unconditionally throws RuntimeError with file:line and no message.
[[noreturn]] inline void Panic(std::source_location where = std::source_location::current()) {
  detail::throw_error("RuntimeError", std::string{}, &where);
}

/// \brief `a / b` rounded up, for `a >= 0` and `b > 0` (in their common type):
/// how many groups of `b` hold `a` items.
template <typename T, typename U>
constexpr auto div_ceil(T a, U b) {
  using V = std::common_type_t<T, U>;
  return (static_cast<V>(a) + static_cast<V>(b) - 1) / static_cast<V>(b);
}

/// \brief `for (auto i : irange(n))` iterates 0..n-1; `irange(a, b)` iterates a..b-1.
template <typename T>
class IntegerRange {
 public:
  class iterator {
   public:
    constexpr explicit iterator(T value) : value_(value) {}
    constexpr T operator*() const { return value_; }
    constexpr iterator& operator++() {
      ++value_;
      return *this;
    }
    constexpr bool operator!=(const iterator& other) const { return value_ != other.value_; }

   private:
    T value_;
  };
  constexpr IntegerRange(T begin, T end) : begin_(begin), end_(end < begin ? begin : end) {}
  constexpr iterator begin() const { return iterator(begin_); }
  constexpr iterator end() const { return iterator(end_); }

 private:
  T begin_;
  T end_;
};

template <typename T>
constexpr IntegerRange<T> irange(T end) {
  return IntegerRange<T>(T{0}, end);
}
template <typename T, typename U>
constexpr auto irange(T begin, U end) {
  using V = std::common_type_t<T, U>;
  return IntegerRange<V>(static_cast<V>(begin), static_cast<V>(end));
}

}  // namespace host
