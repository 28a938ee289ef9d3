"""The cache key: a sha256 over everything that can change the built .so.

It covers the contents of every file under the spec's include dirs (by relative
path, so moving the checkout or the venv keeps the key), the generated source,
all flags, the arch list, the full ``nvcc --version``, the host compiler, the
nvcc flag environment, the tvm-ffi version, our package version and the platform.

The *portable* key leaves out the toolchain (nvcc, host compiler): a machine with
no CUDA toolkit cannot compute the full key, and instead looks for a published
build whose portable key matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .arch import arch_tag
from .spec import JitSpec
from .toolchain import CudaToolkit, host_compiler, tool_version

__all__ = ["KEY_SCHEMA", "KeyInputs", "TreeDigest", "folder_name", "key_inputs", "package_version", "tree_digest"]

#: Bumped when the meaning of a key or the layout of an entry changes: old entries then miss.
KEY_SCHEMA = 1

#: Used only when neither the imported package nor its installed metadata says.
FALLBACK_PACKAGE_VERSION = "0.1.0"

# nvcc reads these on every call: they change the build as much as a flag does.
_NVCC_FLAG_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")


@dataclass(frozen=True)
class TreeDigest:
    """One include dir's contents: how many files, and a sha256 over (relative path, file sha256)."""

    files: int
    sha256: str


def _skipped(name: str) -> bool:
    # Editor, VCS and bytecode droppings are never #included; hashing them would
    # turn a saved swap file into a rebuild.
    return name.startswith(".") or name == "__pycache__" or name.endswith(".pyc")


def tree_digest(root: Path) -> TreeDigest:
    """Hash every file under ``root`` by its path relative to ``root`` and its contents.

    Raises:
        FileNotFoundError: when ``root`` is not a directory.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"JIT include dir does not exist: {root}")
    entries: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
        for filename in filenames:
            if _skipped(filename):
                continue
            path = Path(dirpath) / filename
            if not path.is_file():
                continue
            relative = path.relative_to(root).as_posix()
            entries.append((relative, hashlib.sha256(path.read_bytes()).hexdigest()))
    entries.sort()
    outer = hashlib.sha256()
    for relative, digest in entries:
        outer.update(f"{relative}\0{digest}\n".encode())
    return TreeDigest(files=len(entries), sha256=outer.hexdigest())


def package_version() -> str:
    """flash_compress's version, without importing anything heavy.

    The already-imported package's ``__version__`` first (the loader runs inside it),
    then the installed distribution's metadata, then a constant.
    """
    package = sys.modules.get("flash_compress")
    version = getattr(package, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        return dist_version("flash-compress")
    except (ImportError, PackageNotFoundError):
        return FALLBACK_PACKAGE_VERSION


def _tvm_ffi_version() -> str:
    import tvm_ffi  # the loader imports it anyway, to load the module

    return str(tvm_ffi.__version__)


@dataclass(frozen=True)
class KeyInputs:
    """Everything the cache key covers, as plain data (it also fills the manifest)."""

    schema: int
    name: str
    source_sha256: str
    headers: tuple[str, ...]
    exports: tuple[tuple[str, str | tuple[str, ...]], ...]
    include_trees: tuple[TreeDigest, ...]
    extra_cuda_cflags: tuple[str, ...]
    extra_cflags: tuple[str, ...]
    extra_ldflags: tuple[str, ...]
    arch_list: tuple[str, ...]
    tvm_ffi_version: str
    package_version: str
    platform: str
    nvcc_version: str | None
    host_compiler: str | None
    nvcc_env: tuple[tuple[str, str], ...]

    def _digest(self, fields: dict[str, object]) -> str:
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def portable_key(self) -> str:
        """The key without the toolchain: what a machine with no CUDA toolkit can still compute."""
        fields = asdict(self)
        for toolchain_field in ("nvcc_version", "host_compiler", "nvcc_env"):
            fields.pop(toolchain_field)
        return self._digest(fields)

    def key(self) -> str:
        """The full cache key (64 hex digits).

        Raises:
            ValueError: when the toolchain is unknown (no CUDA toolkit on this machine).
        """
        if self.nvcc_version is None:
            raise ValueError("the full cache key needs nvcc's version, and no CUDA toolkit was found")
        return self._digest(asdict(self))


def key_inputs(
    spec: JitSpec, arch_list: tuple[str, ...], toolkit: CudaToolkit | None, cache_dir: Path | None
) -> KeyInputs:
    """Gather the key inputs of ``spec`` built for ``arch_list`` with ``toolkit`` (``None``: no toolkit).

    ``cache_dir`` holds the on-disk cache of compiler version outputs (``None`` skips it).
    """
    nvcc_version: str | None = None
    cxx_version: str | None = None
    nvcc_env: tuple[tuple[str, str], ...] = ()
    if toolkit is not None:
        nvcc_version = tool_version(toolkit.nvcc, ("--version",), cache_dir)
        cxx = host_compiler()
        cxx_version = tool_version(cxx, ("--version",), cache_dir) if cxx is not None else "not found"
        nvcc_env = tuple((var, os.environ[var]) for var in _NVCC_FLAG_ENV if os.environ.get(var))
    return KeyInputs(
        schema=KEY_SCHEMA,
        name=spec.name,
        source_sha256=hashlib.sha256(spec.translation_unit().encode()).hexdigest(),
        headers=spec.headers,
        exports=tuple(spec.exports.items()),
        include_trees=tuple(tree_digest(root) for root in spec.include_dirs),
        extra_cuda_cflags=spec.extra_cuda_cflags,
        extra_cflags=spec.extra_cflags,
        extra_ldflags=spec.extra_ldflags,
        arch_list=arch_list,
        tvm_ffi_version=_tvm_ffi_version(),
        package_version=package_version(),
        platform=f"{sys.platform}-{platform.machine()}",
        nvcc_version=nvcc_version,
        host_compiler=cxx_version,
        nvcc_env=nvcc_env,
    )


def folder_name(name: str, arch_list: tuple[str, ...], key: str) -> str:
    """The readable cache folder name: ``<name>_<sm tag>_<first 16 hex digits of the key>``."""
    return f"{name}_{arch_tag(arch_list)}_{key[:16]}"
