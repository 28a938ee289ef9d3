"""Looking at and emptying the cache: what the ``status`` and ``clear`` commands use."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .cache import STALE_STAGING_S, CacheLayout, quarantine, read_manifest, remove_tree
from .config import config

__all__ = ["JitCacheInfo", "clear_cache", "list_entries"]


@dataclass(frozen=True)
class JitCacheInfo:
    """One published cache entry.

    Attributes:
        folder: its folder name (``<name>_<sm tag>_<hash16>``).
        path: its full path.
        name: the variant name.
        arch_list: the archs it was built for.
        key: the full cache key (64 hex digits).
        size: bytes on disk, whole folder.
        built_at: when it was built (seconds since the epoch; 0 if unknown).
        build_seconds: how long the compile took.
        intact: whether its .so has the size the manifest records (a quick check, no sha256).
    """

    folder: str
    path: Path
    name: str
    arch_list: tuple[str, ...]
    key: str
    size: int
    built_at: float
    build_seconds: float
    intact: bool


def _root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir


def _folder_bytes(path: Path) -> int:
    total = 0
    for child in path.rglob("*"):
        try:
            if child.is_file():
                total += child.stat().st_size
        except OSError:
            continue
    return total


def list_entries(cache_dir: str | os.PathLike[str] | None = None) -> list[JitCacheInfo]:
    """Every published entry under ``cache_dir`` (default ``config.cache_dir``), sorted by folder name."""
    root = _root(cache_dir)
    if not root.is_dir():
        return []
    entries: list[JitCacheInfo] = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not path.is_dir():
            continue
        manifest = read_manifest(path)
        if manifest is None:
            continue
        library = path / str(manifest.get("library", ""))
        try:
            intact = library.is_file() and library.stat().st_size == manifest.get("size")
        except OSError:
            intact = False
        entries.append(
            JitCacheInfo(
                folder=path.name,
                path=path,
                name=str(manifest.get("name", "")),
                arch_list=tuple(manifest.get("arch_list", ())),
                key=str(manifest.get("key", "")),
                size=_folder_bytes(path),
                built_at=float(manifest.get("built_at", 0.0)),
                build_seconds=float(manifest.get("build_seconds", 0.0)),
                intact=intact,
            )
        )
    return entries


def clear_cache(cache_dir: str | os.PathLike[str] | None = None, name_prefix: str | None = None) -> list[str]:
    """Delete published entries (all, or those whose variant name starts with ``name_prefix``).

    Each entry is renamed away before deletion, so a concurrent loader never sees
    half of one. Clearing everything also drops failed-build logs, the compiler
    version cache and staging folders of dead builders; lock files stay, since
    deleting one that a live builder holds would let a second builder in.

    Returns:
        The folder names of the deleted entries.
    """
    root = _root(cache_dir)
    if not root.is_dir():
        return []
    layout = CacheLayout(root)
    removed: list[str] = []
    for info in list_entries(root):
        if name_prefix is None or info.name.startswith(name_prefix):
            quarantine(layout, info.path)
            removed.append(info.folder)
    if name_prefix is None:
        remove_tree(layout.failed)
        remove_tree(root / ".toolchain")
        remove_tree(layout.trash)
        _remove_stale_staging(layout)
    return removed


def _remove_stale_staging(layout: CacheLayout) -> None:
    try:
        children = list(layout.staging_root.iterdir())
    except OSError:
        return
    for child in children:
        try:
            if time.time() - child.stat().st_mtime > STALE_STAGING_S:
                remove_tree(child)
        except OSError:
            continue
