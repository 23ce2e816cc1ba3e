"""The examples run end to end: real processes started by the launcher, real training."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "pytorch" / "pytorch_digits.py"
ACCURACY_RE = re.compile(r"final test accuracy: (\d+\.\d+)")
# A bound, not an expectation: the job takes ~10-30 s at 2 ranks on 2 shared cores.
TIMEOUT_S = 300

pytest.importorskip("torch", reason="the PyTorch example needs torch")
pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")


def launcher() -> list[str]:
    """bagua-run as pip installed it beside this interpreter, else the module form."""
    script = Path(sys.executable).parent / "bagua-run"
    if script.exists():
        return [str(script)]
    found = shutil.which("bagua-run")
    return [found] if found else [sys.executable, "-m", "bagua_hvd.runner.launch"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs cmd from the repository root; fails the test on a non-zero exit or after TIMEOUT_S."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # A collective stuck on a bug fails with the core's message instead of waiting out TIMEOUT_S.
    env.setdefault("BAGUA_HVD_OP_TIMEOUT_SECONDS", "60")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its ranks on SIGTERM ...
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # ... or everything in its group goes
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S} s:\n{out}\n{err}")
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def final_accuracy(proc: subprocess.CompletedProcess) -> float:
    """The accuracy rank 0 printed (once; a launcher may prefix lines with the rank)."""
    found = ACCURACY_RE.findall(proc.stdout)
    assert len(found) == 1, f"expected one 'final test accuracy' line, got {found}:\n{proc.stdout}"
    return float(found[0])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_two_ranks_through_launcher():
    proc = run([*launcher(), "-np", "2", sys.executable, str(DIGITS)])
    assert "2 rank(s)" in proc.stdout, proc.stdout
    assert "max parameter difference between replicas: 0" in proc.stdout, proc.stdout
    accuracy = final_accuracy(proc)
    assert accuracy >= 0.95, proc.stdout


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_without_launcher_is_a_job_of_size_one():
    proc = run([sys.executable, str(DIGITS), "--epochs", "3"])
    assert "1 rank(s)" in proc.stdout, proc.stdout
    assert final_accuracy(proc) > 0.5, proc.stdout


def readme_programs() -> list[tuple[int, str]]:
    """README.md's ```python blocks with the rank count named just before each one."""
    readme = (ROOT / "README.md").read_text()
    programs, last_end = [], 0
    for match in re.finditer(r"```python\n(.*?)```", readme, re.S):
        counts = re.findall(r"bagua-run -np (\d+) python", readme[last_end : match.start()])
        programs.append((int(counts[-1]) if counts else 2, match.group(1)))
        last_end = match.end()
    return programs


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("index", range(len(readme_programs())))
def test_readme_python_blocks_run(index: int, tmp_path: Path):
    """Every Python block of the README's API tour runs as written (its asserts included)."""
    np, code = readme_programs()[index]
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(code)
    run([*launcher(), "-np", str(np), sys.executable, str(script)])


def test_readme_main_job_names_an_existing_example():
    """The README's main-job command must keep pointing at a real example."""
    readme = (ROOT / "README.md").read_text()
    scripts = re.findall(r"bagua-run -np 2 python (examples/\S+\.py)", readme)
    assert scripts, "README.md has no `bagua-run -np 2 python <example>.py` command"
    for script in scripts:
        assert (ROOT / script).is_file(), f"README.md runs {script}, which does not exist"
