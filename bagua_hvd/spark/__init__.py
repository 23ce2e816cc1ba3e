"""horovod.spark for bagua_hvd: ``bagua_hvd.spark.run`` runs a function on ranks in Spark tasks,
``bagua_hvd.spark.run_elastic`` as an elastic job (docs/spark.md). The estimators are in
bagua_hvd.spark.torch and bagua_hvd.spark.keras, the Store in bagua_hvd.spark.common.store."""

from bagua_hvd.spark.elastic import run_elastic
from bagua_hvd.spark.runner import run

__all__ = ["run", "run_elastic"]
