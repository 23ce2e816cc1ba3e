"""hvd.communication_stats() in every frontend (one rank). The bytes counted on 2 simulated hosts
x 2 ranks, against the collectives' formulas: tests/test_multinode.py
(test_communication_stats_on_two_hosts)."""

from __future__ import annotations

import sys

import pytest
from mp_runner import needs_core, run_command

pytestmark = needs_core


def test_every_frontend_exports_communication_stats() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("tensorflow")
    text = run_command([sys.executable, "tests/workers/communication_stats_frontends.py"],
                       "communication_stats() in every frontend")  # fmt: skip
    assert "frontends OK" in text, text
