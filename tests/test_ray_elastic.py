"""Elastic training on a real local Ray cluster (ray.cluster_utils.Cluster: a head without CPUs,
so it offers no slot, and worker nodes of one CPU each, every one its own raylet):
bagua_hvd.ray.ElasticRayExecutor, RayHostDiscovery and RayExecutor(min_workers=...), on
bagua_hvd's elastic driver with nothing of it mocked.

The training jobs run plain SGD on a linear model (float64) whose data depend only on the step
and the rank, with a commit after every step and the size of each step kept in the state; a
numpy replay of the same SGD at the sizes the job had must give the same weights.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

import cloudpickle  # noqa: E402
import cluster_job  # noqa: E402
from cluster_job import check_trajectory, train  # noqa: E402
from ray import cloudpickle as ray_cloudpickle  # noqa: E402

# The actors cannot import this test module (nor tests/cluster_job.py): send them by value.
for _module in (sys.modules[__name__], cluster_job):
    cloudpickle.register_pickle_by_value(_module)
    ray_cloudpickle.register_pickle_by_value(_module)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    c.add_node(num_cpus=1)
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def worker_nodes(cluster, n: int):
    """Adds or removes worker nodes (1 CPU each) until there are ``n``; returns them."""
    while len(cluster.worker_nodes) < n:
        cluster.add_node(num_cpus=1)
    while len(cluster.worker_nodes) > n:
        cluster.remove_node(list(cluster.worker_nodes)[-1])
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [x for x in ray.nodes() if x["Alive"] and x["Resources"].get("CPU", 0) > 0]
        if len(alive) == n:
            break
        time.sleep(0.2)
    return list(cluster.worker_nodes)


def node_with_id(cluster, node_id: str):
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


class Progress:
    """A callback that keeps rank 0's records; ``wait`` for a step."""

    def __init__(self):
        self.records = []
        self.cond = threading.Condition()

    def __call__(self, record):
        with self.cond:
            self.records.append(record)
            self.cond.notify_all()

    def wait(self, step: int, timeout: float = 60) -> None:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(r["step"] >= step for r in self.records), timeout=timeout
            )
        assert ok, f"step {step} not reached in {timeout} s: {self.records[-3:]}"


def run_in_thread(fn):
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def result_of(thread, out, timeout: float = 120):
    thread.join(timeout)
    assert not thread.is_alive(), "the elastic job did not end"
    if "error" in out:
        raise out["error"]
    return out["value"]


def executor(**settings):
    from bagua_hvd.ray import ElasticRayExecutor

    s = ElasticRayExecutor.create_settings(
        **dict(dict(elastic_timeout=30, timeout_s=30), **settings)
    )
    e = ElasticRayExecutor(s, cpus_per_slot=1)
    e.start()
    return e


@pytest.mark.timeout(150)
def test_node_removed_mid_training_finishes_smaller(cluster):
    nodes = worker_nodes(cluster, 2)
    steps = 20
    progress = Progress()
    ex = executor(min_num_proc=1, max_num_proc=2)
    t, out = run_in_thread(
        lambda: ex.run(lambda: train(steps, 0.05, until_size=1), callbacks=[progress])
    )
    progress.wait(5)
    assert progress.records[-1]["size"] == 2
    # Remove the node that does not hold rank 0 (the hosts are ordered oldest first).
    cluster.remove_node(nodes[1])
    results = result_of(t, out)
    sizes = check_trajectory(results, steps)
    assert len(results) == 1 and results[0]["size"] == 1
    assert sizes[0] == 2 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.timeout(150)
def test_a_steady_job_matches_the_bagua_run_job(cluster):
    """Two nodes that stay: the elastic Ray job's results are the bagua_hvd.run job's (the
    launcher's ranks, the same function), bit for bit."""
    import bagua_hvd

    worker_nodes(cluster, 2)
    steps = 12
    ex = executor(min_num_proc=2, max_num_proc=2)
    results = ex.run(lambda: train(steps, log=False))
    assert check_trajectory(results, steps) == [2] * steps
    reference = bagua_hvd.run(train, args=(steps,), kwargs={"log": False}, np=2)
    assert results == reference


@pytest.mark.timeout(120)
def test_a_job_left_running_is_ended_before_its_actors_go(cluster, tmp_path):
    """Workers whose function returns without hvd.shutdown(): each actor's job ends as at a
    process's exit (its shutdown runs while the job is still up) before the actor is killed,
    so a peer still inside the last collective sees it finish, not vanish."""
    worker_nodes(cluster, 2)
    ex = executor(min_num_proc=2, max_num_proc=2)
    assert ex.run(lambda: cluster_job.job_left_running(str(tmp_path))) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]


@pytest.mark.timeout(150)
def test_node_added_mid_training_grows(cluster):
    worker_nodes(cluster, 1)
    steps = 20
    progress = Progress()
    ex = executor(min_num_proc=1)
    t, out = run_in_thread(
        lambda: ex.run(lambda: train(steps, 0.05, until_size=2), callbacks=[progress])
    )
    progress.wait(3)
    assert progress.records[-1]["size"] == 1
    cluster.add_node(num_cpus=1)
    results = result_of(t, out)
    sizes = check_trajectory(results, steps)
    assert len(results) == 2 and results[0]["size"] == 2
    assert sizes[0] == 1 and sizes[-1] == 2 and sizes == sorted(sizes)


@pytest.mark.timeout(90)
def test_discovery_counts_slots_per_live_node(cluster):
    from bagua_hvd.ray import RayHostDiscovery

    nodes = worker_nodes(cluster, 2)
    ids = {n.node_id for n in nodes}
    assert RayHostDiscovery().find_available_hosts_and_slots() == dict.fromkeys(ids, 1)
    # A node of 4 CPUs and 2 (logical) GPUs: slots by CPUs, then bounded by GPUs.
    big = cluster.add_node(num_cpus=4, num_gpus=2)
    cluster.wait_for_nodes()
    try:
        assert RayHostDiscovery(cpus_per_slot=1).find_available_hosts_and_slots() == dict(
            dict.fromkeys(ids, 1), **{big.node_id: 4}
        )
        assert RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots() == {
            big.node_id: 2
        }
        gpu = RayHostDiscovery(use_gpu=True, cpus_per_slot=1, gpus_per_slot=1)
        assert gpu.find_available_hosts_and_slots() == {big.node_id: 2}
        gpu2 = RayHostDiscovery(use_gpu=True, cpus_per_slot=1, gpus_per_slot=2)
        assert gpu2.find_available_hosts_and_slots() == {big.node_id: 1}
    finally:
        cluster.remove_node(big)
    # A removed node's slots are gone.
    deadline = time.monotonic() + 30
    while big.node_id in RayHostDiscovery().find_available_hosts_and_slots():
        assert time.monotonic() < deadline, "the removed node is still discovered"
        time.sleep(0.2)


class Scale:
    def __init__(self, factor):
        self.factor = factor


def rank_times(scale):
    import bagua_hvd.torch as hvd

    hvd.init()
    return (hvd.rank(), hvd.size(), scale.factor * (hvd.rank() + 1))


@pytest.mark.timeout(120)
def test_ray_executor_elastic_mode(cluster):
    from bagua_hvd.ray import RayExecutor

    worker_nodes(cluster, 2)
    settings = RayExecutor.create_settings(timeout_s=30)
    ex = RayExecutor(settings, min_workers=1, max_workers=2, cpus_per_worker=1, elastic_timeout=30)
    ex.start(executable_cls=Scale, executable_args=[10])
    try:
        results = ex.run(lambda steps, more=0: train(steps + more), args=[1], kwargs={"more": 3})
        check_trajectory(results, 4)
        assert [r["sizes"] for r in results] == [[2] * 4] * 2
        # execute: fn(executable) in each worker, built from executable_cls.
        assert ex.execute(rank_times) == [(0, 2, 10), (1, 2, 20)]
        with pytest.raises(NotImplementedError, match="ObjectRefs cannot be returned"):
            ex.run_remote(lambda: 0)
        with pytest.raises(NotImplementedError, match="does not support execute_single"):
            ex.execute_single(lambda _: 0)
    finally:
        ex.shutdown()
    # max_workers bounds the job below the slots there are.
    one = RayExecutor(settings, min_workers=1, max_workers=1, elastic_timeout=30)
    one.start()
    assert one.execute(lambda _: rank_times(Scale(1))) == [(0, 1, 1)]
    # override_discovery=False: the settings' own discovery, its host named by IP (Horovod's
    # naming) and placed on a node with that IP.
    from bagua_hvd.runner.elastic.discovery import HostDiscovery

    class ByIp(HostDiscovery):
        def find_available_hosts_and_slots(self):
            return {ray.util.get_node_ip_address(): 1}

    own = RayExecutor.create_settings(timeout_s=30)
    own.discovery = ByIp()
    mine = RayExecutor(own, min_workers=1, override_discovery=False, elastic_timeout=30)
    mine.start()
    got = mine.run(lambda: (rank_times(Scale(1)), ray.get_runtime_context().get_node_id()))
    assert got[0][0] == (0, 1, 1) and got[0][1] in {n.node_id for n in cluster.worker_nodes}


def fail_everywhere():
    import bagua_hvd.torch as hvd

    hvd.init()
    raise ValueError(f"boom on rank {hvd.rank()}")


@pytest.mark.timeout(120)
def test_errors(cluster):
    from bagua_hvd.ray import ElasticRayExecutor, RayExecutor

    worker_nodes(cluster, 2)
    # A function that raises on every rank fails the job, naming the error.
    ex = executor(min_num_proc=2)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ex.run(fail_everywhere)
    assert time.monotonic() - started < 60
    text = str(info.value)
    assert "exited with non-zero status" in text and "ValueError: boom on rank" in text, text

    # Horovod's argument errors.
    s = ElasticRayExecutor.create_settings()
    with pytest.raises(ValueError, match="gpus_per_slot is set, but use_gpu is False"):
        ElasticRayExecutor(s, gpus_per_slot=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        ElasticRayExecutor.create_settings(bogus=1)
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        assert ElasticRayExecutor.create_settings(min_np=2).min_num_proc == 2
    with pytest.raises(ValueError, match="max_num_proc"):
        ElasticRayExecutor(
            ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2)
        ).start()
    with pytest.raises(ValueError, match="settings.discovery is None"):
        ElasticRayExecutor(s, override_discovery=False).start()
    with pytest.raises(RuntimeError, match="start"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings()).run(lambda: 0)
    rs = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers` provided"):
        RayExecutor(rs, min_workers=1, num_workers=1)
    with pytest.raises(ValueError, match="`max_workers` provided without any positive"):
        RayExecutor(rs, max_workers=2)
    with pytest.raises(ValueError, match="min_num_proc"):
        RayExecutor(rs, min_workers=0).start()
    # Not enough slots within the elastic timeout: Horovod's message, no hang.
    few = executor(min_num_proc=3, elastic_timeout=2)
    with pytest.raises(RuntimeError, match="Timed out waiting for minimum number of slots"):
        few.run(lambda: 0)


@pytest.mark.timeout(150)
def test_the_example_runs_as_a_driver(cluster):
    """examples/ray/elastic_digits.py, attached to this cluster (so without its own cluster's
    changes, which the tests above make), as a separate driver program."""
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("sklearn")
    worker_nodes(cluster, 2)
    script = Path(__file__).resolve().parent.parent / "examples" / "ray" / "elastic_digits.py"
    env = dict(os.environ, PYTHONPATH=str(script.parent.parent.parent))
    args = ["--address", cluster.address, "--epochs", "2", "--batch-delay", "0"]
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout, proc.stdout
