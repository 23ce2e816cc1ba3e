"""An async op that shutdown() abandoned raises in synchronize() (issue 37.6), as Horovod's
handle map does: before, synchronize returned None and the tensor stayed unreduced."""

from __future__ import annotations

import sys

from mp_runner import REPO, launch, needs_core, run_command


@needs_core
def test_synchronize_after_shutdown_raises_for_an_abandoned_op() -> None:
    worker = REPO / "tests" / "workers" / "abandoned_handle.py"
    out = run_command(launch(2) + [sys.executable, str(worker)], "abandoned handle", timeout=120)
    assert "abandoned ok" in out, out
