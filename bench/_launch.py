"""What the benchmarks share: running a script on N ranks through the launcher, with a bound;
reading a process's own memory figures."""

from __future__ import annotations

import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(np: int, argv: list[str], env: dict, timeout: float) -> int | None:
    """Runs ``argv`` on ``np`` ranks through bagua-run; returns the launcher's exit status, or
    None when it ran past ``timeout`` seconds (the ranks are then stopped)."""
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np), *argv]
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its ranks on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def read_status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
