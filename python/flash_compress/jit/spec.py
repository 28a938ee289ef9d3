"""What to build: a variant's headers, exported functions, include dirs and flags."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["JitSpec"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The tvm-ffi headers every generated translation unit needs for the export macro
# and for the types that exported signatures use (TensorView, Optional, errors).
_PRELUDE = (
    "tvm/ffi/container/tensor.h",
    "tvm/ffi/dtype.h",
    "tvm/ffi/error.h",
    "tvm/ffi/function.h",
)


def _strings(what: str, values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f"{what}: expected a sequence of strings, got the single string {values!r}")
    out = tuple(values)
    for value in out:
        if not isinstance(value, str):
            raise TypeError(f"{what}: expected strings, got {value!r}")
    return out


def _expression(what: str, expr: object) -> str:
    if not isinstance(expr, str) or not expr.strip() or "\n" in expr or "\r" in expr:
        raise ValueError(f"{what}: expected a one-line C++ expression, got {expr!r}")
    return expr.strip()


def _export_value(export: str, value: object) -> str | tuple[str, ...]:
    """One callable expression, or a non-empty tuple of overloads (two or more)."""
    if isinstance(value, str):
        return _expression(f"JitSpec.exports[{export!r}]", value)
    if not isinstance(value, (tuple, list)) or len(value) < 2:
        raise ValueError(
            f"JitSpec.exports[{export!r}]: expected a C++ expression or a tuple of 2 or more overloads, got {value!r}"
        )
    return tuple(_expression(f"JitSpec.exports[{export!r}][{i}]", expr) for i, expr in enumerate(value))


# Dispatches an overloaded export to the overload whose parameter count is the
# call's argument count, unpacking it exactly as TVM_FFI_DLL_EXPORT_TYPED_FUNC
# does (so type errors read the same). Emitted only into units that need it.
_OVERLOAD_HELPER = """\
namespace flash_compress_jit {
template <typename F>
inline constexpr int32_t kArity = static_cast<int32_t>(::tvm::ffi::detail::FunctionInfo<std::decay_t<F>>::num_args);

constexpr bool distinct(std::initializer_list<int32_t> arities) {
  for (auto a = arities.begin(); a != arities.end(); ++a) {
    for (auto b = a + 1; b != arities.end(); ++b) {
      if (*a == *b) return false;
    }
  }
  return true;
}

template <typename... Fs>
inline void call_by_arity(const std::string* name, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result,
                          const Fs&... overloads) {
  bool called = false;
  ([&] {
    using Info = ::tvm::ffi::detail::FunctionInfo<std::decay_t<Fs>>;
    if (called || kArity<Fs> != num_args) return;
    called = true;
    ::tvm::ffi::detail::unpack_call<typename Info::RetType>(
        std::make_index_sequence<Info::num_args>{}, name, overloads, reinterpret_cast<const ::tvm::ffi::AnyView*>(args),
        num_args, reinterpret_cast<::tvm::ffi::Any*>(result));
  }(), ...);
  if (!called) {
    std::string expected;
    ((expected += (expected.empty() ? "" : " or ") + std::to_string(kArity<Fs>)), ...);
    TVM_FFI_THROW(TypeError) << "Mismatched number of arguments when calling `" << *name << "`: expected "
                             << expected << " but got " << num_args << " arguments";
  }
}
}  // namespace flash_compress_jit
"""


def _overloaded_export(export: str, overloads: tuple[str, ...]) -> list[str]:
    """The C ABI symbol tvm-ffi looks up, as TVM_FFI_DLL_EXPORT_TYPED_FUNC names it."""
    args = ", ".join(f"({expr})" for expr in overloads)
    arities = ", ".join(f"flash_compress_jit::kArity<decltype({expr})>" for expr in overloads)
    return [
        'extern "C" {',
        f"TVM_FFI_DLL_EXPORT int __tvm_ffi_{export}(void*, const TVMFFIAny* args, int32_t num_args,",
        "                                           TVMFFIAny* result) {",
        f"  static_assert(flash_compress_jit::distinct({{{arities}}}), "
        f'"overloads of {export} need distinct argument counts");',
        "  TVM_FFI_SAFE_CALL_BEGIN();",
        f'  static std::string name = "{export}";',
        f"  flash_compress_jit::call_by_arity(&name, args, num_args, result, {args});",
        "  TVM_FFI_SAFE_CALL_END();",
        "}",
        "}",
    ]


@dataclass(frozen=True)
class JitSpec:
    """One buildable variant.

    The loader writes a translation unit that includes ``headers`` in order and
    exports, for each ``exports`` item, the C++ callable expression under the
    export name. Every file under every ``include_dirs`` entry is hashed into the
    cache key, so these should be the project's own source roots, not system dirs.

    Attributes:
        name: readable variant name (letters, digits, ``_``); it starts the cache folder's name.
        headers: headers the generated translation unit ``#include``s, in order.
        exports: export name -> C++ callable expression (a function or static member function),
            or a tuple of such expressions: overloads told apart by their argument count (a
            trailing optional argument that callers may leave out). Each must name one function.
        include_dirs: passed as ``-I``; their whole contents go into the cache key.
        extra_cuda_cflags: extra nvcc flags.
        extra_cflags: extra host C++ flags.
        extra_ldflags: extra linker flags.
    """

    name: str
    headers: tuple[str, ...]
    exports: Mapping[str, str]
    include_dirs: tuple[Path, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()
    extra_cflags: tuple[str, ...] = ()
    extra_ldflags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"JitSpec.name: expected letters, digits and _, got {self.name!r}")
        headers = _strings("JitSpec.headers", self.headers)
        if not headers:
            raise ValueError("JitSpec.headers: expected at least one header")
        for header in headers:
            if not header or any(c in header for c in '<>"\n\r'):
                raise ValueError(f"JitSpec.headers: not an includable header name: {header!r}")
        if not isinstance(self.exports, Mapping) or not self.exports:
            raise ValueError("JitSpec.exports: expected a non-empty mapping of export name -> C++ expression")
        exports: dict[str, str | tuple[str, ...]] = {}
        for export, value in self.exports.items():
            if not isinstance(export, str) or not _NAME.fullmatch(export):
                raise ValueError(f"JitSpec.exports: export names must be C identifiers, got {export!r}")
            exports[export] = _export_value(export, value)
        if isinstance(self.include_dirs, (str, os.PathLike)):
            raise TypeError("JitSpec.include_dirs: expected a sequence of paths, got a single path")
        include_dirs = tuple(Path(p).expanduser().resolve() for p in self.include_dirs)
        # Frozen: normalise through object.__setattr__ so that equal specs compare equal.
        object.__setattr__(self, "headers", headers)
        object.__setattr__(self, "exports", exports)
        object.__setattr__(self, "include_dirs", include_dirs)
        object.__setattr__(self, "extra_cuda_cflags", _strings("JitSpec.extra_cuda_cflags", self.extra_cuda_cflags))
        object.__setattr__(self, "extra_cflags", _strings("JitSpec.extra_cflags", self.extra_cflags))
        object.__setattr__(self, "extra_ldflags", _strings("JitSpec.extra_ldflags", self.extra_ldflags))

    def __hash__(self) -> int:
        # The generated __hash__ would choke on the exports dict.
        return hash(
            (
                self.name,
                self.headers,
                tuple(self.exports.items()),
                self.include_dirs,
                self.extra_cuda_cflags,
                self.extra_cflags,
                self.extra_ldflags,
            )
        )

    def translation_unit(self) -> str:
        """The ``.cu`` source the loader compiles: includes, then one export per function.

        It names headers only by their include names, never by absolute path, so
        that moving the checkout leaves the text (and so the cache key) unchanged.
        """
        lines = [f"// Generated by flash_compress.jit for the variant {self.name}; do not edit."]
        lines += [f"#include <{header}>" for header in _PRELUDE]
        lines.append("")
        lines += [f"#include <{header}>" for header in self.headers]
        lines.append("")
        if any(isinstance(value, tuple) for value in self.exports.values()):
            lines += ["#include <initializer_list>", "#include <string>", "#include <utility>", ""]
            lines.append(_OVERLOAD_HELPER)
        for export, value in self.exports.items():
            if isinstance(value, tuple):
                lines += _overloaded_export(export, value)
            else:
                # Parenthesised: a template argument list's commas would split the macro arguments.
                lines.append(f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({export}, ({value}));")
        lines.append("")
        return "\n".join(lines)
