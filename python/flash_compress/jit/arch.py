"""Which CUDA architectures to compile for: the setting, else the visible GPU, else sm_90."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable

from .config import config, split_arch_text

__all__ = ["DEFAULT_ARCH_LIST", "arch_tag", "cuda_arch_list", "detect_gpu_arch_list", "normalize_arch_list"]

#: Used when nothing is requested and no GPU is visible (a build machine): the project targets Hopper.
DEFAULT_ARCH_LIST: tuple[str, ...] = ("9.0",)

# "9.0", "10.0", "9.0a" (arch-specific features) or "10.0f" (family-specific).
_ARCH = re.compile(r"(\d+)\.(\d)([af]?)")


def _sort_key(arch: str) -> tuple[int, int, str]:
    match = _ARCH.fullmatch(arch)
    assert match is not None
    return (int(match.group(1)), int(match.group(2)), match.group(3))


def normalize_arch_list(archs: str | Iterable[str]) -> tuple[str, ...]:
    """Validate, de-duplicate and sort an arch list, so that ``"10.0 9.0"`` and ``"9.0 10.0"`` key alike.

    Raises:
        ValueError: on an empty list or an entry not shaped like ``9.0``, ``9.0a`` or ``10.0f``.
    """
    tokens = split_arch_text(archs) if isinstance(archs, str) else tuple(str(a).strip() for a in archs)
    for arch in tokens:
        if not _ARCH.fullmatch(arch):
            raise ValueError(f"CUDA arch: expected a compute capability like 9.0, 9.0a or 10.0, got {arch!r}")
    if not tokens:
        raise ValueError("CUDA arch list: expected at least one arch, e.g. 9.0")
    return tuple(sorted(set(tokens), key=_sort_key))


def arch_tag(arch_list: Iterable[str]) -> str:
    """The arch part of a cache folder name: ``("9.0", "10.0")`` -> ``"sm90-100"``."""
    return "sm" + "-".join(arch.replace(".", "") for arch in arch_list)


def _torch_gpu_archs() -> tuple[str, ...] | None:
    # Only a torch the program already imported: importing it here would cost a second
    # or more and would make the loader depend on torch.
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return None
    try:
        if not cuda.is_available():
            return None
        caps = {cuda.get_device_capability(i) for i in range(cuda.device_count())}
    except Exception:  # a broken driver must not break the loader; fall back to nvidia-smi
        return None
    return tuple(f"{major}.{minor}" for major, minor in caps) or None


@functools.cache
def _nvidia_smi_archs() -> tuple[str, ...] | None:
    # Cached per process: the GPUs do not change under a running process, and the
    # call costs tens of milliseconds.
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    caps = [line.strip() for line in result.stdout.splitlines() if _ARCH.fullmatch(line.strip())]
    return tuple(caps) or None


def detect_gpu_arch_list() -> tuple[str, ...] | None:
    """The compute capabilities of the visible GPUs, or ``None`` when none is visible.

    All distinct capabilities are returned (nvidia-smi ignores ``CUDA_VISIBLE_DEVICES``),
    so a build for them runs on whichever GPU the process ends up using.
    """
    archs = _torch_gpu_archs() or _nvidia_smi_archs()
    return normalize_arch_list(archs) if archs else None


def cuda_arch_list() -> tuple[str, ...]:
    """The archs to build for.

    Resolution order: ``flash_compress.jit.config.arch_list`` (set in Python), then
    ``FLASH_COMPRESS_CUDA_ARCH_LIST`` (e.g. ``"9.0 10.0"``), then the visible GPUs'
    compute capabilities (through torch only if it is already imported, else
    ``nvidia-smi``), then :data:`DEFAULT_ARCH_LIST`.
    """
    requested = config.arch_list
    if requested:
        return normalize_arch_list(requested)
    return detect_gpu_arch_list() or DEFAULT_ARCH_LIST
