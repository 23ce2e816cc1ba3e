"""One host's share of a job started by ``bagua-run -H``/``--hostfile`` (bagua_hvd.runner.ssh).

``python -m bagua_hvd.runner.agent`` is what the launcher runs on each host, over ssh (or
directly for this machine). It reads the job from the first line of its stdin, as JSON: the
command, this host's slots, the environment (the job's secret among it: never on a command
line) and the working directory. It then runs the ranks with bagua_hvd.runner.job's policy
(guards, prefixed output, failure handling) and exits with the job's code.

Its stdin stays open for the job's life: end of file (the launcher closed it, or ssh's
connection is gone because the launcher died) stops the ranks, as SIGTERM would. On stdout,
besides the ranks' lines, it reports to the launcher on lines that start with ``REPORT``:
``{"exit": [rank, code]}`` as each rank exits, ``{"error": message, "exit_code": n}`` when the
ranks cannot start, and ``{"done": code}`` last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any, Dict, Optional

from bagua_hvd.runner.hosts import Slot
from bagua_hvd.runner.job import OUTPUT, LaunchError, run_job

# Starts a report line; a rank's own lines always start with "[<rank>]<".
REPORT = b"\x1ebagua-run-agent "


def report(message: Dict[str, Any]) -> None:
    OUTPUT.write("stdout", REPORT + json.dumps(message).encode() + b"\n")


def _read_line(fd: int) -> bytes:
    """The first line of ``fd``, read unbuffered (the rest of stdin is the watcher's)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


def _stop_on_eof(fd: int) -> None:
    # Raw reads: a buffered reader held by a daemon thread breaks interpreter shutdown.
    try:
        while os.read(fd, 1 << 16):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # run_job's handler stops every rank


def main() -> int:
    line = _read_line(0)
    if not line.endswith(b"\n"):
        return 0  # the launcher went away before sending the job
    spec = json.loads(line)
    threading.Thread(target=_stop_on_eof, args=(0,), name="agent-stdin", daemon=True).start()
    cwd: Optional[str] = spec.get("cwd")
    if cwd is not None and not os.path.isdir(cwd):
        print(
            f"bagua-run: {spec['host']}: no directory {cwd} here; the ranks start in {os.getcwd()}",
            file=sys.stderr,
            flush=True,
        )
        cwd = None
    slots = [Slot(**s) for s in spec["slots"]]
    try:
        result = run_job(
            spec["command"],
            slots,
            spec["env"],
            verbose=spec.get("verbose", False),
            cwd=cwd,
            on_exit=lambda rank, code: report({"exit": [rank, code]}),
        )
    except LaunchError as e:
        report({"error": f"{spec['host']}: {e}", "exit_code": e.exit_code})
        return e.exit_code
    report({"done": result.exit_code})
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
