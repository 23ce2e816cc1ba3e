"""Runs the multi-process torch tests (tests/mp/) at size 1 (directly) and through the launcher
at 2 and 3 ranks, and asserts that every rank passed."""

from __future__ import annotations

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("torch")
pytestmark = needs_core

INNER = [
    "test_torch_ops.py",
    "test_torch_process_sets.py",
    "test_torch_lifecycle.py",
    "test_torch_functions.py",
    "test_torch_optimizer.py",
    "test_torch_algorithms.py",
    "test_scale_factors.py",
]


# BAGUA's algorithms also at 4 ranks (shift_one and the ring change shape with n).
CASES = [(inner, np) for inner in INNER for np in (1, 2, 3)] + [("test_torch_algorithms.py", 4)]


@pytest.mark.parametrize("inner,np", CASES)
def test_torch_multiprocess(inner: str, np: int) -> None:
    run_inner(inner, np)
