"""The job id of a multi-node launch is not derived from the secret (issue 37.6): it travels in
cleartext in every peer HELLO, and a hash of the secret there let a weak secret be tested
offline. Node 0 makes one up and the other nodes read it from its store once authenticated."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "job_id.py"
SECRET = "5a" * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_job_ids(port: int, timeout: float = 120) -> set:
    """Runs the worker as 4 ranks, two launchers (nodes) of 2, with SECRET and the rendezvous
    on ``port``; returns the job ids the ranks saw."""
    env = dict(os.environ, BAGUA_HVD_SECRET=SECRET, HOROVOD_GLOO_TIMEOUT_SECONDS="30")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    common = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "4", "--num-nodes", "2",
              "--rendezvous-addr", f"127.0.0.1:{port}"]  # fmt: skip
    nodes = [
        subprocess.Popen(
            common + ["--node-rank", str(i), sys.executable, str(WORKER)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail(f"the two-node job did not finish in {timeout:g} s")
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in nodes), text
    seen = dict(re.findall(r"rank (\d) job (\S+)", text))
    assert sorted(seen) == ["0", "1", "2", "3"], text
    return set(seen.values())


def test_multinode_job_id_is_shared_and_not_a_function_of_the_secret() -> None:
    pytest.importorskip("torch")
    port = _free_port()
    first = _two_node_job_ids(port)
    second = _two_node_job_ids(port)  # same secret, same rendezvous address
    assert len(first) == 1 and len(second) == 1, (first, second)  # every rank agrees
    assert first != second, f"two launches with the same secret got the same job id {first}"
    assert SECRET not in next(iter(first))
