"""Implementation shared by ``bagua_hvd.tensorflow.keras`` and ``bagua_hvd.keras`` (Horovod's
``horovod/_keras``): the distributed optimizer, the value collectives and ``load_model``.

The functions take the Keras module (or its backend) as their first argument, as Horovod's do;
:func:`collectives` builds a frontend's public collectives bound to its Keras module.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Tuple

import tensorflow as tf

from bagua_hvd._keras.optimizer import (  # noqa: F401
    create_distributed_optimizer,
    is_distributed_optimizer,
    is_keras3_optimizer,
)
from bagua_hvd.common.util import check_predivide_and_groups
from bagua_hvd.tensorflow.compression import Compression
from bagua_hvd.tensorflow.functions import allreduce as _allreduce
from bagua_hvd.tensorflow.functions import broadcast_global_variables as _broadcast_global_variables
from bagua_hvd.tensorflow.functions import reducescatter as _reducescatter
from bagua_hvd.tensorflow.gradient_aggregation import LocalGradientAggregationHelper  # noqa: F401
from bagua_hvd.tensorflow.mpi_ops import Adasum, Average, _executing_eagerly, rocm_built
from bagua_hvd.tensorflow.mpi_ops import allgather as _allgather
from bagua_hvd.tensorflow.mpi_ops import broadcast as _broadcast
from bagua_hvd.tensorflow.optimizer_state import optimizer_variables


def _eval(backend: Any, op_or_result: Any) -> Any:
    """The value eagerly; in a TF1 graph, the result of running the op in Keras' session."""
    if _executing_eagerly():
        return op_or_result
    return backend.get_session().run(op_or_result)


def _constant(value: Any, name: str | None) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)) or hasattr(value, "_value"):
        return tf.convert_to_tensor(value)
    return tf.constant(value, name=name)


def collectives(
    keras: Any, module: str, average_default: bool | None
) -> Tuple[Callable[..., Any], ...]:
    """The public ``broadcast_global_variables``, ``allreduce``, ``allgather``, ``broadcast`` and
    ``reducescatter`` of a Keras frontend, bound to its ``keras`` (whose session runs them in a
    TF1 graph). ``average_default``: ``allreduce``'s default ``average`` (None in
    ``horovod.tensorflow.keras``, True in ``horovod.keras``, where an explicit ``op`` wins over
    it); ``module``: the frontend's module name (their ``__module__``)."""

    def broadcast_global_variables(root_rank: int) -> Any:
        """Broadcasts all global variables from ``root_rank`` (TF1 graphs, run in Keras'
        session). In eager mode (TF2) it raises RuntimeError as Horovod does: use
        ``bagua_hvd.tensorflow.broadcast_variables(model.variables, root_rank)`` or
        ``callbacks.BroadcastGlobalVariablesCallback``."""
        if _executing_eagerly():
            raise RuntimeError(
                "_broadcast_global_variables() does not support eager execution. "
                "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead "
                "(or the callbacks.BroadcastGlobalVariablesCallback in model.fit)."
            )
        return _eval(keras.backend, _broadcast_global_variables(root_rank))

    def allreduce(
        value: Any,
        name: str | None = None,
        average: bool | None = average_default,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        op: int | None = None,
        compression: Any = Compression.none,
    ) -> Any:
        """Allreduces a value (tensor, array or number) across all ranks; returns a tensor (its
        value in a TF1 graph). op/average as in ``bagua_hvd.tensorflow.allreduce`` (default
        Average)."""
        if op is not None and average_default is not None:
            average = None  # an explicit op wins over the default average
        reduced = _allreduce(
            _constant(value, name), average=average, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, op=op, compression=compression,
        )  # fmt: skip
        return _eval(keras.backend, reduced)

    def allgather(value: Any, name: str | None = None) -> Any:
        """Concatenates every rank's value along the first dimension."""
        return _eval(keras.backend, _allgather(_constant(value, name)))

    def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
        """``root_rank``'s value on every rank."""
        return _eval(keras.backend, _broadcast(_constant(value, name), root_rank))

    def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
        """Reduces the value across ranks and returns this rank's slice of the first
        dimension."""
        return _eval(keras.backend, _reducescatter(_constant(value, name), op=op))

    fns = (broadcast_global_variables, allreduce, allgather, broadcast, reducescatter)
    for fn in fns:
        fn.__module__ = module
        fn.__qualname__ = fn.__name__
    return fns


def check_optimizer_args(
    op: int,
    gradient_predivide_factor: float,
    num_groups: int,
    groups: Any,
    average_aggregated_gradients: bool = False,
) -> Any:
    """The checks of Horovod's Keras ``DistributedOptimizer`` functions; returns ``groups`` (an
    int when ``num_groups`` was given)."""
    groups = check_predivide_and_groups(
        op, gradient_predivide_factor, num_groups, groups, rocm_built(), stacklevel=4
    )
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError(
                "groups should be a non-negative integer or a list of list of tf.Variable."
            )
    return groups


class _OptimizerFactory:
    """A ``custom_objects`` entry that builds the distributed version of an optimizer class,
    both through ``from_config`` (Keras 3 / Keras 2 deserialization) and by calling it."""

    def __init__(self, cls: type, wrap: Callable[[Any], Any]) -> None:
        self._cls = cls
        self._wrap = wrap
        self.__name__ = cls.__name__

    def from_config(self, config: Dict[str, Any], custom_objects: Any = None) -> Any:
        return self._wrap(self._cls.from_config(config))

    def __call__(self, **kwargs: Any) -> Any:
        return self._wrap(self._cls(**kwargs))


def _optimizer_classes(module: Any) -> Iterable[type]:
    base = getattr(module, "Optimizer", None)
    if not isinstance(base, type):
        return
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base:
            yield obj


def _copy_optimizer_state(src: Any, dst: Any, model: Any) -> None:
    """Builds ``dst`` on the model's trainable variables and copies ``src``'s state into it."""
    src_vars = optimizer_variables(src)
    if not src_vars:
        return
    if hasattr(dst, "build"):
        dst.build(model.trainable_variables)
    elif hasattr(dst, "_create_all_weights"):
        dst._create_all_weights(model.trainable_variables)
    dst_vars = optimizer_variables(dst)
    if len(dst_vars) == len(src_vars):
        for d, s in zip(dst_vars, src_vars):
            d.assign(s)


def load_model(
    keras: Any,
    wrap_optimizer: Callable[[Any], Any],
    filepath: Any,
    custom_optimizers: Any,
    custom_objects: Any,
    legacy_opts: bool = False,
) -> Any:
    """Loads a Keras model whose optimizer is wrapped by ``wrap_optimizer`` (an optimizer ->
    distributed optimizer function).

    Every optimizer class of ``keras.optimizers`` (and ``custom_optimizers``) is given to Keras
    as a custom object under its name and lower-case name (Horovod's scheme), so a model saved
    with a distributed optimizer loads. A model saved with a plain built-in optimizer is loaded
    by Keras 3 without looking at custom objects: its optimizer is then wrapped afterwards and
    its state (iterations, slots) copied into the wrapper.
    """
    objects: Dict[str, Any] = {}
    module = keras.optimizers
    if legacy_opts and getattr(module, "legacy", None) is not None:
        module = module.legacy  # Horovod: legacy_opts maps the names to the legacy classes
    for cls in _optimizer_classes(module):
        factory = _OptimizerFactory(cls, wrap_optimizer)
        objects[cls.__name__] = factory
        objects[cls.__name__.lower()] = factory
    if custom_optimizers is not None:
        for cls in custom_optimizers:
            objects[cls.__name__] = _OptimizerFactory(cls, wrap_optimizer)
    if custom_objects is not None:
        objects.update(custom_objects)
    model = keras.models.load_model(filepath, custom_objects=objects)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not is_distributed_optimizer(opt):
        wrapped = wrap_optimizer(opt)
        _copy_optimizer_state(opt, wrapped, model)
        model.optimizer = wrapped
    return model
