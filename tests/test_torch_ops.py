"""Runs the multi-process torch tests (tests/mp/) at size 1 (directly) and through the launcher
at 3 ranks, and asserts that every rank passed. Two ranks are kept where the size changes what
runs: the collectives (an even split; the C++ tests also run the allreduces at 2 to 4 ranks)
and BAGUA's algorithms; the other files use those collectives as they are at 3 ranks."""

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
    "test_torch_adasum.py",
]


# BAGUA's algorithms also at 2 and 4 ranks (shift_one and the ring change shape with n: at 2 a
# rank's only peer is the same every step).
# Scaling runs in the op executor, the same at every size: test_scale_factors.py runs at 3 only.
CASES = [
    (inner, np) for inner in INNER for np in (1, 3) if (inner, np) != ("test_scale_factors.py", 1)
] + [
    ("test_torch_ops.py", 2),
    ("test_torch_algorithms.py", 2),
    ("test_torch_algorithms.py", 4),
    # Adasum's tree has one level at 2 ranks and two at 4 (3: Horovod's error).
    ("test_torch_adasum.py", 2),
    ("test_torch_adasum.py", 4),
]


@pytest.mark.parametrize("inner,np", CASES)
def test_torch_multiprocess(inner: str, np: int) -> None:
    run_inner(inner, np)
