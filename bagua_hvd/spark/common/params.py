"""horovod.spark.common.params for bagua_hvd: the Spark ML params of the estimators and models.

Horovod's names and defaults; each param ``foo_bar`` has ``setFooBar``/``getFooBar``. Params that
only tuned Petastorm's reader are accepted and warn that they have no effect; params that would
change what is trained and that bagua_hvd cannot honour raise at ``fit`` (docs/spark.md).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, Optional

from pyspark import keyword_only
from pyspark.ml.param.shared import HasOutputCols, Param, Params, TypeConverters

T = TypeConverters


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def add_accessors(cls: type, names: Iterable[str]) -> type:
    """Gives ``cls`` Horovod's ``setFooBar``/``getFooBar`` for each param ``foo_bar``."""
    for name in names:
        camel = _camel(name)

        def setter(self: Params, value: Any, _name: str = name) -> Params:
            return self._set(**{_name: value})

        def getter(self: Params, _name: str = name) -> Any:
            return self.getOrDefault(getattr(self, _name))

        setter.__doc__ = f"Sets ``{name}``."
        getter.__doc__ = f"``{name}`` (set or default)."
        if not hasattr(cls, f"set{camel}"):
            setattr(cls, f"set{camel}", setter)
        if not hasattr(cls, f"get{camel}"):
            setattr(cls, f"get{camel}", getter)
    return cls


def _param(name: str, doc: str, converter: Any = None) -> Param:
    if converter is None:
        return Param(Params._dummy(), name, doc)
    return Param(Params._dummy(), name, doc, typeConverter=converter)


_ESTIMATOR_DEFAULTS: Dict[str, Any] = dict(
    num_proc=None,
    store=None,
    backend=None,
    model=None,
    optimizer=None,
    loss=None,
    loss_weights=None,
    sample_weight_col=None,
    metrics=[],
    feature_cols=None,
    label_cols=None,
    continuous_cols=None,
    categorical_cols=None,
    validation=None,
    gradient_compression=None,
    compress_sparse_cols=False,
    batch_size=32,
    val_batch_size=None,
    epochs=1,
    verbose=1,
    callbacks=[],
    random_seed=None,
    shuffle_buffer_size=None,
    shuffle=True,
    partitions_per_process=10,
    run_id=None,
    train_steps_per_epoch=None,
    validation_steps_per_epoch=None,
    transformation_fn=None,
    transformation_edit_fields=None,
    transformation_removed_fields=None,
    train_reader_num_workers=2,
    val_reader_num_workers=2,
    reader_pool_type="thread",
    label_shapes=None,
    inmemory_cache_all=False,
    use_gpu=True,
    mp_start_method=None,
    backward_passes_per_step=1,
    tensorflow_dataset_prefetch_buffer_size=0,
    algorithm=None,
)

# Params of Petastorm's reader, which bagua_hvd does not use: a value other than the default
# warns that it has no effect.
NO_EFFECT = {
    "train_reader_num_workers": "the ranks read their shard with pyarrow.dataset, no reader pool",
    "val_reader_num_workers": "the ranks read their shard with pyarrow.dataset, no reader pool",
    "reader_pool_type": "the ranks read their shard with pyarrow.dataset, no reader pool",
    "mp_start_method": "no reader processes are started",
    "tensorflow_dataset_prefetch_buffer_size": "batches come from memory, no tf.data prefetch",
    "compress_sparse_cols": "SparseVector columns are written dense",
}
# Params whose effect bagua_hvd cannot give: a value other than the default raises at fit.
UNSUPPORTED = {
    "continuous_cols": "only Horovod's NVTabular data module reads it",
    "categorical_cols": "only Horovod's NVTabular data module reads it",
    "transformation_edit_fields": "Petastorm's TransformSpec is not used; transformation_fn "
    "gets and returns a pandas DataFrame",
    "transformation_removed_fields": "Petastorm's TransformSpec is not used; transformation_fn "
    "gets and returns a pandas DataFrame",
    "data_module": "the ranks read their shard with pyarrow.dataset (no Petastorm, no NVTabular)",
}


class EstimatorParams(Params):
    """The params every estimator has (Horovod's EstimatorParams, plus ``algorithm``)."""

    num_proc = _param("num_proc", "number of processes")
    train_reader_num_workers = _param("train_reader_num_workers", "no effect in bagua_hvd")
    val_reader_num_workers = _param("val_reader_num_workers", "no effect in bagua_hvd")
    reader_pool_type = _param("reader_pool_type", "no effect in bagua_hvd")
    optimizer = _param("optimizer", "optimizer")
    model = _param("model", "model")
    backend = _param("backend", "backend")
    store = _param("store", "store")
    metrics = _param("metrics", "metrics")
    loss = _param("loss", "loss")
    gradient_compression = _param("gradient_compression", "Horovod gradient compression option")
    compress_sparse_cols = _param("compress_sparse_cols", "no effect in bagua_hvd", T.toBoolean)
    loss_weights = _param("loss_weights", "loss weights", T.toListFloat)
    sample_weight_col = _param(
        "sample_weight_col", "name of the column containing sample weights", T.toString
    )
    feature_cols = _param("feature_cols", "feature column names", T.toListString)
    label_cols = _param("label_cols", "label column names", T.toListString)
    continuous_cols = _param("continuous_cols", "not supported", T.toListString)
    categorical_cols = _param("categorical_cols", "not supported", T.toListString)
    validation = _param(
        "validation", "one of: float validation split [0, 1), or string validation column name"
    )
    callbacks = _param("callbacks", "callbacks")
    batch_size = _param("batch_size", "batch size", T.toInt)
    val_batch_size = _param("val_batch_size", "validation batch size", T.toInt)
    epochs = _param("epochs", "epochs", T.toInt)
    train_steps_per_epoch = _param(
        "train_steps_per_epoch", "number of training (batches) steps per epoch", T.toInt
    )
    validation_steps_per_epoch = _param(
        "validation_steps_per_epoch", "number of steps (batches) for validation per epoch", T.toInt
    )
    random_seed = _param("random_seed", "random seed to use for DL frameworks", T.toInt)
    shuffle_buffer_size = _param(
        "shuffle_buffer_size", "(Deprecated) 0 turns shuffling off", T.toInt
    )
    shuffle = _param("shuffle", "whether to shuffle training samples", T.toBoolean)
    verbose = _param("verbose", "verbose flag (0=silent, 1=per epoch, 2=per step)", T.toInt)
    partitions_per_process = _param(
        "partitions_per_process",
        "partitions for parquet form of the DataFrame per process",
        T.toInt,
    )
    run_id = _param(
        "run_id",
        "unique ID for this run, if run already exists, then training will resume from last "
        "checkpoint in the store",
        T.toString,
    )
    transformation_fn = _param(
        "transformation_fn", "function of a pandas DataFrame applied to each shard's rows"
    )
    transformation_edit_fields = _param("transformation_edit_fields", "not supported")
    transformation_removed_fields = _param("transformation_removed_fields", "not supported")
    label_shapes = _param("label_shapes", "the shape (or shapes) of the label column(s)")
    inmemory_cache_all = _param(
        "inmemory_cache_all", "each rank always holds its shard in memory", T.toBoolean
    )
    use_gpu = _param("use_gpu", "whether to use the GPU for training", T.toBoolean)
    mp_start_method = _param("mp_start_method", "no effect in bagua_hvd", T.toString)
    backward_passes_per_step = _param(
        "backward_passes_per_step",
        "number of backward passes to perform before calling hvd.allreduce",
        T.toInt,
    )
    tensorflow_dataset_prefetch_buffer_size = _param(
        "tensorflow_dataset_prefetch_buffer_size", "no effect in bagua_hvd", T.toInt
    )
    algorithm = _param(
        "algorithm", "a BAGUA algorithm for DistributedOptimizer (a bagua_hvd extension)"
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**_ESTIMATOR_DEFAULTS)

    @keyword_only
    def setParams(self, **kwargs: Any) -> EstimatorParams:
        return self._set(**kwargs)

    def _check_params(self, metadata: Dict[str, Any]) -> None:
        """Raises for a missing model or column, or a bad value."""
        if not self.getModel():
            raise ValueError("Model parameter is required")
        validation = self.getValidation()
        if validation is not None and not isinstance(validation, str):
            if not isinstance(validation, (int, float)) or not 0 <= validation < 1:
                raise ValueError(
                    f"validation must be a float in [0, 1) or a column name, got {validation!r}"
                )
        for what, cols in (("Feature", self.getFeatureCols()), ("Label", self.getLabelCols())):
            if not cols:
                raise ValueError(f"{what} columns are required")
            missing = [c for c in cols if c not in metadata]
            if missing:
                raise ValueError(
                    f"{what} columns {missing} not found in training DataFrame metadata"
                )
        if self.getBatchSize() < 1 or self.getEpochs() < 0:
            raise ValueError("batch_size must be >= 1 and epochs >= 0")

    def _check_supported(self) -> None:
        """Warns for params without effect in bagua_hvd, raises for unsupported ones."""
        for name, why in NO_EFFECT.items():
            if self.getOrDefault(name) != _ESTIMATOR_DEFAULTS[name]:
                warnings.warn(
                    f"{type(self).__name__}: {name}={self.getOrDefault(name)!r} has no effect in "
                    f"bagua_hvd ({why})",
                    UserWarning,
                    stacklevel=3,
                )
        for name, why in UNSUPPORTED.items():
            if self.hasParam(name) and self.getOrDefault(name) is not None:
                raise ValueError(f"{type(self).__name__}: {name} is not supported: {why}")


add_accessors(EstimatorParams, _ESTIMATOR_DEFAULTS)


class ModelParams(HasOutputCols):
    """The params every trained model has (Horovod's ModelParams)."""

    history = _param("history", "history")
    model = _param("model", "model")
    feature_columns = _param("feature_columns", "feature columns")
    label_columns = _param("label_columns", "label columns")
    run_id = _param(
        "run_id",
        "unique ID for the run that generated this model, if no ID was given by the user, "
        "defaults to current timestamp at the time of fit()",
        T.toString,
    )
    _metadata = _param("_metadata", "metadata contains the shape and type of input and output")

    @keyword_only
    def setParams(self, **kwargs: Any) -> ModelParams:
        return self._set(**kwargs)

    def setOutputCols(self, value: Any) -> ModelParams:  # noqa: N802 - Horovod's name
        """Sets the prediction columns (default ``<label>__output``)."""
        return self._set(outputCols=value)

    def _get_metadata(self) -> Optional[Dict[str, Any]]:
        return self.getOrDefault(self._metadata)


add_accessors(ModelParams, ["history", "model", "feature_columns", "label_columns", "run_id"])
