"""algorithm="auto": the multi-process tests of tests/mp/test_torch_auto.py and
tests/mp/test_tf_auto.py at 2 and 3 ranks, and ``bagua-run --algorithm auto``."""

from __future__ import annotations

import sys

import pytest
from mp_runner import launch, needs_core, run_command, run_inner

pytestmark = needs_core


@pytest.mark.parametrize("np", [2, 3])
def test_torch_auto(np: int) -> None:
    pytest.importorskip("torch")
    run_inner("test_torch_auto.py", np)


@pytest.mark.parametrize("np", [2, 3])
def test_tf_auto(np: int) -> None:
    pytest.importorskip("tensorflow")
    run_inner("test_tf_auto.py", np)


def test_bagua_run_algorithm_auto() -> None:
    """bagua-run --algorithm auto (BAGUA_HVD_ALGORITHM=auto): ByteGrad made slow, so every
    rank keeps GradientAllReduce from step 18; rank 0 prints the table once."""
    pytest.importorskip("torch")
    out = run_command(
        launch(2) + ["--algorithm", "auto", sys.executable, "tests/workers/auto_algorithm.py"],
        "bagua-run --algorithm auto",
        timeout=120,
        BAGUA_HVD_TEST_ALGORITHM_DELAY="ByteGrad:0.1",
    )
    for r in range(2):
        assert f"rank {r} chose GradientAllReduce at 18" in out, out
    assert out.count("bagua_hvd auto: chose GradientAllReduce from step 18") == 1, out
    assert "ByteGrad" in out and "step (ms)" in out, out
