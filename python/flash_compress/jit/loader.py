"""Find a variant in the cache, or build it once across processes, then load it.

The protocol for one key:

1. Compute the key and verify the published entry (manifest, size, sha256): a hit
   needs no lock, no ninja and no nvcc, and writes nothing.
2. On a miss, take the key's OS lock (``filelock``), check again (another process
   may have just built it), build in a private staging folder, publish it by
   renaming the whole folder onto its final name, release the lock.

A second ``load`` of the same spec in the same process returns the module it
already loaded, without hashing anything: like a Python import, a process does
not see edits made to a variant's sources after it loaded that variant.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .arch import arch_tag, cuda_arch_list, normalize_arch_list
from .build import compile_in_staging
from .cache import (
    BUILD_LOG,
    CacheLayout,
    Verdict,
    clean_staging,
    find_portable_match,
    new_manifest,
    publish,
    quarantine,
    remove_tree,
    verify_entry,
    write_manifest,
)
from .config import config
from .errors import JitBuildError, JitDisabledError, JitLockTimeoutError
from .fingerprint import KeyInputs, folder_name, key_inputs
from .spec import JitSpec
from .toolchain import CudaToolkit, find_cuda_toolkit

if TYPE_CHECKING:
    import tvm_ffi

__all__ = ["BuildOutcome", "ensure_built", "load"]

logger = logging.getLogger("flash_compress")

_loaded: dict[tuple[JitSpec, tuple[str, ...], str], "tvm_ffi.Module"] = {}
_loaded_lock = threading.Lock()


@dataclass(frozen=True)
class BuildOutcome:
    """Where a variant's build is, and whether this call built it.

    Attributes:
        folder: the cache folder name.
        entry: the published entry's path.
        library: the .so inside it.
        sha256: the .so's sha256, as the manifest records it.
        status: ``"built"`` when this call compiled it, ``"cached"`` when it was already there.
        seconds: wall time of this call (the compile time, for a build).
        arch_list: the archs it was built for.
        portable: found by its portable key, on a machine with no CUDA toolkit.
    """

    folder: str
    entry: Path
    library: Path
    sha256: str
    status: Literal["built", "cached"]
    seconds: float
    arch_list: tuple[str, ...]
    portable: bool = False


def _outcome(verdict: Verdict, status: Literal["built", "cached"], start: float, arch: tuple[str, ...],
             portable: bool = False) -> BuildOutcome:
    assert verdict.library is not None and verdict.manifest is not None
    return BuildOutcome(
        folder=verdict.library.parent.name,
        entry=verdict.library.parent,
        library=verdict.library,
        sha256=str(verdict.manifest["sha256"]),
        status=status,
        seconds=time.perf_counter() - start,
        arch_list=arch,
        portable=portable,
    )


def _usable(verdict: Verdict, distrust_sha: str | None) -> bool:
    return verdict.library is not None and (
        distrust_sha is None or (verdict.manifest or {}).get("sha256") != distrust_sha
    )


def _settings(arch_list: tuple[str, ...] | list[str] | str | None,
              cache_dir: str | os.PathLike[str] | None) -> tuple[tuple[str, ...], CacheLayout]:
    arch = normalize_arch_list(arch_list) if arch_list else cuda_arch_list()
    root = Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir
    return arch, CacheLayout(root.absolute())


def _build_locked(spec: JitSpec, inputs: KeyInputs, toolkit: CudaToolkit, layout: CacheLayout,
                  folder: str, key: str, distrust_sha: str | None, start: float) -> BuildOutcome:
    """Steps 2-4 of the protocol; the caller already missed."""
    from filelock import FileLock, Timeout  # only a build needs it

    entry = layout.entry(folder)
    lock_path = layout.lock_path(folder)
    try:
        layout.locks.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path), timeout=config.lock_timeout)
        lock.acquire()
    except Timeout:
        raise JitLockTimeoutError(folder, lock_path, config.lock_timeout) from None
    except OSError as exc:
        raise JitDisabledError(folder, f"the cache dir is not writable ({exc.strerror or exc})", layout.root,
                               inputs.arch_list) from exc
    try:
        verdict = verify_entry(entry, key)
        if _usable(verdict, distrust_sha):
            logger.info("JIT cache hit: %s (built by another builder while this one waited)", folder)
            return _outcome(verdict, "cached", start, inputs.arch_list)
        if verdict.exists:
            problem = verdict.problem or "its shared library failed to load"
            logger.warning("JIT cache entry %s is broken (%s): moving it aside and rebuilding", folder, problem)
            quarantine(layout, entry)
        clean_staging(layout, folder)
        staging = layout.new_staging(folder)
        try:
            staged = compile_in_staging(
                spec,
                variant=folder,
                arch_list=inputs.arch_list,
                toolkit=toolkit,
                staging=staging,
                failed_log=layout.failed_log(folder),
                verbose=config.verbose,
                max_jobs=config.max_jobs,
            )
            write_manifest(
                staging,
                new_manifest(
                    folder=folder,
                    key=key,
                    portable_key=inputs.portable_key(),
                    inputs=asdict(inputs),
                    library=staged.library,
                    build_seconds=staged.seconds,
                    command=staged.command,
                ),
            )
            won = publish(staging, entry)
        except BaseException:
            remove_tree(staging)
            raise
        layout.failed_log(folder).unlink(missing_ok=True)  # an old failure of this key is now fixed
        verdict = verify_entry(entry, key)
        if verdict.library is None:
            raise JitBuildError(folder, f"publish {staging} -> {entry}",
                                (f"the published entry does not verify: {verdict.problem}",), entry / BUILD_LOG)
        if won:
            logger.info("JIT compiled %s in %.1f s", folder, staged.seconds)
            return _outcome(verdict, "built", start, inputs.arch_list)
        logger.info("JIT cache hit: %s (another builder published first)", folder)
        return _outcome(verdict, "cached", start, inputs.arch_list)
    finally:
        lock.release()


def _ensure(spec: JitSpec, arch: tuple[str, ...], layout: CacheLayout, distrust_sha: str | None = None) -> BuildOutcome:
    start = time.perf_counter()
    toolkit = find_cuda_toolkit()
    inputs = key_inputs(spec, arch, toolkit, layout.root)
    if toolkit is None:
        # No nvcc, so no full key: accept a published build that matches every other input.
        tag = arch_tag(arch)
        verdict = find_portable_match(layout, spec.name, tag, inputs.portable_key())
        if _usable(verdict, distrust_sha):
            logger.info("JIT cache hit: %s (no CUDA toolkit here; matched without the nvcc version)",
                        verdict.library.parent.name if verdict.library else "")
            return _outcome(verdict, "cached", start, arch, portable=True)
        raise JitDisabledError(
            f"{spec.name}_{tag}",
            "no CUDA toolkit was found (looked at $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and nvcc on PATH)",
            layout.root,
            arch,
        )
    key = inputs.key()
    folder = folder_name(spec.name, arch, key)
    verdict = verify_entry(layout.entry(folder), key)
    if _usable(verdict, distrust_sha):
        logger.info("JIT cache hit: %s", folder)
        return _outcome(verdict, "cached", start, arch)
    if config.disable_jit:
        reason = "FLASH_COMPRESS_DISABLE_JIT=1 forbids compiling"
        if verdict.problem:
            reason += f" (the cached entry is broken: {verdict.problem})"
        elif verdict.library is not None:
            reason += " (the cached library failed to load)"
        raise JitDisabledError(folder, reason, layout.root, arch)
    return _build_locked(spec, inputs, toolkit, layout, folder, key, distrust_sha, start)


def ensure_built(
    spec: JitSpec,
    *,
    arch_list: tuple[str, ...] | list[str] | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> BuildOutcome:
    """Make sure ``spec`` is built and published in the cache, without loading it (no GPU needed).

    ``arch_list`` defaults to :func:`cuda_arch_list`, ``cache_dir`` to ``config.cache_dir``.

    Raises:
        JitBuildError: the compile failed.
        JitDisabledError: a miss where this process may not or cannot compile.
        JitLockTimeoutError: another process's build of the same key took too long.
    """
    arch, layout = _settings(arch_list, cache_dir)
    return _ensure(spec, arch, layout)


def _load_library(outcome: BuildOutcome) -> "tvm_ffi.Module":
    import tvm_ffi

    return tvm_ffi.load_module(str(outcome.library))


def load(
    spec: JitSpec,
    *,
    arch_list: tuple[str, ...] | list[str] | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> "tvm_ffi.Module":
    """Load ``spec``'s module: from the cache on a hit, after building it on a miss.

    ``arch_list`` defaults to :func:`cuda_arch_list`, ``cache_dir`` to ``config.cache_dir``.
    A cached .so that fails to load is moved aside and rebuilt once.

    Raises:
        JitBuildError: the compile failed, or a fresh build would not load.
        JitDisabledError: a miss where this process may not or cannot compile.
        JitLockTimeoutError: another process's build of the same key took too long.
    """
    arch, layout = _settings(arch_list, cache_dir)
    memo = (spec, arch, str(layout.root))
    with _loaded_lock:
        module = _loaded.get(memo)
    if module is not None:
        return module
    outcome = _ensure(spec, arch, layout)
    try:
        module = _load_library(outcome)
    except Exception as exc:
        if outcome.status == "built" or outcome.portable:
            raise JitBuildError(outcome.folder, f"tvm_ffi.load_module({outcome.library})",
                                (f"{type(exc).__name__}: {exc}",), outcome.entry / BUILD_LOG) from exc
        logger.warning("JIT cache entry %s failed to load (%s): rebuilding", outcome.folder, exc)
        outcome = _ensure(spec, arch, layout, distrust_sha=outcome.sha256)
        try:
            module = _load_library(outcome)
        except Exception as again:
            raise JitBuildError(outcome.folder, f"tvm_ffi.load_module({outcome.library})",
                                (f"{type(again).__name__}: {again}",), outcome.entry / BUILD_LOG) from again
    with _loaded_lock:
        module = _loaded.setdefault(memo, module)
    return module
