"""horovod.spark.common.backend for bagua_hvd: how an estimator runs its training function."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence


class Backend:
    """Runs a function on every rank of a job (Horovod's Backend interface)."""

    def run(
        self, fn: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> List[Any]:  # fmt: skip
        """``fn(*args, **kwargs)`` on every rank; the results by rank."""
        raise NotImplementedError()

    def num_processes(self) -> int:
        raise NotImplementedError()


class SparkBackend(Backend):
    """Runs the function on ``num_proc`` ranks in Spark tasks with :func:`bagua_hvd.spark.run`
    (its other parameters pass through: ``start_timeout``, ``nics``, ``stdout``, ...)."""

    def __init__(
        self,
        num_proc: Optional[int] = None,
        env: Optional[Dict[str, str]] = None,
        verbose: int = 1,
        **run_kwargs: Any,
    ) -> None:
        self._num_proc = num_proc
        self._env = dict(env or {})
        self._verbose = verbose
        self._run_kwargs = run_kwargs

    def run(
        self, fn: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> List[Any]:  # fmt: skip
        from bagua_hvd.spark.runner import run

        return run(
            fn,
            args=args,
            kwargs=kwargs,
            num_proc=self.num_processes(),
            env={**self._env, **(env or {})},
            verbose=self._verbose,
            **self._run_kwargs,
        )

    def num_processes(self) -> int:
        if self._num_proc is not None:
            return self._num_proc
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        if sc is None:
            raise RuntimeError(
                "Could not find an active SparkContext, are you running in a PySpark session?"
            )
        return sc.defaultParallelism
