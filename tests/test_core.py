"""Runs tests/mp/test_core_negotiation.py at 1, 2 and 3 ranks with a wide fusion window, a small
fusion threshold and a tiny response cache."""

from __future__ import annotations

import re
import sys

import pytest
from mp_runner import run_command

TUNING = {
    "HOROVOD_CYCLE_TIME": "100",
    "HOROVOD_FUSION_THRESHOLD": "4096",
    "HOROVOD_CACHE_CAPACITY": "4",
}


@pytest.mark.parametrize("np", [1, 2, 3])
def test_core_negotiation(np: int, monkeypatch) -> None:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "tests/mp/test_core_negotiation.py"]
    launch = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np)]
    # The BAGUA_HVD_ aliases: the runner strips inherited HOROVOD_ variables, and the aliases
    # must work too.
    for k, v in TUNING.items():
        monkeypatch.setenv(k.replace("HOROVOD_", "BAGUA_HVD_"), v)
    text = run_command(launch + cmd if np > 1 else cmd, f"core negotiation at {np} ranks")
    passed = re.findall(r"(\d+) passed", text)
    assert len(passed) == np and all(int(p) > 0 for p in passed), text
