"""Unit tests of flash_compress.jit that need no compiler: settings, specs, keys, toolkit lookup, logs."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

from flash_compress.jit import JitBuildError, JitDisabledError, JitSpec, config, cuda_arch_list
from flash_compress.jit import build, toolchain
from flash_compress.jit.build import first_errors
from flash_compress.jit.cache import (
    MANIFEST, CacheLayout, KeyInputs, TreeDigest, clear_cache, folder_name, list_entries, publish, tree_digest,
    verify_entry,
)

JIT_DIR = Path(__file__).resolve().parents[1] / "python" / "flash_compress" / "jit"
TINY = Path(__file__).resolve().parent / "data" / "jit_tiny"


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch: pytest.MonkeyPatch):
    for var in ("FLASH_COMPRESS_CACHE_DIR", "FLASH_COMPRESS_CUDA_ARCH_LIST", "FLASH_COMPRESS_JIT_VERBOSE",
                "FLASH_COMPRESS_DISABLE_JIT", "FLASH_COMPRESS_JIT_LOCK_TIMEOUT", "MAX_JOBS", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    config.reset()
    yield
    config.reset()


def tiny_spec(**overrides) -> JitSpec:
    fields = dict(
        name="tiny",
        headers=("tiny/tiny.cuh",),
        exports={"add_value": "jit_tiny::add_value"},
        include_dirs=(TINY,),
    )
    fields.update(overrides)
    return JitSpec(**fields)


# --- settings -----------------------------------------------------------------------------------


def test_config_reads_env_at_each_use_and_python_overrides_win(monkeypatch, tmp_path):
    assert config.cache_dir == Path("~/.cache/flash_compress").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir == tmp_path / "xdg" / "flash_compress"  # the user cache folder, as Linux users expect
    monkeypatch.setenv("FLASH_COMPRESS_CACHE_DIR", str(tmp_path / "env"))
    assert config.cache_dir == tmp_path / "env"
    config.cache_dir = tmp_path / "py"
    assert config.cache_dir == tmp_path / "py"
    config.cache_dir = None
    assert config.cache_dir == tmp_path / "env"

    assert config.verbose is False and config.disable_jit is False and config.max_jobs is None
    monkeypatch.setenv("FLASH_COMPRESS_JIT_VERBOSE", "1")
    monkeypatch.setenv("FLASH_COMPRESS_DISABLE_JIT", "true")
    monkeypatch.setenv("MAX_JOBS", "3")
    monkeypatch.setenv("FLASH_COMPRESS_JIT_LOCK_TIMEOUT", "7.5")
    assert config.verbose and config.disable_jit and config.max_jobs == 3 and config.lock_timeout == 7.5
    config.disable_jit = False
    assert config.disable_jit is False
    with pytest.raises(ValueError, match="MAX_JOBS"):
        config.max_jobs = 0


@pytest.mark.parametrize(("var", "value"), [("MAX_JOBS", "zero"), ("MAX_JOBS", "0"),
                                            ("FLASH_COMPRESS_DISABLE_JIT", "maybe"),
                                            ("FLASH_COMPRESS_JIT_LOCK_TIMEOUT", "-1"),
                                            ("FLASH_COMPRESS_JIT_LOCK_TIMEOUT", "nan"),
                                            ("FLASH_COMPRESS_JIT_LOCK_TIMEOUT", "inf")])
def test_config_rejects_bad_values_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        _ = (config.max_jobs, config.disable_jit, config.lock_timeout)


def test_a_user_without_a_home_is_told_to_set_the_cache_dir(monkeypatch):
    """A container running as a uid with no home (no HOME, no passwd entry): platformdirs cannot name a
    cache folder, and the error says which variable to set."""
    import platformdirs

    def no_home(*args, **kwargs):
        raise RuntimeError("could not determine home directory")

    monkeypatch.delenv("FLASH_COMPRESS_CACHE_DIR", raising=False)
    monkeypatch.setattr(platformdirs, "user_cache_path", no_home)
    with pytest.raises(ValueError, match="FLASH_COMPRESS_CACHE_DIR .* unset, and this user has no cache folder"):
        config.resolve_cache_dir()


def test_arch_list_resolution_order(monkeypatch):
    monkeypatch.setattr(toolchain, "detect_gpu_arch_list", lambda: None)
    assert cuda_arch_list() == ("9.0",)  # no GPU, nothing requested
    monkeypatch.setattr(toolchain, "detect_gpu_arch_list", lambda: ("8.0",))
    assert cuda_arch_list() == ("8.0",)  # the visible GPU
    monkeypatch.setenv("FLASH_COMPRESS_CUDA_ARCH_LIST", "10.0 9.0")
    assert cuda_arch_list() == ("9.0", "10.0")  # the environment, sorted
    config.arch_list = "9.0a"
    assert cuda_arch_list() == ("9.0a",)  # Python wins


def test_arch_list_validation_and_tag():
    assert toolchain.normalize_arch_list("9.0;10.0,9.0") == ("9.0", "10.0")
    assert toolchain.arch_tag(("9.0", "10.0")) == "sm90-100"
    assert toolchain.arch_tag(("9.0a",)) == "sm90a"
    for bad in ("sm_90", "90", "9", ""):
        with pytest.raises(ValueError):
            toolchain.normalize_arch_list(bad)


def test_arch_detection_uses_no_torch_unless_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    toolchain._nvidia_smi_gpus.cache_clear()
    monkeypatch.setenv("PATH", "")  # no nvidia-smi either
    try:
        assert toolchain.detect_gpu_arch_list() is None
        assert cuda_arch_list() == ("9.0",)
    finally:
        toolchain._nvidia_smi_gpus.cache_clear()


def test_arch_detection_leaves_cuda_uninitialised_where_nvidia_smi_answers(monkeypatch, tmp_path):
    """Asking torch for a capability initialises CUDA, which a forked child then cannot use: torch is asked
    first only where the program initialised CUDA, and after nvidia-smi only where that does not answer
    or names two kinds it cannot tell apart."""
    asked = []

    class FakeCuda:
        initialized = False

        def is_initialized(self):
            return self.initialized

        def is_available(self):
            return True

        def device_count(self):
            return 1

        def get_device_capability(self, index):
            asked.append(index)
            return (10, 0)

    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, GPU-aaaa-1111, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    toolchain._nvidia_smi_gpus.cache_clear()
    try:
        assert toolchain.detect_gpu_arch_list() == ("9.0",) and asked == []  # nvidia-smi's answer
        cuda.initialized = True
        assert toolchain.detect_gpu_arch_list() == ("10.0",) and asked == [0]  # torch's, CUDA already up
        cuda.initialized = False
        monkeypatch.setenv("PATH", "")
        toolchain._nvidia_smi_gpus.cache_clear()
        assert toolchain.detect_gpu_arch_list() == ("10.0",) and asked == [0, 0]  # torch, the last resort
        # Two kinds on the host, and no telling which one CUDA sees: torch, which knows.
        smi.write_text("#!/bin/sh\necho '0, GPU-aaaa-1111, 9.0'\necho '1, GPU-bbbb-2222, 7.5'\n")
        monkeypatch.setenv("PATH", str(tmp_path))
        toolchain._nvidia_smi_gpus.cache_clear()
        assert toolchain.detect_gpu_arch_list() == ("10.0",) and asked == [0, 0, 0]
        monkeypatch.setitem(sys.modules, "torch", None)  # without torch, both kinds
        assert toolchain.detect_gpu_arch_list() == ("7.5", "9.0")
    finally:
        toolchain._nvidia_smi_gpus.cache_clear()


@pytest.mark.parametrize("visible, order, want", [
    (None, None, ("7.5", "9.0")),             # the whole host
    ("1", "PCI_BUS_ID", ("9.0",)),            # nvidia-smi's index is CUDA's in PCI order
    ("GPU-bbbb", None, ("9.0",)),             # a UUID prefix, in any order
    ("1,7,0", "PCI_BUS_ID", ("9.0",)),        # read up to the first entry that names no GPU
    ("", None, None),                         # no GPU visible: the default arch list
    ("1", None, ("7.5", "9.0")),              # fastest-first indices on two kinds: both kept
    ("MIG-cccc", None, ("7.5", "9.0")),       # a MIG instance: both kept
])
def test_arch_detection_by_nvidia_smi_follows_cuda_visible_devices(monkeypatch, tmp_path, visible, order, want):
    """A rank of a host with two kinds of GPU builds for the one it sees (torch not imported)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, GPU-aaaa-1111, 7.5'\necho '1, GPU-bbbb-2222, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    for var, value in (("CUDA_VISIBLE_DEVICES", visible), ("CUDA_DEVICE_ORDER", order)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    toolchain._nvidia_smi_gpus.cache_clear()
    try:
        assert toolchain.detect_gpu_arch_list() == want
    finally:
        toolchain._nvidia_smi_gpus.cache_clear()


def test_jit_package_never_imports_torch():
    for path in JIT_DIR.glob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path


# --- specs ---------------------------------------------------------------------------------------


def test_spec_translation_unit_is_path_free_and_parenthesises_exports():
    spec = tiny_spec(exports={"run": "ns::Cls<512, true>::run"})
    text = spec.translation_unit()
    assert "#include <tvm/ffi/function.h>" in text
    assert "#include <tiny/tiny.cuh>" in text
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, (ns::Cls<512, true>::run));" in text
    assert str(TINY) not in text
    assert spec == tiny_spec(exports={"run": "ns::Cls<512, true>::run"})
    assert hash(spec) == hash(tiny_spec(exports={"run": "ns::Cls<512, true>::run"}))
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize("bad", [
    {"name": "has space"}, {"name": "dash-ed"}, {"headers": ()}, {"headers": ("a>b.h",)},
    {"exports": {}}, {"exports": {"1bad": "f"}}, {"exports": {"f": ""}}, {"include_dirs": "/a/single/path"},
])
def test_spec_rejects_malformed_fields(bad):
    with pytest.raises((ValueError, TypeError)):
        tiny_spec(**bad)


# --- keys ------------------------------------------------------------------------------------------


def test_tree_digest_follows_contents_not_location(tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "elsewhere" / "b"
    import shutil

    shutil.copytree(TINY, a)
    shutil.copytree(TINY, b)
    assert tree_digest(a) == tree_digest(b) == tree_digest(TINY)
    (b / "tiny" / ".value.h.swp").write_text("editor droppings")
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert tree_digest(b) == tree_digest(a)
    (b / "tiny" / "value.h").write_text((b / "tiny" / "value.h").read_text().replace("= 1", "= 2"))
    assert tree_digest(b) != tree_digest(a)
    (a / "tiny" / "new.h").write_text("")
    assert tree_digest(a).files == tree_digest(TINY).files + 1
    with pytest.raises(FileNotFoundError):
        tree_digest(tmp_path / "missing")


def _inputs(**overrides) -> KeyInputs:
    fields = dict(
        schema=1, name="tiny", source_sha256="s",
        include_trees=(TreeDigest(1, "t"),), extra_cuda_cflags=("-O3",), extra_ldflags=(),
        arch_list=("9.0",), tvm_ffi_version="0.1", package_version="0.1.0", platform="linux-x86_64",
        nvcc_version="nvcc 13.0", host_compiler="g++ 12", nvcc_env=(),
    )
    fields.update(overrides)
    return KeyInputs(**fields)


def test_every_key_input_changes_the_key_and_the_portable_key_ignores_the_toolchain():
    base = _inputs()
    for change in ({"arch_list": ("10.0",)}, {"extra_cuda_cflags": ("-O2",)}, {"include_trees": (TreeDigest(1, "u"),)},
                   {"tvm_ffi_version": "0.2"}, {"package_version": "0.2.0"}, {"source_sha256": "x"},
                   {"nvcc_version": "nvcc 13.1"}, {"host_compiler": "clang"}, {"nvcc_env": (("NVCC_APPEND_FLAGS", "-G"),)}):
        assert _inputs(**change).key() != base.key(), change
    assert _inputs(nvcc_version="nvcc 12.8", host_compiler="clang").portable_key() == base.portable_key()
    assert _inputs(arch_list=("10.0",)).portable_key() != base.portable_key()
    with pytest.raises(ValueError):
        _inputs(nvcc_version=None).key()
    assert folder_name("tiny", ("9.0", "10.0"), base.key()) == f"tiny_sm90-100_{base.key()[:16]}"


# --- compiler lookup --------------------------------------------------------------------------------


def _fake_nvcc(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho fake nvcc\n")
    nvcc.chmod(0o755)
    return nvcc


def test_nvcc_from_cuda_home_then_cuda_path_then_default_then_path(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "_DEFAULT_CUDA_HOME", tmp_path / "no-default")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-home"))
    assert toolchain.find_nvcc() is None  # a CUDA_HOME without nvcc, and nothing else around
    home = _fake_nvcc(tmp_path / "cuda-home")
    assert toolchain.find_nvcc() == home

    monkeypatch.delenv("CUDA_HOME")
    other = _fake_nvcc(tmp_path / "cuda-path")
    monkeypatch.setenv("CUDA_PATH", str(other.parent.parent))
    assert toolchain.find_nvcc() == other

    monkeypatch.delenv("CUDA_PATH")
    default = _fake_nvcc(tmp_path / "default")
    monkeypatch.setattr(toolchain, "_DEFAULT_CUDA_HOME", default.parent.parent)
    assert toolchain.find_nvcc() == default


def test_nvcc_wrapper_script_on_path_is_used_as_is(monkeypatch, tmp_path):
    # /usr/local/bin/nvcc here is such a wrapper: nvcc finds its own headers, so no CUDA_HOME is needed.
    wrapper = _fake_nvcc(tmp_path / "usr-local")
    monkeypatch.setattr(toolchain, "_DEFAULT_CUDA_HOME", tmp_path / "no-default")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper.parent))
    assert toolchain.find_nvcc() == wrapper


def test_host_compiler_is_the_one_nvcc_runs(monkeypatch, tmp_path):
    """nvcc runs ``gcc`` from PATH unless NVCC_CCBIN names a compiler or its folder; ``$CXX`` is not its."""
    for name in ("gcc", "clang++"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "clang++")
    monkeypatch.delenv("NVCC_CCBIN", raising=False)
    assert toolchain.host_compiler() == tmp_path / "gcc"
    monkeypatch.setenv("NVCC_CCBIN", str(tmp_path / "clang++"))
    assert toolchain.host_compiler() == tmp_path / "clang++"
    monkeypatch.setenv("NVCC_CCBIN", str(tmp_path))
    assert toolchain.host_compiler() == tmp_path / "gcc"


def test_gencode_flags_name_each_arch():
    assert toolchain.gencode_flags(("9.0", "10.0a")) == [
        "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_100a,code=sm_100a"]


def test_tool_versions_are_cached_on_disk_by_binary_identity(monkeypatch, tmp_path):
    calls = tmp_path / "calls"
    tool = tmp_path / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\necho x >> {calls}\necho tool 1.0\n")
    tool.chmod(0o755)
    cache = tmp_path / "cache"

    def fresh_process_version() -> str:
        toolchain._versions.clear()  # as a new process would start
        return toolchain.tool_version(tool, ("--version",), cache)

    assert fresh_process_version() == "tool 1.0"
    assert fresh_process_version() == "tool 1.0"
    assert calls.read_text().count("x") == 1  # the second "process" ran nothing

    tool.write_text(f"#!/bin/sh\necho x >> {calls}\necho tool 2.0 upgraded\n")  # new size and mtime
    assert fresh_process_version() == "tool 2.0 upgraded"
    assert calls.read_text().count("x") == 2

    # An unwritable cache costs only the re-run (its parent is a file, so even root cannot write).
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    toolchain._versions.clear()
    assert toolchain.tool_version(tool, ("--version",), blocker / "cache") == "tool 2.0 upgraded"


def test_a_compiler_link_is_asked_by_the_name_nvcc_runs(tmp_path):
    """ccache-style links dispatch on their own name: ``gcc -> ccache`` must be asked as ``gcc``, and two
    links to one binary remembered apart."""
    dispatcher = tmp_path / "bin" / "dispatcher"
    dispatcher.parent.mkdir()
    dispatcher.write_text('#!/bin/sh\necho "$(basename "$0") 1.0"\n')
    dispatcher.chmod(0o755)
    for name in ("gcc", "g++"):
        (tmp_path / "bin" / name).symlink_to(dispatcher)
    cache = tmp_path / "cache"
    for _ in range(2):  # the second time from the disk, as a new process would
        toolchain._versions.clear()
        assert toolchain.tool_version(tmp_path / "bin" / "gcc", ("--version",), cache) == "gcc 1.0"
        assert toolchain.tool_version(tmp_path / "bin" / "g++", ("--version",), cache) == "g++ 1.0"


# --- logs and errors -------------------------------------------------------------------------------

NVCC_FAILURE = """/s/t.cu(3): error: identifier "undefined_thing" is undefined
  int broken() { return undefined_thing + 1; }
                        ^

1 error detected in the compilation of "/s/t.cu".
"""


def test_first_errors_from_nvcc_output():
    errors = first_errors(NVCC_FAILURE)
    assert errors[0] == '/s/t.cu(3): error: identifier "undefined_thing" is undefined'
    assert "undefined_thing + 1" in errors[1]
    assert not any("errors detected" in line or "error detected" in line for line in errors)
    many = "\n".join(f"f.cu({i}): error: e{i}\n  ctx\n  ^" for i in range(50))
    assert len(first_errors(many)) == 20
    assert first_errors("no problem words\nlast line") == ("no problem words", "last line")


def _guard():
    """The guard script as a module (Linux only: it uses SIGRTMIN and /proc)."""
    from flash_compress.jit import _child_guard

    return _child_guard


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a container's PID 1 may never reap one)."""
    try:
        return _guard()._state_and_parent(pid)[0] != "Z"
    except OSError:
        return False


def _running_with(marker: str) -> list[int]:
    """The running processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text() and _running(int(entry.name)):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard uses Linux's PR_SET_PDEATHSIG")
def test_a_build_command_reports_its_output_and_status_through_the_guard(tmp_path):
    """build._run's command keeps its merged output, its exit status (128 + N for a signal N), and a
    command that cannot start is a status of 127 with a line that says why."""
    assert build._run(["sh", "-c", "echo out; echo err >&2; exit 3"], echo=False) == (3, ["out", "err"])
    assert build._run(["sh", "-c", "kill -9 $$"], echo=False)[0] == 128 + 9
    status, lines = build._run([str(tmp_path / "no-nvcc")], echo=False)
    assert status == 127 and lines[-1].startswith(f"could not run {tmp_path / 'no-nvcc'}: "), lines


def test_a_builder_that_exits_mid_build_stops_the_build_instead_of_waiting_for_it(tmp_path):
    """A server whose SIGTERM handler calls sys.exit while a thread compiles: the SystemExit leaves at once
    and takes the compiler down, rather than waiting for the compile to end."""
    pid_file = tmp_path / "compiler.pid"
    previous = signal.signal(signal.SIGALRM, lambda *_: sys.exit(3))
    start = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(SystemExit):
            build._run(["sh", "-c", f"echo $$ > {pid_file}; exec sleep 20"], echo=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < 10
    compiler = int(pid_file.read_text())
    for _ in range(100):  # the guard kills and reaps it
        if not Path(f"/proc/{compiler}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{compiler}").exists()


def test_a_build_runs_unguarded_where_the_guard_cannot_run(monkeypatch):
    """Off Linux, or under an interpreter that is not Python's own binary (embedded, frozen), the command
    runs as it is rather than through an executable that would not take the guard's arguments."""
    command = ["nvcc", "-V"]
    if sys.platform.startswith("linux"):
        assert build._guarded(command)[1:4] == ["-s", "-S", str(JIT_DIR / "_child_guard.py")]
    for executable in ("", "/usr/bin/uwsgi"):
        monkeypatch.setattr(sys, "executable", executable)
        assert build._guarded(command) == command
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    assert build._guarded(command) == command


def _start_builder(tmp_path: Path, script: str, prologue: str = "") -> tuple[subprocess.Popen, str]:
    """A process (its own process group) that runs ``sh -c script`` through build._run, echoing its output
    to stderr and then the status it got; and a marker that is in the command line of the shell."""
    marker = f"build-{uuid.uuid4().hex}"
    builder = tmp_path / "builder.py"
    builder.write_text(f"import signal, sys\n{prologue}from flash_compress.jit import build\n"
                       f"status, _ = build._run(['sh', '-c', {script!r}, '{marker}'], echo=True)\n"
                       "print('status', status, file=sys.stderr)\n")
    # The package from this checkout, and whatever else this process imports (tvm-ffi may sit on a PYTHONPATH).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JIT_DIR.parents[1]), *sys.path])}
    return subprocess.Popen([sys.executable, str(builder)], stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True), marker


def _parent_of(pid: int) -> int:
    return _guard()._state_and_parent(pid)[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard uses Linux's PR_SET_PDEATHSIG")
@pytest.mark.parametrize("kill", ["builder", "group", "guard"])
def test_a_build_stops_whole_when_its_builder_or_guard_is_killed(tmp_path, kill):
    """SIGKILL the process running a build, or its whole process group, or SIGTERM the guard between it
    and the command (a shell standing in for nvcc, with a child as nvcc has cicc and ptxas): the guard,
    the command and its child all end, none runs on as an orphan."""
    process, marker = _start_builder(tmp_path, "sleep 60 & echo $$ $!; wait")
    try:
        shell, sleeper = map(int, process.stderr.readline().split())
        guard = _parent_of(shell)
        # The sleeper holds the marker too until the shell's fork of it has exec'd sleep.
        assert {guard, shell} <= set(_running_with(marker)) <= {guard, shell, sleeper} and _running(sleeper)
        assert _parent_of(guard) == process.pid
        if kill == "group":
            os.killpg(process.pid, signal.SIGKILL)
        elif kill == "guard":
            os.kill(guard, signal.SIGTERM)
            assert process.stderr.readline().split() == ["status", str(128 + signal.SIGTERM)]
            assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 10
    while (_running_with(marker) or _running(sleeper)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running_with(marker) and not _running(sleeper), (_running_with(marker), _running(sleeper))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard uses Linux's PR_SET_PDEATHSIG")
def test_the_guard_follows_proc_only_where_it_numbers_its_own_processes(monkeypatch):
    """The guard finds what is below it through /proc; where /proc is missing or numbers another PID
    namespace's processes, it kills only its own child, whose id it knows."""
    guard = _guard()
    child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    below: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while len(below) < 2 and time.monotonic() < deadline:
            below = guard._descendants(os.getpid())
            time.sleep(0.01)
        (sleeper,) = [pid for pid in below if _parent_of(pid) == child.pid]
        monkeypatch.setattr(guard.os, "readlink", lambda path: "1")  # another namespace's /proc/self
        guard._kill_descendants([child])
        assert child.wait(timeout=10) == -signal.SIGKILL and _running(sleeper)  # the sleeper is out of reach
    finally:
        child.kill()
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard uses Linux's PR_SET_PDEATHSIG")
def test_a_signal_the_builder_ignores_leaves_its_build_running(tmp_path):
    """A builder under nohup (SIGHUP ignored) keeps its build through a hangup: the guard ignores it too."""
    process, _ = _start_builder(tmp_path, "echo $$; sleep 1; echo done", prologue="signal.signal(signal.SIGHUP, "
                                "signal.SIG_IGN)\n")
    try:
        shell = int(process.stderr.readline())
        os.killpg(process.pid, signal.SIGHUP)
        os.kill(_parent_of(shell), signal.SIGHUP)
        assert [process.stderr.readline().strip() for _ in range(2)] == ["done", "status 0"]
    finally:
        process.kill()
        process.wait()


def test_errors_carry_their_fields_and_survive_pickling(tmp_path):
    error = JitBuildError("tiny_sm90_0123", "nvcc -c x.cu", ("x.cu(1): error: bad",), tmp_path / "log")
    for e in (error, pickle.loads(pickle.dumps(error))):
        assert isinstance(e, RuntimeError)
        assert (e.variant, e.command, e.first_errors, e.log_path) == error.__reduce__()[1]
        for part in ("tiny_sm90_0123", "nvcc -c x.cu", "x.cu(1): error: bad", str(tmp_path / "log")):
            assert part in str(e)
    disabled = JitDisabledError("tiny_sm90_0123", "FLASH_COMPRESS_DISABLE_JIT=1 forbids compiling", tmp_path)
    assert "tiny_sm90_0123" in str(disabled) and "python -m flash_compress prebuild" in str(disabled)
    assert pickle.loads(pickle.dumps(disabled)).reason == disabled.reason


# --- cache layout ------------------------------------------------------------------------------------


def _fake_entry(root: Path, folder: str, name: str, payload: bytes = b"so bytes") -> Path:
    import hashlib

    entry = root / folder
    entry.mkdir(parents=True)
    (entry / f"{name}.so").write_bytes(payload)
    manifest = {"folder": folder, "name": name, "key": folder[-16:] * 4, "arch_list": ["9.0"],
                "library": f"{name}.so", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                "built_at": 1.0e9, "build_seconds": 2.5}
    (entry / MANIFEST).write_text(json.dumps(manifest))
    return entry


def test_verify_entry_catches_truncation_and_corruption(tmp_path):
    entry = _fake_entry(tmp_path, "tiny_sm90_0123456789abcdef", "tiny")
    assert verify_entry(entry).library == entry / "tiny.so"
    assert verify_entry(entry, key="other").library is None
    (entry / "tiny.so").write_bytes(b"so bytez")  # same size, other bytes
    assert "sha256" in verify_entry(entry).problem
    (entry / "tiny.so").write_bytes(b"so")
    assert "bytes" in verify_entry(entry).problem
    (entry / MANIFEST).write_text("{not json")
    assert "manifest" in verify_entry(entry).problem
    assert not verify_entry(tmp_path / "absent").exists


def test_an_entry_cleared_while_it_is_checked_is_a_miss_not_an_error(tmp_path, monkeypatch):
    """`clear` renames entries away at any moment: a check that loses its files midway finds no entry (the
    loader then builds or raises JitDisabledError) instead of raising FileNotFoundError, and `status`
    lists what is left."""
    from flash_compress.jit import cache

    entry = _fake_entry(tmp_path, "tiny_sm90_0123456789abcdef", "tiny")
    real_sha256 = cache._sha256

    def cleared_meanwhile(path):
        clear_cache(tmp_path)
        return real_sha256(path)

    monkeypatch.setattr(cache, "_sha256", cleared_meanwhile)
    verdict = verify_entry(entry)
    assert not entry.exists() and verdict.library is None and not verdict.exists
    _fake_entry(tmp_path, "tiny_sm90_0123456789abcdef", "tiny")
    assert list_entries(tmp_path) == []  # hashing it cleared it; listing raised nothing


def test_a_shared_cache_root_keeps_its_folders_and_locks_writable_by_every_user(tmp_path):
    """A root writable by its group or others (one cache several users build into): the folders the cache
    makes take the root's bits and lock files are writable by all, whatever the builder's umask; a private
    root keeps the umask's."""
    old_umask = os.umask(0o022)
    try:
        for mode, folder_mode, lock_mode in ((0o2775, 0o2775, 0o666), (0o755, 0o755, 0o644)):
            root = tmp_path / oct(mode)
            root.mkdir()
            root.chmod(mode)
            layout = CacheLayout(root)
            lock = layout.lock("v_sm90_0", timeout=5)
            with lock:
                assert stat.S_IMODE((root / ".locks" / "v_sm90_0.lock").stat().st_mode) == lock_mode
            staging = layout.new_staging("v")  # published as is: another user may have to move it aside
            for made in (root / ".locks", root / ".staging", staging):
                assert stat.S_IMODE(made.stat().st_mode) == folder_mode, made
    finally:
        os.umask(old_umask)


def test_a_shared_cache_root_opens_an_entry_s_files_to_every_user_whatever_the_umask(tmp_path):
    """The library and the files beside it get the shared root's read bits (and its run bits where the
    builder's file has them), so another user can load the entry; a private root leaves them as made."""
    old_umask = os.umask(0o077)
    try:
        for mode, library_mode, text_mode in ((0o2775, 0o755, 0o644), (0o2770, 0o750, 0o640), (0o700, 0o700, 0o600)):
            root = tmp_path / oct(mode)
            root.mkdir()
            root.chmod(mode)
            layout = CacheLayout(root)
            staging = layout.new_staging("v")
            (staging / "v.so").write_bytes(b"so bytes")
            (staging / "v.so").chmod(0o700)  # as the linker makes it under umask 077
            (staging / MANIFEST).write_text("{}")
            layout.share_files(staging)
            assert stat.S_IMODE((staging / "v.so").stat().st_mode) == library_mode, oct(mode)
            assert stat.S_IMODE((staging / MANIFEST).stat().st_mode) == text_mode, oct(mode)
    finally:
        os.umask(old_umask)


def test_a_broken_entry_this_user_may_not_move_aside_is_a_clear_error(tmp_path, monkeypatch):
    """Another user's broken entry in a shared root (its folder not writable by this one): a JitDisabledError
    that says so, not a PermissionError from the rename."""
    from flash_compress.jit import loader

    spec = tiny_spec()
    folder = "tiny_sm90_0123456789abcdef"
    entry = _fake_entry(tmp_path, folder, "tiny")
    (entry / "tiny.so").write_bytes(b"so bytez")  # same size, other bytes: broken

    def denied(layout, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(loader, "quarantine", denied)
    monkeypatch.setattr(loader, "verify_entry", lambda e, key=None: verify_entry(e))
    inputs = _inputs()
    with pytest.raises(JitDisabledError, match=r"cached entry is broken \(the shared library's sha256.*may not "
                                               r"move it aside \(Permission denied\).*`clear`"):
        loader._build_locked(spec, CacheLayout(tmp_path), folder, inputs, Path("nvcc"), None, time.perf_counter())


def test_publish_first_writer_wins(tmp_path):
    layout = CacheLayout(tmp_path)
    first, second = layout.new_staging("v"), layout.new_staging("v")
    (first / "who").write_text("first")
    (second / "who").write_text("second")
    assert publish(first, tmp_path / "v") is True
    assert publish(second, tmp_path / "v") is False
    assert (tmp_path / "v" / "who").read_text() == "first"
    assert not second.exists()


def test_list_and_clear_entries(tmp_path):
    _fake_entry(tmp_path, "alpha_sm90_0000000000000001", "alpha")
    _fake_entry(tmp_path, "beta_sm90_0000000000000002", "beta")
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "x.log").write_text("old failure")
    infos = list_entries(tmp_path)
    assert [i.name for i in infos] == ["alpha", "beta"]
    assert infos[0].arch_list == ("9.0",) and infos[0].intact and infos[0].size > len(b"so bytes")
    assert clear_cache(tmp_path, name_prefix="al") == ["alpha_sm90_0000000000000001"]
    assert [i.name for i in list_entries(tmp_path)] == ["beta"]
    assert clear_cache(tmp_path) == ["beta_sm90_0000000000000002"]
    assert list_entries(tmp_path) == [] and not (tmp_path / "failed").exists()
    assert list_entries(tmp_path / "never-made") == [] and clear_cache(tmp_path / "never-made") == []


def test_broken_entries_are_listed_as_broken_and_cleared(tmp_path):
    """An entry whose .so has other bytes of the same size, or whose manifest is unreadable, is still an
    entry: listed with its problem (name and archs off the folder name), and cleared."""
    _fake_entry(tmp_path, "alpha_sm90-100a_0000000000000001", "alpha")
    _fake_entry(tmp_path, "beta_sm90_0000000000000002", "beta")
    (tmp_path / "alpha_sm90-100a_0000000000000001" / MANIFEST).write_text("{trunc")
    library = tmp_path / "beta_sm90_0000000000000002" / "beta.so"
    library.write_bytes(bytes(len(library.read_bytes())))
    (tmp_path / "failed").mkdir()
    infos = list_entries(tmp_path)
    assert [(i.name, i.arch_list, i.intact) for i in infos] == [("alpha", ("9.0", "10.0a"), False),
                                                                ("beta", ("9.0",), False)]
    assert "manifest" in infos[0].problem and "sha256" in infos[1].problem
    assert clear_cache(tmp_path, name_prefix="al") == ["alpha_sm90-100a_0000000000000001"]
    assert clear_cache(tmp_path) == ["beta_sm90_0000000000000002"] and list_entries(tmp_path) == []


def test_status_and_clear_commands_print_tables(tmp_path, capsys):
    from flash_compress.jit import cli

    _fake_entry(tmp_path, "alpha_sm90_0000000000000001", "alpha")
    assert cli.status(tmp_path) == 0
    out = capsys.readouterr().out
    assert "alpha_sm90_0000000000000001" in out and "9.0" in out and "ok" in out
    assert cli.clear(tmp_path, name_prefix="alpha") == 0
    assert "removed alpha_sm90_0000000000000001" in capsys.readouterr().out
    assert cli.status(tmp_path) == 0
    assert "(empty)" in capsys.readouterr().out


def test_status_names_a_broken_entry_and_clear_says_when_it_cannot_delete(tmp_path, capsys, monkeypatch):
    from flash_compress.jit import cache, cli

    entry = _fake_entry(tmp_path, "alpha_sm90_0000000000000001", "alpha")
    (entry / "alpha.so").write_bytes(b"so bytez")  # same size, other bytes
    assert cli.status(tmp_path) == 0
    assert "BROKEN alpha_sm90_0000000000000001: the shared library's sha256" in capsys.readouterr().out

    def denied(layout, path):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".trash"))

    monkeypatch.setattr(cache, "quarantine", denied)
    assert cli.clear(tmp_path) == 1
    assert f"clear: cannot delete from {tmp_path}: Permission denied" in capsys.readouterr().err


def test_cache_commands_without_a_cache_dir_print_the_reason_not_a_traceback(monkeypatch, capsys):
    import platformdirs

    from flash_compress.__main__ import main

    def no_home(*args, **kwargs):
        raise RuntimeError("could not determine home directory")

    monkeypatch.setattr(platformdirs, "user_cache_path", no_home)
    for argv in (["status"], ["clear"], ["prebuild", "--planner-only", "--arch", "9.0"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"{argv[0]}: FLASH_COMPRESS_CACHE_DIR") and "Traceback" not in err, argv


def test_an_interrupted_prebuild_cancels_the_builds_still_queued(tmp_path, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt in the waiting main thread) must not run every queued build first."""
    import threading

    from flash_compress.jit import cli

    started, release = [], threading.Event()

    def slow_build(spec, arch_list, cache_dir):
        started.append(spec.name)
        release.wait(5)
        return "built", spec.name, 0.0, ""

    def interrupted(futures):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_prebuild_one", slow_build)
    monkeypatch.setattr(cli, "as_completed", interrupted)
    specs = [(f"v{i}", tiny_spec(name=f"tiny{i}")) for i in range(6)]
    try:
        assert cli.prebuild(specs, arch_list="9.0", jobs=1, cache_dir=tmp_path) == 130
    finally:
        release.set()
    time.sleep(0.2)  # a cancelled build would have started by now
    assert started == ["tiny0"]
    assert "interrupted after 0 of 6 variants" in capsys.readouterr().err


def test_source_roots_point_at_the_checkout():
    from flash_compress._paths import source_roots

    csrc, include = source_roots()
    assert csrc.name == "csrc" and include.name == "include"
    assert csrc.is_dir() and include.is_dir()


def test_lock_dir_permissions_do_not_matter_for_reads(tmp_path):
    # verify_entry only reads: a read-only entry verifies.
    entry = _fake_entry(tmp_path, "ro_sm90_0000000000000003", "ro")
    for path in (entry / "ro.so", entry / MANIFEST, entry):
        path.chmod(stat.S_IRUSR | stat.S_IXUSR if path.is_dir() else stat.S_IRUSR)
    try:
        assert verify_entry(entry).library is not None
    finally:
        entry.chmod(0o755)
        for path in entry.iterdir():
            path.chmod(0o644)
    assert os.access(entry, os.W_OK)
