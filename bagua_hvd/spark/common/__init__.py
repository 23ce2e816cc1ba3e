"""horovod.spark.common for bagua_hvd: what the Spark estimators share (the Store, params, the
data written as Parquet and read back by each rank, the estimator and model base classes)."""
