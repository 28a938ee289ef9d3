"""The on-disk cache: the key, what a complete entry is, how one is published, listed and cleared.

Layout under the cache root::

    <name>_<sm tag>_<hash16>/        a published entry: <name>.so, <name>.cu, manifest.json, build.log
    .staging/<folder>.<pid>.<rand>/  a build in progress (private to its builder)
    .locks/<folder>.lock             per-key OS lock (released when its holder dies)
    .trash/                          entries moved aside before deletion
    .toolchain/                      remembered compiler --version outputs
    failed/<folder>.log              the full log of the last failed build of a key

An entry appears only by renaming a complete staging folder onto its final name, so a
reader sees a whole entry or none; a killed builder leaves only its staging folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from filelock import FileLock

from .spec import JitSpec
from .toolchain import arch_tag, host_compiler, tool_version

__all__ = [
    "BUILD_LOG", "MANIFEST", "CacheLayout", "JitCacheInfo", "KeyInputs", "TreeDigest", "Verdict", "clear_cache",
    "find_covering_entry", "folder_name", "key_inputs", "list_entries", "publish", "quarantine", "tree_digest",
    "verify_entry", "write_manifest",
]

MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
#: Bumped when the meaning of a key or the layout of an entry changes: old entries then miss.
KEY_SCHEMA = 2
#: A staging or trash folder this old belongs to a builder that died (no build takes hours).
STALE_S = 6 * 3600.0
# nvcc reads these on every call, itself or through nvcc.profile, and passes them to the tools it
# runs (cudafe++, cicc, ptxas, nvlink; `nvcc --dryrun` shows them): they change the build as much as
# a flag does.
_NVCC_FLAG_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CUDAFE_FLAGS", "NVVM_FLAGS",
                  "OCG_FLAGS", "PTXAS_FLAGS", "NVLINK_FLAGS", "INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES")


# --- the key ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeDigest:
    """One include dir's contents: how many files, and a sha256 over (relative path, file sha256)."""

    files: int
    sha256: str


def _skipped(name: str) -> bool:
    # Editor, VCS and bytecode droppings are never #included; hashing them would turn a saved swap file into a rebuild.
    return name.startswith(".") or name == "__pycache__" or name.endswith(".pyc")


def tree_digest(root: Path) -> TreeDigest:
    """Hash every file under ``root`` by its path relative to ``root`` and its contents.

    Raises:
        FileNotFoundError: when ``root`` is not a directory.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"JIT include dir does not exist: {root}")
    entries = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not _skipped(d)]
        for path in (Path(dirpath) / f for f in filenames if not _skipped(f)):
            if path.is_file():
                entries.append((path.relative_to(root).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest()))
    outer = hashlib.sha256()
    for relative, digest in sorted(entries):
        outer.update(f"{relative}\0{digest}\n".encode())
    return TreeDigest(files=len(entries), sha256=outer.hexdigest())


def package_version() -> str:
    """flash_compress's version: the imported package's, else the installed metadata's."""
    version = getattr(sys.modules.get("flash_compress"), "__version__", None)
    if isinstance(version, str):
        return version
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("flash-compress")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class KeyInputs:
    """Everything the cache key covers, as plain data (the manifest records it too).

    ``nvcc_version``, ``host_compiler`` and ``nvcc_env`` are the toolchain: ``None``/empty
    where no nvcc exists. The *portable* key leaves them out, so that such a machine can
    still find a published build that matches everything else.
    """

    schema: int
    name: str
    source_sha256: str
    include_trees: tuple[TreeDigest, ...]
    extra_cuda_cflags: tuple[str, ...]
    extra_ldflags: tuple[str, ...]
    arch_list: tuple[str, ...]
    tvm_ffi_version: str
    package_version: str
    platform: str
    nvcc_version: str | None
    host_compiler: str | None
    nvcc_env: tuple[tuple[str, str], ...]

    @staticmethod
    def _digest(fields: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def portable_key(self) -> str:
        """The key without the toolchain."""
        fields = asdict(self)
        for name in ("nvcc_version", "host_compiler", "nvcc_env"):
            del fields[name]
        return self._digest(fields)

    def key(self) -> str:
        """The full cache key (64 hex digits).

        Raises:
            ValueError: when the toolchain is unknown (no nvcc on this machine).
        """
        if self.nvcc_version is None:
            raise ValueError("the full cache key needs nvcc's version, and no nvcc was found")
        return self._digest(asdict(self))


def key_inputs(spec: JitSpec, arch_list: tuple[str, ...], nvcc: Path | None, cache_dir: Path | None) -> KeyInputs:
    """The key inputs of ``spec`` built for ``arch_list`` by ``nvcc`` (``None``: no nvcc here).

    ``cache_dir`` holds the remembered compiler versions (``None`` skips them).
    """
    import tvm_ffi  # the loader imports it anyway, to load the module

    versions: tuple[str | None, str | None] = (None, None)
    if nvcc is not None:
        cxx = host_compiler()
        versions = (tool_version(nvcc, ("--version",), cache_dir),
                    tool_version(cxx, ("--version",), cache_dir) if cxx else "not found")
    return KeyInputs(
        schema=KEY_SCHEMA,
        name=spec.name,
        source_sha256=hashlib.sha256(spec.translation_unit().encode()).hexdigest(),
        include_trees=tuple(tree_digest(root) for root in spec.include_dirs),
        extra_cuda_cflags=spec.extra_cuda_cflags,
        extra_ldflags=spec.extra_ldflags,
        arch_list=arch_list,
        tvm_ffi_version=str(tvm_ffi.__version__),
        package_version=package_version(),
        platform=f"{sys.platform}-{platform.machine()}",
        nvcc_version=versions[0],
        host_compiler=versions[1],
        nvcc_env=tuple((var, os.environ[var]) for var in _NVCC_FLAG_ENV if nvcc and os.environ.get(var)),
    )


def folder_name(name: str, arch_list: tuple[str, ...], key: str) -> str:
    """The readable cache folder name: ``<name>_<sm tag>_<first 16 hex digits of the key>``."""
    return f"{name}_{arch_tag(arch_list)}_{key[:16]}"


# --- entries ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheLayout:
    """Paths inside one cache root."""

    root: Path

    def entry(self, folder: str) -> Path:
        return self.root / folder

    @property
    def staging_root(self) -> Path:
        return self.root / ".staging"

    @property
    def trash(self) -> Path:
        return self.root / ".trash"

    @property
    def failed(self) -> Path:
        return self.root / "failed"

    def lock_path(self, folder: str) -> Path:
        return self.root / ".locks" / f"{folder}.lock"

    def failed_log(self, folder: str) -> Path:
        return self.failed / f"{folder}.log"

    def shared_mode(self) -> int | None:
        """The root's permission bits where its group or others may write in it (a cache several users
        build into), else ``None``."""
        try:
            mode = self.root.stat().st_mode & 0o7777
        except OSError:
            return None
        return mode if mode & 0o022 else None

    def make_dir(self, path: Path) -> Path:
        """``mkdir -p`` a folder of the cache's own (locks, staging, trash, failed logs). In a shared root it
        gets the root's permission bits, which a builder's umask would otherwise narrow to its own user."""
        shared = self.shared_mode()
        missing = [p for p in (path, *path.parents) if not p.exists() and self.root in p.parents]
        path.mkdir(parents=True, exist_ok=True)
        for created in missing if shared is not None else ():
            try:
                created.chmod(shared)
            except OSError:  # made by another user meanwhile: theirs to set
                pass
        return path

    def lock(self, folder: str, timeout: float) -> FileLock:
        """The OS lock of ``folder``'s builds; in a shared root its file is writable by every user (a lock
        file only one user could open would stop every other one from building)."""
        path = self.make_dir(self.root / ".locks") / f"{folder}.lock"
        return FileLock(str(path), timeout=timeout, mode=0o666 if self.shared_mode() is not None else 0o644)

    def new_staging(self, folder: str) -> Path:
        """A fresh private staging folder for a build of ``folder``."""
        self.make_dir(self.staging_root)
        path = self.staging_root / f"{folder}.{os.getpid()}.{secrets.token_hex(4)}"
        path.mkdir()
        shared = self.shared_mode()
        if shared is not None:  # the published entry keeps them: another user may have to move it aside
            path.chmod(shared)
        return path

    def share_files(self, staging: Path) -> None:
        """In a shared root, open a staged entry's files to whom the root is open: read, and run where the
        builder may run them. A builder's umask (``077``) would otherwise leave the library only its own to
        load."""
        shared = self.shared_mode()
        if shared is None:
            return
        for path in staging.iterdir():
            if path.is_file():
                runnable = shared & 0o111 if path.stat().st_mode & stat.S_IXUSR else 0
                path.chmod(stat.S_IRUSR | stat.S_IWUSR | shared & 0o444 | runnable)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(entry: Path) -> dict[str, Any] | None:
    """An entry's manifest, or ``None`` when it is missing or unreadable."""
    try:
        data = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(staging: Path, inputs: KeyInputs, library: Path, build_seconds: float, command: str) -> None:
    """Record what was built, from what, and the .so's size and sha256 (flushed to disk)."""
    manifest = {
        **asdict(inputs),
        "folder": folder_name(inputs.name, inputs.arch_list, inputs.key()),
        "key": inputs.key(),
        "portable_key": inputs.portable_key(),
        "library": library.name,
        "size": library.stat().st_size,
        "sha256": _sha256(library),
        "build_seconds": round(build_seconds, 3),
        "built_at": time.time(),
        "command": command,
    }
    with (staging / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Verdict:
    """One entry on disk: ``library`` when complete and matching its manifest, else ``problem``
    (both ``None``: no such entry)."""

    library: Path | None
    problem: str | None
    manifest: dict[str, Any] | None = None

    @property
    def exists(self) -> bool:
        return self.library is not None or self.problem is not None


def verify_entry(entry: Path, key: str | None = None) -> Verdict:
    """Check an entry: manifest readable, ``key`` matches (if given), .so of the recorded size and sha256."""
    if not entry.is_dir():
        return Verdict(None, None)
    manifest = read_manifest(entry)
    if manifest is None:
        # `clear` (or a quarantine) may have renamed the whole entry away since the check above.
        return Verdict(None, "manifest.json is missing or unreadable" if entry.is_dir() else None)
    if key is not None and manifest.get("key") != key:
        return Verdict(None, "manifest.json belongs to another key", manifest)
    library = entry / str(manifest.get("library", ""))
    try:
        if not manifest.get("library") or not library.is_file():
            return Verdict(None, "the shared library is missing" if entry.is_dir() else None, manifest)
        size = library.stat().st_size
        if size != manifest.get("size"):
            return Verdict(None, f"the shared library has {size} bytes, the manifest says {manifest.get('size')}",
                           manifest)
        if _sha256(library) != manifest.get("sha256"):
            return Verdict(None, "the shared library's sha256 does not match the manifest", manifest)
    except FileNotFoundError:  # renamed away while being checked: a miss, not a broken entry
        return Verdict(None, None)
    return Verdict(library, None, manifest)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def quarantine(layout: CacheLayout, entry: Path) -> None:
    """Rename an entry out of its final name at once (a loader never sees half of one), then delete it.

    A process that already mapped the .so keeps its mapping.
    """
    layout.make_dir(layout.trash)
    aside = layout.trash / f"{entry.name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.rename(entry, aside)
    except FileNotFoundError:
        return
    remove_tree(aside)


def publish(staging: Path, final: Path) -> bool:
    """Rename a complete staging folder onto its final name; ``False`` (and the staging folder
    deleted) if another builder got there first."""
    try:
        os.rename(staging, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            remove_tree(staging)
            return False
        raise
    return True


def clean_staging(layout: CacheLayout, folder: str | None) -> None:
    """Delete what dead builders left: staging folders of ``folder`` (call it holding that key's lock,
    so none is live) and any staging or trash folder older than :data:`STALE_S`."""
    now = time.time()
    for parent in (layout.staging_root, layout.trash):
        for child in parent.iterdir() if parent.is_dir() else ():
            try:
                stale = now - child.stat().st_mtime > STALE_S
            except OSError:
                continue
            if stale or (folder is not None and parent == layout.staging_root and child.name.startswith(f"{folder}.")):
                remove_tree(child)


def find_covering_entry(layout: CacheLayout, inputs: KeyInputs, *, portable: bool = False) -> Verdict:
    """The newest intact entry built for every arch of ``inputs.arch_list``, and maybe more, whose key is the
    one ``inputs`` would have with that entry's arch list; ``portable`` compares portable keys (a machine
    with no nvcc, which cannot compute the full key).

    So a node that asks for its own GPU's arch finds a cluster's multi-arch prebuild (``--arch 9.0 10.0``).
    """
    wanted = set(inputs.arch_list)
    candidates = []
    for entry in layout.root.glob(f"{inputs.name}_*"):
        manifest = read_manifest(entry)
        if manifest is None or manifest.get("name") != inputs.name:
            continue
        archs = tuple(str(arch) for arch in manifest.get("arch_list", ()))
        if not wanted <= set(archs):
            continue
        built_for = replace(inputs, arch_list=archs)
        if portable and manifest.get("portable_key") == built_for.portable_key() or (
                not portable and manifest.get("key") == built_for.key()):
            candidates.append((float(manifest.get("built_at", 0.0)), entry))
    for _, entry in sorted(candidates, reverse=True):
        verdict = verify_entry(entry)
        if verdict.library is not None:
            return verdict
    return Verdict(None, None)


# --- looking at and emptying the cache --------------------------------------------------------------


@dataclass(frozen=True)
class JitCacheInfo:
    """One published entry: folder name and path, variant name, archs, full key, bytes on disk,
    build time (epoch seconds, 0 if unknown), compile seconds, and ``problem``: ``None`` when it
    verifies (manifest, size and sha256 of its .so), else what is wrong (a broken entry is listed too,
    its name and archs read off the folder name when its manifest is unreadable)."""

    folder: str
    path: Path
    name: str
    arch_list: tuple[str, ...]
    key: str
    size: int
    built_at: float
    build_seconds: float
    problem: str | None

    @property
    def intact(self) -> bool:
        return self.problem is None


def _folder_fields(folder: str) -> tuple[str, tuple[str, ...]] | None:
    """``(name, archs)`` of a folder named as ``folder_name`` names entries, else ``None``."""
    parts = folder.rsplit("_", 2)
    if len(parts) != 3 or not parts[1].startswith("sm") or not parts[0]:
        return None
    archs = [re.fullmatch(r"(\d+)(\d)([af]?)", tag) for tag in parts[1][2:].split("-")]
    return parts[0], tuple(f"{m[1]}.{m[2]}{m[3]}" for m in archs if m)


def _entry_folders(root: Path) -> list[tuple[Path, str, tuple[str, ...], dict[str, Any]]]:
    """``(path, variant name, archs, manifest)`` of every entry under ``root``, broken ones too (name and
    archs read off the folder name when the manifest is unreadable; its manifest then ``{}``), sorted."""
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if not path.is_dir() or path.name.startswith("."):
            continue
        manifest = read_manifest(path)
        fields = _folder_fields(path.name)
        if manifest is None and fields is None:
            continue  # not an entry (failed/, or something else's)
        name, archs = (str(manifest.get("name", "")), tuple(manifest.get("arch_list", ()))) if manifest else fields
        found.append((path, name, archs, manifest or {}))
    return found


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, counting none that `clear` removes meanwhile (os.walk passes
    over a folder it cannot list)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def list_entries(root: Path) -> list[JitCacheInfo]:
    """Every entry under ``root``, broken ones too, sorted by folder name (each .so is hashed); one that
    `clear` removes meanwhile is left out."""
    infos = []
    for path, name, archs, manifest in _entry_folders(root):
        size, verdict = _tree_bytes(path), verify_entry(path)
        if not verdict.exists:
            continue
        infos.append(JitCacheInfo(
            folder=path.name,
            path=path,
            name=name,
            arch_list=archs,
            key=str(manifest.get("key", "")),
            size=size,
            built_at=float(manifest.get("built_at", 0.0)),
            build_seconds=float(manifest.get("build_seconds", 0.0)),
            problem=verdict.problem,
        ))
    return infos


def clear_cache(root: Path, name_prefix: str | None = None, match: Callable[[str], bool] | None = None) -> list[str]:
    """Delete published entries (all, or those whose variant name starts with ``name_prefix`` and
    satisfies ``match``); returns their folder names.

    Each is renamed away first, so a concurrent loader never sees half of one. Clearing
    everything also drops failed-build logs, remembered compiler versions and dead
    builders' leftovers; lock files stay (deleting a held one would let a second builder in).
    """
    layout = CacheLayout(root)
    removed = []
    for path, name, _, _ in _entry_folders(root):  # no need to hash what is deleted
        if (name_prefix is None or name.startswith(name_prefix)) and (match is None or match(name)):
            quarantine(layout, path)
            removed.append(path.name)
    if name_prefix is None and match is None and root.is_dir():
        for path in (layout.failed, root / ".toolchain", layout.trash):
            remove_tree(path)
        clean_staging(layout, None)
    return removed
