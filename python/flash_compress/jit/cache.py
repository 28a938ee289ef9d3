"""The on-disk cache: where things live, what a complete entry is, and how one is published.

Layout under the cache root::

    <name>_<sm tag>_<hash16>/     one published entry: <name>.so, manifest.json, build.log,
                                  and for reference <name>.cu and build.ninja
    .staging/<folder>.<pid>.<rand>/   a build in progress (private to its builder)
    .locks/<folder>.lock          per-key OS lock (dies with its holder)
    .trash/                       entries moved aside before deletion
    .toolchain/                   cached compiler --version outputs
    failed/<folder>.log           the full log of the last failed build of a key

An entry only ever appears by renaming a complete staging folder onto its final
name, so a reader sees a whole entry or none; a killed builder leaves only its
staging folder behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUILD_LOG",
    "MANIFEST",
    "CacheLayout",
    "Verdict",
    "clean_staging",
    "file_sha256",
    "find_portable_match",
    "new_manifest",
    "publish",
    "quarantine",
    "read_manifest",
    "remove_tree",
    "verify_entry",
    "write_manifest",
]

MANIFEST = "manifest.json"
BUILD_LOG = "build.log"

#: A staging folder this old belongs to a builder that died (no build takes hours).
STALE_STAGING_S = 6 * 3600.0


@dataclass(frozen=True)
class CacheLayout:
    """Paths inside one cache root."""

    root: Path

    def entry(self, folder: str) -> Path:
        """A published entry's folder."""
        return self.root / folder

    @property
    def staging_root(self) -> Path:
        return self.root / ".staging"

    @property
    def locks(self) -> Path:
        return self.root / ".locks"

    @property
    def trash(self) -> Path:
        return self.root / ".trash"

    @property
    def failed(self) -> Path:
        return self.root / "failed"

    def lock_path(self, folder: str) -> Path:
        """The per-key lock file."""
        return self.locks / f"{folder}.lock"

    def failed_log(self, folder: str) -> Path:
        """Where a failed build's full log is kept."""
        return self.failed / f"{folder}.log"

    def new_staging(self, folder: str) -> Path:
        """Create a fresh private staging folder for a build of ``folder``."""
        self.staging_root.mkdir(parents=True, exist_ok=True)
        path = self.staging_root / f"{folder}.{os.getpid()}.{secrets.token_hex(4)}"
        path.mkdir()
        return path


def file_sha256(path: Path) -> str:
    """sha256 of a file's contents, read in chunks."""
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


def new_manifest(
    *,
    folder: str,
    key: str,
    portable_key: str,
    inputs: dict[str, Any],
    library: Path,
    build_seconds: float,
    command: str,
) -> dict[str, Any]:
    """A manifest for a freshly built entry: what was built, from what, and the .so's size and sha256.

    ``inputs`` is the key inputs as plain data (names, digests, flags, versions).
    """
    return {
        "folder": folder,
        "name": inputs["name"],
        "key": key,
        "portable_key": portable_key,
        "arch_list": list(inputs["arch_list"]),
        "nvcc_version": inputs["nvcc_version"],
        "tvm_ffi_version": inputs["tvm_ffi_version"],
        "package_version": inputs["package_version"],
        "flags": {
            "extra_cuda_cflags": list(inputs["extra_cuda_cflags"]),
            "extra_cflags": list(inputs["extra_cflags"]),
            "extra_ldflags": list(inputs["extra_ldflags"]),
        },
        "key_inputs": inputs,
        "library": library.name,
        "size": library.stat().st_size,
        "sha256": file_sha256(library),
        "build_seconds": round(build_seconds, 3),
        "built_at": time.time(),
        "command": command,
        "log": BUILD_LOG,
    }


def write_manifest(entry: Path, manifest: dict[str, Any]) -> None:
    """Write (and flush to disk) an entry's manifest; only ever done in staging."""
    path = entry / MANIFEST
    with path.open("w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Verdict:
    """The state of one entry on disk.

    ``library`` is set when the entry is complete and its .so matches the manifest;
    ``problem`` says what is wrong otherwise (``None`` together with no library
    means the entry does not exist).
    """

    library: Path | None
    problem: str | None
    manifest: dict[str, Any] | None = None

    @property
    def exists(self) -> bool:
        return self.library is not None or self.problem is not None


def verify_entry(entry: Path, key: str | None = None) -> Verdict:
    """Check an entry: manifest readable, (``key`` matches), .so present with the recorded size and sha256."""
    if not entry.is_dir():
        return Verdict(library=None, problem=None)
    manifest = read_manifest(entry)
    if manifest is None:
        return Verdict(library=None, problem="manifest.json is missing or unreadable")
    if key is not None and manifest.get("key") != key:
        return Verdict(library=None, problem="manifest.json belongs to another key", manifest=manifest)
    library = entry / str(manifest.get("library", ""))
    if not manifest.get("library") or not library.is_file():
        return Verdict(library=None, problem="the shared library is missing", manifest=manifest)
    size = library.stat().st_size
    if size != manifest.get("size"):
        return Verdict(
            library=None,
            problem=f"the shared library has {size} bytes, the manifest says {manifest.get('size')}",
            manifest=manifest,
        )
    if file_sha256(library) != manifest.get("sha256"):
        return Verdict(library=None, problem="the shared library's sha256 does not match the manifest", manifest=manifest)
    return Verdict(library=library, problem=None, manifest=manifest)


def remove_tree(path: Path) -> None:
    """Delete a folder, ignoring what is already gone."""
    shutil.rmtree(path, ignore_errors=True)


def quarantine(layout: CacheLayout, entry: Path) -> None:
    """Move an entry out of its final name at once, then delete it.

    The rename is atomic, so no other process can load it half-deleted; a process
    that already mapped the .so keeps its mapping.
    """
    layout.trash.mkdir(parents=True, exist_ok=True)
    aside = layout.trash / f"{entry.name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.rename(entry, aside)
    except FileNotFoundError:
        return
    remove_tree(aside)


def publish(staging: Path, final: Path) -> bool:
    """Rename a complete staging folder onto its final name; ``False`` if another builder got there first.

    The loser's staging folder is deleted; the caller then uses the winner's entry.
    """
    try:
        os.rename(staging, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            remove_tree(staging)
            return False
        raise
    return True


def clean_staging(layout: CacheLayout, folder: str) -> None:
    """Delete staging folders left by dead builders.

    Call it holding ``folder``'s lock: then any staging folder of ``folder`` belongs
    to a builder that died (a live one would hold the lock). Other keys' staging
    folders are deleted only when older than :data:`STALE_STAGING_S`.
    """
    try:
        children = list(layout.staging_root.iterdir())
    except OSError:
        return
    now = time.time()
    for child in children:
        mine = child.name.startswith(f"{folder}.")
        try:
            stale = now - child.stat().st_mtime > STALE_STAGING_S
        except OSError:
            continue
        if mine or stale:
            remove_tree(child)
    for child in (layout.trash.iterdir() if layout.trash.is_dir() else ()):
        try:
            if now - child.stat().st_mtime > STALE_STAGING_S:
                remove_tree(child)
        except OSError:
            continue


def find_portable_match(layout: CacheLayout, name: str, tag: str, portable_key: str) -> Verdict:
    """The newest intact entry of ``name`` for arch tag ``tag`` whose portable key matches.

    Used where no CUDA toolkit exists, so the full key (which needs nvcc's version)
    cannot be computed.
    """
    best: Verdict = Verdict(library=None, problem=None)
    best_time = -1.0
    for entry in layout.root.glob(f"{name}_{tag}_*"):
        manifest = read_manifest(entry)
        if manifest is None or manifest.get("portable_key") != portable_key:
            continue
        built_at = float(manifest.get("built_at", 0.0))
        if built_at <= best_time:
            continue
        verdict = verify_entry(entry)
        if verdict.library is not None:
            best, best_time = verdict, built_at
    return best
