"""The CPU side of the GPU measurement scripts: prefill_scaling.py's line fit, and warp_stamps.py's
stamp layout and kernel edits, which must keep applying to (and compiling with) the kernel file as
it changes. The scripts themselves need a GPU."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from test_headers_nvcc import compile_alone, needs_nvcc

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scaling_fit_recovers_a_line():
    fit_line = load_script("prefill_scaling").fit_line
    megabytes = [8.4, 16.8, 33.7, 67.4, 134.7]
    fixed, slope = fit_line(megabytes, [3.3 + 0.25 * x for x in megabytes])
    assert fixed == pytest.approx(3.3) and slope == pytest.approx(0.25)


@pytest.mark.parametrize("head_dim", [64, 128, 512, 1024])
def test_stamps_never_share_a_word_nor_touch_a_row_the_pass_writes(head_dim):
    """A 1 x N-from-0 compress pass writes output rows 127 mod 128 only; the stamps must fit in the
    other rows of the smallest call the script times (8192 tokens), one 64-bit word each."""
    stamps = load_script("warp_stamps")
    positions = [stamps.stamp_position(i, head_dim) for i in range(stamps.PER_WARP * stamps.STAMP_WARPS + 2)]
    assert len(set(positions)) == len(positions)
    assert all(row % 128 != 127 and row < 8192 and col < head_dim // 2 for row, col in positions)


def test_the_stamp_edits_apply_to_the_kernel_file(tmp_path):
    folder = load_script("warp_stamps").instrumented_kernel(tmp_path / "stamped")
    text = (folder / "c128_prefill.cuh").read_text()
    assert text.count("= global_ns();") == 4  # entry, after the PDL wait, first tokens landed, done


@needs_nvcc
@pytest.mark.nvcc
def test_the_instrumented_kernel_compiles(tmp_path):
    kernels = tmp_path / "stamped" / "deepseek_v4"
    shutil.copytree(ROOT / "csrc" / "deepseek_v4", kernels)
    load_script("warp_stamps").instrumented_kernel(kernels)  # replaces the copy's prefill kernel
    source = ("#include <deepseek_v4/c128_prefill.cuh>\n"
              "void* compress_pass() {\n"
              "  return reinterpret_cast<void*>(&flash_compress::c128::c128_prefill_kernel<128, 64, false, true, float>);\n"
              "}\n")
    flags = ("-std=c++20", "-O0", "--expt-relaxed-constexpr", f"-I{tmp_path / 'stamped'}")
    result = compile_alone(source, "90", tmp_path, flags)
    assert result.returncode == 0, result.stdout + result.stderr
