#!/usr/bin/env python3
"""Prebuild the JIT cache: the same as ``python -m flash_compress prebuild ARGS...``.

Run from a checkout without installing: the repository's ``python/`` is put on the
import path when ``flash_compress`` is not importable.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _main() -> int:
    try:
        import flash_compress  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from flash_compress.__main__ import main

    return main(["prebuild", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(_main())
