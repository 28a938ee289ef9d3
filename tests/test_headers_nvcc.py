"""The kernel headers under the real nvcc (no GPU needed): each compiles on its own, and a build for
an arch the kernels cannot run on stops with one clear line, at the boundary and in the compiler."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import flash_compress
from flash_compress import jit
from flash_compress._paths import source_roots
from flash_compress.c128_online import check_arch_list
from flash_compress.jit.toolchain import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
# Kernel files and the header library, each as a kernel or a user would include it.
HEADERS = sorted(str(path.relative_to(root)) for root, folder in ((ROOT / "csrc", "deepseek_v4"),
                                                                   (ROOT / "include", "sgl_kernel"))
                 for path in (root / folder).rglob("*") if path.suffix in (".h", ".cuh"))

# docs/SPEC.md section 6: the header library, every name used once (host and device).
LIBRARY_SURFACE = """
#include <sgl_kernel/deepseek_v4/compress.cuh>
#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/tensor.h>
#include <sgl_kernel/tile.cuh>
#include <sgl_kernel/type.cuh>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>
#include <sgl_kernel/vec.cuh>
#include <sgl_kernel/warp.cuh>

__global__ void surface(const float* in, float* out, device::bf16_t* half_out) {
  using Vec = device::AlignedVector<float, 4>;
  device::PDLWaitPrimary<true>();
  const auto tile = device::tile::Memory<Vec>::cta(blockDim.x);
  Vec v = tile.load(in, 0);
  v[0] = device::warp::reduce_max<8>(v[0]) + device::warp::reduce_sum<device::kWarpThreads>(v[1]);
  tile.store(out, v, 0);
  half_out[threadIdx.x] = device::cast<device::bf16_t>(v[0]);
  device::PDLTriggerSecondary<true>();
}

int64_t host_surface(int64_t n) {
  int64_t total = 0;
  for (auto i : host::irange(n)) total += i;
  for (auto i : host::irange(2, n)) total += i;
  host::RuntimeCheck(total >= 0, "total ", total);
  if (n < 0) host::Panic("negative n ", n);
  return total + sizeof(device::compress::PrefillPlan) + host::compress::kPrefillPlanDim;
}
"""

needs_nvcc = pytest.mark.skipif(find_nvcc() is None,
                                reason="no nvcc found ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc on PATH)")


def compile_alone(source: str, arch: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Compiles `source` as one translation unit for `arch` (e.g. "90"), object only."""
    import tvm_ffi.libinfo

    unit = tmp_path / "unit.cu"
    unit.write_text(source)
    includes = [f"-I{path}" for path in (*source_roots(), *tvm_ffi.libinfo.include_paths())]
    command = [str(find_nvcc()), "-c", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-std=c++20", "-O0",
               "--expt-relaxed-constexpr", *includes, str(unit), "-o", str(tmp_path / "unit.o")]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("header", HEADERS)
def test_each_header_compiles_on_its_own(header, tmp_path):
    """Each file includes what it uses, so a kernel file can be read, edited and benchmarked alone."""
    result = compile_alone(f"#include <{header}>\n", "90", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_nvcc
@pytest.mark.nvcc
def test_the_header_library_surface_compiles(tmp_path):
    """Every helper the contract names for the header library, used once: the kernels use only some."""
    result = compile_alone(LIBRARY_SURFACE, "90", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_nvcc
@pytest.mark.nvcc
def test_an_arch_without_cp_async_stops_with_one_clear_line(tmp_path):
    result = compile_alone("#include <sgl_kernel/async_copy.cuh>\n__global__ void k() {}\n", "75", tmp_path)
    assert result.returncode != 0
    first_error = next(line for line in (result.stdout + result.stderr).splitlines() if "error" in line)
    assert "cp.async needs sm_80 or newer" in first_error, first_error


def test_the_arch_check_names_the_archs_to_drop():
    check_arch_list(("8.0", "9.0a", "10.0"))
    with pytest.raises(ValueError, match=r"arch_list: .*sm_80 or newer.*got 7\.5 9\.0; drop 7\.5"):
        check_arch_list(("7.5", "9.0"))


def test_load_module_refuses_an_old_arch_before_any_build(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("load_module built for an arch it cannot run on")

    monkeypatch.setattr(jit, "load", no_build)
    monkeypatch.setattr(jit, "cuda_arch_list", lambda: ("7.5",))
    with pytest.raises(ValueError, match="sm_80 or newer"):
        flash_compress.load_module(128)


def test_prebuild_refuses_an_old_arch_for_the_kernels_before_any_build(monkeypatch, capsys):
    from flash_compress.__main__ import main
    from flash_compress.jit import cli

    def no_build(*args, **kwargs):
        raise AssertionError("prebuild built for an arch the kernels cannot run on")

    monkeypatch.setattr(cli, "prebuild", no_build)
    assert main(["prebuild", "--head-dim", "128", "--arch", "7.5", "9.0"]) == 2
    assert "sm_80 or newer" in capsys.readouterr().err
