"""Process-wide JIT settings: each is an environment variable, and each is also settable in Python.

An environment variable is read at every use, not once at import, so a test or a
launcher that sets it late still wins over the default. A value assigned in Python
(``flash_compress.jit.config.cache_dir = ...``) wins over the environment for this
process; assigning ``None`` goes back to the environment.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "ENV_ARCH_LIST",
    "ENV_CACHE_DIR",
    "ENV_DISABLE_JIT",
    "ENV_LOCK_TIMEOUT",
    "ENV_MAX_JOBS",
    "ENV_VERBOSE",
    "JitConfig",
    "config",
]

ENV_CACHE_DIR = "FLASH_COMPRESS_CACHE_DIR"
ENV_ARCH_LIST = "FLASH_COMPRESS_CUDA_ARCH_LIST"
ENV_VERBOSE = "FLASH_COMPRESS_JIT_VERBOSE"
ENV_DISABLE_JIT = "FLASH_COMPRESS_DISABLE_JIT"
ENV_LOCK_TIMEOUT = "FLASH_COMPRESS_JIT_LOCK_TIMEOUT"
ENV_MAX_JOBS = "MAX_JOBS"

DEFAULT_CACHE_DIR = Path("~/.cache/flash_compress")
#: A cold build of a big variant takes minutes on a small machine; a waiter gives up after this.
DEFAULT_LOCK_TIMEOUT_S = 20 * 60.0

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: expected 0 or 1, got {text!r}")


def split_arch_text(text: str) -> tuple[str, ...]:
    """Split an arch list as people write it: ``"9.0 10.0"``, ``"9.0;10.0"`` or ``"9.0,10.0"``."""
    return tuple(token for token in re.split(r"[\s,;]+", text.strip()) if token)


class JitConfig:
    """The JIT's settings; one shared instance is :data:`config`.

    Attributes (each a property; reading it consults the override, then the environment):

    - ``cache_dir``: where builds are cached (``FLASH_COMPRESS_CACHE_DIR``, default ``~/.cache/flash_compress``).
    - ``arch_list``: CUDA archs to build for, as written (``FLASH_COMPRESS_CUDA_ARCH_LIST``), or
      ``None`` to detect the GPU; :func:`flash_compress.jit.cuda_arch_list` validates it.
    - ``verbose``: print the compiler's output to stderr (``FLASH_COMPRESS_JIT_VERBOSE=1``).
    - ``disable_jit``: never compile; a cache miss raises (``FLASH_COMPRESS_DISABLE_JIT=1``).
    - ``max_jobs``: parallel compile jobs inside one build (``MAX_JOBS``), ``None`` for ninja's default.
    - ``lock_timeout``: seconds to wait for another process's build of the same variant
      (``FLASH_COMPRESS_JIT_LOCK_TIMEOUT``, default 1200).
    """

    def __init__(self) -> None:
        self._cache_dir: Path | None = None
        self._arch_list: tuple[str, ...] | None = None
        self._verbose: bool | None = None
        self._disable_jit: bool | None = None
        self._max_jobs: int | None = None
        self._lock_timeout: float | None = None

    @property
    def cache_dir(self) -> Path:
        """The cache root, with ``~`` expanded (it need not exist yet)."""
        if self._cache_dir is not None:
            return self._cache_dir
        text = os.environ.get(ENV_CACHE_DIR, "").strip()
        return (Path(text) if text else DEFAULT_CACHE_DIR).expanduser()

    @cache_dir.setter
    def cache_dir(self, value: str | os.PathLike[str] | None) -> None:
        self._cache_dir = None if value is None else Path(value).expanduser()

    @property
    def arch_list(self) -> tuple[str, ...] | None:
        """The requested archs as written, or ``None`` when nothing was requested."""
        if self._arch_list is not None:
            return self._arch_list
        tokens = split_arch_text(os.environ.get(ENV_ARCH_LIST, ""))
        return tokens or None

    @arch_list.setter
    def arch_list(self, value: str | tuple[str, ...] | list[str] | None) -> None:
        if value is None:
            self._arch_list = None
        elif isinstance(value, str):
            self._arch_list = split_arch_text(value) or None
        else:
            self._arch_list = tuple(str(arch) for arch in value) or None

    @property
    def verbose(self) -> bool:
        """Whether builds print the compiler's output to stderr."""
        if self._verbose is not None:
            return self._verbose
        return _parse_bool(ENV_VERBOSE, os.environ.get(ENV_VERBOSE, ""))

    @verbose.setter
    def verbose(self, value: bool | None) -> None:
        self._verbose = None if value is None else bool(value)

    @property
    def disable_jit(self) -> bool:
        """Whether a cache miss raises instead of compiling."""
        if self._disable_jit is not None:
            return self._disable_jit
        return _parse_bool(ENV_DISABLE_JIT, os.environ.get(ENV_DISABLE_JIT, ""))

    @disable_jit.setter
    def disable_jit(self, value: bool | None) -> None:
        self._disable_jit = None if value is None else bool(value)

    @property
    def max_jobs(self) -> int | None:
        """Parallel compile jobs inside one build, or ``None`` for ninja's default."""
        if self._max_jobs is not None:
            return self._max_jobs
        text = os.environ.get(ENV_MAX_JOBS, "").strip()
        if not text:
            return None
        try:
            jobs = int(text)
        except ValueError:
            raise ValueError(f"{ENV_MAX_JOBS}: expected a positive integer, got {text!r}") from None
        if jobs < 1:
            raise ValueError(f"{ENV_MAX_JOBS}: expected a positive integer, got {text!r}")
        return jobs

    @max_jobs.setter
    def max_jobs(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or int(value) < 1):
            raise ValueError(f"max_jobs: expected a positive integer, got {value!r}")
        self._max_jobs = None if value is None else int(value)

    @property
    def lock_timeout(self) -> float:
        """Seconds to wait for another process building the same variant."""
        if self._lock_timeout is not None:
            return self._lock_timeout
        text = os.environ.get(ENV_LOCK_TIMEOUT, "").strip()
        if not text:
            return DEFAULT_LOCK_TIMEOUT_S
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{ENV_LOCK_TIMEOUT}: expected seconds, got {text!r}") from None
        if seconds <= 0:
            raise ValueError(f"{ENV_LOCK_TIMEOUT}: expected a positive number of seconds, got {text!r}")
        return seconds

    @lock_timeout.setter
    def lock_timeout(self, value: float | None) -> None:
        if value is not None and float(value) <= 0:
            raise ValueError(f"lock_timeout: expected a positive number of seconds, got {value!r}")
        self._lock_timeout = None if value is None else float(value)

    def reset(self) -> None:
        """Drop every Python override: the environment decides again."""
        self._cache_dir = None
        self._arch_list = None
        self._verbose = None
        self._disable_jit = None
        self._max_jobs = None
        self._lock_timeout = None


#: The process-wide settings the loader reads.
config = JitConfig()
