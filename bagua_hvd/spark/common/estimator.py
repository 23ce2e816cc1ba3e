"""horovod.spark.common.estimator for bagua_hvd: what TorchEstimator and KerasEstimator share.

``fit(df)``: the DataFrame goes to the Store as Parquet (util.prepare_data), the frontend's
training function runs on every rank through the backend (``bagua_hvd.spark.run`` by default),
each rank reading its shard; rank 0 writes the run's checkpoint and history to the Store after
every epoch. A fit with the ``run_id`` of an earlier one starts from that run's checkpoint and
goes on counting its epochs; it trains ``epochs`` more epochs (Horovod trains ``epochs`` again
from the checkpoint too).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

from pyspark.ml import Estimator, Model

from bagua_hvd.spark.common import util
from bagua_hvd.spark.common.backend import SparkBackend
from bagua_hvd.spark.common.params import EstimatorParams, ModelParams

HISTORY_FILE = util.HISTORY_FILE


class HorovodEstimator(Estimator, EstimatorParams):
    """The Spark ML Estimator both frontends extend: data preparation, backend, run ids and
    checkpoints. A frontend provides ``_fit_on_prepared_data``."""

    _run_prefix = "run"

    def fit(self, df: Any, params: Any = None) -> Any:
        """Fits the model to the DataFrame ``df``; returns the frontend's Model (a Spark ML
        Transformer whose ``transform`` adds the ``<label>__output`` columns)."""
        return super().fit(df, params)

    def fit_on_parquet(self, params: Any = None, dataset_idx: Optional[int] = None) -> Any:
        """Trains on Parquet data already in the store (``store.get_train_data_path(idx)``)."""
        if params:
            return self.copy(params)._fit_on_parquet(dataset_idx=dataset_idx)
        return self._fit_on_parquet(dataset_idx=dataset_idx)

    def _fit_on_parquet(self, dataset_idx: Optional[int] = None) -> Any:
        store = self._get_store()
        path = store.get_train_data_path(dataset_idx)
        if not store.is_parquet_dataset(path):
            raise ValueError(f"no Parquet dataset at {path}")
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        if spark is None:
            raise RuntimeError("fit_on_parquet needs an active SparkSession")
        df = spark.read.parquet(path)
        self._check_supported()
        metadata = util.column_metadata(df, self._columns())
        self._check_params(metadata)
        return self._fit_prepared(self._get_or_create_backend(), store, metadata, dataset_idx)

    def _columns(self) -> List[str]:
        cols = list(self.getFeatureCols() or []) + list(self.getLabelCols() or [])
        if self.getSampleWeightCol():
            cols.append(self.getSampleWeightCol())
        return list(dict.fromkeys(cols))

    def _get_store(self) -> Any:
        store = self.getStore()
        if store is None:
            raise ValueError("the store parameter is required (bagua_hvd.spark.common.store)")
        return store

    def _fit(self, df: Any) -> Any:
        store = self._get_store()
        self._check_supported()
        backend = self._get_or_create_backend()
        # Missing columns fail here, before the Spark job that measures the others.
        present = {c: {} for c in self._columns() if c in df.columns}
        self._check_params(present)
        metadata = util.column_metadata(df, list(present))
        with util.prepare_data(
            backend.num_processes(),
            store,
            df,
            label_columns=self.getLabelCols(),
            feature_columns=self.getFeatureCols(),
            validation=self.getValidation(),
            sample_weight_col=self.getSampleWeightCol(),
            partitions_per_process=self.getPartitionsPerProcess(),
            verbose=self.getVerbose(),
            random_seed=self.getRandomSeed(),
        ) as dataset_idx:
            return self._fit_prepared(backend, store, metadata, dataset_idx)

    def _fit_prepared(self, backend: Any, store: Any, metadata: Any, dataset_idx: Any) -> Any:
        train_rows = util.dataset_rows(store, store.get_train_data_path(dataset_idx))
        val_rows = util.dataset_rows(store, store.get_val_data_path(dataset_idx))
        if train_rows < backend.num_processes():
            raise ValueError(
                f"{train_rows} training rows for {backend.num_processes()} processes: every "
                "process needs at least one row"
            )
        return self._fit_on_prepared_data(backend, train_rows, val_rows, metadata, None,
                                          dataset_idx)  # fmt: skip

    def _fit_on_prepared_data(
        self, backend: Any, train_rows: int, val_rows: int, metadata: Any, avg_row_size: Any,
        dataset_idx: Any = None,
    ) -> Any:  # fmt: skip
        raise NotImplementedError()

    def _get_or_create_backend(self) -> Any:
        backend = self.getBackend()
        if backend is None:
            backend = SparkBackend(self.getNumProc(), verbose=self.getVerbose())
        elif self.getNumProc() is not None:
            raise ValueError('At most one of parameters "backend" and "num_proc" may be specified')
        return backend

    # -- runs and checkpoints --------------------------------------------------------------
    def _run_id(self) -> str:
        return self.getRunId() or f"{self._run_prefix}_{int(time.time())}"

    def _checkpoint_file(self, run_id: str) -> Optional[str]:
        store = self.getStore()
        path = store.get_checkpoint_path(run_id)
        if path is None:
            return None
        return f"{path}/{store.get_checkpoint_filename()}"

    def _has_checkpoint(self, run_id: str) -> bool:
        path = self._checkpoint_file(run_id)
        return path is not None and self.getStore().exists(path)

    def _load_run(self, run_id: str) -> Tuple[Optional[bytes], List[Dict[str, Any]]]:
        """The checkpoint of ``run_id`` (None without one) and its history so far."""
        if not self._has_checkpoint(run_id):
            return None, []
        store = self.getStore()
        path = self._checkpoint_file(run_id)
        if self.getVerbose():
            print(f"Resuming training from last checkpoint: {path}")
        history: List[Dict[str, Any]] = []
        logs = store.get_logs_path(run_id)
        if logs is not None and store.exists(f"{logs}/{HISTORY_FILE}"):
            history = json.loads(store.read(f"{logs}/{HISTORY_FILE}"))
        return store.read(path), history

    def _settings(
        self, run_id: str, metadata: Dict[str, Any], train_rows: int, val_rows: int,
        dataset_idx: Any, history: List[Dict[str, Any]], round_steps: Any,
    ) -> Dict[str, Any]:  # fmt: skip
        """What a rank needs of the estimator, as plain values (util-level, frontend-free)."""
        store = self.getStore()
        batch = self.getBatchSize()
        val_batch = self.getValBatchSize() or batch
        size = self._get_or_create_backend().num_processes()
        steps = self.getTrainStepsPerEpoch()
        if steps is None:
            steps = max(1, int(round_steps(train_rows / batch / size)))
        val_steps = 0
        if 0 < val_rows < size:
            warnings.warn(
                f"{val_rows} validation rows for {size} processes: training without validation",
                UserWarning,
                stacklevel=3,
            )
            val_rows = 0
        if val_rows:
            val_steps = self.getValidationStepsPerEpoch()
            if val_steps is None:
                val_steps = max(1, int(math.ceil(val_rows / val_batch / size)))
        shuffle = self.getShuffle() and self.getShuffleBufferSize() != 0
        return dict(
            store=store,
            run_id=run_id,
            train_path=store.get_train_data_path(dataset_idx),
            val_path=store.get_val_data_path(dataset_idx) if val_rows else None,
            train_rows=train_rows,
            val_rows=val_rows,
            feature_cols=list(self.getFeatureCols()),
            label_cols=list(self.getLabelCols()),
            sample_weight_col=self.getSampleWeightCol(),
            label_shapes=self.getLabelShapes(),
            metadata=metadata,
            batch_size=batch,
            val_batch_size=val_batch,
            epochs=self.getEpochs(),
            initial_epoch=len(history),
            history=history,
            steps_per_epoch=steps,
            validation_steps=val_steps,
            shuffle=shuffle,
            random_seed=self.getRandomSeed(),
            verbose=self.getVerbose(),
            transformation_fn=self.getTransformationFn(),
            gradient_compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            algorithm=self.getAlgorithm(),
            use_gpu=self.getUseGpu(),
            checkpoint_file=self._checkpoint_file(run_id),
            logs_path=store.get_logs_path(run_id),
        )


class HorovodModel(Model, ModelParams):
    """The Spark ML Model both frontends' models extend."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(history=None, model=None, feature_columns=None, label_columns=None,
                         run_id=None, _metadata=None)  # fmt: skip

    def transform(self, df: Any, params: Any = None) -> Any:
        """``df`` with the model's predictions added, one column per label: ``<label>__output``
        unless set with ``setOutputCols``."""
        return super().transform(df, params)

    def _transform(self, df: Any) -> Any:
        return util.transform_df(
            df,
            self.getFeatureColumns(),
            self.getLabelColumns(),
            self.getOutputCols(),
            self._get_metadata() or {},
            self._predict_factory(),
            self._probe,
        )

    def _predict_factory(self) -> Any:
        """A picklable function that, on an executor, returns ``predict(inputs) -> outputs``
        (lists of numpy arrays, one row per sample)."""
        raise NotImplementedError()

    def _probe(self) -> List[int]:
        """Values per row of each model output (the model run on one row of zeros)."""
        raise NotImplementedError()
