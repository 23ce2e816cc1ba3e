"""The function that tests/test_ray.py and tests/test_spark.py run on a cluster's ranks and with
bagua_hvd.run, to compare the two jobs; the tests send this module by value (the workers cannot
import it)."""

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
