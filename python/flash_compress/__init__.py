"""flash-compress: JIT-compiled CUDA kernels for DeepSeek-V4's online c128 KV compressor.

``load_module`` needs only apache-tvm-ffi (and nvcc for a cache miss); the torch
parts (``reference``) are imported on first use, so the loader works without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .c128_online import load_module

if TYPE_CHECKING:
    from . import reference

__version__ = "0.1.0"

__all__ = ["__version__", "load_module", "reference"]

_LAZY_MODULES = frozenset({"reference"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flash_compress' has no attribute {name!r}")
