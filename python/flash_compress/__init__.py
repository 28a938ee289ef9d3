"""flash-compress: JIT-compiled CUDA kernels for DeepSeek-V4's online c128 KV compressor."""

from __future__ import annotations

from . import reference
from .c128_online import load_module

__version__ = "0.1.0"

__all__ = ["__version__", "load_module", "reference"]
