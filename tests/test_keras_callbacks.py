"""Runs the multi-process Keras callbacks / SyncBatchNormalization / TF1 DistributedOptimizer
tests (tests/mp/test_keras_callbacks.py): the whole file at 2 ranks, and the
SyncBatchNormalization tests at 3 ranks (odd size, three different per-rank batch sizes).
Asserts that every rank passed and nothing was skipped."""

from __future__ import annotations

import re
import sys

import pytest
from mp_runner import needs_core, run_command, run_inner

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytestmark = needs_core

INNER = "test_keras_callbacks.py"


def test_keras_callbacks_2_ranks() -> None:
    text = run_inner(INNER, 2)
    assert not re.search(r"\d+ skipped", text), text


def test_sync_batch_norm_3_ranks() -> None:
    cmd = [
        sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "3",
        sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
        "-k", "sync_batch_norm", f"tests/mp/{INNER}",
    ]  # fmt: skip
    text = run_command(cmd, f"{INNER} -k sync_batch_norm at 3 ranks")
    passed = [int(p) for p in re.findall(r"(\d+) passed", text)]
    assert passed == [6, 6, 6], text  # 4 parametrized + masked + fused/model.fit per rank
    assert not re.search(r"\d+ (failed|error|skipped)", text), text
