"""horovod.spark for bagua_hvd: ``bagua_hvd.spark.run`` runs a function on ranks in Spark tasks
(docs/spark.md). Elastic runs (``run_elastic``) are not supported yet. The estimators are in
bagua_hvd.spark.torch and bagua_hvd.spark.keras, the Store in bagua_hvd.spark.common.store."""

from typing import Any

from bagua_hvd.spark.runner import run

__all__ = ["run", "run_elastic"]


def run_elastic(*args: Any, **kwargs: Any) -> Any:
    """horovod.spark.run_elastic: not supported by bagua_hvd yet (NotImplementedError)."""
    raise NotImplementedError(
        "bagua_hvd.spark.run_elastic is not supported yet: use bagua_hvd.spark.run (a fixed "
        "number of ranks), or bagua-run --min-np/--host-discovery-script outside Spark"
    )
