"""BAGUA's algorithms: the framework-neutral declarations (docs/algorithms.md).

An algorithm is a declaration: which tensors are communicated (gradients, weights or the
optimizer's momentum), how they are bucketed, and which primitive of the core runs when. The
primitives themselves (compressed allreduce, decentralized averages, asynchronous averaging)
run in the C++ core; the engine (``bagua_hvd.common.engine``) implements every algorithm once,
asking the declaration through the attributes and methods of :class:`Algorithm`; each
frontend (``bagua_hvd.torch.algorithms``, ``bagua_hvd.tensorflow.algorithms``) hands the
engine its tensors and decides when in its training step each part runs. The classes are the
same objects in every frontend: ``bagua_hvd.torch.algorithms.ByteGrad is
bagua_hvd.common.algorithms.ByteGrad``.

This module imports no framework. A frontend registers its QAdam optimizer class with
:func:`register_qadam_optimizer` (``QAdamAlgorithm`` accepts instances of it).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from bagua_hvd.common import basics, config
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.compression import NoneCompressor

# The public names every frontend's algorithms module re-exports (each adds its QAdamOptimizer).
FRONTEND_EXPORTS = [
    "Algorithm",
    "GradientAllReduce",
    "ByteGrad",
    "Decentralized",
    "LowPrecisionDecentralized",
    "QAdamAlgorithm",
    "AsyncModelAverage",
    "Auto",
    "BY_NAME",
    "from_name",
    "from_environment",
    "ALGORITHM_ENV",
]
# ``from bagua_hvd.common.algorithms import *`` gives a frontend exactly these.
__all__ = FRONTEND_EXPORTS

ALGORITHM_ENV = config.ALGORITHM_ENV

# The frontends' QAdam optimizer classes.
_QADAM_OPTIMIZERS: List[type] = []


def register_qadam_optimizer(cls: type) -> None:
    """Declares ``cls`` a QAdam optimizer that ``QAdamAlgorithm`` may hold."""
    if cls not in _QADAM_OPTIMIZERS:
        _QADAM_OPTIMIZERS.append(cls)


def is_qadam_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a registered QAdam optimizer class."""
    return any(isinstance(obj, cls) for cls in _QADAM_OPTIMIZERS)


_QADAM_MISMATCH = (
    "QAdamAlgorithm goes with QAdamOptimizer: pass the QAdamOptimizer to both "
    "QAdamAlgorithm(...) and DistributedOptimizer(...)"
)


def check_algorithm(algorithm: Any, frontend: str) -> None:
    """Raises ValueError when ``algorithm`` is not a declaration (``frontend``: the package
    named in the message, e.g. ``"torch"``)."""
    if not isinstance(algorithm, Algorithm):
        got = repr(algorithm) if isinstance(algorithm, str) else type(algorithm).__name__
        raise ValueError(
            f'algorithm must be an object from bagua_hvd.{frontend}.algorithms or "auto", got {got}'
        )


class Algorithm:
    """Base class of the algorithm declarations.

    The engine (:mod:`bagua_hvd.common.engine`) asks a declaration what to do through the
    attributes and methods below; no frontend looks at its class.
    """

    #: within each host, then among the hosts (where the job spans several hosts and some host
    #: runs several ranks; the core runs the flat algorithm otherwise)
    hierarchical: bool = False
    #: gradients are averaged (else summed) by the gradient path
    average: bool = True
    #: the compressed allreduce carries each quantization's residual into the next step
    error_feedback: bool = False
    #: which weight averaging of the engine runs ("peer_average", "low_precision_ring",
    #: "async"), or None: the algorithm communicates gradients only
    weight_averaging: Optional[str] = None
    #: the gradients may be communicated at some step (a frontend that stages them through an
    #: extra operation may skip it otherwise)
    uses_gradient_path: bool = True
    #: the ``step`` of :meth:`compresses_gradients` and :meth:`sends_momentum` counts the
    #: updates of the algorithm's optimizer (QAdam's stages), not the distributed steps
    staged_by_optimizer: bool = False

    #: gradients are averaged by the frontend's gradient path at this step
    def communicates_gradients(self, step: int) -> bool:
        return True

    #: the gradient buckets go through the compressed (ByteGrad) allreduce at this step
    def compresses_gradients(self, step: int) -> bool:
        return False

    def sends_momentum(self, step: int) -> bool:
        """The gradient path carries the optimizer's new momentum instead of the gradient."""
        return False

    def gradient_stages(self) -> Tuple[int, ...]:
        """The steps at which the answers of :meth:`communicates_gradients`,
        :meth:`compresses_gradients` and :meth:`sends_momentum` change (each the first step
        of a stage; the first stage starts at 0): a frontend whose step count is a graph
        value plans every stage once and picks one per step."""
        return ()

    def is_horovod_allreduce(self) -> bool:
        """The gradients go through Horovod's allreduce, configured by the optimizer's own
        arguments (``op=``, ``compression=``, ``groups=``)."""
        return False

    def reduce_op(self, op: int) -> int:
        """The gradient path's reduce op, given the one the optimizer was built with."""
        return op

    def check(
        self,
        optimizer: Any,
        qadam_optimizer_class: type,
        compression: bool = False,
        groups: Any = None,
    ) -> None:
        """Raises ValueError when the algorithm cannot run with ``optimizer`` (the wrapped
        optimizer, or None: the algorithm's own), an optimizer ``compression`` other than
        none, or ``groups``. ``qadam_optimizer_class``: the frontend's QAdamOptimizer."""
        if isinstance(optimizer, qadam_optimizer_class):
            raise ValueError(_QADAM_MISMATCH)
        self._check_data_path(compression, groups)

    def _check_data_path(self, compression: bool, groups: Any) -> None:
        if compression or groups is not None:
            raise ValueError(
                f"algorithm={type(self).__name__}(...) decides how data is communicated: it "
                "cannot be combined with compression= or groups="
            )

    def prepare_optimizer(self, optimizer: Any) -> None:
        """Called with the distributed optimizer built for this algorithm."""

    def own_optimizer(self) -> Any:
        """The optimizer the algorithm was given (QAdam's), or None."""
        return None

    def register_impl(self, impl: Any) -> None:
        """Called by the engine for each implementation it builds."""

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

    def is_horovod_allreduce(self) -> bool:
        return not self.hierarchical

    def reduce_op(self, op: int) -> int:
        return _ops.Average if self.average else _ops.Sum

    def _check_data_path(self, compression: bool, groups: Any) -> None:
        pass  # Horovod's path: compression= and groups= apply


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

    def reduce_op(self, op: int) -> int:
        return _ops.Average if self.average else _ops.Sum


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

    weight_averaging = "peer_average"
    uses_gradient_path = False

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

    weight_averaging = "low_precision_ring"
    uses_gradient_path = False

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

    staged_by_optimizer = True

    def compresses_gradients(self, step: int) -> bool:
        """``step``: the QAdam optimizer's completed updates (warm-up, then compression)."""
        return step >= self.optimizer.warmup_steps

    def sends_momentum(self, step: int) -> bool:
        return step >= self.optimizer.warmup_steps

    def gradient_stages(self) -> Tuple[int, ...]:
        return (self.optimizer.warmup_steps,)

    def check(
        self,
        optimizer: Any,
        qadam_optimizer_class: type,
        compression: bool = False,
        groups: Any = None,
    ) -> None:
        q = self.optimizer if optimizer is None else optimizer
        if not isinstance(q, qadam_optimizer_class):
            raise ValueError(
                _QADAM_MISMATCH
                + (
                    " (this QAdamOptimizer is torch's: use bagua_hvd.tensorflow.algorithms'"
                    " QAdamOptimizer)"
                    if optimizer is None
                    else ""
                )
            )
        self._check_data_path(compression, groups)

    def prepare_optimizer(self, optimizer: Any) -> None:
        """The distributed optimizer is a QAdamOptimizer of its own: it takes over the stage
        of the one this algorithm was given."""
        optimizer.adopt_stage(self.optimizer)

    def own_optimizer(self) -> Any:
        return self.optimizer


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

    weight_averaging = "async"

    def communicates_gradients(self, step: int) -> bool:
        return step < self.warmup_steps

    def gradient_stages(self) -> Tuple[int, ...]:
        return (self.warmup_steps,)

    def register_impl(self, impl: Any) -> None:
        """Called by the engine for each implementation it builds: abort()/resume() reach it."""
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


# The names of bagua-run --algorithm (bagua_hvd.runner.flags.ALGORITHM_NAMES, kept in step).
BY_NAME: Dict[str, Callable[[], Algorithm]] = {
    "gradient_allreduce": GradientAllReduce,
    "bytegrad": ByteGrad,
    "decentralized": Decentralized,
    "low_precision_decentralized": LowPrecisionDecentralized,
    "async": AsyncModelAverage,
}


# ---- algorithm="auto" (the schedule, the measurements and the decision: auto_algorithm.py) ----
#: the name of ``algorithm="auto"`` and ``bagua-run --algorithm auto``
AUTO_NAME = "auto"
#: steps run with the first candidate before any measurement (allocations, first traces)
DEFAULT_WARMUP_STEPS = 2
#: measured steps per candidate and round (each after one unmeasured step with it)
DEFAULT_STEPS_PER_CANDIDATE = 3
#: rounds through the candidates: a slow phase of the machine during one round, or the first
#: steps of a job, cannot decide alone
DEFAULT_ROUNDS = 2

# Candidates Auto refuses, and why.
_REFUSED = {
    QAdamAlgorithm: (
        "QAdamAlgorithm cannot be a candidate of Auto: it changes the update itself "
        "(QAdamOptimizer, with a warm-up stage), not only how gradients travel"
    ),
    AsyncModelAverage: (
        "AsyncModelAverage cannot be a candidate of Auto: its background averaging has no "
        "step time to compare"
    ),
}


def _default_candidates() -> List[Algorithm]:
    """GradientAllReduce and ByteGrad: both keep every rank's model identical."""
    return [GradientAllReduce(), ByteGrad()]


def _candidate(c: Any, i: int) -> Algorithm:
    if isinstance(c, str):
        key = c.strip().lower()
        if key == AUTO_NAME:
            raise ValueError(f"Auto: candidate {i} is 'auto' itself")
        if key == "qadam":
            raise ValueError(
                f"Auto: candidate {i} 'qadam' needs its own optimizer (QAdamOptimizer), which a "
                "name cannot give; " + _REFUSED[QAdamAlgorithm]
            )
        if key not in BY_NAME:
            raise ValueError(
                f"Auto: unknown candidate {c!r} (candidate {i}): choose algorithm objects or "
                f"names among {', '.join(n for n in BY_NAME if n not in ('async', AUTO_NAME))}"
            )
        c = BY_NAME[key]()
    if isinstance(c, Auto):
        raise ValueError(f"Auto: candidate {i} is an Auto itself; list the algorithms")
    if not isinstance(c, Algorithm):
        raise ValueError(
            f"Auto: candidate {i} must be an algorithm (e.g. ByteGrad()) or its name, got "
            f"{type(c).__name__}"
        )
    for cls, why in _REFUSED.items():
        if isinstance(c, cls):
            raise ValueError(f"{why} (candidate {i})")
    return c


def _count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"Auto: {name} must be an integer >= {least}, got {value!r}")
    return value


class Auto(Algorithm):
    """Chooses the fastest of ``candidates`` by measured step time, once, and keeps it.

    The first ``warmup_steps`` steps run the first candidate unmeasured; then, ``rounds`` times,
    each candidate in turn runs ``1 + steps_per_candidate`` steps, the first after the switch
    unmeasured, the others timed (wall time from the start of one step to the start of the
    next). A candidate's time on a rank is the smallest of its rounds' medians; the ranks'
    times are averaged; the candidate with the smallest average runs from the next step on, on
    every rank, with fresh state. Rank 0 prints the table once (``verbose``).

    ``candidates``: algorithm objects or names of ``bagua-run --algorithm`` (default:
    ``[GradientAllReduce(), ByteGrad()]``, which keep every rank's model identical);
    ``Decentralized`` and ``LowPrecisionDecentralized`` run only where listed, and let the
    ranks' models differ. ``QAdamAlgorithm`` and ``AsyncModelAverage`` are refused
    (ValueError), as are an empty list, unknown names, one object listed twice and candidates
    that disagree on ``average``.
    """

    def __init__(
        self,
        candidates: Optional[Sequence[Union[Algorithm, str]]] = None,
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
        steps_per_candidate: int = DEFAULT_STEPS_PER_CANDIDATE,
        verbose: bool = True,
        rounds: int = DEFAULT_ROUNDS,
    ) -> None:
        if candidates is None:
            cands = _default_candidates()
        else:
            if isinstance(candidates, (str, Algorithm)) or not hasattr(candidates, "__iter__"):
                raise ValueError(
                    "Auto: candidates must be a list of algorithms or names, got "
                    f"{type(candidates).__name__}"
                )
            cands = [_candidate(c, i) for i, c in enumerate(candidates)]
            if not cands:
                raise ValueError("Auto: candidates is empty: give at least one algorithm")
        if len({id(c) for c in cands}) != len(cands):
            raise ValueError(
                "Auto: the same algorithm object is listed twice (each candidate keeps its own "
                "state): pass separate objects"
            )
        averages = {bool(getattr(c, "average", True)) for c in cands}
        if len(averages) > 1:
            raise ValueError(
                "Auto: the candidates disagree on average= (some average the gradients, some "
                "sum them): the updates would differ by a factor of the job size"
            )
        self.candidates: List[Algorithm] = cands
        self.warmup_steps = _count(warmup_steps, "warmup_steps", 0)
        self.steps_per_candidate = _count(steps_per_candidate, "steps_per_candidate", 1)
        self.rounds = _count(rounds, "rounds", 1)
        self.verbose = bool(verbose)
        self.average = averages.pop()
        self._latest: Optional[weakref.ref] = None
        self._pending: Optional[Dict[str, Any]] = None  # a state restored before any loop

    def check(
        self,
        optimizer: Any,
        qadam_optimizer_class: type,
        compression: bool = False,
        groups: Any = None,
    ) -> None:
        super().check(optimizer, qadam_optimizer_class, compression, groups)
        for c in self.candidates:
            c.check(optimizer, qadam_optimizer_class, compression, groups)

    def reduce_op(self, op: int) -> int:
        return _ops.Average if self.average else _ops.Sum

    def labels(self) -> List[str]:
        """The candidates' names in the table and in checkpoints: the class name, with the
        arguments where two candidates share a class."""
        names = [type(c).__name__ for c in self.candidates]
        return [repr(c) if names.count(n) > 1 else n for c, n in zip(self.candidates, names)]

    def schedule(self, process_set: Any) -> Any:
        """A new :class:`AutoSchedule` of this declaration for one training loop (each
        frontend implementation makes one)."""
        from bagua_hvd.common.auto_algorithm import AutoSchedule  # the logic: imported lazily

        s = AutoSchedule(self, process_set)
        self._latest = weakref.ref(s)
        if self._pending is not None:
            s.load_state_dict(self._pending)
            self._pending = None
        return s

    def state_dict(self) -> Dict[str, Any]:
        """The latest training loop's choice (``AutoSchedule.state_dict``), for checkpoints;
        before any loop, what :meth:`load_state_dict` was given (or an undecided state)."""
        s = self._schedule()
        if s is not None:
            return s.state_dict()
        if self._pending is not None:
            return dict(self._pending)
        return {"candidates": self.labels(), "chosen": None, "chosen_step": None,
                "step_times": None}  # fmt: skip

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict` into the latest training loop, or, before it exists,
        into the next one made (a checkpoint restored before the first step)."""
        s = self._schedule()
        if s is not None:
            s.load_state_dict(state)
        else:
            self._pending = dict(state)

    def _schedule(self) -> Any:
        return None if self._latest is None else self._latest()

    @property
    def chosen(self) -> Optional[Algorithm]:
        """The candidate chosen by the latest training loop using this object (None before
        the decision)."""
        s = self._schedule()
        return None if s is None or s.chosen is None else self.candidates[s.chosen]

    def __repr__(self) -> str:
        return (
            f"Auto(candidates={self.candidates!r}, warmup_steps={self.warmup_steps}, "
            f"steps_per_candidate={self.steps_per_candidate}, rounds={self.rounds})"
        )


BY_NAME[AUTO_NAME] = Auto  # bagua-run --algorithm auto: the default candidates


def from_name(name: str) -> Algorithm:
    """The algorithm named ``name`` with default arguments (``bagua-run --algorithm``;
    ``"auto"``: :class:`Auto` with its default candidates)."""
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
    """``from_name(BAGUA_HVD_ALGORITHM)``, a new object at each call (an optimizer's algorithm
    holds its state: QAdam its optimizer, AsyncModelAverage its implementations); None when
    the variable is unset or empty."""
    name = config.algorithm_name()
    return from_name(name) if name else None


def resolve(
    algorithm: Any,
    *,
    frontend: str,
    op: int,
    compression: Any,
    groups: Any,
    optimizer: Any,
    qadam_optimizer_class: Callable[[], type],
) -> Tuple[Optional[Algorithm], int]:
    """``(algorithm or None, op)``: what a frontend's DistributedOptimizer or gradient tape
    runs for its ``algorithm=`` argument, and the reduce op of its gradient path.

    ``algorithm`` None takes :func:`from_environment`. An algorithm is refused (ValueError)
    when it is not a declaration (``frontend`` names the package in the message), when
    ``op`` is Adasum in a job of more than one rank, or when :meth:`Algorithm.check` refuses
    it with ``optimizer`` (the wrapped optimizer, or None), ``compression`` (the frontend's
    compressor; ``Compression.none`` is none) and ``groups``. The op becomes the
    algorithm's (:meth:`Algorithm.reduce_op`). An algorithm that is Horovod's allreduce
    (``GradientAllReduce(hierarchical=False)``) is returned as None: the caller then runs its
    own allreduce, configured by ``op``, ``compression`` and ``groups``.
    ``qadam_optimizer_class()`` returns the frontend's QAdamOptimizer class; it is called only
    when there is an algorithm (a frontend may load its algorithms module then)."""
    if algorithm is None:
        algorithm = from_environment()
    elif isinstance(algorithm, str) and algorithm.lower() == "auto":
        algorithm = from_name(algorithm)  # the one name algorithm= takes: Auto()
    if algorithm is None:
        return None, op
    check_algorithm(algorithm, frontend)
    if op == _ops.Adasum and basics.size() > 1:
        raise ValueError(
            "op=hvd.Adasum is Horovod's reduction of the updates; it does not combine with "
            f"BAGUA's algorithm {type(algorithm).__name__} (BAGUA_HVD_ALGORITHM or "
            "algorithm=)"
        )
    algorithm.check(optimizer, qadam_optimizer_class(), compression is not NoneCompressor, groups)
    op = algorithm.reduce_op(op)
    if algorithm.is_horovod_allreduce():
        return None, op
    return algorithm, op


def check_qadam_arguments(
    lr: Any,
    warmup_steps: Any,
    betas: Tuple[float, float],
    eps: float,
    weight_decay: float,
    bool_steps: bool = True,
) -> None:
    """A QAdamOptimizer's arguments (torch.optim.Adam's messages); ``lr`` None: a schedule,
    not checked; ``bool_steps=False`` refuses ``warmup_steps=True``."""
    if lr is not None and not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i in (0, 1):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if (
        (isinstance(warmup_steps, bool) and not bool_steps)
        or not isinstance(warmup_steps, int)
        or warmup_steps <= 0
    ):
        raise ValueError(
            f"warmup_steps must be a positive integer, got {warmup_steps!r}: the compression "
            "stage freezes the second moment estimated during warm-up"
        )


def check_interval(communication_interval: int) -> None:
    if not isinstance(communication_interval, int) or communication_interval < 1:
        raise ValueError(
            f"communication_interval must be a positive integer, got {communication_interval!r}"
        )


# ---- helpers shared by the frontends -------------------------------------------------------------
BUCKET_MB_ENV = config.BUCKET_MB_ENV
DEFAULT_BUCKET_MB = config.DEFAULT_BUCKET_MB


bucket_bytes = config.bucket_bytes
