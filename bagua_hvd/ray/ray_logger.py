"""``horovod.ray.ray_logger``: a worker's ``log(info)`` reaches the driver, where the
``callbacks`` given to ``ElasticRayExecutor.run`` / ``RayExecutor.run`` (elastic) are called
with it. The executor hands every actor a Ray queue (:func:`configure`); without callbacks
there is none, and ``log`` warns once and drops the record, as Horovod's does unconfigured; so
it does when the queue is gone (unlike Horovod's, which raises into the training loop)."""

from __future__ import annotations

import warnings
from typing import Any, Optional

_queue: Optional[Any] = None
_warned = False


def configure(queue: Any) -> None:
    """Sends this process's records to ``queue`` (a ``ray.util.queue.Queue``)."""
    global _queue
    _queue = queue


def log(info_dict: dict) -> None:
    """Sends ``info_dict`` (picklable) to the driver's callbacks."""
    global _warned
    if _queue is not None:
        try:
            _queue.put(info_dict)
            return
        except Exception as e:  # noqa: BLE001 - the driver's queue gone: training goes on
            why = f"`ray_logger.log`: the driver's queue is gone ({type(e).__name__}); dropped"
    else:
        why = "`ray_logger.log` called but logging is not configured."
    if not _warned:
        _warned = True
        warnings.warn(why, stacklevel=2)
