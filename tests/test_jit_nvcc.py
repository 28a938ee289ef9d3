"""The JIT cache with the real nvcc (no GPU needed), on a tiny test kernel that compiles in seconds.

Each test gets its own cache dir. A module-scoped fixture compiles the tiny
variant once; tests that need a warm cache copy that cache. Scenarios that are
about processes (fresh-process hits, races, a killed builder) run real child
processes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flash_compress import jit
from flash_compress.jit import JitBuildError, JitDisabledError, JitSpec, cli, config
from flash_compress.jit.cache import MANIFEST, verify_entry
from flash_compress.jit.toolchain import find_nvcc

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(find_nvcc() is None,
                       reason="no nvcc found ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc on PATH)"),
]

DATA = Path(__file__).resolve().parent / "data"
TINY = DATA / "jit_tiny"
BROKEN = DATA / "jit_broken"
ARCH = ("9.0",)
CHILD_TIMEOUT_S = 300


def tiny_spec(include_dir: Path = TINY) -> JitSpec:
    return JitSpec(
        name="jit_tiny",
        headers=("tiny/tiny.cuh",),
        exports={"add_value": "jit_tiny::add_value", "has_kernel": "jit_tiny::has_kernel"},
        include_dirs=(include_dir,),
        extra_cuda_cflags=("-O1",),
    )


def broken_spec() -> JitSpec:
    return JitSpec(name="jit_broken", headers=("broken.cuh",), exports={"broken": "jit_broken::broken"},
                   include_dirs=(BROKEN,))


def entries(cache: Path) -> list[Path]:
    """Published entries (not the dot-folders or failed/)."""
    return sorted(p for p in cache.glob("jit_*_sm*_*") if p.is_dir())


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch: pytest.MonkeyPatch):
    for var in ("FLASH_COMPRESS_CACHE_DIR", "FLASH_COMPRESS_JIT_VERBOSE", "FLASH_COMPRESS_DISABLE_JIT", "MAX_JOBS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASH_COMPRESS_CUDA_ARCH_LIST", "9.0")
    config.reset()
    yield
    config.reset()


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the tiny variant, compiled once for the module; copy it, don't change it."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    outcome = jit.ensure_built(tiny_spec(), arch_list=ARCH, cache_dir=cache)
    assert outcome.status == "built"
    return cache


def copy_cache(warm: Path, dest: Path) -> Path:
    shutil.copytree(warm, dest, symlinks=True)
    return dest


# --- child processes ---------------------------------------------------------------------------------

CHILD = r"""
import json, logging, sys, time
start = time.perf_counter()
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from pathlib import Path
from flash_compress.jit import JitSpec, load
include_dir, cache_dir = sys.argv[1], sys.argv[2]
spec = JitSpec(name="jit_tiny", headers=("tiny/tiny.cuh",),
               exports={"add_value": "jit_tiny::add_value", "has_kernel": "jit_tiny::has_kernel"},
               include_dirs=(include_dir,), extra_cuda_cflags=("-O1",))
module = load(spec, arch_list=("9.0",), cache_dir=cache_dir)
print(json.dumps({"add_value": module.add_value(10), "has_kernel": module.has_kernel(),
                  "seconds": time.perf_counter() - start}))
"""


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # The child imports exactly what this process imports.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["FLASH_COMPRESS_CUDA_ARCH_LIST"] = "9.0"
    env.pop("FLASH_COMPRESS_DISABLE_JIT", None)
    env.update(extra)
    return env


def start_child(include_dir: Path, cache: Path, **popen) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(include_dir), str(cache)], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def run_child(include_dir: Path, cache: Path, code: str = CHILD, **env: str) -> tuple[dict, str]:
    """Load the tiny variant in a fresh process; returns its JSON result and its stderr (log lines)."""
    result = subprocess.run([sys.executable, "-c", code, str(include_dir), str(cache)], env=child_env(**env),
                            capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


# --- tests ---------------------------------------------------------------------------------------------


def test_cold_build_publishes_a_complete_entry_and_a_fresh_process_hits(warm_cache, tmp_path):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    [entry] = entries(cache)
    assert entry.name.startswith("jit_tiny_sm90_") and len(entry.name.rsplit("_", 1)[1]) == 16
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["name"] == "jit_tiny" and manifest["arch_list"] == ["9.0"]
    assert "release" in manifest["nvcc_version"] and manifest["tvm_ffi_version"]
    assert manifest["extra_cuda_cflags"] == ["-O1"]
    import tvm_ffi

    assert manifest["tvm_ffi_version"] == tvm_ffi.__version__  # a .so built against one release keys apart
    assert manifest["size"] == (entry / "jit_tiny.so").stat().st_size and manifest["build_seconds"] > 0
    assert "nvcc" in manifest["command"] and "sm_90" in manifest["command"]
    assert (entry / "build.log").is_file() and not list(entry.glob("*.o"))
    assert not any((cache / ".staging").iterdir())

    result, log = run_child(TINY, cache)
    assert result == {"add_value": 11, "has_kernel": True, "seconds": result["seconds"]}
    assert "JIT cache hit" in log and "JIT compiled" not in log


def test_warm_hit_in_a_fresh_process_runs_no_subprocess(warm_cache, tmp_path):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    no_subprocess = (
        # The dependencies' own imports may spawn processes (a CUDA build of torch asks ldconfig for libdl
        # through ctypes.util.find_library on Python 3.10): they come first, the loader's hot path after.
        "import tvm_ffi\n"
        "import subprocess\n"
        "def _refuse(*a, **k): raise AssertionError(f'subprocess on the hot path: {a}')\n"
        "subprocess.Popen = _refuse\n"
        "subprocess.run = _refuse\n"
    ) + CHILD
    result, _ = run_child(TINY, cache, code=no_subprocess)
    assert result["add_value"] == 11


def test_loading_twice_in_one_process_returns_the_same_module(warm_cache, tmp_path):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    first = jit.load(tiny_spec(), cache_dir=cache)
    start = time.perf_counter()
    second = jit.load(tiny_spec(), cache_dir=cache)
    assert second is first and time.perf_counter() - start < 0.01
    assert first.add_value(1) == 2


def test_a_variant_says_compiled_or_cache_hit_once_per_process(warm_cache, tmp_path, caplog):
    """A warm-up (``ensure_built``) then ``load``: the second call's hit logs at DEBUG, after a compile or a hit."""

    def said(cache: Path) -> list[tuple[int, str]]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="flash_compress"):
            jit.ensure_built(tiny_spec(), cache_dir=cache)
            assert jit.load(tiny_spec(), cache_dir=cache).add_value(1) == 2
            jit.ensure_built(tiny_spec(), cache_dir=cache)
        return [(r.levelno, r.getMessage().split(":")[0].split(" jit_tiny")[0]) for r in caplog.records
                if r.getMessage().startswith(("JIT cache hit", "JIT compiled"))]

    assert said(tmp_path / "cold") == [(logging.INFO, "JIT compiled"), (logging.DEBUG, "JIT cache hit"),
                                       (logging.DEBUG, "JIT cache hit")], caplog.text
    assert said(copy_cache(warm_cache, tmp_path / "warm")) == [(logging.INFO, "JIT cache hit")] + [
        (logging.DEBUG, "JIT cache hit")] * 2, caplog.text


def test_header_edit_rebuilds_and_moving_the_tree_does_not(warm_cache, tmp_path):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    moved = shutil.copytree(TINY, tmp_path / "moved" / "somewhere" / "jit_tiny")
    moved_outcome = jit.ensure_built(tiny_spec(moved), cache_dir=cache)
    assert moved_outcome.status == "cached" and len(entries(cache)) == 1

    edited = shutil.copytree(TINY, tmp_path / "edited")
    value_h = edited / "tiny" / "value.h"
    value_h.write_text(value_h.read_text().replace("kValue = 1", "kValue = 5"))
    edited_outcome = jit.ensure_built(tiny_spec(edited), cache_dir=cache)
    assert edited_outcome.status == "built" and edited_outcome.folder != moved_outcome.folder
    assert len(entries(cache)) == 2
    result, _ = run_child(edited, cache)
    assert result["add_value"] == 15


def test_four_cold_processes_compile_once_and_all_load(tmp_path):
    cache = tmp_path / "cache"
    children = [start_child(TINY, cache) for _ in range(4)]
    outputs = [child.communicate(timeout=CHILD_TIMEOUT_S) for child in children]
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["add_value"] == 11
    logs = "".join(err for _, err in outputs)
    assert logs.count("JIT compiled") == 1, logs
    assert logs.count("JIT cache hit") == 3, logs
    assert len(entries(cache)) == 1
    assert not any((cache / ".staging").iterdir())


def test_killed_builder_leaves_nothing_loadable_and_the_next_load_builds(tmp_path):
    cache = tmp_path / "cache"
    child = start_child(TINY, cache, start_new_session=True)  # its own group: nvcc dies with it
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    staging = cache / ".staging"
    while not (staging.is_dir() and any(staging.glob("*/jit_tiny.cu"))):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    time.sleep(1.0)  # nvcc is compiling now
    assert not entries(cache), "the build finished before it could be killed"
    os.killpg(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert not entries(cache)
    assert not list(cache.glob("*.so")) and any(staging.iterdir())  # only the dead staging folder

    started = time.perf_counter()
    result, log = run_child(TINY, cache, FLASH_COMPRESS_JIT_LOCK_TIMEOUT="120")
    assert result["add_value"] == 11 and "JIT compiled" in log
    assert time.perf_counter() - started < CHILD_TIMEOUT_S
    assert not any(staging.iterdir()), "the dead builder's staging folder was not cleaned"
    [entry] = entries(cache)
    assert verify_entry(entry).library is not None


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_read_only_cache_hit_works_and_writes_nothing(warm_cache, tmp_path):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    before = _snapshot(cache)
    paths = [cache, *cache.rglob("*")]
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result, log = run_child(TINY, cache)
        after = _snapshot(cache)
    finally:
        for path in paths:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert result["add_value"] == 11 and "JIT cache hit" in log
    # Root ignores the mode bits, so check that nothing was written rather than that writing failed.
    assert after == before


def test_unwritable_cache_miss_raises_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache dir under a regular file cannot be created, even by root
    with pytest.raises(JitDisabledError, match="not writable"):
        jit.load(tiny_spec(), cache_dir=blocker / "cache")


def test_disable_jit_raises_on_a_miss_and_still_loads_a_hit(warm_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_COMPRESS_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError) as info:
        jit.load(tiny_spec(), cache_dir=tmp_path / "empty")
    message = str(info.value)
    assert "jit_tiny_sm90_" in message and "FLASH_COMPRESS_DISABLE_JIT=1" in message
    assert "python -m flash_compress prebuild --arch 9.0" in message and str(tmp_path / "empty") in message
    assert not (tmp_path / "empty").exists()

    cache = copy_cache(warm_cache, tmp_path / "cache")
    assert jit.load(tiny_spec(), cache_dir=cache).add_value(0) == 1


def test_disable_jit_loads_a_prebuilt_entry_whatever_toolchain_the_node_has(warm_cache, tmp_path, monkeypatch):
    """USAGE section 7: a serving node that may not compile takes a build that matches every input but the
    toolchain, as one without nvcc does, though its own nvcc (here its nvcc flags) differs from the build
    machine's; with compiling allowed the same node misses."""
    cache = copy_cache(warm_cache, tmp_path / "cache")
    [entry] = entries(cache)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-w")  # another full key than the build machine's
    monkeypatch.setenv("FLASH_COMPRESS_DISABLE_JIT", "1")
    outcome = jit.ensure_built(tiny_spec(), cache_dir=cache)
    assert (outcome.status, outcome.portable, outcome.entry) == ("cached", True, entry)
    assert jit.load(tiny_spec(), cache_dir=cache).add_value(6) == 7
    with pytest.raises(JitDisabledError, match="jit_tiny_sm100_"):
        jit.ensure_built(tiny_spec(), arch_list=("10.0",), cache_dir=cache)  # not built for that arch
    assert entries(cache) == [entry]


def test_the_key_covers_every_variable_nvcc_passes_to_its_tools(tmp_path, monkeypatch):
    """The variables besides ``NVCC_*`` that nvcc or its nvcc.profile hand to cudafe++, cicc, ptxas or
    nvlink: each reaches a tool's command line (``nvcc --dryrun``) and changes the key."""
    from flash_compress.jit import cache

    nvcc = find_nvcc()
    source = tmp_path / "k.cu"
    source.write_text("__global__ void k() {}\n")
    base = cache.key_inputs(tiny_spec(), ("9.0",), nvcc, None).key()
    for var in (v for v in cache._NVCC_FLAG_ENV if not v.startswith("NVCC_")):
        dryrun = subprocess.run([str(nvcc), "--dryrun", "-shared", "-Xcompiler", "-fPIC", str(source), "-o",
                                 str(tmp_path / "k.so")], capture_output=True, text=True,
                                env={**os.environ, var: "--flash-compress-marker"})
        assert "--flash-compress-marker" in dryrun.stdout + dryrun.stderr, var
        monkeypatch.setenv(var, "-v")
        assert cache.key_inputs(tiny_spec(), ("9.0",), nvcc, None).key() != base, var
        monkeypatch.delenv(var)


def test_a_multi_arch_prebuild_serves_a_node_that_asks_for_one_of_its_archs(tmp_path, monkeypatch):
    """USAGE section 7: the cluster prebuilds for 9.0 and 10.0, and a node that asks for its own GPU's arch
    finds that build, with nvcc or without, compiling nothing."""
    from flash_compress.jit import loader

    cache = tmp_path / "cache"
    built = jit.ensure_built(tiny_spec(), arch_list=("9.0", "10.0"), cache_dir=cache)
    assert built.status == "built"
    monkeypatch.setenv("FLASH_COMPRESS_DISABLE_JIT", "1")
    config.reset()
    for arch in (("9.0",), ("10.0",)):
        outcome = jit.ensure_built(tiny_spec(), arch_list=arch, cache_dir=cache)
        assert (outcome.status, outcome.folder, outcome.arch_list) == ("cached", built.folder, built.arch_list)
    assert jit.load(tiny_spec(), arch_list=("9.0",), cache_dir=cache).add_value(4) == 5
    with pytest.raises(JitDisabledError, match="jit_tiny_sm80_"):
        jit.ensure_built(tiny_spec(), arch_list=("8.0",), cache_dir=cache)  # an arch the build lacks
    monkeypatch.setattr(loader, "find_nvcc", lambda: None)
    outcome = jit.ensure_built(tiny_spec(), arch_list=("10.0",), cache_dir=cache)
    assert outcome.portable and outcome.folder == built.folder
    assert entries(cache) == [built.entry]


def test_compile_error_surfaces_the_compiler_message(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FLASH_COMPRESS_JIT_VERBOSE", "1")
    cache = tmp_path / "cache"
    with pytest.raises(JitBuildError) as info:
        jit.load(broken_spec(), cache_dir=cache)
    error = info.value
    assert isinstance(error, RuntimeError)
    assert error.variant.startswith("jit_broken_sm90_")
    assert "nvcc" in error.command
    assert any("this_identifier_is_undefined" in line and "error" in line for line in error.first_errors)
    assert len(error.first_errors) <= 20
    assert error.log_path is not None and "this_identifier_is_undefined" in error.log_path.read_text()
    assert error.log_path.parent == cache / "failed"
    for part in (error.variant, error.command, "this_identifier_is_undefined", str(error.log_path)):
        assert part in str(error)
    assert not entries(cache) and not any((cache / ".staging").iterdir())
    err = capfd.readouterr().err
    assert "compiling jit_broken_sm90_" in err and "this_identifier_is_undefined" in err  # verbose echo


def test_truncated_library_is_detected_logged_and_rebuilt(warm_cache, tmp_path, caplog):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    [entry] = entries(cache)
    library = entry / "jit_tiny.so"
    with library.open("r+b") as f:
        f.truncate(library.stat().st_size // 2)
    with caplog.at_level(logging.INFO, logger="flash_compress"):
        module = jit.load(tiny_spec(), cache_dir=cache)
    assert module.add_value(1) == 2
    assert any("broken" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    assert any("JIT compiled" in r.message for r in caplog.records)
    [rebuilt] = entries(cache)
    assert rebuilt == entry and verify_entry(rebuilt).library is not None


def test_no_toolkit_loads_a_matching_prebuilt_entry_or_raises(warm_cache, tmp_path, monkeypatch):
    from flash_compress.jit import loader

    cache = copy_cache(warm_cache, tmp_path / "cache")
    monkeypatch.setattr(loader, "find_nvcc", lambda: None)
    outcome = jit.ensure_built(tiny_spec(), cache_dir=cache)
    assert outcome.status == "cached" and outcome.portable
    assert jit.load(tiny_spec(), cache_dir=cache).add_value(2) == 3
    with pytest.raises(JitDisabledError, match="no CUDA compiler"):
        jit.ensure_built(tiny_spec(), arch_list=("10.0",), cache_dir=cache)


def test_warm_load_works_without_torch(warm_cache, tmp_path):
    cache = copy_cache(warm_cache, tmp_path / "cache")
    # torch unimportable: the package (and tvm-ffi, which tries torch first) must still import and load.
    no_torch = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import flash_compress, flash_compress.jit\n"
    ) + CHILD
    result, _ = run_child(TINY, cache, code=no_torch)
    assert result["add_value"] == 11


def test_prebuild_exit_status(tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli.prebuild([("tiny", tiny_spec())], arch_list=ARCH, jobs=1, cache_dir=cache) == 0
    out = capsys.readouterr().out
    assert "built" in out and "1 built, 0 cached, 0 failed" in out

    status = cli.prebuild([("tiny", tiny_spec()), ("broken", broken_spec())], arch_list=ARCH, jobs=2,
                          cache_dir=cache)
    captured = capsys.readouterr()
    assert status != 0
    assert "0 built, 1 cached, 1 failed" in captured.out
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line.startswith(("tiny", "broken"))}
    assert rows["tiny"][2] == "cached" and rows["broken"][2] == "failed"
    assert "this_identifier_is_undefined" in captured.err
    assert len(entries(cache)) == 1


def test_a_cached_library_that_fails_to_load_is_rebuilt_once(warm_cache, tmp_path, monkeypatch, caplog):
    from flash_compress.jit import loader

    cache = copy_cache(warm_cache, tmp_path / "cache")
    real_load = loader._load_library
    calls: list[str] = []

    def fail_first(outcome):
        calls.append(outcome.status)
        if len(calls) == 1:
            raise OSError("simulated dlopen failure")
        return real_load(outcome)

    monkeypatch.setattr(loader, "_load_library", fail_first)
    with caplog.at_level(logging.INFO, logger="flash_compress"):
        module = jit.load(tiny_spec(), cache_dir=cache)
    assert module.add_value(3) == 4
    assert calls == ["cached", "built"]
    assert any("failed to load" in r.message and r.levelno == logging.WARNING for r in caplog.records)


def test_waiting_for_a_held_lock_times_out_clearly(tmp_path):
    from filelock import FileLock

    from flash_compress.jit.cache import folder_name, key_inputs

    cache = tmp_path / "cache"
    inputs = key_inputs(tiny_spec(), ARCH, find_nvcc(), cache)
    folder = folder_name("jit_tiny", ARCH, inputs.key())
    (cache / ".locks").mkdir(parents=True)
    config.lock_timeout = 0.5
    with FileLock(str(cache / ".locks" / f"{folder}.lock")):  # "another builder" holds it
        with pytest.raises(jit.JitLockTimeoutError, match=folder):
            jit.ensure_built(tiny_spec(), arch_list=ARCH, cache_dir=cache)
    assert not entries(cache)
