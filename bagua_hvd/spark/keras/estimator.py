"""horovod.spark.keras.estimator for bagua_hvd: KerasEstimator and KerasModel (Keras 3)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pyspark import keyword_only
from pyspark.ml.param.shared import Param, Params

from bagua_hvd.spark.common.estimator import HorovodEstimator, HorovodModel
from bagua_hvd.spark.common.params import add_accessors


class KerasEstimator(HorovodEstimator):
    """Spark Estimator fitting a Keras 3 model (TensorFlow backend) to a DataFrame on
    ``num_proc`` ranks in Spark tasks, each reading its shard of the data from the Store, with
    ``bagua_hvd.tensorflow.keras.DistributedOptimizer``; returns a :class:`KerasModel`.

    Horovod's parameters and defaults (docs/spark.md says which ones have no effect or are
    refused); those that differ from TorchEstimator's:

    Args:
        model: a built ``keras.Model`` (its inputs in ``feature_cols`` order); compiled or not.
        optimizer: a Keras optimizer (default: the compiled model's); rebuilt from its config
            on every rank, its learning rate multiplied by the number of processes while
            training (Horovod's scaling; the returned model's is the original).
        loss, loss_weights, metrics: as ``model.compile`` takes them (strings, or picklable
            Keras objects).
        custom_objects: Keras custom objects needed to load the model.
        callbacks: Keras callbacks, run on every rank after bagua_hvd's broadcast, metric
            averaging and checkpoint callbacks (they must be picklable).
        backend_env: environment variables of the ranks.
        checkpoint_callback: not supported (rank 0 saves the model after every epoch).
        run_id: default ``keras_<time>``.
        algorithm: a BAGUA algorithm for ``DistributedOptimizer(algorithm=)``.

    Steps per epoch default to ``train_rows / batch_size / num_proc`` rounded up (Horovod's
    Keras rule).
    """

    _run_prefix = "keras"

    custom_objects = Param(Params._dummy(), "custom_objects", "custom objects")
    checkpoint_callback = Param(Params._dummy(), "checkpoint_callback", "not supported")
    data_module = Param(Params._dummy(), "data_module", "not supported")
    backend_env = Param(Params._dummy(), "backend_env", "environment of the ranks")

    @keyword_only
    def __init__(
        self,
        num_proc: Optional[int] = None,
        data_module: Any = None,
        model: Any = None,
        backend: Any = None,
        store: Any = None,
        custom_objects: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        loss_weights: Any = None,
        sample_weight_col: Optional[str] = None,
        gradient_compression: Any = None,
        metrics: Any = None,
        feature_cols: Any = None,
        label_cols: Any = None,
        continuous_cols: Any = None,
        categorical_cols: Any = None,
        validation: Any = None,
        callbacks: Any = None,
        batch_size: Optional[int] = None,
        val_batch_size: Optional[int] = None,
        epochs: Optional[int] = None,
        verbose: Optional[int] = None,
        random_seed: Optional[int] = None,
        shuffle_buffer_size: Optional[int] = None,
        shuffle: bool = True,
        partitions_per_process: Optional[int] = None,
        run_id: Optional[str] = None,
        train_steps_per_epoch: Optional[int] = None,
        validation_steps_per_epoch: Optional[int] = None,
        transformation_fn: Any = None,
        train_reader_num_workers: Optional[int] = None,
        val_reader_num_workers: Optional[int] = None,
        reader_pool_type: str = "thread",
        label_shapes: Any = None,
        checkpoint_callback: Any = None,
        inmemory_cache_all: bool = False,
        backend_env: Any = None,
        use_gpu: bool = True,
        mp_start_method: Optional[str] = None,
        tensorflow_dataset_prefetch_buffer_size: int = 0,
        backward_passes_per_step: int = 1,
        algorithm: Any = None,
    ) -> None:
        super().__init__()
        self._setDefault(
            data_module=None,
            optimizer=None,
            custom_objects={},
            checkpoint_callback=None,
            backend_env={"LIBHDFS_OPTS": "-Xms2048m -Xmx2048m"},
        )
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        self.setParams(**kwargs)

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.getCheckpointCallback() is not None:
            raise ValueError(
                "KerasEstimator: checkpoint_callback is not supported: rank 0 saves the whole "
                "model to the store's checkpoint after every epoch"
            )

    def _fit_on_prepared_data(
        self, backend: Any, train_rows: int, val_rows: int, metadata: Any, avg_row_size: Any,
        dataset_idx: Any = None,
    ) -> Any:  # fmt: skip
        import math

        import keras

        from bagua_hvd.spark.keras import remote

        model = self.getModel()
        optimizer = self.getOptimizer() or getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "Optimizer must be provided either as a parameter or as part of a compiled model"
            )
        if not self.getLoss():
            raise ValueError("Loss parameter is required for the model to compile")
        run_id = self._run_id()
        checkpoint, history = self._load_run(run_id)
        settings = self._settings(run_id, metadata, train_rows, val_rows, dataset_idx, history,
                                  round_steps=math.ceil)  # fmt: skip
        results = backend.run(
            remote.train,
            args=(
                settings,
                remote.model_to_bytes(model),
                keras.optimizers.serialize(optimizer),
                checkpoint,
                self.getLoss(),
                self.getLossWeights(),
                self.getMetrics() or None,
                self.getCustomObjects(),
                list(self.getCallbacks() or []),
            ),
            env=dict(self.getBackendEnv() or {}),
        )
        history, model_bytes, _size = results[0]
        trained = remote.model_from_bytes(model_bytes, self.getCustomObjects(), compile=True)
        by_key: Dict[str, List[float]] = {}
        for entry in history:
            for phase, prefix in (("train", ""), ("validation", "val_")):
                for k, v in entry.get(phase, {}).items():
                    by_key.setdefault(prefix + k, []).append(v)
        return KerasModel(
            history=by_key,
            model=trained,
            feature_columns=self.getFeatureCols(),
            label_columns=self.getLabelCols(),
            custom_objects=self.getCustomObjects(),
            run_id=run_id,
            _metadata=metadata,
            _floatx=keras.backend.floatx(),
        )


add_accessors(KerasEstimator, ["custom_objects", "checkpoint_callback", "data_module",
                               "backend_env"])  # fmt: skip


class KerasModel(HorovodModel):
    """Spark Transformer wrapping a trained Keras model: ``transform(df)`` adds a column per
    label, ``<label>__output`` (the label's type for one value per row and a scalar label, else
    a DenseVector). ``getModel()`` is the ``keras.Model``; ``getHistory()`` its metrics by
    epoch (``{"loss": [...], "val_loss": [...], ...}``)."""

    custom_objects = Param(Params._dummy(), "custom_objects", "custom objects")
    _floatx = Param(Params._dummy(), "_floatx", "keras default float type")

    @keyword_only
    def __init__(
        self,
        history: Any = None,
        model: Any = None,
        feature_columns: Any = None,
        label_columns: Any = None,
        custom_objects: Any = None,
        run_id: Optional[str] = None,
        _metadata: Any = None,
        _floatx: Optional[str] = None,
    ) -> None:
        super().__init__()
        if label_columns:
            self.setOutputCols([col + "__output" for col in label_columns])
        self._setDefault(custom_objects={}, _floatx=None)
        self.setParams(**self._input_kwargs)

    def _predict_factory(self) -> Any:
        from bagua_hvd.spark.keras import remote

        model_bytes = remote.model_to_bytes(self.getModel())
        custom_objects = self.getCustomObjects()
        floatx = self.getOrDefault(self._floatx) or "float32"

        def factory() -> Any:
            import os

            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            import keras
            import numpy as np
            import tensorflow as tf

            from bagua_hvd.spark.common import util
            from bagua_hvd.spark.keras import remote

            try:  # one Spark task per core
                tf.config.threading.set_intra_op_parallelism_threads(1)
                tf.config.threading.set_inter_op_parallelism_threads(1)
            except RuntimeError:
                pass  # already initialized in this Python worker
            keras.backend.set_floatx(floatx)
            model = remote.model_from_bytes(model_bytes, custom_objects, compile=False)
            shapes = remote.input_shapes(model)

            def predict(inputs: List[Any]) -> List[Any]:
                cols = [f"f{i}" for i in range(len(inputs))]
                arrays = util.as_inputs(dict(zip(cols, inputs)), cols, shapes, np.float32)
                out = model(arrays[0] if len(arrays) == 1 else arrays, training=False)
                outs = out if isinstance(out, (list, tuple)) else [out]
                return [keras.ops.convert_to_numpy(o).reshape(len(inputs[0]), -1) for o in outs]

            return predict

        return factory

    def _probe(self) -> List[int]:
        import math

        outputs = self.getModel().outputs
        return [int(math.prod(d for d in o.shape[1:])) for o in outputs]


add_accessors(KerasModel, ["custom_objects"])
