"""A cross-process signal for test workers: one rank touches a file, another waits for it."""

import sys
import time
from pathlib import Path


def wait_for(path: Path, who: str, what: str, timeout: float = 60.0) -> None:
    """Blocks until ``path`` exists (exits the process with a message after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{who}: {what} did not happen within {timeout:.0f} s")
        time.sleep(0.01)
