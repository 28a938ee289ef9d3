"""Find a variant in the cache, or build it once across processes, then load it.

For one key:

1. Compute the key and verify the published entry (manifest, size, sha256): a hit takes
   no lock, runs no compiler and writes nothing.
2. On a miss, take the key's OS lock (``filelock``, with a timeout), look again (another
   process may have just built it), build in a private staging folder, publish it by
   renaming the whole folder onto its final name, release the lock.

A second ``load`` of the same spec in one process returns the module it already loaded,
hashing nothing: like an import, a process does not see edits made after it loaded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from filelock import Timeout

from .build import compile_in_staging
from .cache import (
    BUILD_LOG, CacheLayout, KeyInputs, Verdict, clean_staging, find_covering_entry, folder_name, key_inputs, publish,
    quarantine, remove_tree, verify_entry, write_manifest,
)
from .config import config
from .errors import JitBuildError, JitDisabledError, JitLockTimeoutError
from .spec import JitSpec
from .toolchain import arch_tag, cuda_arch_list, find_nvcc, normalize_arch_list

if TYPE_CHECKING:
    import tvm_ffi

__all__ = ["BuildOutcome", "ensure_built", "load"]

logger = logging.getLogger("flash_compress")

_loaded: dict[tuple[JitSpec, tuple[str, ...], str], "tvm_ffi.Module"] = {}
_loaded_lock = threading.Lock()
#: Entries this process has already said it built or found: a variant's later hits (`ensure_built` as
#: a warm-up, then `load`) log at DEBUG, so a variant says "JIT compiled" or "JIT cache hit" once.
_reported: set[Path] = set()


def _report(entry: Path, message: str, *args: object, compiled: bool = False) -> None:
    """Logs what became of ``entry``: at INFO for a compile and for the entry's first hit here, at DEBUG after."""
    with _loaded_lock:
        first = entry not in _reported
        _reported.add(entry)
    logger.log(logging.INFO if first or compiled else logging.DEBUG, message, *args)


@dataclass(frozen=True)
class BuildOutcome:
    """Where a variant's build is, and whether this call built it.

    Attributes:
        folder: the cache folder name.
        library: the published .so.
        sha256: its sha256, as the manifest records it.
        status: ``"built"`` when this call compiled it, ``"cached"`` when it was there.
        seconds: wall time of this call.
        arch_list: the archs it was built for.
        portable: found by its portable key (without the toolchain), on a machine with no nvcc or
            with ``FLASH_COMPRESS_DISABLE_JIT=1``.
    """

    folder: str
    library: Path
    sha256: str
    status: Literal["built", "cached"]
    seconds: float
    arch_list: tuple[str, ...]
    portable: bool = False

    @property
    def entry(self) -> Path:
        return self.library.parent


def _outcome(verdict: Verdict, status: Literal["built", "cached"], start: float, arch: tuple[str, ...],
             portable: bool = False) -> BuildOutcome:
    assert verdict.library is not None and verdict.manifest is not None
    return BuildOutcome(verdict.library.parent.name, verdict.library, str(verdict.manifest["sha256"]), status,
                        time.perf_counter() - start, arch, portable)


def _built_for(verdict: Verdict) -> tuple[str, ...]:
    """The archs a published entry was built for, as its manifest records them."""
    return tuple(str(arch) for arch in (verdict.manifest or {}).get("arch_list", ()))


def _usable(verdict: Verdict, distrust_sha: str | None) -> bool:
    return verdict.library is not None and (verdict.manifest or {}).get("sha256") != distrust_sha


def _build_locked(spec: JitSpec, layout: CacheLayout, folder: str, inputs, nvcc: Path, distrust_sha: str | None,
                  start: float) -> BuildOutcome:
    """Step 2; the caller already missed."""
    entry, lock_path = layout.entry(folder), layout.lock_path(folder)
    try:
        lock = layout.lock(folder, config.lock_timeout)
        lock.acquire()
    except Timeout:
        raise JitLockTimeoutError(folder, lock_path, config.lock_timeout) from None
    except OSError as exc:
        raise JitDisabledError(folder, f"the cache dir is not writable ({exc.strerror or exc}); "
                               "FLASH_COMPRESS_CACHE_DIR can name a writable one to build in", layout.root,
                               inputs.arch_list, spec.prebuild_options) from exc
    try:
        verdict = verify_entry(entry, inputs.key())
        if _usable(verdict, distrust_sha):
            _report(entry, "JIT cache hit: %s (built by another process while this one waited)", folder)
            return _outcome(verdict, "cached", start, inputs.arch_list)
        if verdict.exists:
            problem = verdict.problem or "its shared library failed to load"
            logger.warning("JIT cache entry %s is broken (%s): moving it aside and rebuilding", folder, problem)
            try:
                quarantine(layout, entry)
            except PermissionError as exc:  # another user's entry in a shared root that keeps it theirs
                raise JitDisabledError(folder, f"the cached entry is broken ({problem}) and this user may not move "
                                       f"it aside ({exc.strerror or exc}); its owner can run `clear`, or make the "
                                       "cache root group-writable (USAGE section 7)", layout.root, inputs.arch_list,
                                       spec.prebuild_options) from exc
        clean_staging(layout, folder)
        staging = layout.new_staging(folder)
        try:
            library, command, seconds = compile_in_staging(
                spec, variant=folder, arch_list=inputs.arch_list, nvcc=nvcc, staging=staging,
                failed_log=layout.failed_log(folder), verbose=config.verbose, threads=config.max_jobs)
            write_manifest(staging, inputs, library, seconds, command)
            layout.share_files(staging)
            won = publish(staging, entry)
        except BaseException:
            remove_tree(staging)
            raise
        layout.failed_log(folder).unlink(missing_ok=True)  # an old failure of this key is fixed now
        verdict = verify_entry(entry, inputs.key())
        if verdict.library is None:
            raise JitBuildError(folder, f"publish {staging} -> {entry}",
                                (f"the published entry does not verify: {verdict.problem}",), entry / BUILD_LOG)
        if won:
            _report(entry, "JIT compiled %s in %.1f s", folder, seconds, compiled=True)
        else:
            _report(entry, "JIT cache hit: %s (another process published first)", folder)
        return _outcome(verdict, "built" if won else "cached", start, inputs.arch_list)
    finally:
        lock.release()


def _portable_hit(layout: CacheLayout, inputs: KeyInputs, distrust_sha: str | None, start: float,
                  why: str) -> BuildOutcome | None:
    """A published build that matches every input but the toolchain, for a machine that will not
    compile (``why``): it has no nvcc, or may not use it."""
    verdict = find_covering_entry(layout, inputs, portable=True)
    if not _usable(verdict, distrust_sha):
        return None
    entry = verdict.library.parent
    _report(entry, "JIT cache hit: %s (%s; matched without the toolchain)", entry.name, why)
    return _outcome(verdict, "cached", start, _built_for(verdict), portable=True)


def _ensure(spec: JitSpec, arch: tuple[str, ...], layout: CacheLayout, distrust_sha: str | None = None) -> BuildOutcome:
    start = time.perf_counter()
    nvcc = find_nvcc()
    inputs = key_inputs(spec, arch, nvcc, layout.root)
    if nvcc is None:
        # No nvcc, so no full key.
        hit = _portable_hit(layout, inputs, distrust_sha, start, "no nvcc here")
        if hit is not None:
            return hit
        raise JitDisabledError(f"{spec.name}_{arch_tag(arch)}",
                               "no CUDA compiler was found (looked at $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and "
                               "nvcc on PATH)", layout.root, arch, spec.prebuild_options)
    folder = folder_name(spec.name, arch, inputs.key())
    verdict = verify_entry(layout.entry(folder), inputs.key())
    if _usable(verdict, distrust_sha):
        _report(layout.entry(folder), "JIT cache hit: %s", folder)
        return _outcome(verdict, "cached", start, arch)
    covering = find_covering_entry(layout, inputs)
    if _usable(covering, distrust_sha):
        entry = covering.library.parent
        _report(entry, "JIT cache hit: %s (built for more archs than %s)", entry.name, arch_tag(arch))
        return _outcome(covering, "cached", start, _built_for(covering))
    if config.disable_jit:
        # A node that may not compile has no use for its own toolchain: as where no nvcc exists (a build
        # prebuilt on a build machine with another nvcc).
        hit = _portable_hit(layout, inputs, distrust_sha, start, "FLASH_COMPRESS_DISABLE_JIT=1")
        if hit is not None:
            return hit
        reason = "FLASH_COMPRESS_DISABLE_JIT=1 forbids compiling"
        if verdict.exists:
            reason += f" (the cached entry is broken: {verdict.problem or 'its library failed to load'})"
        raise JitDisabledError(folder, reason, layout.root, arch, spec.prebuild_options)
    return _build_locked(spec, layout, folder, inputs, nvcc, distrust_sha, start)


def _settings(arch_list: tuple[str, ...] | list[str] | str | None,
              cache_dir: str | os.PathLike[str] | None) -> tuple[tuple[str, ...], CacheLayout]:
    arch = normalize_arch_list(arch_list) if arch_list else cuda_arch_list()
    return arch, CacheLayout(config.resolve_cache_dir(cache_dir))


def ensure_built(spec: JitSpec, *, arch_list: tuple[str, ...] | list[str] | str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> BuildOutcome:
    """Make sure ``spec`` is built and published in the cache, without loading it (no GPU needed).

    ``arch_list`` defaults to :func:`cuda_arch_list`, ``cache_dir`` to ``config.cache_dir``.

    Raises:
        JitBuildError: the compile failed.
        JitDisabledError: a miss where this process may not or cannot compile.
        JitLockTimeoutError: another process's build of the same key took too long.
    """
    return _ensure(spec, *_settings(arch_list, cache_dir))


def _load_library(outcome: BuildOutcome) -> "tvm_ffi.Module":
    import tvm_ffi

    return tvm_ffi.load_module(str(outcome.library))


def _load_error(outcome: BuildOutcome, exc: Exception) -> JitBuildError:
    return JitBuildError(outcome.folder, f"tvm_ffi.load_module({outcome.library})", (f"{type(exc).__name__}: {exc}",),
                         outcome.entry / BUILD_LOG)


def load(spec: JitSpec, *, arch_list: tuple[str, ...] | list[str] | str | None = None,
         cache_dir: str | os.PathLike[str] | None = None) -> "tvm_ffi.Module":
    """Load ``spec``'s module: from the cache on a hit, after building it on a miss.

    Arguments as :func:`ensure_built`. A cached .so that fails to load is moved aside and
    rebuilt once.

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
            raise _load_error(outcome, exc) from exc
        logger.warning("JIT cache entry %s failed to load (%s): rebuilding", outcome.folder, exc)
        outcome = _ensure(spec, arch, layout, distrust_sha=outcome.sha256)
        try:
            module = _load_library(outcome)
        except Exception as again:
            raise _load_error(outcome, again) from again
    with _loaded_lock:
        return _loaded.setdefault(memo, module)
