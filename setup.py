"""Packaging hook: wheels and sdists carry the kernel sources the JIT compiles at run time.

Everything else about the package is declared in pyproject.toml. A built wheel gets
the repository's ``csrc/`` and ``include/`` as ``flash_compress/data/csrc`` and
``flash_compress/data/include`` (``flash_compress._paths.source_roots`` finds them
there); an sdist carries them at its root so that a wheel built from it gets them
too. An editable install needs no copy: it compiles from the checkout itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
SOURCE_DIRS = ("csrc", "include")


def _copy_sources(dest: Path) -> None:
    for name in SOURCE_DIRS:
        source = ROOT / name
        if not source.is_dir():
            raise FileNotFoundError(f"setup.py: {source} is missing; the package cannot be built without it")
        target = dest / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".*", "__pycache__"))


class BuildPyWithSources(build_py):
    """build_py that also copies csrc/ and include/ into the built package's data/ folder."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the editable package reads the checkout's own csrc/ and include/
        _copy_sources(Path(self.build_lib) / "flash_compress" / "data")


class SdistWithSources(sdist):
    """sdist that also ships csrc/ and include/, for a later wheel build from it."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _copy_sources(Path(base_dir))


setup(cmdclass={"build_py": BuildPyWithSources, "sdist": SdistWithSources})
