"""``--output-filename`` that cannot be created is refused before any rank starts, whatever
the launch path (one host, ``-H`` over agents, elastic), with an error naming the directory
(bagua_hvd.runner.job.output_rank_dir). Before, ``-H`` and elastic runs started the job and lost
every rank's output (an elastic run even exited 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "how",
    [
        ["-np", "1"],
        ["-np", "2", "-H", "localhost:1,127.0.0.1:1"],
        ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
    ],
    ids=["one-host", "hosts", "elastic"],
)
def test_output_filename_that_cannot_be_created_is_refused(tmp_path, how):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    marker = tmp_path / "ran"
    worker = [sys.executable, "-c", f"open({str(marker)!r}, 'a').close(); print('hello')"]
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", *how,
           "--output-filename", str(blocker / "out"), *worker]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env
    )
    assert proc.returncode != 0, proc.stderr
    assert f"cannot write --output-filename files in {blocker / 'out'}" in proc.stderr, proc.stderr
    assert not marker.exists()  # refused before any rank started
