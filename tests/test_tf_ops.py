"""Runs the multi-process TensorFlow tests (tests/mp/test_tf_ops.py) at size 1 (directly) and
through the launcher at 2 and 3 ranks, and asserts that every rank passed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

REPO = Path(__file__).resolve().parent.parent
INNER = "tests/mp/test_tf_ops.py"
TIMEOUT_S = 600


def _core_library() -> Path:
    override = os.environ.get("BAGUA_HVD_LIBRARY")
    return Path(override) if override else REPO / "bagua_hvd" / "_lib" / "libbagua_hvd.so"


pytestmark = pytest.mark.skipif(
    not _core_library().exists(),
    reason=f"core library not built ({_core_library()}); run `pip install -e .` or set "
    "BAGUA_HVD_LIBRARY",
)


def _env() -> dict:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.setdefault("BAGUA_HVD_OP_TIMEOUT_SECONDS", "60")  # a stuck collective fails, not hangs
    env.setdefault("BAGUA_HVD_TEST_TIMEOUT", "300")  # per inner test watchdog (tests/mp/conftest)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up banner out
    for k in [k for k in env if k.startswith("HOROVOD_") and k not in ("HOROVOD_LOG_LEVEL",)]:
        del env[k]  # an outer launcher's rank variables must not leak into the inner job
    return env


def _run(cmd: list, what: str) -> str:
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {TIMEOUT_S} s:\n{out.decode(errors='replace')}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{text}"
    return text


@pytest.mark.parametrize("np", [1, 2, 3])
def test_tf_multiprocess(np: int) -> None:
    pytest_cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", INNER]
    if np == 1:
        text = _run(pytest_cmd, f"{INNER} at size 1")
    else:
        launch = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np)]
        text = _run(launch + pytest_cmd, f"{INNER} at {np} ranks")
    passed = re.findall(r"(\d+) passed", text)
    assert len(passed) == np, f"expected a pytest summary from each of {np} ranks:\n{text}"
    assert all(int(p) > 0 for p in passed), text
    assert not re.search(r"\d+ (failed|error)", text), text
    # Only the mismatch test may skip, and only at size 1 (it needs peers).
    skipped = [int(s) for s in re.findall(r"(\d+) skipped", text)]
    assert sum(skipped) == (1 if np == 1 else 0), text
