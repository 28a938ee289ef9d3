"""Exports and tvm-ffi: one export name per C++ signature, and only public tvm-ffi API anywhere.

The unit tests need no compiler; the last test builds a tiny host-only module with nvcc (no GPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flash_compress import jit
from flash_compress.c128_online import STATE_DTYPES, planner_spec, spec
from flash_compress.jit import JitSpec
from flash_compress.jit.toolchain import find_nvcc

REPO = Path(__file__).resolve().parents[1]
TINY = Path(__file__).resolve().parent / "data" / "jit_tiny"

# tvm-ffi's private names: its C++ detail namespace, a `_`-prefixed module member, a patched build function.
PRIVATE_TVM_FFI = re.compile(r"ffi::details?::|tvm_ffi(?:\.\w+)*\._(?!_)\w+|extension\.build_ninja|_find_cuda_home")


@pytest.mark.parametrize("bad", [("f", "g"), ["f"], 7, "", "f\ng"])
def test_an_export_is_one_expression(bad):
    with pytest.raises((ValueError, TypeError)):
        JitSpec(name="x", headers=("x.h",), exports={"f": bad})


def test_every_export_uses_the_public_macro():
    for variant in (spec(512, True), planner_spec(False)):
        text = variant.translation_unit()
        assert text.count("TVM_FFI_DLL_EXPORT_TYPED_FUNC(") == len(variant.exports)
        assert not PRIVATE_TVM_FFI.search(text)
    for state_dtype in STATE_DTYPES:
        assert set(spec(128, False, state_dtype).exports) == {
            "run_decode", "run_prefill", "run_prefill_compact", "run_verify", "run_commit", "plan_online_prefill",
            "plan_online_prefill_counted"}
    assert set(planner_spec(True).exports) == {"plan_online_prefill", "plan_online_prefill_counted"}


def test_no_private_tvm_ffi_name_in_the_tree():
    offenders = []
    for folder in ("python", "csrc", "include", "scripts", "tests"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".cuh", ".h", ".cu", ".cc") and path != Path(__file__).resolve():
                offenders += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in PRIVATE_TVM_FFI.finditer(path.read_text())]
    assert not offenders, offenders


@pytest.mark.nvcc
@pytest.mark.skipif(find_nvcc() is None, reason="no nvcc found")
def test_a_built_module_exposes_exactly_its_exports(tmp_path):
    tiny = JitSpec(name="jit_tiny_exports", headers=("tiny/tiny.cuh",), include_dirs=(TINY,),
                   exports={"add_value": "jit_tiny::add_value", "has_kernel": "jit_tiny::has_kernel"})
    module = jit.load(tiny, arch_list=("9.0",), cache_dir=tmp_path / "cache")
    assert module.add_value(41) == 42 and module.has_kernel() is True
    with pytest.raises(TypeError, match="Expected 1 but got 2"):
        module.add_value(1, 2)
    with pytest.raises(AttributeError):
        module.not_exported  # noqa: B018
