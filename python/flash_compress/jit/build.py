"""Compiling one variant into a private staging folder with ``tvm_ffi.cpp.build``.

tvm-ffi reads its settings from the environment (``TVM_FFI_CUDA_ARCH_LIST``,
``CUDA_HOME``, ``MAX_JOBS``), and environment variables are process-wide, so they
are set only around the build call, under one process-wide lock. Parallel builds
of different archs therefore need processes (the prebuild CLI uses a pool).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .build_log import failed_command, first_errors
from .errors import JitBuildError
from .spec import JitSpec
from .toolchain import CudaToolkit

__all__ = ["StagedBuild", "compile_in_staging"]

# Build products not worth keeping once the .so is linked (the objects are as big as the .so).
_INTERMEDIATES = (".ninja_deps", ".ninja_log", "lock")

_env_lock = threading.Lock()


@dataclass(frozen=True)
class StagedBuild:
    """A finished build inside its staging folder."""

    library: Path
    source: Path
    log: str
    command: str
    seconds: float


@contextmanager
def _environment(overrides: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _StreamingNinja:
    """Stands in for ``tvm_ffi.cpp.extension.build_ninja``: the same ``ninja -v`` run,
    but its output is read line by line, kept for the log, and echoed live when verbose
    (tvm-ffi's own runner captures everything until ninja exits)."""

    def __init__(self, echo: bool) -> None:
        self.lines: list[str] = []
        self.echo = echo

    def __call__(self, build_dir: str) -> None:
        command = ["ninja", "-v"]
        if os.environ.get("MAX_JOBS"):
            command += ["-j", os.environ["MAX_JOBS"]]
        with subprocess.Popen(command, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as ninja:
            assert ninja.stdout is not None
            for line in ninja.stdout:
                self.lines.append(line.rstrip("\n"))
                if self.echo:
                    print(line, end="", file=sys.stderr, flush=True)
        if ninja.returncode != 0:
            output = "\n".join(self.lines)
            raise RuntimeError(f"ninja exited with status {ninja.returncode}\noutput:\n{output}")


@contextmanager
def _ninja_runner(echo: bool) -> Iterator[_StreamingNinja]:
    from tvm_ffi.cpp import extension

    runner = _StreamingNinja(echo)
    saved = extension.build_ninja  # tvm-ffi's build looks it up as a module global at call time
    extension.build_ninja = runner
    try:
        yield runner
    finally:
        extension.build_ninja = saved


def _forget_tvm_ffi_cuda_home() -> None:
    # tvm-ffi caches its CUDA_HOME guess for the whole process; drop it so that the
    # CUDA_HOME we set now is the one it uses (it is the same value each time).
    from tvm_ffi.cpp import extension

    cache_clear = getattr(getattr(extension, "_find_cuda_home", None), "cache_clear", None)
    if callable(cache_clear):
        cache_clear()


def _compile_commands(log: str) -> str:
    # ninja -v prints each command as "[i/n] <command>".
    commands = [line.split("] ", 1)[1] for line in log.splitlines() if line.startswith("[") and "] " in line]
    return "\n".join(commands)


def _prune(staging: Path) -> None:
    for child in staging.iterdir():
        if child.name in _INTERMEDIATES or child.suffix in (".o", ".d") or child.name.endswith(".o.d"):
            child.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def compile_in_staging(
    spec: JitSpec,
    *,
    variant: str,
    arch_list: tuple[str, ...],
    toolkit: CudaToolkit,
    staging: Path,
    failed_log: Path,
    verbose: bool,
    max_jobs: int | None,
) -> StagedBuild:
    """Write ``spec``'s translation unit into ``staging`` and compile it to ``<name>.so`` there.

    ``variant`` (the cache folder name) labels logs and errors. The full log goes to
    ``staging/build.log``; on failure also to ``failed_log``, which outlives the staging folder.

    Raises:
        JitBuildError: the compile or link failed.
    """
    source = staging / f"{spec.name}.cu"
    source.write_text(spec.translation_unit())
    env = {
        "TVM_FFI_CUDA_ARCH_LIST": " ".join(arch_list),
        "CUDA_HOME": str(toolkit.home),
    }
    if max_jobs is not None:
        env["MAX_JOBS"] = str(max_jobs)
    header = (
        f"# variant {variant}\n# arch {' '.join(arch_list)}\n# CUDA_HOME {toolkit.home}\n"
        f"# started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
    if verbose:
        print(f"flash_compress.jit: compiling {variant} in {staging}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    failure: BaseException | None = None
    import tvm_ffi.cpp

    with _env_lock, _environment(env), _ninja_runner(echo=verbose) as ninja:
        _forget_tvm_ffi_cuda_home()
        try:
            library = Path(
                tvm_ffi.cpp.build(
                    spec.name,
                    cuda_files=[str(source)],
                    extra_cflags=list(spec.extra_cflags),
                    extra_cuda_cflags=list(spec.extra_cuda_cflags),
                    extra_ldflags=list(spec.extra_ldflags),
                    extra_include_paths=[str(root) for root in spec.include_dirs],
                    build_directory=str(staging),
                    backend="cuda",  # also keeps tvm-ffi from importing torch to guess the backend
                )
            )
        except Exception as exc:  # tvm-ffi raises a bare RuntimeError holding ninja's output
            failure = exc
    seconds = time.perf_counter() - start
    log = header + "\n".join(ninja.lines)
    if failure is not None:
        if not ninja.lines:  # failed before ninja ran (e.g. no compiler found)
            log += f"\n{failure}\n"
            if verbose:
                print(failure, file=sys.stderr, flush=True)
        (staging / "build.log").write_text(log)
        try:
            failed_log.parent.mkdir(parents=True, exist_ok=True)
            failed_log.write_text(log)
            kept: Path | None = failed_log
        except OSError:
            kept = None
        command = failed_command(str(failure)) or f"ninja -v -C {staging}"
        raise JitBuildError(variant, command, first_errors(str(failure)), kept) from failure
    log += f"\n# finished in {seconds:.1f} s\n"
    (staging / "build.log").write_text(log)
    _prune(staging)
    _fsync(library)
    return StagedBuild(library=library, source=source, log=log, command=_compile_commands(log), seconds=seconds)
