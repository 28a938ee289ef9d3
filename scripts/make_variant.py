#!/usr/bin/env python3
"""Makes a kernel checkout from experiment patches, for bench_variants.py and kernel_sass.py.

    python scripts/make_variant.py .variants/ck_ww docs/experiments/wide_write_slices.patch [MORE.patch ...]

Copies the working tree's ``csrc/`` and ``include/`` into the folder (replacing it), then applies
each patch's hunks on those two folders, in the order given; hunks on tests or scripts are left out.
It fails, naming the patch, where a patch does not apply or changes no kernel file: ``git apply``
with an ``--exclude`` that matches everything reports success having changed nothing, and a
benchmark of an unchanged copy reads as a result. Build the folder inside the repository (under
``.variants/``, which ``.git/info/exclude`` ignores) to carry it to the device machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders a kernel checkout holds, in the order a build includes them.
KERNEL_TREES = ("csrc", "include")


def is_checkout(path: Path) -> bool:
    """Whether ``path`` holds a whole kernel source tree (``csrc/deepseek_v4/`` and ``include/``), not kernel files."""
    return (path / "csrc" / "deepseek_v4").is_dir() and (path / "include").is_dir()


def checkout_include_dirs(checkout: Path) -> tuple[Path, ...]:
    """The include paths that build ``checkout``'s sources in place of the tree's."""
    return tuple(checkout / tree for tree in KERNEL_TREES)


def _git_apply(args: list[str], patch: Path, folder: Path) -> subprocess.CompletedProcess:
    # Inside the repository git would read the patch's paths from its top level and skip those
    # outside the folder; the ceiling keeps it from finding the repository at all.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(folder.parent)}
    includes = [f"--include={tree}/*" for tree in KERNEL_TREES]
    return subprocess.run(["git", "apply", *args, *includes, str(patch.resolve())], cwd=folder, env=env,
                          capture_output=True, text=True)


def make_variant(folder: Path, patches: list[Path], root: Path = ROOT) -> dict[Path, list[str]]:
    """``root``'s kernel folders copied to ``folder`` with ``patches`` applied; returns, per patch,
    the kernel files it changed. Raises ValueError naming the patch if one does not apply or
    changes no kernel file."""
    folder = folder.resolve()
    if folder == root.resolve() or root.resolve().is_relative_to(folder):
        raise ValueError(f"folder: expected a new folder for the copy, got {folder}, which holds the tree")
    if folder.exists():
        shutil.rmtree(folder)
    for tree in KERNEL_TREES:
        shutil.copytree(root / tree, folder / tree)
    changed: dict[Path, list[str]] = {}
    for patch in patches:
        listed = _git_apply(["--numstat"], patch, folder)
        files = [line.split("\t")[-1] for line in listed.stdout.splitlines() if line.strip()]
        if listed.returncode == 0 and not files:
            raise ValueError(f"{patch}: changes no file under {' or '.join(KERNEL_TREES)}/")
        applied = _git_apply([], patch, folder)
        if listed.returncode or applied.returncode:
            message = "; ".join((listed.stderr or applied.stderr).strip().splitlines())
            raise ValueError(f"{patch}: does not apply on {folder}: {message}")
        changed[patch] = files
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the checkout to make (replaced if it exists)")
    parser.add_argument("patches", type=Path, nargs="+", metavar="PATCH")
    args = parser.parse_args()
    try:
        changed = make_variant(args.folder, args.patches)
    except ValueError as error:
        print(f"make_variant.py: {error}", file=sys.stderr)
        return 1
    for patch, files in changed.items():
        print(f"{patch}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
