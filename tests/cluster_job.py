"""The functions that tests/test_ray.py, tests/test_spark.py and their elastic tests run on a
cluster's ranks and with bagua_hvd.run, to compare the jobs; the tests send this module by value
(the workers cannot import it)."""

from __future__ import annotations

import os


def job(tag: str) -> dict:
    """The rank variables and two collectives' results."""
    import numpy as np
    import torch

    import bagua_hvd.torch as hvd

    hvd.init()
    r = hvd.rank()
    x = torch.from_numpy(np.random.default_rng(r).standard_normal(100_000).astype(np.float32))
    total = hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.ar")
    ranks = hvd.allgather(torch.tensor([[r, hvd.local_rank()]]), name=f"{tag}.ag")
    out = {
        "rank": r,
        "size": hvd.size(),
        "local": (hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "host": os.environ.get("HOROVOD_HOSTNAME"),
        "sum": total.numpy().tobytes(),
        "gathered": ranks.tolist(),
    }
    hvd.shutdown()
    return out


def horovod_job() -> tuple:
    """A Horovod user's function: ``import horovod.torch`` in the rank."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="as_horovod")
    out = (hvd.__name__, hvd.rank(), total.item())
    hvd.shutdown()
    return out


def numpy_sum(n: int):
    """What the allreduce of :func:`job` on ``n`` ranks sums to, computed by numpy."""
    import numpy as np

    data = [np.random.default_rng(r).standard_normal(100_000).astype(np.float32) for r in range(n)]
    return sum(data)


def job_left_running(marks: str) -> int:
    """A rank that returns without ``hvd.shutdown()`` (as Horovod users' functions often do):
    when its job ends, while still up, it writes ``<marks>/<rank>``. Its launcher must end the
    job as a process's exit does before it discards the rank."""
    import pathlib

    import torch

    import bagua_hvd.torch as hvd
    from bagua_hvd.common import basics

    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(4), name="left_running")

    def mark() -> None:
        # Only while the job is still up: a rank killed or failed writes nothing.
        hvd.allreduce(torch.ones(1), name="left_running.last")
        pathlib.Path(marks, str(rank)).write_text("ended")

    basics.before_shutdown(mark)
    return rank


# Elastic training (tests/test_ray_elastic.py, tests/test_spark_elastic.py): plain SGD on a
# linear model (float64) whose data depend only on the step and the rank, one commit per step.

DIM = 5
BATCH = 4
LR = 0.1


def batch(step: int, rank: int):
    import numpy as np

    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal((BATCH, DIM)), rng.standard_normal(BATCH)


# With until_size, the most steps a job takes while it waits for its new size.
MAX_STEPS = 1000


def train(steps: int, step_s: float = 0.0, until_size=None, log: bool = True, on_step=None):
    """The workers' function: elastic SGD, one commit per step. Rank 0 logs each step (the
    test's callback sees the progress); returns the weights, the steps and their sizes. With
    ``until_size`` it goes on past ``steps`` until the job has that size (the cluster's change
    has landed, however slow the machine), then takes ``steps // 2`` more. ``log``: rank 0
    logs each step through ray_logger (only where a Ray driver listens). ``on_step(state)``, if
    given, is called after each step, before its commit."""
    import time

    import torch

    import bagua_hvd.torch as hvd

    hvd.init()
    model = torch.nn.Linear(DIM, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
    )
    # reached: the step at which the job first had until_size (-1: not yet).
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=[], reached=-1)

    def more(state):
        if until_size is None or state.step >= MAX_STEPS:
            return state.step < steps
        if hvd.size() != until_size:
            return True
        if state.reached < 0:
            state.reached = state.step
        return state.step < max(steps, state.reached + steps // 2)

    @hvd.elastic.run
    def loop(state):
        while more(state):
            x, y = batch(state.step, hvd.rank())
            opt.zero_grad()
            out = model(torch.from_numpy(x)).squeeze(1)
            loss = 0.5 * ((out - torch.from_numpy(y)) ** 2).mean()
            loss.backward()
            opt.step()
            state.sizes.append(hvd.size())
            state.step += 1
            if log and hvd.rank() == 0:
                from bagua_hvd.ray import ray_logger

                ray_logger.log({"step": state.step, "size": hvd.size()})
            time.sleep(step_s)
            if on_step is not None:
                on_step(state)
            state.commit()

    loop(state)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "step": state.step,
        "sizes": list(state.sizes),
        "weights": model.weight.detach().numpy().ravel().tolist(),
    }


def replay(sizes):
    """The same SGD in numpy: each step's gradient averaged over that step's ranks."""
    import numpy as np

    w = np.zeros(DIM)
    for step, n in enumerate(sizes):
        grads = []
        for r in range(n):
            x, y = batch(step, r)
            grads.append(x.T @ (x @ w - y) / BATCH)
        w = w - LR * np.mean(grads, axis=0)
    return w


def check_trajectory(results, steps):
    import numpy as np

    assert results, "no worker returned"
    first = results[0]
    assert [r["rank"] for r in results] == list(range(first["size"]))
    assert len(results) == first["size"]
    for r in results:
        assert r["step"] >= steps and len(r["sizes"]) == r["step"]
        assert r["sizes"] == first["sizes"]
        assert r["weights"] == first["weights"]  # every rank holds the same model
    np.testing.assert_allclose(first["weights"], replay(first["sizes"]), rtol=1e-9, atol=1e-12)
    return first["sizes"]
