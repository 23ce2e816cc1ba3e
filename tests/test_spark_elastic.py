"""bagua_hvd.spark.run_elastic on a local Spark standalone cluster (tests/spark_cluster.py: two
workers of 2 cores, the second one's ranks under another host name), nothing of it mocked.

The jobs run tests/cluster_job.py's elastic SGD (a commit per step, the size of each step kept
in the state); a numpy replay of the same SGD at the sizes the job had must give the same
weights. A steady job must give what bagua_hvd.spark.run gives for the same function.
"""

from __future__ import annotations

import io
import secrets
import shutil
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("torch")
if shutil.which("java") is None:
    pytest.skip("no java on PATH: Spark needs a Java runtime", allow_module_level=True)

# The ranks cannot import this test module (nor tests/cluster_job.py): send them by value.
import cloudpickle  # noqa: E402
import cluster_job  # noqa: E402
from cluster_job import check_trajectory, train  # noqa: E402
from spark_cluster import processes_with  # noqa: E402

for _module in (sys.modules[__name__], cluster_job):
    cloudpickle.register_pickle_by_value(_module)

STEPS = 12
KILL_AT = 4


def test_arguments_it_refuses(monkeypatch):
    """Horovod's deprecations and messages, before any task."""
    from pyspark import SparkContext

    from bagua_hvd.spark import run_elastic

    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    for old, new in (("min_np", "min_num_proc"), ("max_np", "max_num_proc")):
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated, use {new} instead"):
            with pytest.raises(RuntimeError, match="Could not find an active SparkContext, are "
                               "you running in a PySpark session"):  # fmt: skip
                run_elastic(train, **{old: 1})

    class Conf(dict):
        def get(self, key, default=None):
            return super().get(key, default)

    class Context:
        defaultParallelism = 2
        conf = Conf()

        def getConf(self):
            return self.conf

    monkeypatch.setattr(SparkContext, "_active_spark_context", Context())
    with pytest.raises(ValueError, match=r"min_num_proc \(3\) <= num_proc \(2\) <= max_num_proc"):
        run_elastic(train, min_num_proc=3)
    with pytest.raises(ValueError, match=r"num_proc \(2\) <= max_num_proc \(1\) does not hold"):
        run_elastic(train, max_num_proc=1)
    with pytest.raises(ValueError, match="num_proc must be an int >= 1"):
        run_elastic(train, num_proc=0)
    with pytest.raises(ValueError, match="reset_limit must be >= 0"):
        run_elastic(train, reset_limit=-1)
    with pytest.raises(TypeError, match="fn must be callable"):
        run_elastic(3)
    Context.conf["spark.speculation"] = "true"
    with pytest.raises(ValueError, match="spark.speculation=false"):
        run_elastic(train)


def say_step(state):
    import bagua_hvd.torch as hvd

    print(f"rank {hvd.rank()} took step {state.step}", flush=True)


def test_a_steady_job_matches_spark_run(spark_cluster):
    """Nothing lost: the elastic job's results are bagua_hvd.spark.run's, bit for bit, and the
    ranks' output reaches the caller's streams."""
    import bagua_hvd.spark

    out = io.StringIO()
    got = bagua_hvd.spark.run_elastic(
        train,
        args=(STEPS,),
        kwargs={"log": False, "on_step": say_step},
        num_proc=2,
        start_timeout=120,
        elastic_timeout=60,
        stdout=out,
    )
    assert check_trajectory(got, STEPS) == [2] * STEPS
    assert f"[1]<stdout>:rank 1 took step {STEPS}\n" in out.getvalue()
    ref = bagua_hvd.spark.run(
        train, args=(STEPS,), kwargs={"log": False}, num_proc=2, start_timeout=120
    )
    assert got == ref
    assert spark_cluster.sparkContext.statusTracker().getActiveStageIds() == []


def fail_on_rank_one():
    import bagua_hvd.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one gives up")
    return hvd.rank()


def test_a_failing_function_fails_the_job(spark_cluster):
    """An error of the function (not a lost peer) fails the job, naming it, and nothing of the
    job is left."""
    import bagua_hvd.spark

    marker = f"BAGUA_HVD_SPARK_TEST_{secrets.token_hex(6)}"
    with pytest.raises(RuntimeError) as info:
        bagua_hvd.spark.run_elastic(fail_on_rank_one, num_proc=2, start_timeout=120,
                                    elastic_timeout=60, env={marker: "1"})  # fmt: skip
    text = str(info.value)
    assert "exited with non-zero status" in text and "ValueError: rank one gives up" in text
    _nothing_left(spark_cluster, marker)


def kill_at_step(target: str, state) -> None:
    """At step KILL_AT of the 3-rank job, the rank alone on its host (one host has two of the
    three tasks, the other one) kills with SIGKILL its ``target``: its Spark executor's JVM
    (whose Python workers die with it), or its task's Python worker (its guard's parent). Either
    way its guard then stops it."""
    import os
    import signal
    import time

    import bagua_hvd.torch as hvd

    if state.step != KILL_AT or hvd.size() != 3 or hvd.local_size() != 1:
        return

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])

    victim = parent(os.getppid())
    if target == "executor":
        while victim > 1:
            with open(f"/proc/{victim}/cmdline", "rb") as f:
                if b"CoarseGrainedExecutorBackend" in f.read():
                    break
            victim = parent(victim)
        else:
            raise RuntimeError("no Spark executor among this rank's ancestors")
    os.kill(victim, signal.SIGKILL)
    time.sleep(60)  # until this rank's guard stops it


@pytest.mark.parametrize("target", ["python worker", "executor"])
def test_a_lost_task_leaves_a_smaller_job(spark_cluster, target):
    """3 ranks (2 on one host, 1 on the other), at least 2: the lone rank's executor, or its
    task's Python worker, is killed mid-training; the two others go on as a job of 2 to the end
    (the lost host is blacklisted: Spark's new attempt of the task there stays idle)."""
    import functools

    import bagua_hvd.spark

    marker = f"BAGUA_HVD_SPARK_TEST_{secrets.token_hex(6)}"
    started = time.monotonic()
    got = bagua_hvd.spark.run_elastic(
        train,
        args=(STEPS,),
        kwargs={"step_s": 0.2, "log": False, "on_step": functools.partial(kill_at_step, target)},
        num_proc=3,
        min_num_proc=2,
        max_num_proc=3,
        start_timeout=120,
        elastic_timeout=60,
        env={marker: "1"},
    )
    sizes = check_trajectory(got, STEPS)
    assert len(got) == 2 and sizes[0] == 3 and sizes[-1] == 2, sizes
    assert sizes == sorted(sizes, reverse=True), sizes
    assert time.monotonic() - started < 150
    _nothing_left(spark_cluster, marker)


def _nothing_left(spark, marker: str) -> None:
    """No Spark task of the job runs, and no rank (whose environment holds ``marker``) lives."""
    assert spark.sparkContext.statusTracker().getActiveStageIds() == []
    deadline = time.monotonic() + 15
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == []
