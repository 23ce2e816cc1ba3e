"""A rank killed with SIGKILL while the others are inside an allreduce: the survivors raise an
error naming it within the timeout, and the launcher exits non-zero naming the rank."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "kill_during_allreduce.py"


@pytest.mark.parametrize("np_,transport", [(2, "auto"), (3, "auto"), (3, "tcp")])
def test_sigkill_during_allreduce(np_, transport):
    pytest.importorskip("torch")
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="10", BAGUA_HVD_TRANSPORT=transport)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np_), sys.executable,
         str(WORKER)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Process name: 1" in out, out
    assert "Exit code: 137" in out, out
    survivors = [r for r in range(np_) if r != 1]
    for r in survivors:
        m = re.search(rf"rank {r} caught after ([0-9.]+) s: (.*)", out)
        assert m, f"rank {r} did not raise:\n{out}"
        assert float(m.group(1)) < 10.0, out  # within HOROVOD_GLOO_TIMEOUT_SECONDS
        assert "rank 1" in m.group(2), m.group(2)


RELAY_WORKER = ROOT / "tests" / "workers" / "failure_seen_by_another.py"


@pytest.mark.parametrize("mode", ["stop", "kill"])
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_failure_is_named_on_a_rank_that_waited_on_another(mode, transport):
    """Rank 2 fails inside an allreduce with rank 1 while rank 0 waits for rank 1: rank 1 names
    rank 2 and exits, and rank 0, which sees only rank 1 close or fall silent, names rank 2 too
    (rank 1's failure notice), with who saw it. Every case failed on the core before notices.
    The timeout also bounds the ranks' start-up (sanitized builds in CI): not shorter."""
    pytest.importorskip("torch")
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="5", BAGUA_HVD_TRANSPORT=transport)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "3", sys.executable,
         str(RELAY_WORKER), mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    errors = dict(re.findall(r"rank ([01]) caught after [0-9.]+ s: (.*)", out))
    assert set(errors) == {"0", "1"}, out
    assert re.search(r"\brank 2\b", errors["1"]), errors["1"]
    assert re.search(r"\brank 2\b", errors["0"]), errors["0"]
    # Rank 0 may also see rank 2 itself first ("kill": a keepalive to it fails): then no witness.
    assert errors["0"].endswith("(seen by rank 1)") or "rank 1" not in errors["0"], errors["0"]
