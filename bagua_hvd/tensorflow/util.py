"""Horovod's ``horovod.tensorflow.util`` helpers, which scripts and Horovod's own tests import
(``hvd.util._executing_eagerly``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import tensorflow as tf

from bagua_hvd.tensorflow.mpi_ops import _executing_eagerly, tf_variable

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars"]


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoizes ``f`` on its (hashable) arguments, separately for eager and graph mode."""
    results: Dict[Tuple[Any, bool], Any] = {}

    def cached(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]

    return cached


def vars_to_refs(variables: Any) -> Any:
    """Hashable references of a variable or (nested) list of variables: tuples of ``ref()``.
    A Keras 3 variable, which has no ``ref()``, is referred to by its ``tf.Variable``."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return tf_variable(variables).ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of :func:`vars_to_refs` (lists for tuples)."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
