"""The online c128 compressor's build specs: sources, template values, exports.

Two variant families: the kernels, per ``(head_dim, use_pdl, state_dtype)``, and
the prefill planner, per ``use_pdl`` alone (it depends on neither head_dim nor the
state dtype). The kernel variants carry the planner's exports too, so that one
module has every function of ``docs/SPEC.md`` sections 3, 9 and 10.
"""

from __future__ import annotations

from typing import Any

from . import jit
from ._paths import source_roots

__all__ = ["HEAD_DIMS_TESTED", "MIN_ARCH", "STATE_DTYPES", "check_arch_list", "is_supported_head_dim",
           "load_module", "load_planner", "planner_spec", "resolve_use_pdl", "spec"]

#: head_dim values the GPU tests run and ``prebuild`` builds by default (any
#: :func:`is_supported_head_dim` value builds).
HEAD_DIMS_TESTED = (128, 256, 512)

#: State dtypes (docs/SPEC.md section 8) -> the C++ element type and the variant-name tag.
#: The names are torch's and numpy's dtype names; the other modules derive their maps from this one.
STATE_DTYPES = {"float32": ("float", "f32"), "bfloat16": ("device::bf16_t", "bf16")}


def is_supported_head_dim(head_dim: int) -> bool:
    """Whether the kernels build for ``head_dim``: a multiple of 64 in [64, 1024] (C++:
    ``kSupportedHeadDim`` in ``c128_state.cuh``)."""
    return 64 <= head_dim <= 1024 and head_dim % 64 == 0

_CUDA_FLAGS = ("-std=c++20", "-O3", "--expt-relaxed-constexpr", "-lineinfo")

#: The kernel exports of ``csrc/deepseek_v4/c128_online.cuh``'s ``C128Online``, in docs/SPEC.md's order.
_KERNEL_EXPORTS = ("run_decode", "run_prefill", "run_prefill_compact", "run_verify", "run_commit")


def _check_head_dim(head_dim: int) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim: expected an int, got {type(head_dim).__name__}")
    if not is_supported_head_dim(head_dim):
        raise ValueError(f"head_dim: expected a multiple of 64 in [64, 1024], got {head_dim}")


def _check_state_dtype(state_dtype: str) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype: expected one of {', '.join(map(repr, STATE_DTYPES))}, got {state_dtype!r}")


#: The oldest arch the kernels build for: the prefill streams tokens through cp.async (sm_80).
MIN_ARCH = 8.0


def _arch_number(arch: str) -> float:
    return float(arch.rstrip("af"))


def check_arch_list(arch_list: tuple[str, ...]) -> None:
    """ValueError unless every target arch is sm_80 or newer (``MIN_ARCH``)."""
    too_old = [arch for arch in arch_list if _arch_number(arch) < MIN_ARCH]
    if too_old:
        raise ValueError(f"arch_list: the kernels need sm_80 or newer (cp.async), got {' '.join(arch_list)}; "
                         f"drop {' '.join(too_old)} from the arch list (prebuild --arch, FLASH_COMPRESS_CUDA_ARCH_LIST "
                         "or jit.config.arch_list)")


def resolve_use_pdl(use_pdl: bool | None, arch_list: tuple[str, ...]) -> bool:
    """``None`` means on when every target arch is sm_90 or newer (PDL needs it)."""
    if use_pdl is not None and (isinstance(use_pdl, str) or use_pdl not in (True, False)):  # "false" is truthy
        raise TypeError(f"use_pdl: expected True, False or None, got {use_pdl!r}")
    oldest = min(_arch_number(arch) for arch in arch_list)
    if use_pdl is None:
        return oldest >= 9.0
    if use_pdl and oldest < 9.0:
        raise ValueError(f"use_pdl: PDL needs sm_90 or newer, but the target archs are {' '.join(arch_list)}")
    return bool(use_pdl)


def _planner_exports(use_pdl: bool) -> dict[str, str]:
    planner = f"flash_compress::c128::C128Planner<{str(use_pdl).lower()}>"
    # Two signatures, two names: the 6-argument form adds the device-side `counts` output.
    return {"plan_online_prefill": f"{planner}::plan", "plan_online_prefill_counted": f"{planner}::plan_counted"}


def spec(head_dim: int, use_pdl: bool, state_dtype: str = "float32") -> jit.JitSpec:
    """The build of one ``(head_dim, use_pdl, state_dtype)`` kernel variant."""
    _check_head_dim(head_dim)
    _check_state_dtype(state_dtype)
    cxx_state, tag = STATE_DTYPES[state_dtype]
    exports = f"flash_compress::c128::C128Online<{head_dim}, {str(use_pdl).lower()}, {cxx_state}>"
    return jit.JitSpec(
        name=f"c128_online_hd{head_dim}_pdl{int(use_pdl)}_{tag}",
        headers=("deepseek_v4/c128_online.cuh",),
        exports={**{name: f"{exports}::{name}" for name in _KERNEL_EXPORTS}, **_planner_exports(use_pdl)},
        include_dirs=source_roots(),
        extra_cuda_cflags=_CUDA_FLAGS,
        prebuild_options=("--head-dim", str(head_dim), "--pdl", str(int(use_pdl)), "--state-dtype", state_dtype),
    )


def planner_spec(use_pdl: bool) -> jit.JitSpec:
    """The build of the prefill planner alone."""
    return jit.JitSpec(
        name=f"c128_planner_pdl{int(use_pdl)}",
        headers=("deepseek_v4/c128_plan.cuh",),
        exports=_planner_exports(use_pdl),
        include_dirs=source_roots(),
        extra_cuda_cflags=_CUDA_FLAGS,
        prebuild_options=("--planner-only", "--pdl", str(int(use_pdl))),
    )


def load_module(head_dim: int = 512, use_pdl: bool | None = None, state_dtype: str = "float32") -> Any:
    """Compile (on first use) and load the online c128 compressor for ``head_dim``.

    Returns the tvm-ffi module with ``run_decode``, ``run_prefill``,
    ``run_prefill_compact``, ``run_verify``, ``run_commit``, ``plan_online_prefill`` and
    ``plan_online_prefill_counted``, which take DLPack tensors as ``docs/SPEC.md``
    sections 3, 9 and 10 describe; its
    kernels take a ``kv_score_buffer`` of ``state_dtype`` (``"float32"`` or
    ``"bfloat16"``, section 8) and refuse any other. ``use_pdl=None`` enables
    programmatic dependent launch when every target arch is sm_90 or newer. Builds
    are cached per variant; see :mod:`flash_compress.jit` for the cache and its settings.
    """
    _check_head_dim(head_dim)
    _check_state_dtype(state_dtype)
    arch_list = jit.cuda_arch_list()
    check_arch_list(arch_list)
    return jit.load(spec(head_dim, resolve_use_pdl(use_pdl, arch_list), state_dtype), arch_list=arch_list)


def load_planner(use_pdl: bool | None = None) -> Any:
    """Compile (on first use) and load the prefill planner alone: ``plan_online_prefill`` and
    ``plan_online_prefill_counted`` (host lengths plan on the CPU, CUDA lengths on the GPU)."""
    arch_list = jit.cuda_arch_list()
    return jit.load(planner_spec(resolve_use_pdl(use_pdl, arch_list)), arch_list=arch_list)
