"""Background algorithm work ends cleanly when ranks stop at different times: AsyncModelAverage
without a manual abort() (float32 and float16 weights), and LowPrecisionDecentralized's last ring
exchange, at hvd.shutdown() and at interpreter exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "async_exit.py"
LP_WORKER = ROOT / "tests" / "workers" / "lp_exit.py"
LP_WORKER_TF = ROOT / "tests" / "workers" / "lp_exit_tf.py"

pytest.importorskip("torch")


# Each way to end and each dtype once (the dtype changes the averaging, not the ending).
@pytest.mark.parametrize("how,dtype", [("shutdown", "float32"), ("exit", "float16")])
def test_async_stops_without_abort(how: str, dtype: str):
    env = dict(os.environ, PYTHONPATH=str(ROOT), BAGUA_HVD_OP_TIMEOUT_SECONDS="60")
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]
    args = [how] + (["fp16"] if dtype == "float16" else [])
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bagua_hvd.runner.launch",
            "-np",
            "2",
            sys.executable,
            str(WORKER),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    rounds = [int(r) for r in re.findall(r"rank \d rounds (\d+)", text)]
    assert len(rounds) == 2 and min(rounds) >= 3, text  # background averaging did run
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end\n{text}"
    if how == "shutdown":
        took = [float(t) for t in re.findall(r"shutdown took ([\d.]+) s", text)]
        assert len(took) == 2 and max(took) < 10, text


# TensorFlow once, at interpreter exit (the harder of the two: its runtime is torn down around
# the flush); both ways end in the same shutdown, which the torch cases run each way.
@pytest.mark.parametrize(
    "framework,how", [("torch", "shutdown"), ("torch", "exit"), ("tensorflow", "exit")]
)
def test_low_precision_decentralized_last_exchange(framework: str, how: str, tmp_path: Path):
    """Rank 0 ends while its last exchange waits for the slower rank 1 (which takes its last
    step only after rank 0 has reached the end): the exchange completes on both ranks
    (shutdown and exit wait for it) instead of failing rank 1's last step with "Horovod has
    been shut down"."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        BAGUA_HVD_OP_TIMEOUT_SECONDS="60",
        LP_EXIT_MARKER=str(tmp_path / "rank0-at-end"),
    )
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]
    proc = subprocess.run(
        [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2", sys.executable,
         str(LP_WORKER if framework == "torch" else LP_WORKER_TF), how],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert sorted(re.findall(r"rank (\d) done", text)) == ["0", "1"], text
    if how == "shutdown":
        took = [float(t) for t in re.findall(r"shutdown took ([\d.]+) s", text)]
        assert len(took) == 2 and max(took) < 10, text


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_low_precision_shutdown_wait_is_bounded(framework: str, tmp_path: Path):
    """A rank that never takes its last step does not hold the other's shutdown forever: the
    wait for the last exchange gives up after HOROVOD_GLOO_TIMEOUT_SECONDS with a warning."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        BAGUA_HVD_OP_TIMEOUT_SECONDS="60",
        HOROVOD_GLOO_TIMEOUT_SECONDS="3",
        LP_EXIT_MARKER=str(tmp_path / "rank0-at-end"),
    )
    for key in [k for k in env if k.startswith("HOROVOD_") and k != "HOROVOD_GLOO_TIMEOUT_SECONDS"]:
        del env[key]
    proc = subprocess.run(
        [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2", sys.executable,
         str(LP_WORKER if framework == "torch" else LP_WORKER_TF), "stall"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "1 low-precision decentralized exchange(s) still in flight after 3 s" in text, text
    took = [float(t) for t in re.findall(r"rank 0 shutdown took ([\d.]+) s", text)]
    assert len(took) == 1 and 3 <= took[0] < 15, text
