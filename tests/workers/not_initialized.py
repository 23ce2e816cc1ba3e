"""Calls made before hvd.init(), one process per frontend (argv[1]: "torch" or "tensorflow"):
prints one line per call, ``<call>: <exception class>: <message>``, for
tests/test_not_initialized.py to compare with Horovod's classes."""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from bagua_hvd.common import ops
from bagua_hvd.common import primitives as P

FRONTEND = sys.argv[1]


def report(what: str, call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the class is what is reported
        message = " ".join(str(e).split())  # graph errors span lines
        print(f"{what}: {type(e).__name__}: {message}", flush=True)
    else:
        print(f"{what}: no error", flush=True)


weights = np.ones(4, np.float32)
buf = P.Buffer(weights.ctypes.data, ops.FLOAT32, weights.size)

if FRONTEND == "torch":
    import torch

    import bagua_hvd.torch as hvd

    errors = P.PYTHON_ERRORS
    report("allreduce", lambda: hvd.allreduce(torch.ones(2)))
    report("allgather", lambda: hvd.allgather(torch.ones(2)))
    report("barrier", lambda: hvd.barrier())
else:
    import tensorflow as tf

    import bagua_hvd.tensorflow as hvd
    from bagua_hvd.tensorflow.mpi_ops import TF_ERRORS as errors

    def in_graph() -> object:
        return hvd.allreduce(tf.ones(2))

    report("allreduce", lambda: hvd.allreduce(tf.ones(2)))
    report("allreduce in tf.function", tf.function(in_graph))
    report("allgather", lambda: hvd.allgather(tf.ones(2)))
    report("barrier", lambda: hvd.barrier())

# The algorithms' primitives, with the frontend's errors.
report("compressed allreduce", lambda: P.allreduce(buf, "c", 0, reduce_op=ops.Average,
                                                   compressed=True, errors=errors))  # fmt: skip
report("peer average", lambda: P.peer_average(buf, buf, "p", 0, peer_selection_mode="all",
                                              step=0, errors=errors))  # fmt: skip
