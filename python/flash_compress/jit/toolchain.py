"""The compilers: where the CUDA toolkit is, and what exactly nvcc and the host compiler are.

Their ``--version`` outputs go into the cache key. Running them costs tens of
milliseconds per process, so the outputs are cached, in memory and on disk in the
cache dir, keyed by each binary's real path, size and mtime: a warm load in a
fresh process then runs no subprocess at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .config import config

__all__ = ["CudaToolkit", "find_cuda_toolkit", "host_compiler", "tool_version"]

_DEFAULT_CUDA_HOME = Path("/usr/local/cuda")
# A wrapper script is read for the toolkit it execs only when it is this small.
_MAX_WRAPPER_BYTES = 64 * 1024


@dataclass(frozen=True)
class CudaToolkit:
    """A usable CUDA toolkit: its root (what ``CUDA_HOME`` should be) and its ``nvcc``."""

    home: Path
    nvcc: Path


def _is_toolkit(home: Path) -> bool:
    # A bare bin/nvcc is not enough: /usr/local/bin/nvcc may be a wrapper whose
    # parent has no CUDA headers, and tvm-ffi takes CUDA_HOME/lib64 and the headers from here.
    if not (home / "bin" / "nvcc").is_file():
        return False
    if (home / "include" / "cuda_runtime.h").is_file():
        return True
    targets = home / "targets"
    return targets.is_dir() and any(targets.glob("*/include/cuda_runtime.h"))


def _homes_named_in_wrapper(nvcc: Path) -> list[Path]:
    """Toolkit roots that a small wrapper script around nvcc names (``exec /opt/cuda/bin/nvcc "$@"``)."""
    try:
        if nvcc.stat().st_size > _MAX_WRAPPER_BYTES:
            return []
        data = nvcc.read_bytes()
    except OSError:
        return []
    if data.startswith(b"\x7fELF"):
        return []
    text = data.decode("utf-8", errors="replace")
    return [Path(match) for match in re.findall(r"(/[^\s\"'`;|&]+)/bin/nvcc\b", text)]


def _home_reported_by_nvcc(nvcc: Path) -> Path | None:
    """Ask nvcc where it lives (its dry run prints ``_HERE_=<home>/bin``): the last resort."""
    try:
        result = subprocess.run(
            [str(nvcc), "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", result.stdout + result.stderr, re.MULTILINE)
    return Path(match.group(1).strip()).parent if match else None


def find_cuda_toolkit() -> CudaToolkit | None:
    """Find the CUDA toolkit, or ``None`` when this machine has none.

    Candidates in order: ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``, then the
    ``nvcc`` on ``PATH`` (its real path's grandparent, a toolkit its wrapper script
    names, and finally the home nvcc reports). The first candidate that holds both
    ``bin/nvcc`` and ``include/cuda_runtime.h`` wins.
    """
    candidates: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var, "").strip()
        if value:
            candidates.append(Path(value).expanduser())
    candidates.append(_DEFAULT_CUDA_HOME)
    for home in candidates:
        if _is_toolkit(home):
            return CudaToolkit(home=home, nvcc=home / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path is None:
        return None
    nvcc = Path(on_path)
    later = [nvcc.resolve().parent.parent, nvcc.parent.parent, *_homes_named_in_wrapper(nvcc)]
    for home in later:
        if _is_toolkit(home):
            return CudaToolkit(home=home, nvcc=home / "bin" / "nvcc")
    reported = _home_reported_by_nvcc(nvcc)
    if reported is not None and _is_toolkit(reported):
        return CudaToolkit(home=reported, nvcc=reported / "bin" / "nvcc")
    return None


def host_compiler() -> Path | None:
    """The host C++ compiler tvm-ffi links with: ``$CXX``, else ``c++`` on ``PATH``."""
    name = os.environ.get("CXX", "").strip() or "c++"
    found = shutil.which(name)
    return Path(found) if found else None


_memory: dict[tuple[str, int, int, tuple[str, ...]], str] = {}
_memory_lock = threading.Lock()


def _run_version(binary: Path, args: tuple[str, ...]) -> str:
    try:
        result = subprocess.run(
            [str(binary), *args], capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
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
    """``binary args...``'s output, cached in memory and under ``cache_dir/.toolchain``.

    The cache is keyed by the binary's real path, size and mtime, so an upgraded
    compiler is re-asked. A cache dir that cannot be written only costs the re-run.
    """
    real = binary.resolve()
    try:
        st = real.stat()
    except OSError as exc:
        return f"unavailable: {exc}"
    mem_key = (str(real), st.st_size, st.st_mtime_ns, args)
    stamp = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "args": list(args)}
    disk: Path | None = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps([str(real), list(args)]).encode()).hexdigest()[:16]
        disk = cache_dir / ".toolchain" / f"{real.name}-{digest}.json"
    with _memory_lock:
        remembered = _memory.get(mem_key)
    if remembered is not None:
        # Another cache dir may be new to this process: give it the answer too,
        # so that its next process runs no subprocess either.
        # (Not with the JIT disabled: a miss then must leave the cache dir untouched.)
        if disk is not None and not config.disable_jit and not disk.exists():
            try:
                _write_atomically(disk, json.dumps({"stamp": stamp, "output": remembered}, indent=1))
            except OSError:
                pass
        return remembered
    if disk is not None:
        try:
            saved = json.loads(disk.read_text())
        except (OSError, ValueError):
            saved = None
        output = saved.get("output") if isinstance(saved, dict) and saved.get("stamp") == stamp else None
        if isinstance(output, str):
            with _memory_lock:
                _memory[mem_key] = output
            return output
    output = _run_version(real, args)
    if disk is not None and not output.startswith("unavailable:"):
        try:
            _write_atomically(disk, json.dumps({"stamp": stamp, "output": output}, indent=1))
        except OSError:
            pass  # a read-only cache is fine: the next process asks again
    with _memory_lock:
        _memory[mem_key] = output
    return output
