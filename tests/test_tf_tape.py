"""Runs the multi-process DistributedGradientTape tests (tests/mp/test_tf_tape.py) through the
launcher at 3 ranks, and asserts that every rank passed (size 1, where the tape is TensorFlow's
own, is tested by test_tf_ops.py's size-1 run and the examples)."""

from __future__ import annotations

import re

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("tensorflow")
pytestmark = needs_core


@pytest.mark.parametrize("np", [3])
def test_tf_tape_multiprocess(np: int) -> None:
    text = run_inner("test_tf_tape.py", np)
    assert not re.search(r"\d+ skipped", text), text
