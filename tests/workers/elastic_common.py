"""What the elastic test workers share (imported from beside them: a script's directory is on
its path)."""

from __future__ import annotations

import time
from typing import Any


def wait_for_host_update(state: Any, seconds: float) -> None:
    """Waits until the driver's notification of new hosts reached ``state`` (Horovod's scripts
    do this too), so that the next commit takes the change in; TimeoutError after ``seconds``."""
    state._last_updated_timestamp = 0
    deadline = time.monotonic() + seconds
    while state._host_messages.empty():
        if time.monotonic() > deadline:
            raise TimeoutError("Timed out waiting for notifications from driver.")
        time.sleep(0.05)
