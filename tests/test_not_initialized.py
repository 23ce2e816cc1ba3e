"""Calls before hvd.init() raise Horovod's class for each frontend, chosen by the core's status
code (BHVD_NOT_INITIALIZED), with Horovod's message: ValueError in torch,
tf.errors.FailedPreconditionError in TensorFlow (eagerly, in tf.function, and from the
algorithms' primitives). TensorFlow's allreduce is the exception, as in Horovod: it reads the
process set's size in Python first (horovod/tensorflow/__init__.py), which raises ValueError."""

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
PYTHON_FIRST = {"allreduce", "allreduce in tf.function"}  # TensorFlow's: ValueError, as Horovod


@pytest.mark.parametrize("frontend", ["torch", "tensorflow"])
def test_calls_before_init(frontend: str) -> None:
    pytest.importorskip(frontend)
    text = run_command([sys.executable, "tests/workers/not_initialized.py", frontend],
                       f"{frontend} calls before hvd.init()")  # fmt: skip
    lines = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    for call in CALLS[frontend]:
        assert call in lines, text
        want = (
            "ValueError" if frontend == "tensorflow" and call in PYTHON_FIRST else CLASS[frontend]
        )
        assert lines[call].startswith(want + ": "), f"{call}: {lines[call]}"
        assert NOT_INIT in lines[call], f"{call}: {lines[call]}"
