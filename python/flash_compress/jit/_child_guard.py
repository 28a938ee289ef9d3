"""Runs a build command so that it does not outlive the process that started it (Linux).

    python -I -S _child_guard.py PARENT_PID COMMAND [ARGS...]

``build.py`` starts nvcc through this script, run as a file (it imports nothing of the
package, so it starts in milliseconds). It asks the kernel for SIGTERM when the thread that
started it ends (``PR_SET_PDEATHSIG``: set here, after the fork, rather than in a
``preexec_fn``, which is unsafe in a process with threads such as ``prebuild --jobs``), then
runs COMMAND as the leader of its own process group. On SIGTERM, SIGINT or SIGHUP it kills
that whole group (nvcc's cicc and ptxas included) and exits; so a builder killed with SIGKILL
leaves no compiler running. Its output is COMMAND's, and its exit status COMMAND's (128 + N
where a signal N ended it; 127, with a line saying why, where COMMAND cannot be started).
"""

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
_STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    # Where the kernel refuses (a sandbox that filters prctl), the build runs all the same, unguarded.
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != parent:
        return 128 + signal.SIGTERM  # the parent was gone before the request took effect
    started: list[subprocess.Popen] = []
    caught: list[int] = []

    def stop(signum: int) -> None:
        for child in started:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # Not child.wait(): the handler may have interrupted that very call, whose lock it holds.
            try:
                os.waitpid(child.pid, 0)
            except ChildProcessError:
                pass
        os._exit(128 + signum)

    def on_signal(signum: int, _frame: object) -> None:
        caught.append(signum)
        if started:  # else the command is being started: stopped right after
            stop(signum)

    for stopping in _STOPPING_SIGNALS:
        signal.signal(stopping, on_signal)
    try:
        child = subprocess.Popen(command, start_new_session=True)
    except OSError as exc:
        print(f"could not run {command[0]}: {exc}", file=sys.stderr, flush=True)
        return 127
    started.append(child)
    if caught:
        stop(caught[0])
    status = child.wait()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
