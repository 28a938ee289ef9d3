"""A wheel carries csrc/ and include/ as flash_compress/data/, and source_roots() finds them there."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _can_build_wheels_offline() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    # setuptools 70.1 builds wheels by itself; older ones need the wheel package.
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels_offline(), reason="needs setuptools>=70.1 (or wheel) in this environment")
def test_wheel_carries_the_kernel_sources(tmp_path):
    tree = tmp_path / "src"
    # A copy, so that the build's egg-info and build/ folders stay out of the checkout.
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "tests", "data"))
    if not (tree / "README.md").exists():
        (tree / "README.md").write_text("# flash-compress\n")  # pyproject names it; the content is not under test
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
        cwd=tree, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = (tmp_path / "dist").glob("flash_compress-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source_dir in ("csrc", "include"):
        expected = {
            f"flash_compress/data/{source_dir}/{p.relative_to(REPO / source_dir).as_posix()}"
            for p in (REPO / source_dir).rglob("*") if p.is_file() and not p.name.startswith(".")
        }
        assert expected and expected <= names, sorted(expected - names)
    assert "flash_compress/jit/loader.py" in names and "flash_compress/_paths.py" in names

    # Installed from the wheel, source_roots() points into the package, not at any checkout.
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    probe = (
        "import sys, types, importlib.util\n"
        "spec = importlib.util.find_spec('flash_compress')\n"
        "package = types.ModuleType('flash_compress')\n"  # skip __init__: it imports torch
        "package.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['flash_compress'] = package\n"
        "from flash_compress._paths import source_roots\n"
        "print(*source_roots(), sep='\\n')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
    csrc, include = (Path(line) for line in out.stdout.split())
    assert csrc == target / "flash_compress" / "data" / "csrc"
    assert include == target / "flash_compress" / "data" / "include"
