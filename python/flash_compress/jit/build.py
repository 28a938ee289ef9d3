"""Compiling one variant: one nvcc call that compiles and links the .so, in a private staging folder.

On Linux nvcc runs under ``_child_guard.py``, so that it ends with the builder, however the builder ends.

The include and library paths come from tvm-ffi's public ``tvm_ffi.libinfo``; nothing
of tvm-ffi is patched and no environment variable is touched, so builds of different
variants may run in parallel threads or processes.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from .errors import JitBuildError
from .spec import JitSpec
from .toolchain import gencode_flags

__all__ = ["compile_in_staging", "first_errors", "nvcc_command"]

# nvcc:  file.cu(12): error: ...      gcc: file.cc:12:5: error: ...      nvcc fatal   : ...
_ERROR = re.compile(r"\berror\b|\bfatal\b|undefined reference", re.IGNORECASE)
_NOISE = re.compile(r"^\d+ errors? detected in the compilation")


def first_errors(log: str, limit: int = 20, context: int = 2) -> tuple[str, ...]:
    """The first error lines of ``log``, each with up to ``context`` following lines (nvcc and
    gcc print the source line and a caret there), at most ``limit`` lines; with no error
    line at all, the log's last lines."""
    lines = log.splitlines()
    picked: list[int] = []
    for index, line in enumerate(lines):
        if len(picked) >= limit:
            break
        if _ERROR.search(line) and not _NOISE.match(line.strip()):
            picked += [j for j in range(index, min(index + 1 + context, len(lines)))
                       if j not in picked and not _NOISE.match(lines[j].strip())]
    if not picked:
        return tuple([line for line in lines if line.strip()][-limit:])
    return tuple(lines[j].rstrip() for j in picked[:limit])


def compile_flags(spec: JitSpec) -> list[str]:
    """What every compile of ``spec``'s translation unit takes: its include paths (tvm-ffi's, then the
    spec's) and its extra nvcc flags."""
    import tvm_ffi.libinfo

    includes = [*tvm_ffi.libinfo.include_paths(), *map(str, spec.include_dirs)]
    return [*[f"-I{path}" for path in includes], *spec.extra_cuda_cflags]


def nvcc_command(spec: JitSpec, nvcc: Path, arch_list: tuple[str, ...], source: Path, library: Path,
                 threads: int | None) -> list[str]:
    """The one command that builds ``library`` from ``source``: compile for every arch, then link."""
    import tvm_ffi.libinfo

    lib_dir = str(Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent)
    return [
        str(nvcc), "-shared", "-Xcompiler=-fPIC", *gencode_flags(arch_list),
        f"--threads={threads if threads is not None else len(arch_list)}",
        *compile_flags(spec),
        str(source), "-o", str(library), f"-L{lib_dir}", "-ltvm_ffi", *spec.extra_ldflags,
    ]


#: Runs a build so that it dies with the thread that started it (Linux only: prctl).
_CHILD_GUARD = Path(__file__).with_name("_child_guard.py")


def _guarded(command: list[str]) -> list[str]:
    """``command`` as this process starts it: on Linux through ``_child_guard.py``, so that a builder
    killed outright (SIGKILL, an OOM kill) takes its compiler down with it. As it is where the guard
    cannot run: off Linux, or where ``sys.executable`` is not a Python interpreter (an application
    that embeds one, a frozen one)."""
    interpreter = Path(sys.executable or "").name
    if not sys.platform.startswith("linux") or getattr(sys, "frozen", False) or not interpreter.startswith("python"):
        return command
    # -s -S: no site-packages to import; PYTHONHOME and the like still apply, as they do to the builder.
    return [sys.executable, "-s", "-S", str(_CHILD_GUARD), str(os.getpid()), *command]


def _run(command: list[str], echo: bool) -> tuple[int, list[str]]:
    """Run ``command`` (guarded), keeping its merged output line by line and echoing it live when ``echo``."""
    lines: list[str] = []
    with subprocess.Popen(_guarded(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                lines.append(line.rstrip("\n"))
                if echo:
                    print(line, end="", file=sys.stderr, flush=True)
        except BaseException:
            # The builder is leaving (SystemExit from a server's SIGTERM handler, Ctrl-C, an error here):
            # the `with` would wait for the whole compile; the guard, told to stop, stops nvcc's tree.
            process.terminate()
            raise
    return process.returncode, lines


def compile_in_staging(spec: JitSpec, *, variant: str, arch_list: tuple[str, ...], nvcc: Path, staging: Path,
                       failed_log: Path, verbose: bool, threads: int | None) -> tuple[Path, str, float]:
    """Write ``spec``'s translation unit into ``staging`` and build ``<name>.so`` there.

    ``variant`` (the cache folder name) labels logs and errors. The full log goes to
    ``staging/build.log``, and on failure also to ``failed_log``, which outlives staging.

    Returns:
        The library, the command (one shell line) and the build's seconds.

    Raises:
        JitBuildError: nvcc failed.
    """
    source = staging / f"{spec.name}.cu"
    source.write_text(spec.translation_unit())
    library = staging / f"{spec.name}.so"
    command = nvcc_command(spec, nvcc, arch_list, source, library, threads)
    shell_line = shlex.join(command)
    if verbose:
        print(f"flash_compress.jit: compiling {variant} in {staging}\n{shell_line}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        status, lines = _run(command, echo=verbose)
    except OSError as exc:
        status, lines = 127, [f"could not run {nvcc}: {exc}"]
    seconds = time.perf_counter() - start
    log = "\n".join([f"# variant {variant}", f"# arch {' '.join(arch_list)}", f"$ {shell_line}", *lines,
                     f"# exit status {status} after {seconds:.1f} s", ""])
    (staging / "build.log").write_text(log)
    if status != 0 or not library.is_file():
        kept: Path | None = failed_log
        try:
            failed_log.parent.mkdir(parents=True, exist_ok=True)
            failed_log.write_text(log)
        except OSError:
            kept = None
        raise JitBuildError(variant, shell_line, first_errors("\n".join(lines)), kept)
    with library.open("rb") as f:
        os.fsync(f.fileno())
    return library, shell_line, seconds
