"""Runs the multi-process TensorFlow tests (tests/mp/test_tf_ops.py) through the launcher at 3
ranks, and asserts that every rank passed (the frontend does not depend on the size; the core
under it runs at 2 ranks in the torch and C++ tests). A job of size 1 without the launcher:
tests/test_keras.py::test_keras_size_1, tests/test_frontends_alone.py and the examples."""

from __future__ import annotations

import re

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("tensorflow")
pytestmark = needs_core


def test_tf_multiprocess() -> None:
    text = run_inner("test_tf_ops.py", 3)
    # Nothing may skip at 3 ranks (the tests that need peers skip at size 1 only).
    skipped = [int(s) for s in re.findall(r"(\d+) skipped", text)]
    assert sum(skipped) == 0, text


@pytest.mark.parametrize("np", [2, 3])
def test_tf_adasum(np: int) -> None:
    """op=hvd.Adasum at 2 ranks (a power of 2) and at 3 (Horovod's error)."""
    run_inner("test_tf_adasum.py", np)


def test_kernels_build_command(tmp_path) -> None:
    """``python -m bagua_hvd.tensorflow.build_kernels`` prints the kernels' library, built in the
    user's cache (the same build the first TensorFlow op runs: the other tests' ranks share that
    cache, so no second build of the kernels here); with no usable compiler it fails and says why.
    """
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    cmd = [sys.executable, "-m", "bagua_hvd.tensorflow.build_kernels"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip().splitlines()[-1]
    assert path.endswith(".so") and os.path.getsize(path) > 0, done.stdout
    env["BAGUA_HVD_CACHE_DIR"] = str(tmp_path / "other")
    env["CXX"] = "false"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert "bagua_hvd: cannot build the TensorFlow kernels:" in done.stderr, done.stderr
    assert "failed" in done.stderr, done.stderr
