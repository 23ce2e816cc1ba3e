"""Runs the multi-process Keras tests (tests/mp/test_keras.py): all of them at 2 ranks through
the launcher, and the ones whose size-1 behaviour differs (no communication at all) at size 1;
asserts that every rank passed."""

from __future__ import annotations

import re
import sys

import pytest
from mp_runner import needs_core, run_command, run_inner

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytestmark = needs_core

SIZE1 = "exports or errors or wrapped or fit_matches or agg_helper or partial or load_model"


def test_keras_size_1() -> None:
    cmd = [
        sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
        "tests/mp/test_keras.py", "-k", SIZE1,
    ]  # fmt: skip
    text = run_command(cmd, "test_keras.py at size 1")
    passed = re.findall(r"(\d+) passed", text)
    assert len(passed) == 1 and int(passed[0]) >= 8, text
    assert not re.search(r"\d+ (failed|error|skipped)", text), text


def test_keras_2_ranks() -> None:
    text = run_inner("test_keras.py", 2)
    assert not re.search(r"\d+ skipped", text), text
