"""A JIT build-and-cache for tvm-ffi CUDA modules; it knows nothing about any kernel.

Describe a variant with :class:`JitSpec`; :func:`load` returns its tvm-ffi module,
compiling it with one nvcc call on the first use anywhere on the machine and loading
the cached .so afterwards. The cache key covers the sources' contents, flags, archs,
nvcc, the host compiler, the tvm-ffi version and this package's version; builds are
published atomically and built once across processes. Only public tvm-ffi API is used
(``tvm_ffi.libinfo`` for paths, ``tvm_ffi.load_module``).

Settings (environment variable, or the same attribute on :data:`config`):
``FLASH_COMPRESS_CACHE_DIR``, ``FLASH_COMPRESS_CUDA_ARCH_LIST``,
``FLASH_COMPRESS_JIT_VERBOSE``, ``FLASH_COMPRESS_DISABLE_JIT``, ``MAX_JOBS``,
``FLASH_COMPRESS_JIT_LOCK_TIMEOUT``.
"""

from __future__ import annotations

from .cache import JitCacheInfo, clear_cache, list_entries
from .config import JitConfig, config
from .errors import JitBuildError, JitDisabledError, JitError, JitLockTimeoutError
from .loader import BuildOutcome, ensure_built, load
from .spec import JitSpec
from .toolchain import cuda_arch_list, find_nvcc

__all__ = [
    "BuildOutcome",
    "JitBuildError",
    "JitCacheInfo",
    "JitConfig",
    "JitDisabledError",
    "JitError",
    "JitLockTimeoutError",
    "JitSpec",
    "clear_cache",
    "config",
    "cuda_arch_list",
    "ensure_built",
    "find_nvcc",
    "list_entries",
    "load",
]
