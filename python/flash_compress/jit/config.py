"""Process-wide JIT settings: each an environment variable, each also settable in Python.

The environment is read at every use, so a launcher that sets a variable late still
wins over the default. A value assigned in Python (``flash_compress.jit.config.cache_dir
= ...``) wins over the environment for this process; assigning ``None`` hands the
setting back to the environment.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import platformdirs

__all__ = ["JitConfig", "config", "split_arch_text"]

#: A cold build of a big variant takes minutes on a small machine; a waiter gives up after this.
DEFAULT_LOCK_TIMEOUT_S = 20 * 60.0


def split_arch_text(text: str) -> tuple[str, ...]:
    """Split an arch list as people write it: ``"9.0 10.0"``, ``"9.0;10.0"`` or ``"9.0,10.0"``."""
    return tuple(token for token in re.split(r"[\s,;]+", text.strip()) if token)


def _path(value: Any) -> Path:
    return Path(value).expanduser()


def _arch_list(value: Any) -> tuple[str, ...] | None:
    tokens = split_arch_text(value) if isinstance(value, str) else tuple(str(arch) for arch in value)
    return tokens or None


def _bool(value: Any) -> bool:
    if not isinstance(value, str):
        return bool(value)
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("expected 0 or 1")


def _positive(kind: type) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected a positive {kind.__name__}")
        number = kind(value)  # ValueError for text that is no number
        if not 0 < number < math.inf:  # NaN and infinity too
            raise ValueError(f"expected a positive finite {kind.__name__}")
        return number

    return parse


def _user_cache_dir() -> Path:
    """The user cache folder; a container running as a user with no home has none."""
    try:
        return platformdirs.user_cache_path("flash_compress", appauthor=False)
    except (RuntimeError, KeyError, OSError) as exc:
        raise ValueError(f"FLASH_COMPRESS_CACHE_DIR (config.cache_dir): unset, and this user has no cache folder "
                         f"to default to ({exc}); set it to a folder for the JIT's builds") from None


class _Setting:
    """One setting: a Python override, else the environment variable ``env``, else ``default()``."""

    def __init__(self, env: str, parse: Callable[[Any], Any], default: Callable[[], Any]) -> None:
        self.env, self.parse, self.default = env, parse, default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _parsed(self, value: Any) -> Any:
        try:
            return self.parse(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.env} (config.{self.name}): {exc}, got {value!r}") from None

    def __get__(self, owner: JitConfig | None, cls: type) -> Any:
        if owner is None:
            return self
        override = owner.overrides.get(self.name)
        if override is not None:
            return override
        text = os.environ.get(self.env, "").strip()
        return self._parsed(text) if text else self.default()

    def __set__(self, owner: JitConfig, value: Any) -> None:
        owner.overrides[self.name] = None if value is None else self._parsed(value)


class JitConfig:
    """The JIT's settings; the shared instance is :data:`config`.

    - ``cache_dir`` (``FLASH_COMPRESS_CACHE_DIR``): where builds are cached; default the
      user cache folder, ``$XDG_CACHE_HOME/flash_compress`` (``~/.cache/flash_compress``) on Linux.
    - ``arch_list`` (``FLASH_COMPRESS_CUDA_ARCH_LIST``, e.g. ``"9.0 10.0"``): archs to build for,
      ``None`` to detect the GPU.
    - ``verbose`` (``FLASH_COMPRESS_JIT_VERBOSE=1``): echo the compiler's output to stderr.
    - ``disable_jit`` (``FLASH_COMPRESS_DISABLE_JIT=1``): never compile; a cache miss raises.
    - ``max_jobs`` (``MAX_JOBS``): nvcc threads for a multi-arch build, ``None`` for one per arch.
    - ``lock_timeout`` (``FLASH_COMPRESS_JIT_LOCK_TIMEOUT``): seconds to wait for another
      process's build of the same variant (default 1200).
    """

    cache_dir = _Setting("FLASH_COMPRESS_CACHE_DIR", _path, lambda: _user_cache_dir())
    arch_list = _Setting("FLASH_COMPRESS_CUDA_ARCH_LIST", _arch_list, lambda: None)
    verbose = _Setting("FLASH_COMPRESS_JIT_VERBOSE", _bool, lambda: False)
    disable_jit = _Setting("FLASH_COMPRESS_DISABLE_JIT", _bool, lambda: False)
    max_jobs = _Setting("MAX_JOBS", _positive(int), lambda: None)
    lock_timeout = _Setting("FLASH_COMPRESS_JIT_LOCK_TIMEOUT", _positive(float), lambda: DEFAULT_LOCK_TIMEOUT_S)

    def __init__(self) -> None:
        self.overrides: dict[str, Any] = {}

    def resolve_cache_dir(self, cache_dir: str | os.PathLike[str] | None = None) -> Path:
        """``cache_dir`` as an absolute path, or :attr:`cache_dir` when it is ``None``."""
        return (_path(cache_dir) if cache_dir is not None else self.cache_dir).absolute()

    def reset(self) -> None:
        """Drop every Python override: the environment decides again."""
        self.overrides.clear()


#: The process-wide settings the loader reads.
config = JitConfig()
