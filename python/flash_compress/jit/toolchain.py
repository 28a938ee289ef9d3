"""The compilers and the target: which nvcc, what exactly it and the host compiler are, which archs.

The compilers' ``--version`` outputs go into the cache key. Running them costs tens
of milliseconds, so the outputs are remembered, in memory and under the cache dir,
keyed by the path nvcc runs and its real file's path, size and mtime: a warm load in a
fresh process runs none of them. (Detecting the GPU's arch may run ``nvidia-smi`` once per
process, where no arch list is set and torch is not imported or sees no GPU; of the GPUs it
lists, those ``CUDA_VISIBLE_DEVICES`` leaves count.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from .config import config, split_arch_text

__all__ = [
    "DEFAULT_ARCH_LIST",
    "arch_tag",
    "cuda_arch_list",
    "detect_gpu_arch_list",
    "find_nvcc",
    "gencode_flags",
    "host_compiler",
    "normalize_arch_list",
    "tool_version",
]

_DEFAULT_CUDA_HOME = Path("/usr/local/cuda")

#: Used when nothing is requested and no GPU is visible (a build machine): the project targets Hopper.
DEFAULT_ARCH_LIST: tuple[str, ...] = ("9.0",)

# "9.0", "10.0", "9.0a" (arch-specific features) or "10.0f" (family-specific).
_ARCH = re.compile(r"(\d+)\.(\d)([af]?)")


# --- compilers -------------------------------------------------------------------------------------


def find_nvcc() -> Path | None:
    """The nvcc to build with, or ``None`` when this machine has none.

    ``$CUDA_HOME/bin/nvcc``, ``$CUDA_PATH/bin/nvcc``, ``/usr/local/cuda/bin/nvcc``, then
    ``nvcc`` on ``PATH`` (a wrapper script is fine: nvcc finds its own headers and libraries).
    """
    homes = [Path(os.environ[var]).expanduser() for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var, "").strip()]
    for home in (*homes, _DEFAULT_CUDA_HOME):
        nvcc = home / "bin" / "nvcc"
        if nvcc.is_file() and os.access(nvcc, os.X_OK):
            return nvcc
    on_path = shutil.which("nvcc")
    return Path(on_path) if on_path else None


def host_compiler() -> Path | None:
    """The host compiler nvcc drives, as nvcc picks it (``nvcc --dryrun`` shows it): ``$NVCC_CCBIN`` (a
    compiler, or a folder holding ``gcc``), else ``gcc`` on ``PATH``. ``$CXX`` is not nvcc's."""
    chosen = os.environ.get("NVCC_CCBIN", "").strip() or "gcc"
    if Path(chosen).is_dir():
        chosen = str(Path(chosen) / "gcc")
    found = shutil.which(chosen)
    return Path(found) if found else None


_versions: dict[tuple[str, str, int, int, tuple[str, ...]], str] = {}
_versions_lock = threading.Lock()


def _run_version(binary: Path, args: tuple[str, ...]) -> str:
    try:
        result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120, check=False,
                                env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"
    return (result.stdout + result.stderr).strip()


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tool_version(binary: Path, args: tuple[str, ...], cache_dir: Path | None) -> str:
    """``binary args...``'s output, remembered in memory and under ``cache_dir/.toolchain``.

    Keyed by the path as given (what nvcc runs: a ccache link answers for the compiler it
    is named after) and by its real file's path, size and mtime, so an upgraded compiler is
    asked again. An unwritable cache dir only costs the re-run in the next process; with the
    JIT disabled nothing is written (a miss then leaves the cache dir untouched).
    """
    real = binary.resolve()
    try:
        st = real.stat()
    except OSError as exc:
        return f"unavailable: {exc}"
    stamp = {"path": str(binary), "real": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
             "args": list(args)}
    memo_key = (str(binary), str(real), st.st_size, st.st_mtime_ns, args)
    disk = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps([str(binary), str(real), list(args)]).encode()).hexdigest()[:16]
        disk = cache_dir / ".toolchain" / f"{binary.name}-{digest}.json"
    with _versions_lock:
        output = _versions.get(memo_key)
    if output is None and disk is not None:
        try:
            saved = json.loads(disk.read_text())
            if saved.get("stamp") == stamp and isinstance(saved.get("output"), str):
                output = saved["output"]
        except (OSError, ValueError, AttributeError):
            pass
    fresh = output is None
    if output is None:
        output = _run_version(binary, args)
        if output.startswith("unavailable:"):
            return output
    with _versions_lock:
        _versions[memo_key] = output
    if disk is not None and not config.disable_jit and (fresh or not disk.exists()):
        try:
            _write_atomically(disk, json.dumps({"stamp": stamp, "output": output}, indent=1))
        except OSError:
            pass
    return output


# --- target archs ----------------------------------------------------------------------------------


def _sort_key(arch: str) -> tuple[int, int, str]:
    major, minor, suffix = _ARCH.fullmatch(arch).groups()  # type: ignore[union-attr]
    return (int(major), int(minor), suffix)


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


def gencode_flags(arch_list: Iterable[str]) -> list[str]:
    """nvcc's ``-gencode`` flags: SASS for each arch (``9.0a`` -> ``compute_90a``/``sm_90a``)."""
    flags = []
    for arch in arch_list:
        cc = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
    return flags


def _torch_gpu_archs(*, initialized_only: bool) -> tuple[str, ...] | None:
    # Only a torch the program already imported: importing it here would cost a second
    # or more and make the loader depend on torch. Asking torch for a capability initialises
    # CUDA, after which a forked child cannot use it: with ``initialized_only`` torch is asked
    # only where the program has initialised CUDA itself.
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is None:
        return None
    try:
        if initialized_only and not cuda.is_initialized():
            return None
        if not cuda.is_available():
            return None
        return tuple({"%d.%d" % cuda.get_device_capability(i) for i in range(cuda.device_count())}) or None
    except Exception:  # a broken driver must not break the loader; nvidia-smi may still answer
        return None


@functools.cache
def _nvidia_smi_gpus() -> tuple[tuple[str, str, str], ...] | None:
    """``(index, uuid, compute capability)`` of every GPU of the host, as nvidia-smi numbers them (by PCI
    bus). Once per process: the GPUs do not change under it, and the call costs tens of ms."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run([smi, "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    rows = (tuple(field.strip() for field in line.split(",")) for line in result.stdout.splitlines())
    return tuple(row for row in rows if len(row) == 3 and _ARCH.fullmatch(row[2])) or None


def _visible_to_cuda(gpus: tuple[tuple[str, str, str], ...]) -> tuple[tuple[str, str, str], ...]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` leaves this process: nvidia-smi lists the whole host, and a rank
    of a host with two kinds of GPU must not build for (or refuse for) the other kind. Its entries are
    UUIDs (or their prefixes) or indices, read up to the first that names no GPU, as CUDA does. An index
    is nvidia-smi's only in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``); in CUDA's default order,
    fastest first, or with MIG instances, the host's GPUs of every kind are kept where they differ."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    pci_order = os.environ.get("CUDA_DEVICE_ORDER", "").strip() == "PCI_BUS_ID"
    one_kind = len({arch for _, _, arch in gpus}) == 1
    chosen: list[tuple[str, str, str]] = []
    for entry in (token.strip() for token in visible.split(",")):
        if entry.startswith("MIG-") or (entry.isdigit() and not pci_order and not one_kind):
            return gpus
        matches = [gpu for gpu in gpus
                   if gpu[0] == entry or (entry.startswith("GPU-") and gpu[1].startswith(entry))]
        if len(matches) != 1:  # no GPU, or an ambiguous UUID prefix: CUDA stops there
            break
        chosen.append(matches[0])
    return tuple(chosen)


def _nvidia_smi_archs() -> tuple[str, ...] | None:
    gpus = _nvidia_smi_gpus()
    if gpus is None:
        return None
    return tuple(arch for _, _, arch in _visible_to_cuda(gpus)) or None


def detect_gpu_arch_list() -> tuple[str, ...] | None:
    """The distinct compute capabilities of the visible GPUs, or ``None`` when none is visible.

    torch where the program has initialised CUDA; else nvidia-smi where it names one kind (it cannot
    always tell which of a host's kinds ``CUDA_VISIBLE_DEVICES`` leaves); else torch, which may
    initialise CUDA; else nvidia-smi's kinds."""
    archs = _torch_gpu_archs(initialized_only=True)
    if archs:
        return normalize_arch_list(archs)
    host = _nvidia_smi_archs()
    archs = host if host and len(set(host)) == 1 else _torch_gpu_archs(initialized_only=False) or host
    return normalize_arch_list(archs) if archs else None


def cuda_arch_list() -> tuple[str, ...]:
    """The archs to build for: ``config.arch_list`` (Python, then ``FLASH_COMPRESS_CUDA_ARCH_LIST``),
    else the visible GPUs (:func:`detect_gpu_arch_list`), else sm_90."""
    requested = config.arch_list
    if requested:
        return normalize_arch_list(requested)
    return detect_gpu_arch_list() or DEFAULT_ARCH_LIST
