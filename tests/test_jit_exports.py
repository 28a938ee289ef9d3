"""JitSpec exports with overloads: one export name, several C++ functions told apart by argument count.

The unit tests need no compiler; the last test builds a tiny host-only module with nvcc (no GPU).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from flash_compress import jit
from flash_compress.jit import JitSpec, config
from flash_compress.jit.toolchain import find_cuda_toolkit

DATA = Path(__file__).resolve().parent / "data" / "jit_overloads"


def overload_spec(**overrides) -> JitSpec:
    fields = dict(
        name="jit_overloads",
        headers=("overloads/overloads.h",),
        exports={
            "scale": ("jit_overloads::scale_default", "jit_overloads::scale"),
            "plain": "jit_overloads::plain",
        },
        include_dirs=(DATA,),
        extra_cuda_cflags=("-std=c++20", "-O1"),
    )
    fields.update(overrides)
    return JitSpec(**fields)


def test_overloads_are_normalised_to_a_tuple_and_the_spec_stays_hashable():
    spec = overload_spec(exports={"scale": [" jit_overloads::scale_default ", "jit_overloads::scale"]})
    assert spec.exports["scale"] == ("jit_overloads::scale_default", "jit_overloads::scale")
    same = overload_spec(exports={"scale": ("jit_overloads::scale_default", "jit_overloads::scale")})
    assert spec == same and hash(spec) == hash(same)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_overloaded_export_defines_the_symbol_tvm_ffi_looks_up():
    text = overload_spec().translation_unit()
    assert "TVM_FFI_DLL_EXPORT int __tvm_ffi_scale(" in text
    call = "call_by_arity(&name, args, num_args, result, (jit_overloads::scale_default), (jit_overloads::scale));"
    assert call in text
    assert "distinct(" in text  # equal arities are a compile error, not a silent shadowing
    # Single exports keep the tvm-ffi macro, so their units are unchanged.
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(plain, (jit_overloads::plain));" in text


def test_units_without_overloads_carry_no_dispatch_helper():
    text = overload_spec(exports={"plain": "jit_overloads::plain"}).translation_unit()
    assert "call_by_arity" not in text and "flash_compress_jit" not in text


@pytest.mark.parametrize("bad", [(), ("only_one",), ("f", ""), ("f", "g\nh"), ("f", 3), 7])
def test_malformed_overloads_are_rejected(bad):
    with pytest.raises((ValueError, TypeError)):
        overload_spec(exports={"scale": bad})


@pytest.mark.nvcc
@pytest.mark.skipif(find_cuda_toolkit() is None, reason="no CUDA toolkit found")
def test_overloaded_export_dispatches_on_argument_count(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_COMPRESS_CUDA_ARCH_LIST", "9.0")
    config.reset()
    try:
        module = jit.load(overload_spec(), arch_list=("9.0",), cache_dir=tmp_path / "cache")
    finally:
        config.reset()
    assert module.scale(3) == 30
    assert module.scale(3, 2) == 6
    assert module.scale(3, None) == 30
    assert module.plain(3) == 4
    with pytest.raises(TypeError, match="expected 1 or 2 but got 0"):
        module.scale()
    with pytest.raises(TypeError, match="expected 1 or 2 but got 3"):
        module.scale(1, 2, 3)
    with pytest.raises(TypeError, match="Mismatched type on argument #1"):
        module.scale(1, "x")
