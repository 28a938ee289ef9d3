"""The cache commands behind ``python -m flash_compress prebuild|status|clear``.

Each prints for a person and returns a process exit status. The variant grid is the
caller's business: ``prebuild`` takes any labelled specs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from .cache import clear_cache, list_entries
from .config import config
from .errors import JitError
from .loader import ensure_built
from .spec import JitSpec
from .toolchain import cuda_arch_list, normalize_arch_list

__all__ = ["clear", "prebuild", "status"]


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _prebuild_one(spec: JitSpec, arch_list: tuple[str, ...], cache_dir: str) -> tuple[str, str, float, str]:
    """``(status, folder, seconds, error)`` of one build (in a worker thread; nvcc is its own process)."""
    start = time.perf_counter()
    try:
        outcome = ensure_built(spec, arch_list=arch_list, cache_dir=cache_dir)
    except JitError as exc:
        return "failed", getattr(exc, "variant", spec.name), time.perf_counter() - start, str(exc)
    except Exception as exc:  # one broken variant must not hide the others' results
        return "failed", spec.name, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
    return outcome.status, outcome.folder, outcome.seconds, ""


def prebuild(specs: Sequence[tuple[str, JitSpec]], arch_list: Sequence[str] | str | None = None,
             jobs: int | None = None, cache_dir: str | os.PathLike[str] | None = None) -> int:
    """Build every ``(label, spec)`` into the cache, ``jobs`` at a time (default: CPU count); no GPU needed.

    Builds here ignore ``FLASH_COMPRESS_DISABLE_JIT``: prebuilding is how a cache gets
    filled for machines that set it. Prints a line per finished variant and a summary
    table; returns 0 when every variant is built or cached, 1 when any failed.
    """
    arch = normalize_arch_list(arch_list) if arch_list else cuda_arch_list()
    root = config.resolve_cache_dir(cache_dir)
    if not specs:
        print("prebuild: nothing to build")
        return 0
    workers = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    print(f"prebuild: {len(specs)} variants for arch {' '.join(arch)} into {root} ({workers} jobs)", file=sys.stderr)
    results: dict[str, tuple[str, str, float, str]] = {}
    disable_jit = config.overrides.get("disable_jit")
    config.disable_jit = False
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = {pool.submit(_prebuild_one, spec, arch, str(root)): label for label, spec in specs}
        for future in as_completed(futures):
            label = futures[future]
            results[label] = status, _, seconds, _ = future.result()
            print(f"[{len(results)}/{len(specs)}] {label}: {status} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        # The `finally` cancels the queued builds (a pool's `with` would run them all first). Ctrl-C reached
        # the running nvcc too (its process group); what it leaves behind the next build of its key clears.
        print(f"prebuild: interrupted after {len(results)} of {len(specs)} variants; the rest were not built",
              file=sys.stderr)
        return 130
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        config.disable_jit = disable_jit
    print(_table(("variant", "arch", "status", "seconds", "folder"),
                 [(label, " ".join(arch), results[label][0], f"{results[label][2]:.1f}", results[label][1])
                  for label, _ in specs]))
    counts = {status: sum(r[0] == status for r in results.values()) for status in ("built", "cached", "failed")}
    for label, _ in specs:
        if results[label][0] == "failed":
            print(f"\n{label}: {results[label][3]}", file=sys.stderr)
    print(f"prebuild: {counts['built']} built, {counts['cached']} cached, {counts['failed']} failed")
    return 1 if counts["failed"] else 0


def _size(nbytes: int) -> str:
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:.1f} KiB" if nbytes < 1 << 20 else \
        f"{nbytes / (1 << 20):.1f} MiB"


def status(cache_dir: str | os.PathLike[str] | None = None, match: Callable[[str], bool] | None = None) -> int:
    """Print what the cache holds (the entries whose variant name satisfies ``match``): folder,
    variant, arch, key, size, build time. Returns 0."""
    root = config.resolve_cache_dir(cache_dir)
    entries = [e for e in list_entries(root) if match is None or match(e.name)]
    print(f"cache: {root}")
    if not entries:
        print("(empty)")
        return 0
    print(_table(("folder", "variant", "arch", "key", "size", "built", "build s", "state"), [
        (e.folder, e.name, " ".join(e.arch_list), e.key[:16], _size(e.size),
         time.strftime("%Y-%m-%d %H:%M", time.localtime(e.built_at)) if e.built_at else "?",
         f"{e.build_seconds:.1f}", "ok" if e.intact else "BROKEN")
        for e in entries
    ]))
    for e in entries:
        if not e.intact:
            print(f"BROKEN {e.folder}: {e.problem} (the next load rebuilds it; `clear` deletes it)")
    print(f"{len(entries)} entries, {_size(sum(e.size for e in entries))}")
    return 0


def clear(cache_dir: str | os.PathLike[str] | None = None, name_prefix: str | None = None,
          match: Callable[[str], bool] | None = None) -> int:
    """Delete cached builds (all, or those whose variant name starts with ``name_prefix`` and
    satisfies ``match``). Returns 0, or 1 where the cache cannot be written."""
    root = config.resolve_cache_dir(cache_dir)
    try:
        removed = clear_cache(root, name_prefix, match)
    except OSError as exc:
        print(f"clear: cannot delete from {root}: {exc.strerror or exc} ({exc.filename})", file=sys.stderr)
        return 1
    for folder in removed:
        print(f"removed {folder}")
    which = " matching the selection" if name_prefix or match else ""
    print(f"cleared {len(removed)} entries{which} from {root}")
    return 0
