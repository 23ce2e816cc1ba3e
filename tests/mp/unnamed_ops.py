"""A user's unnamed collectives, as a training script calls them after its loop (metrics, a
checkpoint's object): shared by the torch and TensorFlow tests of tests/mp/."""

from __future__ import annotations

from typing import Any, Callable


def check_unnamed_ops(hvd: Any, tensor: Callable[[list], Any], values: Callable[[Any], list]):
    """Unnamed allreduce, allgather, broadcast and broadcast_object on every rank, each checked
    against its value computed here from the rank numbers. ``tensor`` makes the frontend's
    tensor from a list, ``values`` reads one back as a list."""
    n, r = hvd.size(), hvd.rank()
    total = hvd.allreduce(tensor([float(r + 1)]), op=hvd.Sum)
    ranks = hvd.allgather(tensor([r]))
    root = hvd.broadcast(tensor([10 * r]), root_rank=n - 1)
    obj = hvd.broadcast_object({"from": r}, root_rank=0)
    assert values(total) == [n * (n + 1) / 2]
    assert values(ranks) == list(range(n))
    assert values(root) == [10 * (n - 1)]
    assert obj == {"from": 0}


def train_until_every_rank_averaged(
    hvd: Any,
    rounds: Callable[[], int],
    step: Callable[[], None],
    tensor: Callable[[list], Any],
    values: Callable[[Any], list],
    limit: int = 2000,
) -> None:
    """Steps every rank together (a named check per step: it takes no unnamed number) until
    each rank's background averager has merged a round; on a loaded machine the first steps
    may all end before one did. Fails after ``limit`` steps."""
    for i in range(limit):
        done = hvd.allreduce(
            tensor([min(rounds(), 1)]), op=hvd.Min, name=f"unnamed_ops.averaged.{i}"
        )
        if values(done) == [1]:
            return
        step()
    raise AssertionError(f"no background averaging round on some rank after {limit} steps")
