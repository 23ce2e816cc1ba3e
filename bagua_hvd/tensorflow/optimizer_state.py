"""A Keras optimizer's variables, read and created the same way in Keras 3 and tf_keras."""

from __future__ import annotations

import contextlib
from typing import Any, List, Sequence


def optimizer_variables(optimizer: Any) -> List[Any]:
    """The optimizer's variables (a property in Keras 3, a method in tf_keras); [] for None."""
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def build_optimizer(optimizer: Any, variables: Sequence[Any]) -> None:
    """Creates the slot variables (momentum, Adam's moments) of an optimizer that has not made
    them yet, for ``variables``, as its first update would (Keras 3 and tf_keras's newer
    optimizers create them then, under the optimizer's name scope: the same names here). Does
    nothing for a built optimizer or one that creates its slots otherwise (tf_keras's legacy
    optimizers)."""
    if getattr(optimizer, "built", True) is not False or not hasattr(optimizer, "build"):
        return
    scope: Any = contextlib.nullcontext()
    try:
        import keras

        if hasattr(keras, "name_scope") and hasattr(optimizer, "name"):
            scope = keras.name_scope(optimizer.name, caller=optimizer)
    except ImportError:  # pragma: no cover - TensorFlow without Keras
        pass
    with scope:
        optimizer.build(list(variables))
    optimizer.built = True
