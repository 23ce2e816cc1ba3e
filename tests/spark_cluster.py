"""A local Spark standalone cluster for the Spark tests (tests/test_spark.py,
tests/test_spark_estimators.py; the fixture ``spark_cluster`` of tests/conftest.py runs it), and
``_session``: a SparkSession bound to 127.0.0.1 whose Python workers run this Python."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyspark
import pytest

REPO = Path(__file__).resolve().parent.parent
SPARK_HOME = Path(pyspark.__file__).resolve().parent
# The second worker's executors group their ranks under another host name (as on a second
# machine), so that ranks span two hosts.
OTHER_HOST = "spark-test-host-b"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session(master: str, monkeypatch: pytest.MonkeyPatch, **conf: str):
    from pyspark.sql import SparkSession

    # The Python workers' interpreter: PySpark reads PYSPARK_PYTHON when the context starts
    # (spark.pyspark.python is spark-submit's), else runs whatever python3 is on PATH.
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)

    builder = SparkSession.builder.master(master)
    settings = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.driver.memory": "512m",
        "spark.executor.memory": "512m",
        "spark.executorEnv.PYTHONPATH": str(REPO),
        **conf,
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def run_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A standalone master and two workers (2 cores each), bound to 127.0.0.1; a session on it.
    Every JVM is the leader of its process group (a worker's executors join its group), so the
    teardown stops them all."""
    root = tmp_path_factory.mktemp("spark")
    port = _free_port()
    master_url = f"spark://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_DAEMON_MEMORY="256m",
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_DIRS=str(root / "local"),
        SPARK_LOG_DIR=str(root / "logs"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    procs = []

    def start(name: str, args: list, extra: dict) -> None:
        log = open(root / f"{name}.log", "wb")
        procs.append(
            subprocess.Popen(
                [spark_class, *args],
                env=dict(env, **extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                     "--port", str(port), "--webui-port", str(_free_port())], {})  # fmt: skip
    for i, host in enumerate((None, OTHER_HOST)):
        work = root / f"worker{i}"
        start(
            f"worker{i}",
            ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "2",
             "--memory", "1g", "--webui-port", str(_free_port()), "--work-dir", str(work),
             master_url],
            {"BAGUA_HVD_SPARK_HOST": host} if host else {},
        )  # fmt: skip
    spark = None
    patch = pytest.MonkeyPatch()
    try:
        spark = _session(master_url, patch, **{"spark.cores.max": "4"})
        deadline = time.monotonic() + 120
        # Both workers' executors registered (the driver counts itself too).
        while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:
            assert time.monotonic() < deadline, f"executors did not register; logs in {root}"
            time.sleep(0.5)
        yield spark
    finally:
        if spark is not None:
            spark.stop()
        patch.undo()
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        time.sleep(1)
        for p in procs:  # the executors too (same process groups)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
