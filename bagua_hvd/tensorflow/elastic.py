"""Elastic training for TensorFlow (``horovod.tensorflow.elastic``): the ``run`` decorator,
``TensorFlowKerasState`` and ``TensorFlowState``. ``bagua_hvd.keras.elastic`` and
``bagua_hvd.tensorflow.keras.elastic`` build their ``KerasState`` and callbacks on it.

The loop itself (sync, restore, reset, host-update notifications) is framework-neutral:
bagua_hvd.common.elastic. A reset is this frontend's ``shutdown()`` then ``init()`` without
arguments, as in Horovod: options given to the first ``hvd.init()`` (process sets included) do
not survive it.

What a lost peer looks like here: the core stops the job ("Horovod is shut down because
communication failed: ...", or Horovod's "Horovod has been shut down. ..." when a peer shut the
job down, e.g. because it raised and exited) and every collective in flight or submitted later
fails. TensorFlow raises that as one of its own errors: ``tf.errors.AbortedError`` from an op
that was running (eagerly, in the kernels inside ``tf.function``, through ``BaguaHvdRaise`` on
the numpy_function path), ``tf.errors.FailedPreconditionError`` from an op submitted after the
stop, ``tf.errors.DeadlineExceededError`` when ``BAGUA_HVD_OP_TIMEOUT_SECONDS`` ran out, and
``tf.errors.UnknownError`` carrying the original class name and text where the collectives run
in a bare numpy_function (no kernels built). ``run`` turns every such error into
HorovodInternalError and lets any other exception through unchanged. Horovod matched only
UnknownErrors naming its allreduce, allgather or broadcast op, and swallowed other
UnknownErrors (the function then "returned" None).

Differences from Horovod, on purpose:

- ``TensorFlowState`` runs no collective at construction under eager execution, and its
  ``sync()`` broadcasts the variables (Horovod broadcast them once, when the state was built,
  and never again at a sync: new workers kept their own values).
- The states' ``sync()`` first checks that every rank holds the same variables (count, shapes,
  dtypes) and raises ValueError on every rank when they do not: broadcasting different lists
  would hang. ``TensorFlowKerasState`` builds an optimizer whose variables do not exist yet
  (a Keras 3 optimizer before its first update) on the model's trainable variables, as its
  first update would: Horovod saved none then, and a worker that joined later broadcast fewer
  variables than the others and hung (#2652; its workaround, one training step before the
  state, still works).
- ``TensorFlowKerasState`` tracks ``model.weights`` (what Horovod's ``model.variables`` was
  before Keras 3): Keras 3's ``model.variables`` also holds the dropout seed generators'
  states, left per rank (as BroadcastGlobalVariablesCallback does) so that the ranks' dropout
  masks stay independent.
- ``sync()`` and the reset callbacks run outside the decorated function (in the loop of
  ``run``), so the states map the same errors there too.
- ``TensorFlowKerasState`` accepts a model without an optimizer (neither given nor compiled):
  it tracks the model's variables only (Horovod failed on the missing optimizer).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

import bagua_hvd.tensorflow.kernels as _kernels
from bagua_hvd.common import elastic as _common_elastic
from bagua_hvd.common.elastic import ObjectState, run_fn
from bagua_hvd.common.exceptions import HorovodInternalError
from bagua_hvd.tensorflow.functions import allgather_object, broadcast_object, broadcast_variables
from bagua_hvd.tensorflow.mpi_ops import _executing_eagerly, broadcast, init, rank, shutdown
from bagua_hvd.tensorflow.optimizer_state import build_optimizer, optimizer_variables

__all__ = [
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]

# The texts by which the core reports that the job can no longer run a collective (the
# message of every op failed by it, whatever TensorFlow error class carries it).
_FAILURE_TEXTS = (
    "Horovod is shut down because communication failed",  # a peer was lost or went silent
    "Horovod has been shut down",  # a peer shut the job down (Horovod's text)
    "BAGUA_HVD_OP_TIMEOUT_SECONDS",  # a collective did not complete in time
)


def _is_collective_failure(error: tf.errors.OpError) -> bool:
    """Whether TensorFlow's ``error`` is a failed collective of this job (see the module
    docstring), as opposed to a bad argument, a cross-rank mismatch or a user's error."""
    message = error.message or ""
    if any(text in message for text in _FAILURE_TEXTS):
        return True
    # A HorovodInternalError raised inside a tf.numpy_function/py_function reaches TensorFlow
    # as an UnknownError that names it.
    return isinstance(error, tf.errors.UnknownError) and "HorovodInternalError" in message


@contextlib.contextmanager
def _collective_errors() -> Iterator[None]:
    """Raises HorovodInternalError (from the original) for a TensorFlow error of a failed
    collective; anything else passes unchanged."""
    try:
        yield
    except tf.errors.OpError as e:
        if _is_collective_failure(e):
            raise HorovodInternalError(e) from e
        raise


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

    TensorFlow errors of a failed collective (a lost peer, see the module docstring) count as
    HorovodInternalError: the state is restored to its last commit and the job reset. Any other
    exception ends the loop unchanged.

    Args:
        func: a wrapped function taking any number of args or kwargs. The first argument must
            be a ``bagua_hvd.common.elastic.State`` object (e.g. a ``TensorFlowKerasState``)
            used to synchronize state across workers.

    Returns:
        ``func`` wrapped: called as ``func(state, *args, **kwargs)``, it returns what ``func``
        returns once it completes without a reset.
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        with _collective_errors():
            return func(state, *args, **kwargs)

    return run_fn(wrapper, _reset)


def _reset() -> None:
    _common_elastic.reset(shutdown, init)
    # BAGUA's algorithms: the kernels' state made for the old job (residuals, the ring's
    # replicas, the background averager, the agreed step counts) is renewed at its next use.
    ops = _kernels.loaded()
    if ops is not None:
        ops.bagua_hvd_new_job()


# ---- helpers ------------------------------------------------------------------------------


def _model_built(model: Any) -> bool:
    return model.built if hasattr(model, "build") else True


def _model_variables(model: Any) -> List[Any]:
    """The model's weights (trainable and not); see the module docstring."""
    return list(model.weights if hasattr(model, "weights") else model.variables)


def _signature(variables: Sequence[Any]) -> List[Tuple[Tuple[Optional[int], ...], str]]:
    return [
        (tuple(tf.TensorShape(v.shape).as_list()), tf.as_dtype(v.dtype).name) for v in variables
    ]


def _check_same_variables(
    owner: str, groups: Sequence[Tuple[str, Sequence[Any]]], hint: str = ""
) -> None:
    """Raises ValueError on every rank unless every rank holds variables of the same shapes and
    dtypes in each group (one allgather: broadcasting different lists would hang)."""
    mine = [(label, _signature(variables)) for label, variables in groups]
    everyone = allgather_object(mine, name="elastic.variables")
    if all(theirs == everyone[0] for theirs in everyone):
        return
    counts = "; ".join(
        f"rank {r}: " + ", ".join(f"{len(sig)} {label}" for label, sig in theirs)
        for r, theirs in enumerate(everyone)
    )
    raise ValueError(
        f"{owner}.sync(): the ranks do not hold the same variables (shapes and dtypes "
        f"compared), so they cannot be broadcast from rank 0 ({counts}).{hint}"
    )


def _broadcast_eager(variables: Sequence[Any], label: str) -> None:
    # Named ops: a worker that joined later has another count of unnamed ones.
    for i, var in enumerate(variables):
        var.assign(broadcast(var, root_rank=0, name=f"elastic.{label}.{i}"))


class _TensorFlowObjectState(ObjectState):
    """ObjectState whose failed collectives raise HorovodInternalError also where ``run``
    calls them outside the decorated function (``sync``, the reset callbacks)."""

    def on_reset(self) -> None:
        with _collective_errors():
            super().on_reset()

    def check_host_updates(self) -> None:
        with _collective_errors():
            super().check_host_updates()


# ---- states -------------------------------------------------------------------------------


class TensorFlowKerasState(_TensorFlowObjectState):
    """State representation of a TensorFlow Keras model and optimizer.

    Supports TensorFlow 2 models and optimizers, as well as ``keras`` and ``tf.keras`` (Keras 3,
    and Keras 2 through tf_keras).

    ``save()``/``commit()`` keep a copy of the model's and the optimizer's variables (and of the
    keyword properties), ``restore()`` assigns them back, ``sync()`` broadcasts rank 0's
    current variables and its last committed properties to every rank. An optimizer that has
    not created its variables yet (Keras 3 does at the first update) is built here on the
    model's trainable variables, so that every worker holds and broadcasts the same ones.

    Args:
        model: TensorFlow Keras model (built: ValueError otherwise).
        optimizer: Optional optimizer, can be compiled into model instead (default:
            ``model.optimizer``).
        backend: For TensorFlow v1, backend used by Keras for obtaining the session (default:
            None).
        kwargs: Additional properties to sync, will be exposed as attributes of the object.
    """

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        self.model = model
        if not _model_built(model):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        # Keras 3 creates an optimizer's slots at its first update: made now, every worker
        # (a later joiner too) broadcasts the same variables (Horovod's hang, #2652).
        build_optimizer(self.optimizer, model.trainable_variables)
        self.backend = backend
        # A TF1 graph needs Keras' session (tf_keras with eager execution disabled).
        self._session = None
        if backend is not None and not _executing_eagerly() and hasattr(backend, "get_session"):
            self._session = backend.get_session()
            # One broadcast op, built once (building more would grow the graph at each sync).
            self._bcast_op = broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().__init__(
            bcast_object=self._broadcast_object if self._session is not None
            else broadcast_object,
            get_rank=rank,
            **kwargs,
        )  # fmt: skip

    def _broadcast_object(self, obj: Any) -> Any:
        return broadcast_object(obj, root_rank=0, session=self._session)

    def _variables(self) -> List[Any]:
        return _model_variables(self.model) + optimizer_variables(self.optimizer)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        with _collective_errors():
            if self._session is not None:
                self._session.run(self._bcast_op)
            else:
                model_vars = _model_variables(self.model)
                opt_vars = optimizer_variables(self.optimizer)
                _check_same_variables(
                    type(self).__name__,
                    [("model variables", model_vars), ("optimizer variables", opt_vars)],
                    " The optimizer's variables differ: is it built on other variables on "
                    "some workers?",
                )
                _broadcast_eager(model_vars, "model")
                _broadcast_eager(opt_vars, "optimizer")
            self._save_model()
            super().sync()

    def _save_model(self) -> None:
        if self._session is not None:
            self._saved_model_state = self._session.run(self._variables())
        else:
            # Copies where the variables live (tf.identity reads a snapshot of the value).
            self._saved_model_state = [tf.identity(v) for v in _model_variables(self.model)]
            self._saved_optimizer_state = [
                tf.identity(v) for v in optimizer_variables(self.optimizer)
            ]

    def _load_model(self) -> None:
        if self._session is not None:
            for var, value in zip(self._variables(), self._saved_model_state):
                var.load(value, self._session)
            return
        for var, saved in zip(_model_variables(self.model), self._saved_model_state):
            var.assign(saved)
        for var, saved in zip(optimizer_variables(self.optimizer), self._saved_optimizer_state):
            var.assign(saved)


class TensorFlowState(_TensorFlowObjectState):
    """State representation of a list of TensorFlow variables.

    Supports both TensorFlow v1 (graphs run in a session) and v2 (eager execution).
    ``save()``/``commit()`` keep the variables' values (and the keyword properties),
    ``restore()`` assigns them back, ``sync()`` broadcasts rank 0's current values and its last
    committed properties to every rank. Building the state runs no collective.

    Args:
        variables: List of ``tf.Variable`` objects to track (default:
            ``tf.compat.v1.global_variables()``).
        session: For TensorFlow v1, session used to materialize variables (default: the default
            session).
        kwargs: Additional properties to sync, will be exposed as attributes of the object.
    """

    def __init__(
        self, variables: Optional[Sequence[Any]] = None, session: Any = None, **kwargs: Any
    ) -> None:
        self.variables = variables or tf.compat.v1.global_variables()
        self._eager = _executing_eagerly()
        self.session = session if session is not None or self._eager else _default_session()
        if not self._eager:
            # Built once (no collective runs until sync() runs it in the session).
            self._bcast_op = broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().__init__(bcast_object=self._broadcast_object, get_rank=rank, **kwargs)

    def _broadcast_object(self, obj: Any) -> Any:
        return broadcast_object(obj, root_rank=0, session=self.session)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        with _collective_errors():
            if self._eager:
                _check_same_variables(type(self).__name__, [("variables", self.variables)])
                _broadcast_eager(self.variables, "variables")
            else:
                self._run(self._bcast_op)
            self._save_model()
            super().sync()

    def _run(self, fetches: Any) -> Any:
        session = self.session or _default_session()
        if session is None:
            raise ValueError(
                "TensorFlowState in a TF1 graph needs a session: pass session= or create the "
                "state under a default session (with tf.compat.v1.Session() as sess: ...)"
            )
        return session.run(fetches)

    def _save_model(self) -> None:
        if self._eager:
            self._values = [var.numpy() for var in self.variables]
        else:
            self._values = self._run(list(self.variables))

    def _load_model(self) -> None:
        for var, value in zip(self.variables, self._values):
            if self._eager:
                var.assign(value)
            else:
                var.load(value, self.session or _default_session())


def _default_session() -> Any:
    return tf.compat.v1.get_default_session()
