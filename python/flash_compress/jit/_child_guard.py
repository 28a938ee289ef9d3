"""Runs a build command so that it does not outlive the process that started it (Linux).

    python -s -S _child_guard.py PARENT_PID COMMAND [ARGS...]

``build.py`` starts nvcc through this script, run as a file (it imports nothing of the
package, so it starts in milliseconds). The command stays in the builder's process group, so
whatever reaches that group (Ctrl-C, a kill of the whole group, a job-control stop) reaches the
compiler as it would without the guard. What the guard adds is for the builder dying alone (a
SIGKILL, the OOM killer): the kernel then sends it a signal of its own (``PR_SET_PDEATHSIG``, set
here, after the fork: in a ``preexec_fn`` it is unsafe in a process with threads, such as
``prebuild --jobs``), and it kills every process below it, nvcc's cicc and ptxas included (as a
child subreaper it inherits those orphaned on the way). SIGTERM, SIGINT and SIGHUP do the same
unless the builder ignores them (``nohup``, a background job), in which case the build does too.
Its output is the command's, and its exit status the command's (128 + N where a signal N ended
it; 127, with a line saying why, where the command cannot be started). Where the kernel refuses
prctl (a sandbox) or ctypes is missing, the command runs unguarded.
"""

import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: The builder's death notice: a signal of its own, so that the ones the builder ignores stay ignored.
_DEATH_NOTICE = signal.SIGRTMIN
_STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(option, value, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        return False


def _state_and_parent(pid: int) -> tuple[str, int]:
    """Process ``pid``'s state letter (``Z`` for a zombie) and its parent, from /proc; OSError if it is gone."""
    with open(f"/proc/{pid}/stat") as stat:
        state, parent = stat.read().rsplit(")", 1)[1].split()[:2]  # after the name, which may hold ")"
    return state, int(parent)


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` that are not zombies, from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state, parent = _state_and_parent(int(entry))
        except OSError:
            continue
        if state != "Z":
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [root]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def _kill_descendants(children: list[subprocess.Popen]) -> None:
    """SIGKILL every process below this one until none is left (at most about 2 s). Each pass reaps
    what became this process's: its child, and as a subreaper the orphans of the ones killed. Without
    a /proc of this PID namespace, only ``children`` (not reaped yet, so their ids are still theirs)."""
    try:
        same_namespace = os.readlink("/proc/self") == str(os.getpid())
    except OSError:  # no /proc
        same_namespace = False
    if not same_namespace:
        for child in children:
            if child.returncode is None:
                os.kill(child.pid, signal.SIGKILL)
        return
    for _ in range(200):
        below = _descendants(os.getpid())
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            pass


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    guarded = _prctl(_PR_SET_PDEATHSIG, _DEATH_NOTICE) and _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if guarded and os.getppid() != parent:  # the builder was gone before the request took effect
        return 128 + _DEATH_NOTICE
    started: list[subprocess.Popen] = []
    caught: list[int] = []

    def stop(signum: int) -> None:
        _kill_descendants(started)
        os._exit(128 + signum)

    def on_signal(signum: int, _frame: object) -> None:
        caught.append(signum)
        if started:  # else the command is being started: stopped right after
            stop(signum)

    for stopping in (_DEATH_NOTICE, *_STOPPING_SIGNALS):
        if signal.getsignal(stopping) is not signal.SIG_IGN:
            signal.signal(stopping, on_signal)
    try:
        child = subprocess.Popen(command)
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
