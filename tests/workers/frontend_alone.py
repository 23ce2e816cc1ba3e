"""One rank of a job that uses one frontend while the other framework cannot be imported.

argv[1] is "torch" or "tensorflow": the frontend to use. The other framework is made
unimportable before anything else runs (a meta-path finder raises ModuleNotFoundError for it, as
on a machine where it is not installed; ``sys.modules[name] = None`` would not do: libraries such
as scipy probe ``sys.modules`` for torch). Each rank allreduces rank-dependent data
and checks the result against numpy, then checks that the other framework was never imported.
"""

from __future__ import annotations

import importlib.abc
import sys

FRONTEND = sys.argv[1]
ABSENT = {"torch": "tensorflow", "tensorflow": "torch"}[FRONTEND]


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == ABSENT or name.startswith(ABSENT + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())

import numpy as np  # noqa: E402

if FRONTEND == "torch":
    import bagua_hvd.torch as hvd  # noqa: E402

    def allreduce_sum(x: np.ndarray) -> np.ndarray:
        import torch

        return hvd.allreduce(torch.from_numpy(x), op=hvd.Sum).numpy()
else:
    import bagua_hvd.tensorflow as hvd  # noqa: E402

    def allreduce_sum(x: np.ndarray) -> np.ndarray:
        import tensorflow as tf

        eager = hvd.allreduce(tf.constant(x), op=hvd.Sum).numpy()
        # Inside tf.function: the compiled kernel, built and loaded without torch.
        assert hvd.mpi_ops._kernels.load() is not None, "the TF kernels did not build"
        graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(tf.constant(x)).numpy()
        assert np.array_equal(eager, graph), (eager, graph)
        return graph


hvd.init()
rank, size = hvd.rank(), hvd.size()
x = np.arange(6, dtype=np.float32) * (rank + 1)
expected = np.arange(6, dtype=np.float32) * sum(r + 1 for r in range(size))
got = allreduce_sum(x)
assert np.array_equal(got, expected), (got, expected)
try:
    __import__(ABSENT)
except ImportError:
    pass
else:
    raise AssertionError(f"{ABSENT} should not be importable in this test")
assert ABSENT not in sys.modules, f"{ABSENT} was imported"
hvd.shutdown()
print(f"rank {rank}: {FRONTEND} frontend OK without {ABSENT}", flush=True)
