"""Launching jobs from the tests: the multi-process test files of tests/mp/ (one pytest per
rank, run_inner) and any command at np ranks through the launcher (launch, run_command)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600


def core_library() -> Path:
    override = os.environ.get("BAGUA_HVD_LIBRARY")
    return Path(override) if override else REPO / "bagua_hvd" / "_lib" / "libbagua_hvd.so"


needs_core = pytest.mark.skipif(
    not core_library().exists(),
    reason=f"core library not built ({core_library()}); run `pip install -e .` or set "
    "BAGUA_HVD_LIBRARY",
)


def launch(np: int) -> list:
    """bagua-run -np <np>, as a command prefix (the module: no installed script needed)."""
    return [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np)]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.setdefault("BAGUA_HVD_OP_TIMEOUT_SECONDS", "60")  # a stuck collective fails, not hangs
    env.setdefault("BAGUA_HVD_TEST_TIMEOUT", "300")  # per inner test watchdog (tests/mp/conftest)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up banner out
    for k in [k for k in env if k.startswith("HOROVOD_") and k not in ("HOROVOD_LOG_LEVEL",)]:
        del env[k]  # an outer launcher's rank variables must not leak into the inner job
    env.update(extra)
    return env


def run_command(cmd: list, what: str, **env: str) -> str:
    """Runs cmd from the repository root (rank variables of an outer launcher removed, env
    added); fails the test on a non-zero exit or after TIMEOUT_S. Returns stdout and stderr
    together."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(**env),
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


def run_inner(inner: str, np: int) -> str:
    """Runs tests/mp/<inner> at size 1 (directly) or through the launcher at np ranks; asserts
    that every rank printed a passing pytest summary. Returns the output."""
    pytest_cmd = [
        sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"tests/mp/{inner}",
    ]  # fmt: skip
    if np == 1:
        text = run_command(pytest_cmd, f"{inner} at size 1")
    else:
        text = run_command(launch(np) + pytest_cmd, f"{inner} at {np} ranks")
    passed = re.findall(r"(\d+) passed", text)
    assert len(passed) == np, f"expected a pytest summary from each of {np} ranks:\n{text}"
    assert all(int(p) > 0 for p in passed), text
    assert not re.search(r"\d+ (failed|error)", text), text
    return text
