"""flash-compress: JIT-compiled CUDA kernels for DeepSeek-V4's online c128 KV compressor.

``load_module`` (the kernels) and ``load_planner`` (the prefill planner alone)
need only apache-tvm-ffi (and nvcc for a cache miss); the torch
parts (``reference``, ``ops`` and the torch API ``decode``, ``prefill``,
``plan_prefill``, ``PrefillPlan``, ``verify``, ``commit`` from :mod:`flash_compress.api`) are imported on
first use, so the loader works without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .c128_online import load_module, load_planner

if TYPE_CHECKING:
    from . import api, ops, reference
    from .api import PrefillPlan, commit, decode, plan_prefill, prefill, verify

__version__ = "0.1.0"

__all__ = [
    "PrefillPlan",
    "__version__",
    "api",
    "commit",
    "decode",
    "load_module",
    "load_planner",
    "ops",
    "plan_prefill",
    "prefill",
    "reference",
    "verify",
]

_LAZY_MODULES = frozenset({"api", "ops", "reference"})
_LAZY_API = frozenset({"PrefillPlan", "commit", "decode", "plan_prefill", "prefill", "verify"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_API:
        value = getattr(importlib.import_module(".api", __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'flash_compress' has no attribute {name!r}")
