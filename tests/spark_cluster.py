"""A local Spark standalone cluster for the tests of bagua_hvd.spark (tests/test_spark.py,
tests/test_spark_elastic.py; the ``spark_cluster`` fixture of tests/conftest.py): a master and
two workers (2 cores each), each its own JVM launching its own executor and Python workers,
bound to 127.0.0.1, and a session on it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent
# The second worker's executors group their ranks under another host name (as on a second
# machine), so that ranks span two hosts.
OTHER_HOST = "spark-test-host-b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session(master: str, monkeypatch: pytest.MonkeyPatch, **conf: str):
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


def processes_with(marker: str) -> list:
    """Pids of this user's processes whose environment holds ``marker`` (the ranks of a run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@contextlib.contextmanager
def standalone_cluster(root: Path) -> Iterator:
    """The cluster (logs under ``root``) and a session on it. Every JVM is the leader of its
    process group (a worker's executors join its group), so the teardown stops them all."""
    import pyspark

    spark_home = Path(pyspark.__file__).resolve().parent
    port = free_port()
    master_url = f"spark://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(spark_home),
        SPARK_DAEMON_MEMORY="256m",
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_DIRS=str(root / "local"),
        SPARK_LOG_DIR=str(root / "logs"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    spark_class = str(spark_home / "bin" / "spark-class")
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
                     "--port", str(port), "--webui-port", str(free_port())], {})  # fmt: skip
    for i, host in enumerate((None, OTHER_HOST)):
        work = root / f"worker{i}"
        start(
            f"worker{i}",
            ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "2",
             "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", str(work),
             master_url],
            {"BAGUA_HVD_SPARK_HOST": host} if host else {},
        )  # fmt: skip
    spark = None
    patch = pytest.MonkeyPatch()
    try:
        spark = session(master_url, patch, **{"spark.cores.max": "4"})
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
