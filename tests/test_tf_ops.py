"""Runs the multi-process TensorFlow tests (tests/mp/test_tf_ops.py) at size 1 (directly) and
through the launcher at 2 and 3 ranks, and asserts that every rank passed."""

from __future__ import annotations

import re

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("tensorflow")
pytestmark = needs_core


@pytest.mark.parametrize("np", [1, 2, 3])
def test_tf_multiprocess(np: int) -> None:
    text = run_inner("test_tf_ops.py", np)
    # Only the tests that need peers may skip, and only at size 1: the mismatch tests (eager,
    # tf.function through the kernel and through numpy) and the kernel's timeout.
    skipped = [int(s) for s in re.findall(r"(\d+) skipped", text)]
    assert sum(skipped) == (4 if np == 1 else 0), text
