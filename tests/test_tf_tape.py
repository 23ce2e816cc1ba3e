"""Runs the multi-process DistributedGradientTape tests (tests/mp/test_tf_tape.py) at size 1
(directly: the tape is TensorFlow's own there, a branch of its own) and through the launcher at
3 ranks, and asserts that every rank passed."""

from __future__ import annotations

import re

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("tensorflow")
pytestmark = needs_core


@pytest.mark.parametrize("np", [1, 3])
def test_tf_tape_multiprocess(np: int) -> None:
    text = run_inner("test_tf_tape.py", np)
    assert not re.search(r"\d+ skipped", text), text
