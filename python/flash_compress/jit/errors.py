"""The JIT's exception types: what went wrong, for which variant, and where to look."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["JitBuildError", "JitDisabledError", "JitError", "JitLockTimeoutError", "PREBUILD_COMMAND"]

#: The command that fills a cache ahead of time; named in every "cannot build here" message.
PREBUILD_COMMAND = "python -m flash_compress prebuild"


class JitError(RuntimeError):
    """Base of the JIT's own errors."""


class JitBuildError(JitError):
    """A variant failed to compile (or its fresh build would not load).

    Attributes:
        variant: the cache folder name of the variant, ``<spec name>_<sm tag>_<hash16>``.
        command: the compiler command that failed, as one shell line.
        first_errors: the compiler's first error lines, with a little context (at most ~20 lines).
        log_path: the full build log, kept on disk; ``None`` only when it could not be written.
    """

    def __init__(self, variant: str, command: str, first_errors: Sequence[str], log_path: Path | None) -> None:
        self.variant = variant
        self.command = command
        self.first_errors = tuple(first_errors)
        self.log_path = log_path
        lines = [f"failed to build JIT variant {variant}", f"  command: {command}", "  first errors:"]
        lines += [f"    {line}" for line in self.first_errors] or ["    (the compiler printed no error line)"]
        lines.append(f"  full log: {log_path if log_path is not None else '(could not be written)'}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type, tuple[str, str, tuple[str, ...], Path | None]]:
        # A process pool sends exceptions back by pickling; keep every attribute.
        return (type(self), (self.variant, self.command, self.first_errors, self.log_path))


class JitDisabledError(JitError):
    """A variant is not in the cache and this process may not, or cannot, compile it.

    Attributes:
        variant: the cache folder name (or the variant name where no key could be computed).
        reason: why no build was attempted (JIT disabled, no CUDA toolkit, cache not writable).
        cache_dir: the cache that was searched.
        arch_list: the archs the variant was wanted for (they go into the suggested command).
        prebuild_options: the variant's own options of that command (``JitSpec.prebuild_options``).
    """

    def __init__(self, variant: str, reason: str, cache_dir: Path, arch_list: Sequence[str] = (),
                 prebuild_options: Sequence[str] = ()) -> None:
        self.variant = variant
        self.reason = reason
        self.cache_dir = cache_dir
        self.arch_list = tuple(arch_list)
        self.prebuild_options = tuple(prebuild_options)
        command = " ".join((PREBUILD_COMMAND, "--arch", *(self.arch_list or ("...",)), *self.prebuild_options,
                            "--cache-dir", str(cache_dir)))
        super().__init__(
            f"JIT variant {variant} is not in the cache {cache_dir} and cannot be built here: {reason}. "
            f"Build it ahead of time on a machine with nvcc: `{command}`, then use that cache here."
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, Path, tuple[str, ...], tuple[str, ...]]]:
        return (type(self), (self.variant, self.reason, self.cache_dir, self.arch_list, self.prebuild_options))


class JitLockTimeoutError(JitError, TimeoutError):
    """Another process held a variant's build lock for longer than the configured timeout."""

    def __init__(self, variant: str, lock_path: Path, timeout_s: float) -> None:
        self.variant = variant
        self.lock_path = lock_path
        self.timeout_s = timeout_s
        super().__init__(
            f"waited {timeout_s:.0f} s for another process to finish building JIT variant {variant} "
            f"(lock {lock_path}); raise FLASH_COMPRESS_JIT_LOCK_TIMEOUT if its builds are that slow"
        )

    def __reduce__(self) -> tuple[type, tuple[str, Path, float]]:
        return (type(self), (self.variant, self.lock_path, self.timeout_s))
