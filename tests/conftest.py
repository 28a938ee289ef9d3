"""Shared pytest setup: import paths, the ``gpu`` / ``nvcc`` skips and hypothesis profiles.

- Markers ``gpu`` and ``nvcc`` are registered in ``pyproject.toml``. A test
  carrying one is skipped (with a reason) when no CUDA GPU is visible / no CUDA
  toolkit is found; the fixtures of the same names do the same for tests that
  request them.
- Hypothesis profiles: ``ci`` (the default: derandomized, so every run draws the
  same examples, moderate example counts, no deadline) and ``long`` (many more
  examples, random), selected with ``FLASH_COMPRESS_HYPOTHESIS_PROFILE=long``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_PYTHON = _TESTS.parent / "python"
# tests/ for `import oracle` / `import schedule`; python/ so the package imports without installing.
for path in (_TESTS, _PYTHON):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from flash_compress.jit import find_nvcc  # noqa: E402  (the loader's own lookup: skips match what it would use)

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test extra; only the property tests need it
    settings = None

if settings is not None:
    settings.register_profile(
        "ci",
        derandomize=True,
        max_examples=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
    settings.register_profile(
        "long",
        max_examples=2000,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
    settings.load_profile(os.environ.get("FLASH_COMPRESS_HYPOTHESIS_PROFILE", "ci"))


def cuda_available() -> bool:
    """True when torch sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


NO_GPU_REASON = "no CUDA GPU visible"
NO_NVCC_REASON = "no nvcc found (in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin or on PATH)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not cuda_available():
        pytest.skip(NO_GPU_REASON)
    if item.get_closest_marker("nvcc") is not None and find_nvcc() is None:
        pytest.skip(NO_NVCC_REASON)


@pytest.fixture
def gpu() -> None:
    """Skips the test when no CUDA GPU is visible."""
    if not cuda_available():
        pytest.skip(NO_GPU_REASON)


@pytest.fixture
def nvcc() -> str:
    """Skips the test when no CUDA toolkit is found; else the nvcc path."""
    path = find_nvcc()
    if path is None:
        pytest.skip(NO_NVCC_REASON)
    return str(path)
