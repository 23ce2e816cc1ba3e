"""bagua_hvd.spark.run on Spark: one test in local mode (``local[2]``), the others on a local
standalone cluster (a master and two workers, each its own JVM launching its own executor and
Python workers), against the same function run by bagua_hvd.run."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None:
    pytest.skip("no java on PATH: Spark needs a Java runtime", allow_module_level=True)

# The ranks cannot import this test module: send its functions by value.
import cloudpickle  # noqa: E402
from cluster_job import horovod_job, job, numpy_sum  # noqa: E402

for _module in (sys.modules[__name__], sys.modules[job.__module__]):
    cloudpickle.register_pickle_by_value(_module)

from spark_cluster import OTHER_HOST, _session  # noqa: E402


def _processes_with(marker: str) -> list:
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


def test_ranks_are_numbered_host_by_host():
    """Task 0's host first, a host's tasks consecutive and in task order."""
    from bagua_hvd.spark.runner import _assign

    assert _assign(["b", "a", "b", "c", "a"]) == [0, 2, 1, 4, 3]
    assert _assign(["x"] * 3) == [0, 1, 2]


def test_arguments_and_settings_it_refuses(monkeypatch):
    """Before any task: no SparkContext, use_mpi, speculation (a second copy of a rank)."""
    from pyspark import SparkContext

    import bagua_hvd.spark

    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    with pytest.raises(RuntimeError, match="Could not find an active SparkContext"):
        bagua_hvd.spark.run(job)
    with pytest.raises(ValueError, match="use_mpi=True is not supported"):
        bagua_hvd.spark.run(job, use_mpi=True)
    with pytest.raises(ValueError, match="only allow one set True"):
        bagua_hvd.spark.run(job, use_mpi=True, use_gloo=True)
    with pytest.raises(NotImplementedError, match="run_elastic is not supported yet"):
        bagua_hvd.spark.run_elastic(job)

    class Conf(dict):
        def get(self, key, default=None):
            return super().get(key, default)

    class Context:
        defaultParallelism = 2

        def getConf(self):
            return Conf({"spark.speculation": "true"})

    monkeypatch.setattr(SparkContext, "_active_spark_context", Context())
    with pytest.raises(ValueError, match="spark.speculation=false"):
        bagua_hvd.spark.run(job)


def test_local_mode_two_ranks(monkeypatch):
    """``local[2]``: the tasks run in the driver's JVM, the ranks in processes of their own."""
    import bagua_hvd
    import bagua_hvd.spark

    spark = _session("local[2]", monkeypatch)
    try:
        got = bagua_hvd.spark.run(job, args=("local",), start_timeout=120)  # defaultParallelism
    finally:
        spark.stop()
    assert [(g["rank"], g["size"], g["local"]) for g in got] == [(0, 2, (0, 2)), (1, 2, (1, 2))]
    ref = bagua_hvd.run(job, args=("local",), np=2)
    assert [g["sum"] for g in got] == [r["sum"] for r in ref]


@pytest.fixture(scope="module")
def cluster(spark_cluster):
    """The standalone cluster of tests/spark_cluster.py (a master and two workers)."""
    return spark_cluster


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_match_the_bagua_run_job(cluster, n):
    import numpy as np

    import bagua_hvd
    import bagua_hvd.spark

    tag = f"spark{n}"
    got = bagua_hvd.spark.run(job, args=(tag,), num_proc=n, start_timeout=120)
    ref = bagua_hvd.run(job, args=(tag,), np=n)
    assert [g["rank"] for g in got] == list(range(n))
    assert all(g["size"] == n for g in got)
    # Ranks are grouped by host: a host's ranks are consecutive, local ranks count within it.
    hosts = [g["host"] for g in got]
    assert set(hosts) <= {socket.gethostname(), OTHER_HOST}
    order = list(dict.fromkeys(hosts))
    assert hosts == sorted(hosts, key=order.index)
    for g in got:
        mine = [h for h in hosts[: g["rank"]] if h == g["host"]]
        assert g["local"] == (len(mine), hosts.count(g["host"]))
        assert g["cross"][1] == len([h for h in order if hosts.count(h) > len(mine)])
    assert got[0]["gathered"] == [[g["rank"], g["local"][0]] for g in got]
    for g, r in zip(got, ref):
        assert g["sum"] == r["sum"]  # the same bits as the bagua-run job
    np.testing.assert_allclose(np.frombuffer(got[0]["sum"], np.float32), numpy_sum(n),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_three_ranks_span_both_workers(cluster):
    """4 slots, 3 ranks: Spark spreads the tasks over both executors (2 cores each), so two host
    names appear and ranks on the same worker share their host's local ranks."""
    import bagua_hvd.spark

    def where():

        return os.environ["HOROVOD_HOSTNAME"], os.environ["HOROVOD_LOCAL_SIZE"]

    got = bagua_hvd.spark.run(where, num_proc=3, start_timeout=120)
    hosts = [h for h, _ in got]
    assert len(set(hosts)) == 2, got
    assert [int(s) for _, s in got] == [hosts.count(h) for h in hosts]


def failing(marker_seconds: float):
    import time

    import bagua_hvd.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one gives up")
    time.sleep(marker_seconds)  # the others are stuck until the run stops them
    return hvd.rank()


def test_a_failing_rank_fails_the_call_and_leaves_nothing_running(cluster):
    import bagua_hvd.spark

    marker = f"BAGUA_HVD_SPARK_TEST_{secrets.token_hex(6)}"
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        bagua_hvd.spark.run(failing, args=(300,), num_proc=3, start_timeout=120,
                            env={marker: "1"})  # fmt: skip
    assert time.monotonic() - start < 120  # not the sleeping ranks' 300 s
    text = str(info.value)
    assert "rank 1 failed" in text and "ValueError: rank one gives up" in text
    tracker = cluster.sparkContext.statusTracker()
    assert tracker.getActiveStageIds() == [] and tracker.getActiveJobsIds() == []
    deadline = time.monotonic() + 15
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


def killed_on_rank_one():

    if os.environ["HOROVOD_RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return "alive"


def test_a_rank_killed_by_a_signal_is_named(cluster):
    import bagua_hvd.spark

    with pytest.raises(RuntimeError, match="rank 1 was killed by signal SIGKILL without a Python"):
        bagua_hvd.spark.run(killed_on_rank_one, num_proc=2)
    assert cluster.sparkContext.statusTracker().getActiveStageIds() == []


def test_an_executable_that_cannot_start_is_named(cluster):
    import bagua_hvd.spark

    with pytest.raises(RuntimeError, match="cannot start '/no/such/python'"):
        bagua_hvd.spark.run(job, args=("x",), num_proc=2, executable="/no/such/python")
    assert cluster.sparkContext.statusTracker().getActiveStageIds() == []


def test_too_few_slots_time_out(cluster):
    """5 ranks on 4 slots: the start times out, naming the count, and the tasks are cancelled."""
    import bagua_hvd.spark

    with pytest.raises(TimeoutError, match="4 of 5 registered"):
        bagua_hvd.spark.run(job, args=("never",), num_proc=5, start_timeout=8)
    assert cluster.sparkContext.statusTracker().getActiveStageIds() == []


def test_ranks_import_horovod_as_bagua_hvd_when_the_driver_does(cluster, monkeypatch):
    """BAGUA_HVD_AS_HOROVOD=1 on the driver: ``horovod.spark.run`` is bagua_hvd's, and the
    ranks, started by workers without the variable, import horovod as bagua_hvd too."""
    from bagua_hvd import as_horovod

    monkeypatch.setenv("BAGUA_HVD_AS_HOROVOD", "1")
    as_horovod.install()
    try:
        import horovod.spark

        got = horovod.spark.run(horovod_job, num_proc=2, start_timeout=120)
    finally:
        as_horovod.uninstall()
    assert got == [("bagua_hvd.torch", 0, 3.0), ("bagua_hvd.torch", 1, 3.0)]
