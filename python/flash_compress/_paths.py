"""Where the kernel sources are: inside an installed wheel, or in the source checkout."""

from __future__ import annotations

from pathlib import Path

__all__ = ["source_roots"]

_PACKAGE = Path(__file__).resolve().parent


def source_roots() -> tuple[Path, Path]:
    """The ``(csrc, include)`` directories to compile from.

    A wheel carries them as ``flash_compress/data/{csrc,include}`` (setup.py copies
    them there); an editable install or a plain checkout uses the repository's own
    ``csrc/`` and ``include/``, two levels above the package.

    Raises:
        FileNotFoundError: when neither place has both directories.
    """
    for base in (_PACKAGE / "data", _PACKAGE.parent.parent):
        csrc, include = base / "csrc", base / "include"
        if csrc.is_dir() and include.is_dir():
            return csrc, include
    raise FileNotFoundError(
        f"flash_compress: kernel sources not found in {_PACKAGE / 'data'} (a wheel) "
        f"nor in {_PACKAGE.parent.parent} (a checkout); reinstall the package"
    )
