"""Calls before hvd.init() raise Horovod's class for each frontend, chosen by the core's status
code (BHVD_NOT_INITIALIZED), with Horovod's message: ValueError in torch,
tf.errors.FailedPreconditionError in TensorFlow (eagerly, in tf.function, and from the
algorithms' primitives)."""

from __future__ import annotations

import sys

import pytest
from mp_runner import needs_core, run_command

pytestmark = needs_core

NOT_INIT = "Horovod has not been initialized; use hvd.init()"
CALLS = {
    "torch": ["allreduce", "allgather", "barrier", "compressed allreduce", "peer average"],
    "tensorflow": ["allreduce", "allreduce in tf.function", "allgather", "barrier",
                   "compressed allreduce", "peer average"],
}  # fmt: skip
CLASS = {"torch": "ValueError", "tensorflow": "FailedPreconditionError"}


@pytest.mark.parametrize("frontend", ["torch", "tensorflow"])
def test_calls_before_init(frontend: str) -> None:
    pytest.importorskip(frontend)
    text = run_command([sys.executable, "tests/workers/not_initialized.py", frontend],
                       f"{frontend} calls before hvd.init()")  # fmt: skip
    lines = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    for call in CALLS[frontend]:
        assert call in lines, text
        assert lines[call].startswith(CLASS[frontend] + ": "), f"{call}: {lines[call]}"
        assert NOT_INIT in lines[call], f"{call}: {lines[call]}"
