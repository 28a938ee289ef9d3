"""The online c128 compressor's kernel spec: sources, template values, exports."""

from __future__ import annotations

from . import jit
from ._paths import source_roots

__all__ = ["HEAD_DIMS_TESTED", "load_module", "resolve_use_pdl", "spec"]

#: head_dim values the test suite runs; any multiple of 64 in [64, 1024] builds.
HEAD_DIMS_TESTED = (128, 256, 512)

_HEADER = "deepseek_v4/c128_online.cuh"
_CLASS = "flash_compress::c128::C128Online<{head_dim}, {use_pdl}>"
_PLANNER = "flash_compress::c128::C128Planner<{use_pdl}>"
_CUDA_FLAGS = ("-std=c++20", "-O3", "--expt-relaxed-constexpr", "-lineinfo")


def _check_head_dim(head_dim: int) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim: expected an int, got {type(head_dim).__name__}")
    if not (64 <= head_dim <= 1024 and head_dim % 64 == 0):
        raise ValueError(f"head_dim: expected a multiple of 64 in [64, 1024], got {head_dim}")


def resolve_use_pdl(use_pdl: bool | None, arch_list: tuple[str, ...]) -> bool:
    """``None`` means on when every target arch is sm_90 or newer (PDL needs it)."""
    oldest = min(float(arch.rstrip("af")) for arch in arch_list)
    if use_pdl is None:
        return oldest >= 9.0
    if use_pdl and oldest < 9.0:
        raise ValueError(f"use_pdl: PDL needs sm_90 or newer, but the target archs are {' '.join(arch_list)}")
    return bool(use_pdl)


def spec(head_dim: int, use_pdl: bool) -> jit.JitSpec:
    """The build of one ``(head_dim, use_pdl)`` variant."""
    _check_head_dim(head_dim)
    pdl = "true" if use_pdl else "false"
    cls = _CLASS.format(head_dim=head_dim, use_pdl=pdl)
    planner = _PLANNER.format(use_pdl=pdl)
    return jit.JitSpec(
        name=f"c128_online_hd{head_dim}_pdl{int(use_pdl)}",
        headers=(_HEADER,),
        exports={
            "run_decode": f"{cls}::run_decode",
            "run_prefill": f"{cls}::run_prefill",
            # 5 arguments (SPEC.md section 3) or 6 (a trailing `counts`, for CUDA lengths).
            "plan_online_prefill": (f"{planner}::plan", f"{planner}::plan_counted"),
        },
        include_dirs=source_roots(),
        extra_cuda_cflags=_CUDA_FLAGS,
    )


def load_module(head_dim: int = 512, use_pdl: bool | None = None):  # -> tvm_ffi.Module
    """Compile (on first use) and load the online c128 compressor for ``head_dim``.

    Returns the tvm-ffi module with ``run_decode``, ``run_prefill`` and
    ``plan_online_prefill``, which take DLPack tensors as ``SPEC.md`` section 3
    describes; given CUDA lengths, the planner plans on the GPU and takes an
    optional 6th argument ``counts`` (see ``docs/GPU_PLANNER.md``).
    ``use_pdl=None`` enables programmatic dependent launch when every target
    arch is sm_90 or newer. Builds are cached per variant; see
    :mod:`flash_compress.jit` for the cache and its environment variables.
    """
    _check_head_dim(head_dim)
    arch_list = jit.cuda_arch_list()
    return jit.load(spec(head_dim, resolve_use_pdl(use_pdl, arch_list)), arch_list=arch_list)
