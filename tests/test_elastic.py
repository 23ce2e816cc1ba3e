"""Horovod's elastic scenarios through the real launcher: ``bagua-run --min-np/--max-np
--host-discovery-script`` (or ``-H``) over two "hosts" of this machine (``localhost`` and
``127.0.0.1``: distinct names, so the ranks of one talk TCP to the other's), running
tests/workers/elastic_torch_main.py.

Each test checks, per logged epoch, what Horovod's semantics give (worked out by hand from
Horovod's driver: the oldest hosts keep the lowest ranks, a failure blacklists its host, a
failed step rolls back to the last commit): size, start rank and host of rank 0, the number of
rendezvous, and the commits (10 batch commits and 1 epoch commit per epoch: 10 + 11 * epoch
when the line is written, however many resets happened).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "tests" / "workers" / "elastic_torch_main.py"
JOB_TIMEOUT = 240

FAILURE = "Horovod detected that one or more processes exited with non-zero status"


def _discovery_script(tmp: Path, logfile: Path, schedule: list) -> Path:
    """Horovod's test template: the hosts depend on how many epochs rank 0 has logged."""
    lines = [
        "#!/bin/bash",
        f'epoch=$(cat "{logfile}" 2>/dev/null | wc -l)',
    ]
    default = None
    branches = []
    for epoch, hosts in schedule:
        text = "\n".join(f"    echo {h}" for h in hosts) or "    true"
        if epoch is None:
            default = text
        else:
            branches.append((epoch, text))
    for i, (epoch, text) in enumerate(branches):
        lines.append(f'{"if" if i == 0 else "elif"} [ "$epoch" == "{epoch}" ]; then')
        lines.append(text)
    if branches:
        lines.append("else")
    lines.append(default or "    true")
    if branches:
        lines.append("fi")
    script = tmp / "discover.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def _run(
    tmp: Path,
    *,
    np: int = 2,
    min_np: int = 2,
    max_np: int | None = 4,
    schedule: list | None = None,
    hosts: str | None = None,
    exit_schedule: dict | None = None,
    exit_mode: str = "exception",
    epochs: int = 3,
    epoch_wait: float = 0.0,
    extra: tuple = (),
    env: dict | None = None,
    worker_args: tuple = (),
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    logfile = tmp / "log.jsonl"
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np), "--min-np",
           str(min_np)]  # fmt: skip
    if hosts is not None:
        cmd += ["-H", hosts]
    else:
        cmd += ["--host-discovery-script", str(_discovery_script(tmp, logfile, schedule))]
    if max_np is not None:
        cmd += ["--max-np", str(max_np)]
    cmd += list(extra)
    cmd += [sys.executable, str(MAIN), "--logfile", str(logfile), "--epochs", str(epochs),
            "--epoch-wait", str(epoch_wait), "--exit-mode", exit_mode, *worker_args]  # fmt: skip
    if schedule is not None:
        cmd += ["--discovery-schedule", json.dumps(schedule)]
    if exit_schedule:
        cmd += ["--exit-schedule", json.dumps({str(k): v for k, v in exit_schedule.items()})]
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="20", PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=str(tmp), env=env
    )
    lines = []
    if logfile.exists():
        lines = [json.loads(x) for x in logfile.read_text().splitlines() if x.strip()]
    return proc, lines


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstderr:\n{proc.stderr[-6000:]}\nstdout:\n{proc.stdout[-3000:]}"


def _torch_sample(rank: int, epoch: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100000 * rank + 1000 * epoch + batch)
    return torch.randn(8, 4, generator=g).double()


def _numpy_sample(rank: int, epoch: int, batch: int) -> torch.Tensor:
    rng = np.random.default_rng(100000 * rank + 1000 * epoch + batch)
    return torch.from_numpy(rng.standard_normal((8, 4)).astype(np.float32)).double()


def _replay(
    lines: list[dict], sample=_torch_sample, init: list | None = None, first_epoch: int = 0
) -> None:
    """Trains the script's model in this process, batch by batch at the sizes rank 0 logged
    (SGD at lr 0.01 x size on the mean gradient of ranks 0..size-1's samples), and checks the
    job's parameters after every epoch: a failed step must have been rolled back to the last
    commit and replayed, not applied twice or lost. ``lines`` are the epochs from
    ``first_epoch`` on (``init``: the weights that epoch started from)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    if init is not None:
        with torch.no_grad():
            model.weight.copy_(torch.tensor(init[:4]).view(1, 4))
            model.bias.copy_(torch.tensor(init[4:]))
    for epoch, line in enumerate(lines, start=first_epoch):
        assert len(line["sizes"]) == 10, line
        for batch, size in enumerate(line["sizes"]):
            grads = []
            for rank in range(size):
                x = sample(rank, epoch, batch)
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p -= 0.01 * size * torch.stack([g[i] for g in grads]).mean(dim=0)
        got = torch.tensor(line["params"], dtype=torch.float64)
        want = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"epoch {epoch}")


def _run_keras(tmp: Path, launcher: list, worker: list) -> tuple[subprocess.CompletedProcess, list]:
    """tests/workers/elastic_keras_main.py through bagua-run (``launcher``: its arguments before
    the command; ``worker``: the worker's after --logfile): the process and the logged rows
    (the initial weights, then one row per epoch)."""
    logfile = tmp / "log.jsonl"
    keras_main = ROOT / "tests" / "workers" / "elastic_keras_main.py"
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", *launcher, sys.executable,
           str(keras_main), "--logfile", str(logfile), *worker]  # fmt: skip
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="20", PYTHONPATH=str(ROOT),
               TF_CPP_MIN_LOG_LEVEL="2")  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=str(tmp), env=env
    )
    rows = [json.loads(x) for x in logfile.read_text().splitlines()] if logfile.exists() else []
    return proc, rows


def _check(line: dict, epoch: int, **expected) -> None:
    assert line["epoch"] == epoch, line
    assert line["batch"] == 10, line
    assert line["commits"] == 10 + 11 * epoch, line
    for key, value in expected.items():
        assert line[key] == value, (key, line)


@pytest.mark.parametrize("slots", [2, 1])
def test_hosts_added_and_removed(tmp_path, slots):
    schedule = [
        (0, [f"localhost:{slots}"]),
        (1, [f"localhost:{slots}", f"127.0.0.1:{slots}"]),
        (None, [f"127.0.0.1:{slots}"]),
    ]
    proc, lines = _run(tmp_path, np=slots, min_np=slots, max_np=2 * slots, schedule=schedule)
    assert proc.returncode == 0, _explain(proc)
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=slots, hostname="localhost", rendezvous=1)
    _check(lines[1], 1, start_rank=0, size=2 * slots, hostname="localhost", rendezvous=2)
    # localhost removed: 127.0.0.1's workers (started as ranks slots..) go on, without a sync.
    _check(lines[2], 2, start_rank=slots, size=slots, hostname="127.0.0.1", rendezvous=3)
    _replay(lines)


# Horovod's single-rank-failure and fault-tolerance scenarios each run by exception and by
# SIGKILL; here the two ways of failing are split between them (discovery script: exception;
# fixed hosts: kill), as how the worker fails and where the hosts come from are independent (a
# kill also runs in test_failure_mid_epoch_rolls_back_to_the_last_commit).
def test_single_rank_failure(tmp_path):
    schedule = [(None, ["localhost:2", "127.0.0.1:2"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 0): [0]},
                       exit_mode="exception")  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=4, rendezvous=1)
    # Rank 0 failed: localhost is blacklisted, 127.0.0.1's workers go on as ranks 0 and 1 from
    # the commit at the end of epoch 0.
    _check(lines[1], 1, start_rank=2, size=2, hostname="127.0.0.1", rendezvous=2)
    _check(lines[2], 2, start_rank=2, size=2, hostname="127.0.0.1", rendezvous=2)
    _replay(lines)


def test_failure_mid_epoch_rolls_back_to_the_last_commit(tmp_path):
    """Start rank 3 is killed before batch 3 of epoch 1: the survivors were inside batch 3's
    allreduce; they restore the commit after batch 2 and go on at size 2 from batch 3."""
    schedule = [(None, ["localhost:2", "127.0.0.1:2"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 3): [3]},
                       exit_mode="kill")  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=4, rendezvous=1)
    _check(lines[1], 1, start_rank=0, size=2, hostname="localhost", rendezvous=2)
    assert lines[1]["sizes"] == [4, 4, 4] + [2] * 7, lines[1]
    _replay(lines)


def test_fault_tolerance_without_scaling(tmp_path):
    proc, lines = _run(tmp_path, hosts="localhost:2,127.0.0.1:2", max_np=None,
                       exit_schedule={(1, 0): [0]}, exit_mode="kill")  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=4, rendezvous=1)
    _check(lines[1], 1, start_rank=2, size=2, hostname="127.0.0.1", rendezvous=2)
    _check(lines[2], 2, start_rank=2, size=2, hostname="127.0.0.1", rendezvous=2)


def test_all_ranks_of_a_host_failing(tmp_path):
    """Both workers of 127.0.0.1 (start ranks 2 and 3) fail at the start of epoch 1: that host
    is blacklisted and localhost's two workers finish the training from the last commit."""
    schedule = [(None, ["localhost:2", "127.0.0.1:2"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 0): [2, 3]})
    assert proc.returncode == 0, _explain(proc)
    assert len(lines) == 3, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=4, rendezvous=1)
    _check(lines[1], 1, start_rank=0, size=2, hostname="localhost", rendezvous=2)
    _check(lines[2], 2, start_rank=0, size=2, hostname="localhost", rendezvous=2)
    _replay(lines)


# The three scenarios below end the job, whatever the slots per host: one slot each (Horovod's
# tests run two), half the workers to start.
def test_all_ranks_failure(tmp_path):
    schedule = [(None, ["localhost:1", "127.0.0.1:1"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 0): [0, 1]})
    assert proc.returncode != 0, _explain(proc)
    assert FAILURE in proc.stderr, _explain(proc)
    assert len(lines) == 1, _explain(proc)


def test_all_hosts_blacklisted(tmp_path):
    schedule = [(None, ["localhost:1", "127.0.0.1:1"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 0): [0, 1]})
    assert proc.returncode != 0, _explain(proc)
    assert FAILURE in proc.stderr, _explain(proc)
    assert len(lines) == 1, _explain(proc)


def test_min_hosts_timeout(tmp_path):
    schedule = [(None, ["localhost:1", "127.0.0.1:1"])]
    proc, lines = _run(tmp_path, np=2, min_np=2, schedule=schedule,
                       exit_schedule={(1, 0): [0]}, extra=("--elastic-timeout", "1"))  # fmt: skip
    assert proc.returncode != 0, _explain(proc)
    assert (
        "Timed out waiting for minimum number of slots to become available. Please check that "
        "you have enough resources to run at least 2 Horovod processes. Timeout after 1 seconds."
    ) in proc.stderr, _explain(proc)
    assert len(lines) == 1, _explain(proc)


@pytest.mark.parametrize("limit", [1, 2])
def test_reset_limit(tmp_path, limit):
    # One slot per host (Horovod's test runs two): the resets counted do not depend on it.
    schedule = [
        (0, ["localhost:1"]),
        (1, ["localhost:1", "127.0.0.1:1"]),
        (None, ["127.0.0.1:1"]),
    ]
    proc, lines = _run(tmp_path, np=1, min_np=1, schedule=schedule,
                       extra=("--reset-limit", str(limit)))  # fmt: skip
    if limit == 1:
        assert proc.returncode != 0, _explain(proc)
        assert (
            "Horovod was shutdown because number of resets during elastic job exceeded limit: 1"
        ) in proc.stderr, _explain(proc)
        assert len(lines) == 2, _explain(proc)
    else:
        assert proc.returncode == 0, _explain(proc)
        assert [line["size"] for line in lines] == [1, 2, 1], _explain(proc)
        _replay(lines)


def test_blacklisted_host_comes_back_after_cooldown(tmp_path):
    """127.0.0.1's start rank 3 fails at the start of epoch 1: the host is blacklisted for 4 s
    (Horovod's first period: lower * 2 + U * lower, clamped to [3, 4]), the job goes on at size
    2, then the host is added back with fresh workers. Rank 0 waits at the end of epoch 2 for
    that update (unless it came earlier), so the outcome does not depend on the load: sizes 4,
    2, then 4 from epoch 3 at the latest."""
    schedule = [(None, ["localhost:2", "127.0.0.1:2"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 0): [3]}, epochs=5,
                       extra=("--blacklist-cooldown-range", "3", "4"),
                       worker_args=("--expect-size", "2,4", "--discovery-wait", "60"))  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert len(lines) == 5, _explain(proc)
    _check(lines[0], 0, start_rank=0, size=4, rendezvous=1)
    _check(lines[1], 1, start_rank=0, size=2, rendezvous=2)
    sizes = [line["size"] for line in lines]
    back = sizes.index(4, 2)  # the first epoch with the host back
    assert back <= 3 and sizes[back:] == [4] * (5 - back), sizes
    for e, line in enumerate(lines[2:], start=2):
        _check(line, e, start_rank=0, rendezvous=2 if e < back else 3)
    _replay(lines)
    # Rank 0 went through two resets: back at size 4, it holds the threads and descriptors it
    # held at the start (peers' connections, shared memory), no more.
    assert (lines[-1]["threads"], lines[-1]["fds"]) == (lines[0]["threads"], lines[0]["fds"]), lines


def test_elastic_sampler_visits_every_sample_once_across_a_resize(tmp_path):
    """4 workers on two hosts read a 200-sample dataset through an ElasticSampler, 5 samples per
    rank and batch; start rank 3 is killed before batch 3 of epoch 0. The 60 samples of the
    three committed batches at size 4 and the 140 the two survivors read after the reset are
    each of the 200, once; epoch 1 too."""
    logdir = tmp_path / "samples"
    logdir.mkdir()
    sampler_main = ROOT / "tests" / "workers" / "elastic_sampler_main.py"
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "4", "--min-np", "2",
           "-H", "localhost:2,127.0.0.1:2", sys.executable, str(sampler_main),
           "--logdir", str(logdir), "--kill", "0,3,3"]  # fmt: skip
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="20", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=str(tmp_path), env=env
    )
    assert proc.returncode == 0, _explain(proc)
    seen: dict[int, list[int]] = {0: [], 1: []}
    per_worker = {}
    for f in logdir.iterdir():
        rows = [line.split() for line in f.read_text().splitlines()]
        per_worker[int(f.name)] = len(rows)
        for epoch, *indices in rows:
            seen[int(epoch)] += [int(i) for i in indices]
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(200)), (epoch, sorted(indices))
    # Batches each worker committed: 3 at size 4, then 14 + 20 for the survivors (localhost's).
    assert per_worker == {0: 3 + 14 + 20, 1: 3 + 14 + 20, 2: 3, 3: 3}, per_worker


@pytest.mark.parametrize(
    "algorithm", ["bytegrad", "decentralized", "low_precision_decentralized", "async"]
)
def test_bagua_algorithms_re_plan_after_a_failure(tmp_path, algorithm):
    """BAGUA's algorithms through the same failure as above (start rank 3 killed mid-epoch 1):
    after the reset every algorithm re-plans for 2 ranks (new ring neighbours' replicas, error
    feedback dropped, a new background averager) and the ranks agree on the step counts, so the
    training finishes at the new size with finite weights."""
    schedule = [(None, ["localhost:2", "127.0.0.1:2"])]
    proc, lines = _run(tmp_path, schedule=schedule, exit_schedule={(1, 3): [3]},
                       exit_mode="kill", env={"BAGUA_HVD_ALGORITHM": algorithm})  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 4, 1), (1, 2, 2), (2, 2, 2),
    ], _explain(proc)  # fmt: skip
    # Batch 3 may still commit at size 4 with asynchronous averaging: its step communicates in
    # the background, the loss is seen at the next commit's broadcast.
    k = lines[1]["sizes"].count(4)
    assert lines[1]["sizes"] == [4] * k + [2] * (10 - k) and 3 <= k <= 4, lines[1]
    assert all(np.isfinite(line["params"]).all() for line in lines), lines
    if algorithm == "low_precision_decentralized":
        # The replicas a rank keeps of its neighbours are copies of their own (self) replicas,
        # bit for bit: at 4 ranks on two hosts (BAGUA's default hierarchical ring: the hosts'
        # leaders exchange) each is some rank's self replica; at 2 ranks on one host (a flat
        # ring of two) after the reset, exactly the other rank's: made anew for the new
        # neighbour, not kept from the old ring.
        for epoch, size in ((0, 4), (2, 2)):
            reps = {}
            for r in range(size):
                rows = (tmp_path / f"log.jsonl.replicas.{r}").read_text().splitlines()
                row = [json.loads(x) for x in rows if json.loads(x)["epoch"] == epoch][-1]
                assert row["size"] == size, row
                reps[r] = row["replicas"]
            for r in range(size):
                for b, (_, left, right) in enumerate(reps[r]):
                    selves = {reps[q][b][0] for q in range(size)}
                    assert left in selves and right in selves, (epoch, r, b, reps)
                    if size == 2:
                        assert left == right == reps[1 - r][b][0], (epoch, r, b, reps)


def test_async_averaging_takes_in_a_worker_that_joins(tmp_path):
    """torch, asynchronous model averaging, a third worker joining after epoch 0: the
    survivors' new averager and the new worker's have the same name (after the elastic
    generation, not each process's count of restarts), so their rounds meet."""
    schedule = [(0, ["localhost:2"]), (None, ["localhost:2", "127.0.0.1:1"])]
    # A second's wait after each epoch: the averagers (500 ms apart) reach the next steps with
    # a round to snapshot and merge (a round that never meets merges nothing; the training
    # itself does not wait for it).
    proc, lines = _run(tmp_path, np=2, min_np=2, max_np=3, schedule=schedule, epoch_wait=1.0,
                       env={"BAGUA_HVD_ALGORITHM": "async"})  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 2, 1), (1, 3, 2), (2, 3, 2),
    ], _explain(proc)  # fmt: skip
    assert all(np.isfinite(line["params"]).all() for line in lines), lines
    assert lines[2]["rounds"] >= 1, lines  # the three ranks' rounds met after the join


def test_tensorflow_takes_every_algorithm_in_an_elastic_job():
    """The TensorFlow frontend re-plans BAGUA's algorithms after a reset (next test): in an
    elastic job its DistributedOptimizer takes each of them (it refused the stateful ones
    before it could)."""
    code = """
import tensorflow as tf, bagua_hvd.tensorflow as hvd
from bagua_hvd.tensorflow import algorithms as alg
hvd.init()
for a in (alg.ByteGrad(error_feedback=True), alg.Decentralized(), alg.LowPrecisionDecentralized(),
          alg.LowPrecisionDecentralized(hierarchical=False), alg.AsyncModelAverage(),
          alg.GradientAllReduce()):
    hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), algorithm=a)
    print("accepted", type(a).__name__)
"""
    env = dict(os.environ, HOROVOD_ELASTIC="1", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, env=env)  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert proc.stdout.count("accepted") == 6, proc.stdout


# Every algorithm whose re-plan is in the TensorFlow kernels (residuals, peers, replicas). Async
# averaging's averager is the core's (bhvd_async_start), whose end at a peer's death torch's test
# above runs; its kernel's per-job restart runs in the Keras join test below.
@pytest.mark.parametrize("algorithm", ["bytegrad", "decentralized", "low_precision_decentralized"])
def test_keras_bagua_algorithms_re_plan_after_a_failure(tmp_path, algorithm):
    """Keras 3 with BAGUA's algorithms through model.fit and the elastic callbacks: of three
    workers on two hosts, start rank 2 (the second host's) is killed before batch 3 of epoch 1;
    the two others go on at size 2, where the algorithm re-planned in the TensorFlow kernels
    (error feedback's residuals sized for 2 ranks, the peer average over the 2, the ring's
    replicas made for the new neighbours, the step counts agreed), and finish with finite
    weights."""
    proc, rows = _run_keras(tmp_path, ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"],
                            ["--exit", "1,3,2", "--algorithm", algorithm])  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    lines = rows[1:]
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 3, 1), (1, 2, 2), (2, 2, 2),
    ], _explain(proc)  # fmt: skip
    # Keras's batch state is the last batch that ended (Horovod's UpdateBatchStateCallback), so
    # the batch after the last commit may run again at the new size: 10 or 11 batches.
    sizes = lines[1]["sizes"]
    k = sizes.count(3)
    assert sizes == [3] * k + [2] * (len(sizes) - k) and 3 <= k <= 4, lines[1]
    assert len(sizes) in (10, 11), lines[1]
    assert all(np.isfinite(line["params"]).all() for line in lines), lines
    assert lines[-1]["params"] != rows[0]["init"], "the training did not move the weights"
    if algorithm == "low_precision_decentralized":
        # After the reset (2 ranks on one host: a flat ring of two) a rank's copies of its
        # neighbour are that neighbour's own replica bit for bit: made anew for the new ring,
        # not kept from the ring of three.
        for epoch in (1, 2):
            reps = {}
            for r in range(2):
                rows_r = (tmp_path / f"log.jsonl.replicas.{r}").read_text().splitlines()
                row = [json.loads(x) for x in rows_r if json.loads(x)["epoch"] == epoch][-1]
                assert row["size"] == 2, row
                reps[r] = row["replicas"]
            for r in range(2):
                for b, (_, left, right) in enumerate(reps[r]):
                    assert left == right == reps[1 - r][b][0], (epoch, r, b, reps)


@pytest.mark.parametrize("algorithm", ["low_precision_decentralized", "async"])
def test_keras_bagua_algorithms_take_in_a_worker_that_joins(tmp_path, algorithm):
    """Two workers on one host, a third host appears after epoch 0: the new worker starts its
    algorithm from nothing while the others re-plan theirs, and they agree (step counts, the
    ring's replicas made in the same step, the averager's name after the elastic generation),
    so the job of three finishes."""
    # The log's first line is the initial weights; then one line per epoch.
    schedule = [(0, ["localhost:2"]), (1, ["localhost:2"]), (None, ["localhost:2", "127.0.0.1:1"])]
    discover = _discovery_script(tmp_path, tmp_path / "log.jsonl", schedule)
    proc, rows = _run_keras(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3",
                                       "--host-discovery-script", str(discover)],
                            ["--join-after-epoch", "0", "--algorithm", algorithm])  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    lines = rows[1:]
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 2, 1), (1, 3, 2), (2, 3, 2),
    ], _explain(proc)  # fmt: skip
    assert all(np.isfinite(line["params"]).all() for line in lines), lines


def test_keras_training_with_a_failure_matches_its_replay(tmp_path):
    """Keras 3 through model.fit and Horovod's elastic callbacks (KerasState, commit every
    batch): of two workers on two hosts, start rank 1 is killed at the start of epoch 1; the
    other finishes alone, and the weights after every epoch are those of the training replayed
    from the logged sizes."""
    proc, rows = _run_keras(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
                            ["--exit", "1,0,1"])  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    init, lines = rows[0]["init"], rows[1:]
    assert [(x["epoch"], x["size"], x["start_rank"], x["rendezvous"]) for x in lines] == [
        (0, 2, 0, 1), (1, 1, 0, 2), (2, 1, 0, 2),
    ], _explain(proc)  # fmt: skip
    _replay(lines, sample=_numpy_sample, init=init)
