"""Elastic training for PyTorch (``horovod.torch.elastic``): ``TorchState``, ``ElasticSampler``
and the ``run`` decorator.

The loop itself (sync, restore, reset, host-update notifications) is framework-neutral:
bagua_hvd.common.elastic. A reset here is the torch frontend's ``shutdown()`` then ``init()``
without arguments, as in Horovod: options given to the first ``hvd.init()`` (process sets
included) do not survive it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from bagua_hvd.common import elastic as _common_elastic
from bagua_hvd.common.elastic import run_fn
from bagua_hvd.torch.elastic.sampler import ElasticSampler
from bagua_hvd.torch.elastic.state import TorchState
from bagua_hvd.torch.mpi_ops import init, shutdown

__all__ = [
    "TorchState",
    "ElasticSampler",
    "run",
]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator used to run the elastic training process.

    The purpose of this decorator is to allow for uninterrupted execution of the wrapped
    function across multiple workers in parallel, as workers come and go from the system. When a
    new worker is added, its state needs to be brought to the same point as the other workers,
    which is done by synchronizing the state object before executing ``func``.

    When a worker is added or removed, other workers will raise an exception to bring them back
    to such a sync point before executing ``func`` again. This ensures that workers do not
    diverge when such reset events occur.

    No collective operation (broadcast, allreduce, ...) may run between ``hvd.init()`` and the
    call of the wrapped function: a new worker would meet it while the others synchronize the
    state, and the job would deadlock.

    Args:
        func: a wrapped function taking any number of args or kwargs. The first argument must
            be a ``bagua_hvd.common.elastic.State`` object (e.g. a ``TorchState``) used to
            synchronize state across workers.

    Returns:
        ``func`` wrapped: called as ``func(state, *args, **kwargs)``, it returns what ``func``
        returns once it completes without a reset.
    """
    return run_fn(func, functools.partial(_common_elastic.reset, shutdown, init))
