"""A discovered host whose worker cannot start does not stall the others for the rendezvous
timeout (bagua_hvd.runner.elastic.driver: ElasticDriver._release_rendezvous).

A real job through ``bagua-run --host-discovery-script``: one worker on localhost; after epoch 0
the script adds ``bogus-host.invalid`` (ssh cannot even resolve it). localhost's worker resets
into a generation of 2 and waits in the core's rendezvous for rank 1, which never comes. The
driver sees that worker's agent fail at once; the survivor must go on at size 1 well within
the core's rendezvous timeout (120 s here; it waited for all of it before).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_elastic import _check, _explain, _replay

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "tests" / "workers" / "elastic_torch_main.py"


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs an ssh client")
def test_unreachable_host_is_dropped_without_waiting_for_the_rendezvous_timeout(tmp_path):
    logfile = tmp_path / "log.jsonl"
    script = tmp_path / "discover.sh"
    script.write_text(
        f'#!/bin/sh\nif [ -s "{logfile}" ]; then echo bogus-host.invalid:1; fi\necho localhost:1\n'
    )
    script.chmod(0o755)
    # The worker's schedule only makes rank 0 wait after epoch 0 for the update.
    schedule = '[[0, ["localhost:1"]], [null, ["localhost:1", "bogus-host.invalid:1"]]]'
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "1", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", str(script),
           sys.executable, str(MAIN), "--logfile", str(logfile), "--epochs", "3",
           "--discovery-schedule", schedule]  # fmt: skip
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="120", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=80, cwd=str(tmp_path), env=env
    )
    assert proc.returncode == 0, _explain(proc)
    lines = [json.loads(x) for x in logfile.read_text().splitlines() if x.strip()]
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=1, hostname="localhost", rendezvous=1)
    # The reset into the generation with the bogus host failed; the next one went on alone.
    _check(lines[1], 1, start_rank=0, size=1, hostname="localhost", rendezvous=2)
    _check(lines[2], 2, start_rank=0, size=1, hostname="localhost", rendezvous=2)
    assert "never joined generation 2" in proc.stderr, _explain(proc)
    _replay(lines)
