"""Print the SASS that one build variant's kernels compile to, on the CPU (no GPU needed).

    python scripts/kernel_sass.py --head-dim 1024 --state-dtype bfloat16 \\
        --kernel 'prefill_kernelILl1024ELj32ELb1' [--source CHECKOUT] [--arch 90] [--list]

The variant's translation unit is compiled with the loader's own flags (``spec(head_dim,
use_pdl, state_dtype)``) to a cubin (``nvcc -cubin``), then disassembled (``nvdisasm -c``).
Every function whose mangled name matches ``--kernel`` (a regular expression) is printed. For
example, ``prefill_kernelILl1024ELj32ELb1`` is head_dim 1024's prefill kernel with 32-channel
slices in its write pass, and ``verify_kernelILl512ELb1E13__nv_bfloat16`` is head_dim 512's
bfloat16 verify. ``--list`` names the functions and prints nothing else. ``--source`` builds
another checkout's ``csrc/`` and ``include/`` instead of the tree's, for instance an experiment
of docs/experiments/ applied as its README says. This is how PERF_LOG.md's "in the SASS"
readings are made.

nvdisasm comes with a full CUDA toolkit. It is looked for beside nvcc, in ``$CUDA_HOME/bin``, on
``PATH``, and in NVIDIA's ``nvidia-cuda-nvdisasm`` wheel (``pip install nvidia-cuda-nvdisasm``,
part of the ``test`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "scripts")]
from flash_compress.c128_online import spec  # noqa: E402
from flash_compress.jit.build import compile_flags  # noqa: E402
from flash_compress.jit.toolchain import find_nvcc  # noqa: E402
from make_variant import checkout_include_dirs, is_checkout  # noqa: E402

#: Where nvdisasm's listing starts each function's code section.
_FUNCTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+),.*$", re.MULTILINE)


def find_nvdisasm(nvcc: Path | None) -> Path | None:
    """nvdisasm beside ``nvcc``, in ``$CUDA_HOME/bin``, on ``PATH``, or in the ``nvidia-cuda-nvdisasm`` wheel."""
    places = [nvcc.resolve().parent] if nvcc else []
    places += [Path(os.environ[var]) / "bin" for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    for place in places:
        if (place / "nvdisasm").is_file() and os.access(place / "nvdisasm", os.X_OK):
            return place / "nvdisasm"
    if on_path := shutil.which("nvdisasm"):
        return Path(on_path)
    nvidia = importlib.util.find_spec("nvidia")  # the namespace package NVIDIA's wheels install into
    for package_dir in (nvidia.submodule_search_locations or []) if nvidia else []:
        for found in sorted(Path(package_dir).glob("*/bin/nvdisasm")):
            if os.access(found, os.X_OK):
                return found
    return None


def functions(sass: str) -> dict[str, str]:
    """nvdisasm's listing split per function: mangled name -> its code (without the next one's banner)."""
    starts = list(_FUNCTION.finditer(sass))
    bodies = {}
    for match, following in zip(starts, [*starts[1:], None]):
        lines = sass[match.end():following.start() if following else len(sass)].strip("\n").splitlines()
        while lines and lines[-1].lstrip().startswith("//"):
            lines.pop()
        bodies[match.group(1)] = "\n".join(lines)
    return bodies


def variant_sass(head_dim: int, use_pdl: bool, state_dtype: str, arch: str, source: Path | None,
                 nvcc: Path, nvdisasm: Path) -> dict[str, str]:
    """Every function of the variant's cubin for ``sm_{arch}``, built from ``source``'s csrc/ and include/
    (the tree's when ``None``) with the loader's flags."""
    variant = spec(head_dim, use_pdl, state_dtype)
    if source is not None:
        variant = dataclasses.replace(variant, include_dirs=checkout_include_dirs(source))
    with tempfile.TemporaryDirectory(prefix="flash-compress-sass-") as folder:
        unit, cubin = Path(folder) / "unit.cu", Path(folder) / "unit.cubin"
        unit.write_text(variant.translation_unit())
        build = subprocess.run([str(nvcc), "-cubin", f"-arch=sm_{arch}", *compile_flags(variant), str(unit),
                                "-o", str(cubin)], capture_output=True, text=True)
        if build.returncode:
            raise SystemExit(f"nvcc failed ({build.returncode}):\n{build.stdout}{build.stderr}")
        dump = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True)
        if dump.returncode:
            raise SystemExit(f"nvdisasm failed ({dump.returncode}):\n{dump.stderr}")
    return functions(dump.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--pdl", type=int, choices=(0, 1), default=1)
    parser.add_argument("--arch", default="90", help="the SM to compile for (default 90: Hopper)")
    parser.add_argument("--kernel", default="", help="a regular expression on the mangled name (default: all)")
    parser.add_argument("--source", type=Path, default=None, metavar="CHECKOUT",
                        help="build this checkout's csrc/ and include/ instead of the tree's")
    parser.add_argument("--list", action="store_true", help="only name the matching functions")
    args = parser.parse_args(argv)
    if args.source is not None and not is_checkout(args.source):
        parser.error(f"--source: expected a checkout with csrc/deepseek_v4/ and include/, got {args.source}")
    nvcc = find_nvcc()
    if nvcc is None:
        parser.error("no nvcc found ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH)")
    nvdisasm = find_nvdisasm(nvcc)
    if nvdisasm is None:
        parser.error("no nvdisasm found beside nvcc, in $CUDA_HOME/bin or on PATH; "
                     "`pip install nvidia-cuda-nvdisasm` provides one")
    listing = variant_sass(args.head_dim, bool(args.pdl), args.state_dtype, args.arch, args.source, nvcc, nvdisasm)
    chosen = {name: body for name, body in listing.items() if re.search(args.kernel, name)}
    if not chosen:
        print(f"no function matches {args.kernel!r}; the variant has:\n  " + "\n  ".join(listing), file=sys.stderr)
        return 1
    for name, body in chosen.items():
        print(name if args.list else f"Function : {name}\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
