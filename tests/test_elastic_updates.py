"""Host updates the elastic driver announces while the workers are still forming a generation
are acted on (bagua_hvd.common.elastic.State.on_reset, the driver's answer's first update).

A real job through ``bagua-run --host-discovery-script`` over "hosts" of this machine
(``localhost``, ``127.0.0.1``, ``127.0.0.2``), running tests/workers/elastic_torch_main.py:
generation 1 is one worker on localhost; after epoch 0 the script adds 127.0.0.1 (update 1,
rank 0 waits for it and resets at the epoch's commit); once the worker of 127.0.0.1 has started
(generation 2 formed, localhost's worker waiting for it in the rendezvous), the script changes
the hosts again (update 2), and that worker starts its training only once update 2 is
published (tests/workers/elastic_late_joiner.py). Update 2 must take effect at the first commit
of epoch 1, in both of the issue's cases: 127.0.0.1 removed again, and a third host added one
poll later.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_elastic import _check, _explain, _replay

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "tests" / "workers" / "elastic_torch_main.py"
JOINER = ROOT / "tests" / "workers" / "elastic_late_joiner.py"


def _script(tmp: Path, final_hosts: list) -> Path:
    final = "\n".join(f"    echo {h}" for h in final_hosts)
    script = tmp / "discover.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'cd "{tmp}"\n'
        "if [ -f 127.0.0.1.started ]; then\n"
        f"{final}\n"
        "elif [ -s log.jsonl ]; then\n"
        "    echo localhost:1; echo 127.0.0.1:1\n"
        "else\n"
        "    echo localhost:1\n"
        "fi\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    "final_hosts, final_size",
    [
        (["localhost:1"], 1),  # added for one poll, then removed
        (["localhost:1", "127.0.0.1:1", "127.0.0.2:1"], 3),  # two hosts added one poll apart
    ],
    ids=["added-then-removed", "added-twice"],
)
def test_update_published_while_a_generation_forms_is_not_lost(tmp_path, final_hosts, final_size):
    logfile = tmp_path / "log.jsonl"
    # The worker's schedule only makes rank 0 wait after epoch 0 for update 1.
    schedule = '[[0, ["localhost:1"]], [null, ["localhost:1", "127.0.0.1:1"]]]'
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "1", "--min-np", "1",
           "--max-np", "4", "--host-discovery-script", str(_script(tmp_path, final_hosts)),
           sys.executable, str(JOINER), "127.0.0.1",
           sys.executable, str(MAIN), "--logfile", str(logfile), "--epochs", "3",
           "--discovery-schedule", schedule, "--discovery-wait", "60"]  # fmt: skip
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="20", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=env
    )
    assert proc.returncode == 0, _explain(proc)
    lines = [json.loads(x) for x in logfile.read_text().splitlines() if x.strip()]
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=1, hostname="localhost", rendezvous=1)
    # Epoch 1: batch 0 at size 2 (generation 2), then update 2 interrupts its first commit.
    _check(lines[1], 1, start_rank=0, size=final_size, hostname="localhost", rendezvous=3)
    assert lines[1]["sizes"] == [2] + [final_size] * 9, _explain(proc)
    _check(lines[2], 2, start_rank=0, size=final_size, hostname="localhost", rendezvous=3)
    _replay(lines)
    # A normal run: the store's end logs nothing (the workers' update readers were cut off).
    assert "rendezvous store" not in proc.stderr, _explain(proc)
