"""Keras 2 (tf_keras) through bagua_hvd.tensorflow.keras: installs tf_keras for this run and
runs tests/mp/test_keras_legacy.py at 2 ranks with ``TF_USE_LEGACY_KERAS=1``.

tf_keras is installed with ``pip install --no-deps --target`` into a cache directory
(``$TMPDIR/bagua_hvd-tf-keras-<version>``; without ``--no-deps`` pip would pull a full
``tensorflow`` next to tensorflow-cpu). If pip cannot install it (no network), the test FAILS:
the legacy Keras path must be checked, not silently skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mp_runner import needs_core, run_inner

tf = pytest.importorskip("tensorflow")
pytestmark = needs_core


def _tf_keras_dir() -> Path:
    major, minor = tf.__version__.split(".")[:2]
    spec = f"tf-keras~={major}.{minor}.0"  # tf_keras releases follow TensorFlow's minor
    target = Path(tempfile.gettempdir()) / f"bagua_hvd-tf-keras-{major}.{minor}"
    if (target / "tf_keras" / "__init__.py").exists():
        return target
    cmd = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
        "--target", str(target), spec,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not (target / "tf_keras" / "__init__.py").exists():
        pytest.fail(
            f"could not install {spec} for the legacy Keras test (is PyPI reachable?): "
            f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return target


def test_keras_legacy_2_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    target = _tf_keras_dir()
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(target) + (os.pathsep + path if path else ""))
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    run_inner("test_keras_legacy.py", 2)
