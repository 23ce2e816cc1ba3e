"""Launching jobs from the tests: the multi-process test files of tests/mp/ (one pytest per
rank, run_inner; most files of one size share a job, SHARED_JOBS) and any command at np ranks
through the launcher (launch, run_command)."""

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


def _execute(cmd: list, timeout: float, **env: str) -> tuple:
    """Runs cmd from the repository root (rank variables of an outer launcher removed, env
    added). Returns (exit status, or None after ``timeout`` seconds; stdout and stderr)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")
    return proc.returncode, out.decode(errors="replace")


def run_command(cmd: list, what: str, timeout: float = TIMEOUT_S, **env: str) -> str:
    """Runs cmd (see _execute); fails the test on a non-zero exit or after ``timeout`` seconds.
    Returns stdout and stderr together."""
    rc, text = _execute(cmd, timeout, **env)
    if rc is None:
        pytest.fail(f"{what} did not finish within {timeout} s:\n{text}")
    assert rc == 0, f"{what} failed (exit {rc}):\n{text}"
    return text


# tests/mp/ files that run in one job per size (one process per rank for all of them, not one
# per file): a framework's start-up (import, the first optimizer's torch._dynamo, the
# TensorFlow kernels) costs 3-10 CPU-seconds per process, more than most files' tests. The
# first run_inner(file, np) of a group runs the whole group; each file's outer test then checks
# its own file's results on every rank. Files that need their own environment (legacy Keras)
# or options (-k) run alone, and so does every file with BAGUA_HVD_TEST_SHARED_JOBS=0 (.ci/sanitize:
# one file under a sanitizer, not its group).
SHARED_JOBS = {
    1: [
        "test_torch_ops.py", "test_torch_process_sets.py", "test_torch_lifecycle.py",
        "test_torch_functions.py", "test_torch_optimizer.py", "test_torch_algorithms.py",
        "test_torch_elastic.py", "test_tf_tape.py", "test_tf_elastic.py", "test_torch_adasum.py",
    ],
    2: [
        "test_torch_ops.py", "test_torch_algorithms.py", "test_tf_algorithms.py",
        "test_keras.py", "test_keras_callbacks.py", "test_tf_elastic.py", "test_torch_adasum.py",
        "test_tf_adasum.py",
    ],
    3: [
        "test_torch_ops.py", "test_torch_process_sets.py", "test_torch_lifecycle.py",
        "test_torch_functions.py", "test_torch_optimizer.py", "test_torch_algorithms.py",
        "test_scale_factors.py", "test_torch_elastic.py", "test_tf_ops.py",
        "test_tf_algorithms.py", "test_tf_tape.py", "test_torch_adasum.py", "test_tf_adasum.py",
    ],
}  # fmt: skip
_shared_output: dict = {}


def _pytest_cmd(files: list) -> list:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rA",
            *[f"tests/mp/{f}" for f in files]]  # fmt: skip


def _job(files: list, np: int) -> tuple:
    """The command running tests/mp/<files> at np ranks, and its bound against a hang (the
    inner tests have their own watchdog), scaled with the files."""
    cmd = _pytest_cmd(files)
    return (cmd if np == 1 else launch(np) + cmd), TIMEOUT_S * max(1, len(files) // 3)


def _file_results(text: str, inner: str, np: int) -> str:
    """The job's -rA summary lines about tests/mp/<inner>, then a pytest-like count line per
    rank ("[r] P passed, S skipped") for the callers' checks."""
    prefix = re.compile(r"^(?:\[(\d+)\]<stdout>:)?(PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS) (.*)$")
    lines, counts = [], {}
    for line in text.splitlines():
        m = prefix.match(line)
        if not m or f"tests/mp/{inner}" not in m.group(3):
            continue
        lines.append(line)
        rank = int(m.group(1) or 0)
        n = int(re.match(r"\[(\d+)\]", m.group(3)).group(1)) if m.group(2) == "SKIPPED" else 1
        c = counts.setdefault(rank, {})
        c[m.group(2)] = c.get(m.group(2), 0) + n
    for rank in range(np):
        c = counts.get(rank, {})
        bad = {k: v for k, v in c.items() if k in ("FAILED", "ERROR")}
        assert not bad, f"tests/mp/{inner}: rank {rank}: {bad}:\n" + "\n".join(lines)
        # As pytest writes it: no skip, no count.
        skipped = f", {c['SKIPPED']} skipped" if c.get("SKIPPED") else ""
        lines.append(f"[{rank}] {c.get('PASSED', 0)} passed{skipped}")
    return "\n".join(lines)


def run_inner(inner: str, np: int) -> str:
    """Runs tests/mp/<inner> at size 1 (directly) or through the launcher at np ranks; asserts
    that every rank printed a passing pytest summary. A file of SHARED_JOBS[np] runs in that
    size's one job (started by the first caller) and is judged by its own results there (the
    -rA lines of each rank's closing summary): it passes if all its tests passed on every rank,
    whatever a later file did; a rank stopped by the launcher prints no summary, so then every
    file fails and the message names those ranks. Returns the output (for a shared file, its
    own result lines)."""
    where = "size 1" if np == 1 else f"{np} ranks"
    group = SHARED_JOBS.get(np, []) if os.environ.get("BAGUA_HVD_TEST_SHARED_JOBS") != "0" else []
    if inner not in group:
        cmd, timeout = _job([inner], np)
        text = run_command(cmd, f"{inner} at {where}", timeout=timeout)
        _check_summaries(text, np)
        return text
    if np not in _shared_output:
        _shared_output[np] = _execute(*_job(group, np))  # run once; every file judged from it
    rc, text = _shared_output[np]
    what = f"the shared job of {len(group)} files at {where}"
    if rc == 0:
        _check_summaries(text, np)
    # The job's output without the -rA pass lines (thousands), for a failure's message.
    story = "\n".join(line for line in text.splitlines() if "PASSED tests/mp/" not in line)
    status = "did not finish" if rc is None else f"exited with {rc}"
    try:
        own = _file_results(text, inner, np)
    except AssertionError as e:
        raise AssertionError(f"{e}\n\n{what} {status}; its output:\n{story}") from None
    passed = re.findall(r"(\d+) passed", own)
    if rc != 0:
        # -rA lines come from pytest's closing summary: a rank the launcher stopped after
        # another rank failed prints none, so its files cannot be judged (not: did not run).
        silent = [r for r in range(np) if not re.search(rf"^\[{r}\]<stdout>:\d+ (passed|failed)",
                                                       text, re.M)]  # fmt: skip
        assert len(passed) == np and all(int(p) > 0 for p in passed), (
            f"tests/mp/{inner}: no result on every rank: {what} {status} (-x); ranks "
            f"without a pytest summary (stopped before it): {silent}\n{own}\n\n"
            f"its output:\n{story}"
        )
    assert len(passed) == np and all(int(p) > 0 for p in passed), (
        f"no passing tests of {inner} on every rank:\n{own}"
    )
    return own


def _check_summaries(text: str, np: int) -> None:
    passed = re.findall(r"(\d+) passed", text)
    assert len(passed) == np, f"expected a pytest summary from each of {np} ranks:\n{text}"
    assert all(int(p) > 0 for p in passed), text
    assert not re.search(r"\d+ (failed|error)", text), text
