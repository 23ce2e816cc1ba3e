"""``TorchState`` and its handlers (``horovod.torch.elastic.state``).

A ``TorchState`` keeps models, optimizers and ``ElasticSampler``\\ s through their *handlers*
(found in a registry by type, ``isinstance`` in order) and every other keyword argument as a
plain attribute (``ObjectState``). ``save``, ``restore`` and ``sync`` run each handler's, then
``ObjectState``'s.

Differences from Horovod 0.28.1, both fixes:

* ``sync()`` saves what the handlers received, so a ``restore()`` before the next commit returns
  to the synchronised model, optimizer and sampler (Horovod keeps the copy made when the state
  was built: after a failure before the first commit, ranks other than 0 went back to their own
  initial weights while the plain attributes went back to rank 0's). The TensorFlow states of
  Horovod save after syncing too.
* ``reset()``, run at every reset of the job (also when the sync is skipped because hosts were
  only removed), re-partitions the samplers for the new rank and size through
  :meth:`StateHandler.reset`; Horovod's samplers kept the old partition until the next sync or
  ``set_epoch``, and over-counted ``record_batch``.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from bagua_hvd.common.elastic import ObjectState
from bagua_hvd.torch.elastic.sampler import ElasticSampler
from bagua_hvd.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from bagua_hvd.torch.mpi_ops import rank

__all__ = [
    "TorchState",
    "StateHandler",
    "ModelStateHandler",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "get_handler_registry",
    "set_handler_registry",
]


class TorchState(ObjectState):
    """State representation of a PyTorch training process.

    Multiple models and optimizers are supported by providing them as kwargs. During
    initialization, ``TorchState`` will assign attributes for every keyword argument, and handle
    its state synchronization.

    Args:
        model: Optional PyTorch model.
        optimizer: Optional PyTorch optimizer.
        kwargs: Attributes sync, will be exposed as attributes of the object. If a handler exists
            for the attribute type, it will be used to sync the object, otherwise it will be
            handled an ordinary Python object.

    Assigning a new value to a handled attribute (``state.model = other_model``) gives it to the
    handler, which saves it at once. A ``None`` model or optimizer is an ordinary attribute.
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        **kwargs: Any,
    ) -> None:
        kwargs.update(dict(model=model, optimizer=optimizer))
        self._handlers, kwargs = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
            # What arrived from rank 0 is what a restore() before the next commit returns to
            # (ObjectState.sync below likewise keeps the broadcast values as the saved ones).
            handler.save()
        super().sync()

    def reset(self) -> None:
        """Called at every reset of the job, once it runs at its new size and before the reset
        callbacks: the handlers adapt to the new world (samplers re-partition)."""
        for handler in self._handlers.values():
            # A handler of a user's registry need not derive from StateHandler.
            reset = getattr(handler, "reset", None)
            if reset is not None:
                reset()

    def __setattr__(self, name: str, value: Any) -> None:
        # Only an existing handled attribute goes to its handler: the constructor's first
        # assignments (of _handlers itself, then of each handled value) are plain.
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


class StateHandler:
    """Keeps one object of a ``TorchState``: ``save`` copies its state, ``restore`` returns to
    that copy and ``sync`` makes every rank's object rank 0's.

    Args:
        value: the object handled.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value: Any) -> None:
        """Handles ``value`` instead, and saves it."""
        self.value = value
        self.save()

    def reset(self) -> None:
        """Called at every reset of the job, at its new size (a bagua_hvd addition: nothing to
        do by default)."""


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: saved as a deep copy of its ``state_dict()``, synchronised with
    ``broadcast_parameters(model.state_dict(), root_rank=0)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_model_state)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer``: saved as a deep copy of its ``state_dict()``, synchronised
    with ``broadcast_optimizer_state(optimizer, root_rank=0)``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_optimizer_state)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: saved as a copy of its ``state_dict()`` (epoch and processed
    samples); synchronised by loading rank 0's ``state_dict()``, which re-partitions the rest of
    the epoch for the current rank and size."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_sampler_state)

    def sync(self) -> None:
        # Rank 0's current position in the epoch, loaded everywhere.
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def reset(self) -> None:
        # Also when the sync after a reset is skipped: the old partition would skip or repeat
        # samples at the new size.
        self.value.reset()


_handler_registry: List[Tuple[Type[Any], Type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> List[Tuple[Type[Any], Type[StateHandler]]]:
    """The ``(type, handler class)`` pairs that ``TorchState`` tries in order (``isinstance``);
    the list itself, not a copy."""
    return _handler_registry


def set_handler_registry(registry: List[Tuple[Type[Any], Type[StateHandler]]]) -> None:
    """Replaces the whole registry (for the ``TorchState``\\ s built afterwards)."""
    global _handler_registry
    _handler_registry = registry


def _get_handler(value: Any) -> Optional[StateHandler]:
    for handler_type, handler_cls in _handler_registry:
        if isinstance(value, handler_type):
            return handler_cls(value)
    return None


def _get_handlers(kwargs: Dict[str, Any]) -> Tuple[Dict[str, StateHandler], Dict[str, Any]]:
    """Splits ``kwargs`` into handlers (by name) and the ordinary attributes."""
    handlers: Dict[str, StateHandler] = {}
    remainder: Dict[str, Any] = {}
    for name, value in kwargs.items():
        handler = _get_handler(value)
        if handler is not None:
            handlers[name] = handler
        else:
            remainder[name] = value
    return handlers, remainder
