"""Runs the multi-process tests of BAGUA's algorithms in the TensorFlow frontend
(tests/mp/test_tf_algorithms.py) through the launcher at 2 ranks (the interface, tapes, Keras,
validation: the cases marked up_to_two_ranks) and at 3 (odd sizes matter for shift_one and the
ring), and asserts that every rank passed. Size 1 (no communication: every algorithm is the
local optimizer) is left out to save the TensorFlow start-up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("tensorflow")
pytest.importorskip("torch")  # the reference (tests/reference_algorithms.py) is torch
pytestmark = needs_core


@pytest.mark.parametrize("np", [2, 3])
def test_tf_algorithms_multiprocess(np: int) -> None:
    text = run_inner("test_tf_algorithms.py", np)
    assert not re.search(r"\d+ skipped", text), text


# Two ranks where the kernel library cannot be built (a compiler that fails, an empty cache):
# Horovod's collectives in tf.function still run (the numpy_function path); the algorithm path
# is an ImportError with the reason and what to install, on every rank, at the import and at a
# tape built with an algorithm.
WITHOUT_KERNELS = """
import tensorflow as tf
import bagua_hvd.tensorflow as hvd
from bagua_hvd.common import algorithms as declarations

hvd.init()
r = hvd.rank()
total = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))(tf.fill([3], float(r + 1)))
print(f"rank {r} allreduce", total.numpy().tolist(), flush=True)
for what in ("import", "tape"):
    try:
        if what == "import":
            import bagua_hvd.tensorflow.algorithms
        else:
            hvd.DistributedGradientTape(tf.GradientTape(), algorithm=declarations.ByteGrad())
        print(f"rank {r} {what}: no error", flush=True)
    except ImportError as e:
        print(f"rank {r} {what}: ImportError: " + str(e).replace("\\n", " "), flush=True)
"""


def test_algorithms_without_the_kernel_library(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        CXX="/bin/false",
        BAGUA_HVD_CACHE_DIR=str(tmp_path),
        PYTHONPATH=str(root),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2"]
    proc = subprocess.run(
        [*cmd, sys.executable, "-c", WITHOUT_KERNELS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in (0, 1):
        assert f"rank {r} allreduce [3.0, 3.0, 3.0]" in out, out
        for what in ("import", "tape"):
            line = next(x for x in out.splitlines() if f"rank {r} {what}:" in x)
            assert "ImportError: BAGUA's algorithms in TensorFlow" in line, line
            assert "needs bagua_hvd's TensorFlow kernel library, which is not available" in line
            assert "/bin/false" in line and "apt install g++" in line, line
            assert "python -m bagua_hvd.tensorflow.build_kernels" in line, line
