"""The supervisor of one rank: ties the rank's life to its launcher's.

``python -I -S guard.py WATCH_FD STATUS_FD GRACE_S COMMAND...`` is what the launcher starts for
each rank (bagua_hvd.runner.job), as the leader of a new session and process group. It runs
COMMAND in that group and exits as the rank did (same code, or killed by the same signal), so
the launcher sees the rank's status through it.

WATCH_FD is the read end of a pipe whose write end only the launcher holds: it reaches end of file
when the launcher exits, however it exits (the kernel closes the descriptors of a process killed
with SIGKILL too). The guard then sends SIGTERM to its process group (the rank and whatever the
rank started in it), and SIGKILL GRACE_S seconds later to those still there. Unlike
PR_SET_PDEATHSIG this does not depend on which thread of the launcher started the rank, reaches
the rank's children, and survives a set-user-ID exec; and nothing is killed while the launcher
lives. Horovod's launcher takes its ranks down the same way (a middleman per rank that watches a
pipe from the launcher).

STATUS_FD receives one line once COMMAND is started, ``ok PID``, or when it cannot be, ``error
ERRNO MESSAGE`` (the guard then exits 127 or 126, as a shell would), so that the launcher reports
a bad command as it would without a guard.

Only the standard library is used, and ``-I -S`` keeps start-up short: this is one more process
per rank.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import List, NoReturn

# Signals the launcher sends to the whole group: the rank acts on them, the guard outlives the
# rank to report its status (a Python handler, unlike SIG_IGN, is not inherited across exec).
_DEFERRED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_S = 0.05


def _ignore(signum: int, frame: object) -> None:
    pass


def _write(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    except OSError:
        pass  # the launcher is gone: nobody to tell


def _stop_group(proc: subprocess.Popen, grace_s: float) -> NoReturn:
    """The launcher is gone: SIGTERM to the group, SIGKILL to what is left after grace_s."""
    try:
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    finally:
        os.killpg(0, signal.SIGKILL)  # this guard included: nobody is left to report to
    os._exit(137)  # not reached


def _watch(watch_fd: int, proc: subprocess.Popen, grace_s: float) -> None:
    while True:
        try:
            if not os.read(watch_fd, 64):
                break  # end of file: the launcher exited
        except InterruptedError:
            continue
        except OSError:
            break
    _stop_group(proc, grace_s)


def _exit_like(returncode: int) -> NoReturn:
    """Exits with the rank's status: its exit code, or death by the same signal."""
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank dumped core, if anyone
    except (OSError, ValueError):
        pass
    try:
        signal.signal(sig, signal.SIG_DFL)  # not allowed for SIGKILL/SIGSTOP: default anyway
    except (OSError, ValueError):
        pass
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):
        pass
    time.sleep(1)  # a signal that does not end a process (none reported by wait), just in case
    os._exit(128 + sig)


def main(argv: List[str]) -> NoReturn:
    """Runs the rank (see the module docstring); never returns."""
    watch_fd, status_fd, grace_s = int(argv[0]), int(argv[1]), float(argv[2])
    command = argv[3:]
    for sig in _DEFERRED:
        signal.signal(sig, _ignore)
    try:
        proc = subprocess.Popen(command)  # close_fds: the rank inherits neither pipe
    except OSError as e:
        code = e.errno if e.errno is not None else errno.EIO
        _write(status_fd, f"error {code} {e.strerror or e}\n")
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    _write(status_fd, f"ok {proc.pid}\n")
    os.close(status_fd)
    threading.Thread(target=_watch, args=(watch_fd, proc, grace_s), daemon=True).start()
    while True:
        try:
            returncode = proc.wait()
            break
        except InterruptedError:
            continue
    _exit_like(returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
