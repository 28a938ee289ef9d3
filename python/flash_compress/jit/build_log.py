"""Reading a ninja/nvcc build log: the command that failed and the compiler's first errors."""

from __future__ import annotations

import re

__all__ = ["failed_command", "first_errors"]

# nvcc:  file.cu(12): error: ...      gcc: file.cc:12:5: error: ...      nvcc fatal   : ...
_ERROR = re.compile(r"\berror\b|\bfatal\b|undefined reference", re.IGNORECASE)
# Lines that say a build failed without saying why.
_NOISE = re.compile(r"^(FAILED:|ninja: |\d+ errors? detected in the compilation)")


def first_errors(log: str, limit: int = 20, context: int = 2) -> tuple[str, ...]:
    """The first error lines of ``log``, each with up to ``context`` following lines, at most ``limit`` lines.

    nvcc and gcc print the offending source line and a caret under an error, so a
    couple of following lines is what makes one readable. With no error line at
    all, the log's last lines are the best clue.
    """
    lines = log.splitlines()
    picked: list[int] = []
    for index, line in enumerate(lines):
        if _NOISE.match(line.strip()) or not _ERROR.search(line):
            continue
        for j in range(index, min(index + 1 + context, len(lines))):
            if j not in picked and not _NOISE.match(lines[j].strip()):
                picked.append(j)
        if len(picked) >= limit:
            break
    if not picked:
        tail = [line for line in lines if line.strip()][-limit:]
        return tuple(tail)
    return tuple(lines[j].rstrip() for j in picked[:limit])


def failed_command(log: str) -> str | None:
    """The command ninja reported as failed (the line after ``FAILED: <target>``), if any."""
    lines = log.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("FAILED:") and index + 1 < len(lines):
            return lines[index + 1].strip()
    return None
