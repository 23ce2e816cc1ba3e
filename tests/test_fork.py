"""A collective in a process forked after hvd.init() (a DataLoader worker) raises a clear error
at once (issue 37.6); before, it waited forever, whatever the op timeout."""

from __future__ import annotations

import sys

from mp_runner import REPO, launch, needs_core, run_command


@needs_core
def test_collective_in_a_dataloader_worker_raises_and_the_job_goes_on() -> None:
    worker = REPO / "tests" / "workers" / "fork_collective.py"
    out = run_command(launch(2) + [sys.executable, str(worker)], "fork worker", timeout=120)
    for r in range(2):
        assert f"rank {r}: fork ok" in out, out
