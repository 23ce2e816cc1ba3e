"""Runs the multi-process tests of BAGUA's algorithms in the TensorFlow frontend
(tests/mp/test_tf_algorithms.py) through the launcher at 2 ranks (the interface, tapes, Keras,
validation: the cases marked up_to_two_ranks) and at 3 (odd sizes matter for shift_one and the
ring), and asserts that every rank passed. Size 1 (no communication: every algorithm is the
local optimizer) is left out to save the TensorFlow start-up."""

from __future__ import annotations

import re

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("tensorflow")
pytest.importorskip("torch")  # the reference (tests/reference_algorithms.py) is torch
pytestmark = needs_core


@pytest.mark.parametrize("np", [2, 3])
def test_tf_algorithms_multiprocess(np: int) -> None:
    text = run_inner("test_tf_algorithms.py", np)
    assert not re.search(r"\d+ skipped", text), text
