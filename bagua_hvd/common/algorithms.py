"""BAGUA's algorithms: the framework-neutral declarations (docs/algorithms.md).

An algorithm is a declaration: which tensors are communicated (gradients, weights or the
optimizer's momentum), how they are bucketed, and which primitive of the core runs when. The
primitives themselves (compressed allreduce, decentralized averages, asynchronous averaging)
run in the C++ core; each frontend (``bagua_hvd.torch.algorithms``,
``bagua_hvd.tensorflow.algorithms``) turns a declaration into an implementation for its
tensors ("reifies" it) and decides when to start them. The classes are the same objects in
every frontend: ``bagua_hvd.torch.algorithms.ByteGrad is bagua_hvd.common.algorithms.ByteGrad``.

This module imports no framework. Frontend hooks:

* :func:`register_frontend` -- ``Algorithm.reify(owner)`` builds the implementation of the
  frontend whose owner type (e.g. ``torch.optim.Optimizer``) ``owner`` is an instance of;
* :func:`register_qadam_optimizer` -- a frontend's QAdam optimizer class, which
  ``QAdamAlgorithm`` accepts.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from bagua_hvd.common import config
from bagua_hvd.common import ops as _ops

# The public names every frontend's algorithms module re-exports (each adds its QAdamOptimizer).
FRONTEND_EXPORTS = [
    "Algorithm",
    "GradientAllReduce",
    "ByteGrad",
    "Decentralized",
    "LowPrecisionDecentralized",
    "QAdamAlgorithm",
    "AsyncModelAverage",
    "BY_NAME",
    "from_name",
    "from_environment",
]
__all__ = [*FRONTEND_EXPORTS, "register_frontend", "register_qadam_optimizer"]

ALGORITHM_ENV = config.ALGORITHM_ENV

# (owner type, factory(algorithm, owner) -> implementation), in registration order.
_FRONTENDS: List[Tuple[type, Callable[[Any, Any], Any]]] = []
# The frontends' QAdam optimizer classes.
_QADAM_OPTIMIZERS: List[type] = []


def register_frontend(owner_type: type, factory: Callable[[Any, Any], Any]) -> None:
    """Makes ``Algorithm.reify(owner)`` call ``factory(algorithm, owner)`` for owners of
    ``owner_type`` (a frontend registers itself when its algorithms module is imported)."""
    if not any(t is owner_type for t, _ in _FRONTENDS):
        _FRONTENDS.append((owner_type, factory))


def register_qadam_optimizer(cls: type) -> None:
    """Declares ``cls`` a QAdam optimizer that ``QAdamAlgorithm`` may hold."""
    if cls not in _QADAM_OPTIMIZERS:
        _QADAM_OPTIMIZERS.append(cls)


def is_qadam_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a registered QAdam optimizer class."""
    return any(isinstance(obj, cls) for cls in _QADAM_OPTIMIZERS)


class Algorithm:
    """Base class of the algorithm declarations."""

    #: gradients are averaged by the frontend's gradient path at this step
    def communicates_gradients(self, step: int) -> bool:
        return True

    #: the gradient buckets go through the compressed (ByteGrad) allreduce at this step
    def compresses_gradients(self, step: int) -> bool:
        return False

    def reify(self, owner: Any) -> Any:
        """The implementation of this algorithm inside ``owner`` (e.g. a torch
        DistributedOptimizer), built by the frontend registered for ``owner``'s type."""
        for owner_type, factory in _FRONTENDS:
            if isinstance(owner, owner_type):
                return factory(self, owner)
        raise TypeError(
            f"no bagua_hvd frontend implements {type(self).__name__} for a "
            f"{type(owner).__name__}: import bagua_hvd.torch.algorithms or "
            "bagua_hvd.tensorflow.algorithms"
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class GradientAllReduce(Algorithm):
    """Gradients averaged (``average=True``) or summed by allreduce while backward runs:
    Horovod's behaviour. ``hierarchical`` is accepted for BAGUA compatibility; on one host it
    is the flat allreduce."""

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        self.hierarchical = hierarchical
        self.average = average


class ByteGrad(Algorithm):
    """Gradients averaged by the 8-bit MinMaxUInt8-compressed allreduce (compressed alltoall,
    mean, compressed allgather). ``error_feedback=True`` carries each quantization's residual
    into the next step."""

    def __init__(
        self, hierarchical: bool = True, average: bool = True, error_feedback: bool = False
    ) -> None:
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback

    def compresses_gradients(self, step: int) -> bool:
        return True


class Decentralized(Algorithm):
    """Decentralized SGD: every ``communication_interval`` steps the weights are averaged with
    peers (``peer_selection_mode`` ``"all"``, ``"shift_one"`` or ``"ring"``) and the local
    gradient is applied to the average."""

    def __init__(
        self,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        if peer_selection_mode not in _ops.PEER_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {sorted(_ops.PEER_MODES)}, got "
                f"{peer_selection_mode!r}"
            )
        check_interval(communication_interval)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def communicates_gradients(self, step: int) -> bool:
        return False


class LowPrecisionDecentralized(Algorithm):
    """Low-precision decentralized SGD on a ring (W = 1/3): after each local step, 8-bit
    compressed differences are exchanged with both neighbours and every rank keeps replicas of
    its neighbours' weights."""

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        check_interval(communication_interval)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def communicates_gradients(self, step: int) -> bool:
        return False


class QAdamAlgorithm(Algorithm):
    """QAdam's communication: full-precision gradient averaging during warm-up, then the
    momentum through ByteGrad's compressed allreduce (``error_feedback`` as in ByteGrad).
    ``q_adam_optimizer`` is the frontend's ``QAdamOptimizer`` (torch or TensorFlow)."""

    def __init__(
        self,
        q_adam_optimizer: Any,
        hierarchical: bool = True,
        error_feedback: bool = False,
    ) -> None:
        if not is_qadam_optimizer(q_adam_optimizer):
            raise ValueError("QAdamAlgorithm needs the QAdamOptimizer it communicates for")
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical
        self.error_feedback = error_feedback
        self.average = True

    def compresses_gradients(self, step: int) -> bool:
        return not self.optimizer.in_warmup()


class AsyncModelAverage(Algorithm):
    """Asynchronous model averaging: after ``warmup_steps`` of gradient allreduce, gradients stay
    local and the core averages the weights in the background, rounds at least
    ``sync_interval_ms`` apart. ``abort()`` stops the rounds on every rank, ``resume()``
    restarts them; ``hvd.shutdown()`` stops them too."""

    def __init__(
        self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0
    ) -> None:
        if peer_selection_mode != "all":
            raise ValueError(
                f"AsyncModelAverage supports peer_selection_mode='all' only, got "
                f"{peer_selection_mode!r}"
            )
        if sync_interval_ms < 0:
            raise ValueError(f"sync_interval_ms must be >= 0, got {sync_interval_ms}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        # Implementations of any frontend (objects with abort() and resume()).
        self._impls: weakref.WeakSet[Any] = weakref.WeakSet()

    def communicates_gradients(self, step: int) -> bool:
        return step < self.warmup_steps

    def register_impl(self, impl: Any) -> None:
        """Called by a frontend for each implementation it builds: abort()/resume() reach it."""
        self._impls.add(impl)

    def abort(self, model: Any = None) -> None:
        """Stops background averaging on every rank; returns when this rank's rounds ended.
        ``model`` is accepted for BAGUA compatibility and ignored."""
        for impl in list(self._impls):
            impl.abort()

    def resume(self, model: Any = None) -> None:
        """Restarts background averaging after :meth:`abort` (every rank must call it)."""
        for impl in list(self._impls):
            impl.resume()


# The names of bagua-run --algorithm (bagua_hvd.runner.launch.ALGORITHM_NAMES, kept in step).
BY_NAME: Dict[str, Callable[[], Algorithm]] = {
    "gradient_allreduce": GradientAllReduce,
    "bytegrad": ByteGrad,
    "decentralized": Decentralized,
    "low_precision_decentralized": LowPrecisionDecentralized,
    "async": AsyncModelAverage,
}


def from_name(name: str) -> Algorithm:
    """The algorithm named ``name`` with default arguments (``bagua-run --algorithm``)."""
    table = BY_NAME
    key = name.strip().lower()
    if key == "qadam":
        raise ValueError(
            "QAdam needs its own optimizer: build QAdamOptimizer and pass "
            "algorithm=QAdamAlgorithm(optimizer) in code; it cannot be chosen by name"
        )
    if key not in table:
        raise ValueError(
            f"unknown algorithm {name!r} (from {ALGORITHM_ENV} or bagua-run --algorithm): choose "
            f"one of {', '.join(table)}"
        )
    return table[key]()


def from_environment() -> Optional[Algorithm]:
    """``from_name(BAGUA_HVD_ALGORITHM)``, or None when the variable is unset or empty."""
    name = config.algorithm_name()
    return from_name(name) if name else None


def check_interval(communication_interval: int) -> None:
    if not isinstance(communication_interval, int) or communication_interval < 1:
        raise ValueError(
            f"communication_interval must be a positive integer, got {communication_interval!r}"
        )


# ---- helpers shared by the frontends -------------------------------------------------------------
BUCKET_MB_ENV = config.BUCKET_MB_ENV
DEFAULT_BUCKET_MB = config.DEFAULT_BUCKET_MB


bucket_bytes = config.bucket_bytes


def bucket_layout(infos: List[Tuple[int, Any, int]], cap: int) -> List[List[int]]:
    """Buckets (lists of indices into ``infos``) for tensors described as ``(numel, dtype key,
    itemsize)``: taken in reverse order and appended to the open bucket of their dtype; a
    bucket is closed when the next tensor would take it past ``cap`` bytes (a bigger tensor gets
    a bucket of its own); ``cap == 0``: one bucket per tensor. Buckets are listed in the order
    they were opened (the torch DistributedOptimizer's first-guess layout)."""
    out: List[List[int]] = []
    open_: Dict[Any, List[Any]] = {}  # dtype -> [bucket, bytes]
    for i in reversed(range(len(infos))):
        numel, key, itemsize = infos[i]
        nbytes = numel * itemsize
        if cap == 0:
            out.append([i])
            continue
        cur = open_.get(key)
        if cur is not None and cur[1] + nbytes > cap:
            cur = None
        if cur is None:
            cur = [[], 0]
            open_[key] = cur
            out.append(cur[0])
        cur[0].append(i)
        cur[1] += nbytes
    return out
