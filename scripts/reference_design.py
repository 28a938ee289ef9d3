"""Builds the reference design (the upstream contract's seed kernel) for side-by-side benchmarks.

    python scripts/bench.py --reference ../shared/seed/c128_online.cuh.txt

The seed is not part of this project and is never copied into it: it is read
from the path given, lines before its first line of C++ (a provenance label)
are dropped, and the rest is compiled, as ``seed/c128_online.cuh`` in a folder
under the JIT cache, against this project's ``include/sgl_kernel/`` (``docs/SPEC.md``
section 6 names the same interface) with the flags our own kernels get.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from flash_compress import jit  # noqa: E402
from flash_compress._paths import source_roots  # noqa: E402
from flash_compress.c128_online import spec as project_spec  # noqa: E402

__all__ = ["load_reference"]

_CLASS = "FlashCompress128OnlineKernel<{head_dim}, {use_pdl}>"


def _cxx_text(seed_text: str) -> str:
    lines = seed_text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("#", "//", "/*")):
            return "".join(lines[i:])
    raise ValueError("reference seed: no line of C++ found (expected #include or a comment)")


def load_reference(seed_path: str | Path, head_dim: int, use_pdl: bool = True):  # -> tvm_ffi.Module
    """The reference design's module (``run_decode``, ``run_prefill``, ``plan_online_prefill``)."""
    seed_path = Path(seed_path)
    if not seed_path.is_file():
        raise FileNotFoundError(f"--reference: expected the seed kernel file, got {seed_path} (not a file)")
    source_dir = jit.config.cache_dir / "reference-design-src"
    header = source_dir / "seed" / "c128_online.cuh"
    header.parent.mkdir(parents=True, exist_ok=True)
    text = _cxx_text(seed_path.read_text())
    if not header.is_file() or header.read_text() != text:
        header.write_text(text)
    cls = _CLASS.format(head_dim=head_dim, use_pdl="true" if use_pdl else "false")
    ours = project_spec(head_dim, use_pdl)
    spec = jit.JitSpec(
        name=f"reference_design_hd{head_dim}_pdl{int(use_pdl)}",
        headers=("seed/c128_online.cuh",),
        exports={
            "run_decode": f"{cls}::run_decode",
            "run_prefill": f"{cls}::run_prefill",
            "plan_online_prefill": "plan_compress_online_prefill",
        },
        include_dirs=(*source_roots(), source_dir),
        extra_cuda_cflags=ours.extra_cuda_cflags,
    )
    return jit.load(spec)
