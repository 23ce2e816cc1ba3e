"""The TensorFlow example runs end to end: 2 real ranks started by the launcher, real training.

examples/tensorflow2/synthetic_benchmark.py is Horovod's tensorflow2_synthetic_benchmark.py;
with --check-sync it also checks, on every rank, that the weights changed and are bitwise
identical across ranks, that the ranks trained on different batches, and that the gradient of
DistributedGradientTape equals the mean of the ranks' local gradients (allgathered, averaged in
numpy). A run without the post-first-step broadcast must fail that check.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow", reason="the TensorFlow example needs tensorflow")

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "examples" / "tensorflow2" / "synthetic_benchmark.py"
# A bound, not an expectation: one tiny run takes ~8-11 s at 2 ranks on 2 shared cores.
TIMEOUT_S = 240
TINY = [
    "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
    "--num-iters", "3", "--no-cuda", "--image-size", "16", "--num-classes", "10", "--check-sync",
]  # fmt: skip
PER_RANK_RE = re.compile(r"Img/sec per CPU: (\d+\.\d) \+-(\d+\.\d)")
TOTAL_RE = re.compile(r"Total img/sec on (\d+) CPU\(s\): (\d+\.\d) \+-(\d+\.\d)")


def run(args: list[str], expect_rc: int) -> subprocess.CompletedProcess:
    """`bagua-run -np 2 python synthetic_benchmark.py args` from the repository root; fails the
    test on another exit status than expect_rc, or after TIMEOUT_S."""
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2"]
    cmd += [sys.executable, str(SYNTHETIC), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]  # an outer launcher's rank variables must not leak into the job
    env.setdefault("BAGUA_HVD_OP_TIMEOUT_SECONDS", "60")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
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


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("model,extra", [("resnet", []), ("mlp", ["--fp16-allreduce"])])
def test_synthetic_benchmark_two_ranks(model: str, extra: list[str]):
    out = run(["--model", model, *TINY, *extra], expect_rc=0).stdout
    assert f"Model: {model}" in out and "Batch size: 8" in out and "Number of CPUs: 2" in out, out
    iters = re.findall(r"Iter #(\d+): (\d+\.\d) img/sec per CPU", out)
    assert [int(i) for i, _ in iters] == [0, 1, 2], out
    assert all(float(v) > 0 for _, v in iters), out
    (mean, conf), (n, total, total_conf) = PER_RANK_RE.findall(out)[0], TOTAL_RE.findall(out)[0]
    assert abs(float(mean) - sum(float(v) for _, v in iters) / 3) <= 0.11, out
    assert float(mean) > 0 and int(n) == 2, out
    assert abs(float(total) - 2 * float(mean)) <= 0.11, out
    assert abs(float(total_conf) - 2 * float(conf)) <= 0.11, out
    assert "check-sync passed: weights changed and identical on 2 rank(s)" in out, out


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_check_sync_catches_unsynchronized_ranks():
    """Without the broadcast the ranks keep their own random initial weights: --check-sync must
    report it on every rank and the job must fail."""
    proc = run(["--model", "mlp", *TINY, "--skip-broadcast"], expect_rc=1)
    for r in (0, 1):
        assert f"rank {r}: check-sync FAILED: rank 1's weights differ from rank 0's" in (
            proc.stderr
        ), proc.stderr
    assert "check-sync passed" not in proc.stdout, proc.stdout
