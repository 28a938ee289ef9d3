"""The cache commands behind ``python -m flash_compress prebuild|status|clear``.

Each function prints for a person and returns a process exit status. The kernel's
own variant grid is the caller's business: ``prebuild`` takes any labelled specs.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .arch import cuda_arch_list, normalize_arch_list
from .config import config
from .errors import JitError
from .loader import ensure_built
from .manage import clear_cache, list_entries
from .spec import JitSpec

__all__ = ["clear", "prebuild", "status"]


@dataclass(frozen=True)
class _Result:
    """One variant's prebuild result, sent back from a worker process."""

    label: str
    folder: str
    status: str  # "built", "cached" or "failed"
    seconds: float
    error: str | None = None


def _prebuild_one(label: str, spec: JitSpec, arch_list: tuple[str, ...], cache_dir: str) -> _Result:
    """Build one variant (runs in a worker process, which owns its environment)."""
    config.disable_jit = False  # prebuilding is how a cache gets filled for machines that disable the JIT
    start = time.perf_counter()
    try:
        outcome = ensure_built(spec, arch_list=arch_list, cache_dir=cache_dir)
    except JitError as exc:
        return _Result(label, getattr(exc, "variant", spec.name), "failed", time.perf_counter() - start, str(exc))
    except Exception as exc:  # one broken variant must not hide the others' results
        return _Result(label, spec.name, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    return _Result(label, outcome.folder, outcome.status, outcome.seconds)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(map(str, row)) for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


class _Progress:
    """A tqdm bar when tqdm is installed, else one plain line per finished variant (on stderr)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc="prebuild", unit="variant", file=sys.stderr)

    def update(self, result: _Result) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {result.label}: {result.status} ({result.seconds:.1f} s)"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prebuild(
    specs: Sequence[tuple[str, JitSpec]],
    arch_list: Sequence[str] | str | None = None,
    jobs: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> int:
    """Build every ``(label, spec)`` into the cache in parallel; no GPU needed.

    Each variant builds in its own worker process (tvm-ffi takes the arch list and
    CUDA_HOME from the environment, which only a process can own). Prints progress
    and a summary table (variant, arch, status built/cached/failed, seconds).

    Args:
        specs: labelled variants, e.g. ``[("head_dim=512 pdl=1", spec), ...]``.
        arch_list: archs to build for (default: :func:`cuda_arch_list`).
        jobs: parallel builds (default: CPU count, at most one per variant).
        cache_dir: the cache to fill (default: ``config.cache_dir``).

    Returns:
        0 when every variant is built or cached, 1 when any failed.
    """
    arch = normalize_arch_list(arch_list) if arch_list else cuda_arch_list()
    root = (Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir).absolute()
    if not specs:
        print("prebuild: nothing to build")
        return 0
    workers = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    print(f"prebuild: {len(specs)} variants for arch {' '.join(arch)} into {root} ({workers} jobs)", file=sys.stderr)
    results: dict[str, _Result] = {}
    progress = _Progress(len(specs))
    # spawn, not fork: the caller may have threads (torch does), and a forked child inherits their locks.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {pool.submit(_prebuild_one, label, spec, arch, str(root)): label for label, spec in specs}
        for future in as_completed(futures):
            label = futures[future]
            try:
                result = future.result()
            except Exception as exc:  # the worker process itself died
                result = _Result(label, "", "failed", 0.0, f"worker failed: {type(exc).__name__}: {exc}")
            results[label] = result
            progress.update(result)
    progress.close()
    ordered = [results[label] for label, _ in specs]
    print(_table(
        ("variant", "arch", "status", "seconds", "folder"),
        [(r.label, " ".join(arch), r.status, f"{r.seconds:.1f}", r.folder) for r in ordered],
    ))
    failed = [r for r in ordered if r.status == "failed"]
    for result in failed:
        print(f"\n{result.label}: {result.error}", file=sys.stderr)
    built = sum(r.status == "built" for r in ordered)
    cached = sum(r.status == "cached" for r in ordered)
    print(f"prebuild: {built} built, {cached} cached, {len(failed)} failed")
    return 1 if failed else 0


def _size(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{nbytes} B"


def status(cache_dir: str | os.PathLike[str] | None = None) -> int:
    """Print what the cache holds: folder, variant, arch, key, size, build time. Returns 0."""
    root = (Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir).absolute()
    entries = list_entries(root)
    print(f"cache: {root}")
    if not entries:
        print("(empty)")
        return 0
    rows = [
        (
            e.folder,
            e.name,
            " ".join(e.arch_list),
            e.key[:16],
            _size(e.size),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(e.built_at)) if e.built_at else "?",
            f"{e.build_seconds:.1f}",
            "ok" if e.intact else "BROKEN",
        )
        for e in entries
    ]
    print(_table(("folder", "variant", "arch", "key", "size", "built", "build s", "state"), rows))
    print(f"{len(entries)} entries, {_size(sum(e.size for e in entries))}")
    return 0


def clear(cache_dir: str | os.PathLike[str] | None = None, name_prefix: str | None = None) -> int:
    """Delete cached builds (all, or those whose variant name starts with ``name_prefix``). Returns 0."""
    root = (Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir).absolute()
    removed = clear_cache(root, name_prefix)
    for folder in removed:
        print(f"removed {folder}")
    which = f" matching {name_prefix!r}" if name_prefix else ""
    print(f"cleared {len(removed)} entries{which} from {root}")
    return 0
