"""The examples run end to end: real processes started by the launcher, real training.

Results are checked against plain torch where there is something to compute: the checkpoint
that rank 0 writes is evaluated here, in one process, on the whole test split (the accuracy and
loss the job printed are sums over every rank's shard, so they must agree); a run interrupted
and resumed from its checkpoint must end with the weights of an uninterrupted run.
"""

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
DIGITS = ROOT / "examples" / "pytorch" / "digits.py"
SYNTHETIC = ROOT / "examples" / "pytorch" / "synthetic_benchmark.py"
ACCURACY_RE = re.compile(r"final test accuracy: (\d+\.\d+)")
LOSS_RE = re.compile(r"final test loss: (\d+\.\d+)")
EPOCH_RE = re.compile(r"epoch +(\d+)  train loss")
# A bound, not an expectation: a digits job takes ~5-15 s at 2 ranks on 2 shared cores.
TIMEOUT_S = 300

torch = pytest.importorskip("torch", reason="the PyTorch examples need torch")
pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
pytest.importorskip("tqdm", reason="the digits example needs tqdm")


def launcher() -> list[str]:
    """bagua-run as pip installed it beside this interpreter, else the module form."""
    script = Path(sys.executable).parent / "bagua-run"
    if script.exists():
        return [str(script)]
    found = shutil.which("bagua-run")
    return [found] if found else [sys.executable, "-m", "bagua_hvd.runner.launch"]


def run(cmd: list[str], expect_rc: int = 0) -> subprocess.CompletedProcess:
    """Runs cmd from the repository root; fails the test on another exit status than
    expect_rc, or after TIMEOUT_S."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]  # an outer launcher's rank variables must not leak into the job
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
    assert proc.returncode == expect_rc, (
        f"{' '.join(cmd)} exited with {proc.returncode}, expected {expect_rc}\n"
        f"--- stdout\n{out}\n--- stderr\n{err}"
    )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def only(regex: re.Pattern, proc: subprocess.CompletedProcess) -> float:
    """The one value rank 0 printed (a launcher prefixes lines with the rank)."""
    found = regex.findall(proc.stdout)
    assert len(found) == 1, f"expected one {regex.pattern!r} line, got {found}:\n{proc.stdout}"
    return float(found[0])


def final_accuracy(proc: subprocess.CompletedProcess) -> float:
    return only(ACCURACY_RE, proc)


def digits(np: int, *args: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    return run(
        [*launcher(), "-np", str(np), sys.executable, str(DIGITS), "--no-progress", *args],
        expect_rc,
    )


# ---- plain-torch reference for the digits checkpoint ----------------------------------------


def reference_test_split() -> tuple:
    """The digits example's test split, rebuilt here: 20 % held out by a permutation seeded 0."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy((data.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test = perm[: int(len(x) * 0.2)]
    return x[test], y[test]


def reference_model(state: dict) -> torch.nn.Module:
    """The example's CNN written in plain torch; load_state_dict checks that they agree."""
    nn, F = torch.nn, torch.nn.functional

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.fc1 = nn.Linear(512, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    model = Net()
    model.load_state_dict(state)
    return model.eval()


def evaluate_checkpoint(path: Path) -> tuple[int, float, float]:
    """(epoch, test loss, test accuracy) of a checkpoint, in one process."""
    state = torch.load(path, map_location="cpu")
    assert set(state) >= {"epoch", "model", "optimizer"}, sorted(state)
    x, y = reference_test_split()
    with torch.no_grad():
        logits = reference_model(state["model"])(x)
    loss = torch.nn.functional.cross_entropy(logits.double(), y).item()
    accuracy = (logits.argmax(dim=1) == y).double().mean().item()
    return int(state["epoch"]), loss, accuracy


def assert_same_weights(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = a[name].abs().max().item()
        err = (a[name] - b[name]).abs().max().item()
        assert err <= rtol * max(scale, 1e-12), f"{name} differs by {err:.3g} (scale {scale:.3g})"


# ---- digits ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple:
    """digits.py at 2 ranks with Horovod's DistributedOptimizer (allreduce), and its
    checkpoint."""
    checkpoint = tmp_path_factory.mktemp("digits") / "digits.pt"
    return digits(2, "--checkpoint", str(checkpoint)), checkpoint


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_two_ranks_through_launcher(two_ranks):
    proc, checkpoint = two_ranks
    assert "2 rank(s)" in proc.stdout, proc.stdout
    assert "max parameter difference between replicas: 0" in proc.stdout, proc.stdout
    accuracy = final_accuracy(proc)
    assert accuracy >= 0.95, proc.stdout
    epochs = [int(e) for e in EPOCH_RE.findall(proc.stdout)]
    assert epochs == list(range(1, 16)), proc.stdout
    # The printed metrics were summed over both ranks' shards; plain torch on the whole split
    # with the checkpoint's weights must agree.
    epoch, ref_loss, ref_accuracy = evaluate_checkpoint(checkpoint)
    assert epoch == 15
    assert abs(ref_accuracy - accuracy) < 1e-4, (ref_accuracy, proc.stdout)
    assert abs(ref_loss - only(LOSS_RE, proc)) < 1e-4, (ref_loss, proc.stdout)


@pytest.fixture(scope="module")
def four_ranks() -> subprocess.CompletedProcess:
    """digits.py at 4 ranks with Horovod's DistributedOptimizer (allreduce)."""
    return digits(4, "--checkpoint", "")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_four_ranks_through_launcher(four_ranks):
    out = four_ranks.stdout
    assert "4 rank(s)" in out, out
    assert "max parameter difference between replicas: 0" in out, out
    assert final_accuracy(four_ranks) >= 0.95, out


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "algorithm",
    ["bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async"],
)
def test_digits_algorithms_converge_like_allreduce(algorithm, two_ranks):
    """Every BAGUA algorithm reaches, in the same 15 epochs at 2 ranks, a test accuracy within
    1.5 points of allreduce's (Horovod's DistributedOptimizer), and at least 0.95. Async is held
    to the 0.95 alone: its rounds depend on timing (0.9666-0.9805 seen here against allreduce's
    0.9805). (Their exact math at 2 to 4 ranks: tests/mp/test_torch_algorithms.py against
    tests/reference_algorithms.py.)"""
    proc = digits(2, "--checkpoint", "", "--algorithm", algorithm)
    accuracy = final_accuracy(proc)
    baseline = final_accuracy(two_ranks[0])
    if algorithm != "async":
        assert accuracy >= baseline - 0.015, (
            f"{algorithm}: {accuracy:.4f} against allreduce's {baseline:.4f}\n{proc.stdout}"
        )
    assert accuracy >= 0.95, proc.stdout


@pytest.mark.timeout(3 * TIMEOUT_S + 30)
def test_digits_resume_continues_from_the_saved_epoch(tmp_path: Path):
    """Interrupted after epoch 3 and resumed, a run ends where an uninterrupted one does: rank 0
    restored model and optimizer (momentum) and every rank took the epoch from it."""
    whole, part = tmp_path / "whole.pt", tmp_path / "part.pt"
    uninterrupted = digits(2, "--epochs", "6", "--checkpoint", str(whole))

    first = digits(2, "--epochs", "6", "--stop-after", "3", "--checkpoint", str(part))
    assert [int(e) for e in EPOCH_RE.findall(first.stdout)] == [1, 2, 3], first.stdout
    assert evaluate_checkpoint(part)[0] == 3
    after_three = torch.load(part, map_location="cpu")

    resumed = digits(2, "--epochs", "6", "--resume", "--checkpoint", str(part))
    assert "resumed from epoch 3" in resumed.stdout, resumed.stdout
    assert [int(e) for e in EPOCH_RE.findall(resumed.stdout)] == [4, 5, 6], resumed.stdout
    assert "max parameter difference between replicas: 0" in resumed.stdout, resumed.stdout

    final_whole, final_part = (torch.load(p, map_location="cpu") for p in (whole, part))
    assert final_part["epoch"] == 6
    assert_same_weights(final_part["model"], final_whole["model"])
    # The resumed run did train: its weights moved away from the epoch-3 checkpoint.
    assert any(
        not torch.equal(after_three["model"][k], final_part["model"][k])
        for k in after_three["model"]
    )
    assert abs(only(LOSS_RE, resumed) - only(LOSS_RE, uninterrupted)) < 1e-5


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_resume_without_checkpoint_fails_on_every_rank(tmp_path: Path):
    missing = tmp_path / "missing.pt"
    proc = digits(2, "--resume", "--checkpoint", str(missing), expect_rc=1)
    assert f"cannot resume from {missing}" in proc.stdout + proc.stderr


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_without_launcher_is_a_job_of_size_one():
    proc = run([sys.executable, str(DIGITS), "--epochs", "3", "--checkpoint", "", "--no-progress"])
    assert "1 rank(s)" in proc.stdout, proc.stdout
    assert final_accuracy(proc) > 0.5, proc.stdout


# ---- synthetic benchmark ---------------------------------------------------------------------

PER_RANK_RE = re.compile(r"Img/sec per CPU: (\d+\.\d) \+-(\d+\.\d)")
TOTAL_RE = re.compile(r"Total img/sec on (\d+) CPU\(s\): (\d+\.\d) \+-(\d+\.\d)")
TINY = [
    "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
    "--num-iters", "3", "--no-cuda",
]  # fmt: skip


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "model,extra", [("resnet", []), ("mlp", ["--fp16-allreduce"]), ("mlp", ["--use-adasum"])]
)
def test_synthetic_benchmark_two_ranks(model: str, extra: list[str]):
    cmd = [*launcher(), "-np", "2", sys.executable, str(SYNTHETIC), "--model", model]
    proc = run([*cmd, *TINY, *extra])
    out = proc.stdout
    assert f"Model: {model}" in out and "Batch size: 8" in out and "Number of CPUs: 2" in out, out
    iters = re.findall(r"Iter #(\d+): (\d+\.\d) img/sec per CPU", out)
    assert [int(i) for i, _ in iters] == [0, 1, 2], out
    (mean, conf), (n, total, total_conf) = PER_RANK_RE.findall(out)[0], TOTAL_RE.findall(out)[0]
    assert float(mean) > 0 and int(n) == 2, out
    assert abs(float(total) - 2 * float(mean)) <= 0.11, out
    assert abs(float(total_conf) - 2 * float(conf)) <= 0.11, out


# ---- README ----------------------------------------------------------------------------------


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


SPARK_DIGITS = ROOT / "examples" / "spark" / "digits_estimator.py"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_spark_digits_estimator_runs_in_one_command(tmp_path: Path):
    """examples/spark/digits_estimator.py starts Spark in local mode itself, fits the digits
    with TorchEstimator at 2 processes (rank 0's epoch lines reach the driver) and prints the
    test accuracy of its model's transform."""
    for module in ("pyspark", "pyarrow"):
        pytest.importorskip(module)
    if shutil.which("java") is None:
        pytest.skip("no java on PATH: Spark needs a Java runtime")
    proc = run([sys.executable, str(SPARK_DIGITS), "--num-proc", "2", "--epochs", "8",
                "--store", str(tmp_path / "store"), "--min-accuracy", "0.9"])  # fmt: skip
    assert "[0]<stdout>:epoch 8/8  loss" in proc.stdout, proc.stdout
    assert float(re.search(r"test accuracy: (\d\.\d+)", proc.stdout).group(1)) >= 0.9
