"""bagua_hvd.ray.RayExecutor on a real local Ray cluster (a head and one more node, each its
own raylet: ray.cluster_utils.Cluster), against the same function run by bagua_hvd.run."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

# The actors (and bagua_hvd.run's ranks) cannot import this test module: send its functions by
# value.
import sys  # noqa: E402

import cloudpickle  # noqa: E402
from cluster_job import horovod_job, job, job_left_running, numpy_sum  # noqa: E402
from ray import cloudpickle as ray_cloudpickle  # noqa: E402

for _module in (sys.modules[__name__], sys.modules[job.__module__]):
    cloudpickle.register_pickle_by_value(_module)
    ray_cloudpickle.register_pickle_by_value(_module)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_two_workers_match_the_bagua_run_job(cluster):
    import numpy as np

    import bagua_hvd
    from bagua_hvd.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    try:
        got = executor.run(job, args=["ray2"])
    finally:
        executor.shutdown()
    ref = bagua_hvd.run(job, args=("ray2",), np=2)
    # PACK: both ranks on one node (2 CPUs each), sharing memory.
    assert [(g["rank"], g["size"], g["local"]) for g in got] == [(0, 2, (0, 2)), (1, 2, (1, 2))]
    for g, r in zip(got, ref):
        assert g["gathered"] == [[0, 0], [1, 1]]
        assert g["sum"] == r["sum"]  # the same bits as the bagua-run job
        np.testing.assert_allclose(np.frombuffer(g["sum"], np.float32), numpy_sum(2),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_actors_import_horovod_as_bagua_hvd_when_the_driver_does(cluster, monkeypatch):
    """BAGUA_HVD_AS_HOROVOD=1 in the driver (tests/test_as_horovod.py): the actors, started by
    a cluster without it, import horovod as bagua_hvd too."""
    from bagua_hvd.ray import RayExecutor

    monkeypatch.setenv("BAGUA_HVD_AS_HOROVOD", "1")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    try:
        got = executor.run(horovod_job)
    finally:
        executor.shutdown()
    assert got == [("bagua_hvd.torch", 0, 3.0), ("bagua_hvd.torch", 1, 3.0)]


def test_two_hosts_of_two_workers(cluster):
    import numpy as np

    import bagua_hvd
    from bagua_hvd.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(), num_hosts=2, num_workers_per_host=2)
    executor.start()
    try:
        got = executor.run(job, args=["ray4"])
        nodes = executor.execute(lambda _: ray.get_runtime_context().get_node_id())
    finally:
        executor.shutdown()
    # Ranks node by node: 0, 1 on one node, 2, 3 on the other (STRICT_SPREAD).
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert [g["local"] for g in got] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [g["cross"] for g in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all(g["gathered"] == [[0, 0], [1, 1], [2, 0], [3, 1]] for g in got)
    ref = bagua_hvd.run(job, args=("ray4",), np=4)
    for g, r in zip(got, ref):
        assert g["sum"] == r["sum"]
    np.testing.assert_allclose(np.frombuffer(got[0]["sum"], np.float32), numpy_sum(4),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_executable_and_bad_arguments(cluster):
    from bagua_hvd.ray import RayExecutor

    class Counter:
        def __init__(self, start):
            self.value = start

    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    executor.start(executable_cls=Counter, executable_args=[5],
                   extra_env_vars={"BAGUA_HVD_TEST_MARK": "x"})  # fmt: skip
    try:
        import os

        assert executor.execute(lambda c: c.value) == [5, 5]
        assert executor.execute_single(lambda c: os.environ["BAGUA_HVD_TEST_MARK"]) == "x"
        refs = executor.run_remote(lambda a, b=0: a + b, args=[1], kwargs={"b": 2})
        assert ray.get(refs) == [3, 3]
    finally:
        executor.shutdown()
    with pytest.raises(ValueError, match="exactly one of num_workers and num_hosts"):
        RayExecutor(RayExecutor.create_settings(), num_workers=2, num_hosts=1)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers` provided"):
        RayExecutor(RayExecutor.create_settings(), min_workers=1, num_workers=2)
    with pytest.raises(RuntimeError, match="start"):
        RayExecutor(RayExecutor.create_settings(), num_workers=1).run(lambda: 0)


def test_the_readme_block_runs_as_a_driver(cluster, tmp_path):
    # README.md's RayExecutor example (a ```py block: a driver, not a rank program), with a
    # train_fn of its own, run as a separate driver program attached to the cluster.
    import os
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    blocks = re.findall(r"```py\n(.*?)```", (root / "README.md").read_text(), re.S)
    block = next(b for b in blocks if "RayExecutor" in b)
    script = tmp_path / "driver.py"
    script.write_text(
        "def train_fn():\n"
        "    import torch, bagua_hvd.torch as hvd\n"
        "    hvd.init()\n"
        "    return hvd.allreduce(torch.ones(3), op=hvd.Sum, name='readme').tolist()\n"
        + block
        + "assert results == [[4.0, 4.0, 4.0]] * 4, results\nprint('driver OK')\n"
    )
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "driver OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_job_left_running_is_ended_before_its_actors_go(cluster, tmp_path):
    """Functions that return without hvd.shutdown(): RayExecutor.shutdown() ends their job on
    every rank together (each rank's shutdown runs while the job is still up, as at a
    process's exit) before it kills the actors."""
    from bagua_hvd.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    try:
        assert executor.run(job_left_running, args=[str(tmp_path)]) == [0, 1]
    finally:
        executor.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]

