"""horovod.spark.torch.estimator for bagua_hvd: TorchEstimator and TorchModel."""

from __future__ import annotations

import copy
import io
from typing import Any, Dict, List, Optional

from pyspark import keyword_only
from pyspark.ml.param.shared import Param, Params

from bagua_hvd.spark.common.estimator import HorovodEstimator, HorovodModel
from bagua_hvd.spark.common.params import add_accessors


def _to_list(value: Any, n: int) -> List[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if len(value) == 1 and n > 1:
            return list(value) * n
        return list(value)
    return [value] * n


class TorchEstimator(HorovodEstimator):
    """Spark Estimator fitting a PyTorch model to a DataFrame on ``num_proc`` ranks in Spark
    tasks (bagua_hvd.spark.run), each reading its shard of the data from the Store; returns a
    :class:`TorchModel`. Horovod's parameters and defaults (docs/spark.md says which ones have
    no effect or are refused):

    Args:
        num_proc: number of processes (default: ``spark.default.parallelism``).
        model: the ``torch.nn.Module`` to train; ``forward`` takes one tensor per feature column.
        backend: runs the training function (default: a SparkBackend of ``num_proc``
            processes); at most one of ``backend`` and ``num_proc``.
        store: the Store of the intermediate data and of the runs (checkpoints, logs).
        optimizer: a torch optimizer on ``model``'s parameters; its class and state are
            rebuilt on every rank and wrapped in ``hvd.DistributedOptimizer``. The learning rate
            is multiplied by the number of processes during training (Horovod's scaling).
        loss: a loss (or one per label): ``loss(output, label)``; a functional loss must take
            ``reduction=`` when ``sample_weight_col`` is set.
        loss_constructors: functions returning the losses (instead of ``loss``).
        metrics: functions ``metric(output, label) -> number``, averaged by epoch.
        loss_weights: weights of the per-label losses (default: ``1/len(label_cols)`` each).
        sample_weight_col: column of per-row weights of the loss.
        gradient_compression: ``hvd.Compression`` for DistributedOptimizer.
        feature_cols, label_cols: the model's inputs and outputs, in order.
        input_shapes: the shape of each input (``[-1, ...]``), to reshape flat features.
        validation: a fraction of rows held out at random, or a column (1/True: validation).
        label_shapes: shapes the labels are reshaped to before the loss.
        batch_size, val_batch_size, epochs, train_steps_per_epoch, validation_steps_per_epoch:
            as Horovod (steps per epoch default: ``train_rows / batch_size / num_proc``,
            rounded down, at least 1).
        verbose: 0 silent, 1 a line per epoch on rank 0, 2 a line per step too.
        random_seed: seeds torch on every rank and the shuffling of each rank's shard.
        shuffle: shuffle each rank's shard every epoch (default True); ``shuffle_buffer_size``
            0 turns it off too (any other value: the whole shard is shuffled).
        partitions_per_process: Parquet partitions written per process (default 10).
        run_id: names the run in the store; a fit with the run_id of an earlier fit resumes
            from its last checkpoint (default ``pytorch_<time>``).
        train_minibatch_fn: returns Horovod's ``train_minibatch(model, optimizer,
            transform_outputs, loss_fn, inputs, labels, sample_weights,
            backward_passes_per_step, batch_idx) -> (outputs, loss)``; it runs forward and
            backward, the loop calls ``optimizer.step()`` after every
            ``backward_passes_per_step``-th call.
        transformation_fn: a function of a pandas DataFrame (each rank's shard) returning one.
        use_gpu: train on the rank's local GPU when CUDA is available (default True).
        backward_passes_per_step: passes accumulated per allreduce (default 1).
        algorithm: a BAGUA algorithm for ``hvd.DistributedOptimizer(algorithm=)`` (a
            bagua_hvd extension; default: the ``BAGUA_HVD_ALGORITHM`` variable, else allreduce).
    """

    _run_prefix = "pytorch"

    data_module = Param(Params._dummy(), "data_module", "not supported")
    input_shapes = Param(Params._dummy(), "input_shapes", "input layer shapes")
    loss_constructors = Param(
        Params._dummy(), "loss_constructors", "functions that construct the loss"
    )
    train_minibatch_fn = Param(
        Params._dummy(),
        "train_minibatch_fn",
        "functions that construct the minibatch train function for torch",
    )

    @keyword_only
    def __init__(
        self,
        num_proc: Optional[int] = None,
        data_module: Any = None,
        model: Any = None,
        backend: Any = None,
        store: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        loss_constructors: Any = None,
        metrics: Any = None,
        loss_weights: Any = None,
        sample_weight_col: Optional[str] = None,
        gradient_compression: Any = None,
        feature_cols: Any = None,
        continuous_cols: Any = None,
        categorical_cols: Any = None,
        input_shapes: Any = None,
        validation: Any = None,
        label_cols: Any = None,
        callbacks: Any = None,
        batch_size: Optional[int] = None,
        val_batch_size: Optional[int] = None,
        epochs: Optional[int] = None,
        verbose: int = 1,
        random_seed: Optional[int] = None,
        shuffle_buffer_size: Optional[int] = None,
        shuffle: bool = True,
        partitions_per_process: Optional[int] = None,
        run_id: Optional[str] = None,
        train_minibatch_fn: Any = None,
        train_steps_per_epoch: Optional[int] = None,
        validation_steps_per_epoch: Optional[int] = None,
        transformation_fn: Any = None,
        train_reader_num_workers: Optional[int] = None,
        val_reader_num_workers: Optional[int] = None,
        reader_pool_type: str = "thread",
        label_shapes: Any = None,
        inmemory_cache_all: bool = False,
        use_gpu: bool = True,
        mp_start_method: Optional[str] = None,
        backward_passes_per_step: int = 1,
        algorithm: Any = None,
    ) -> None:
        super().__init__()
        self._setDefault(
            data_module=None,
            loss_constructors=None,
            input_shapes=None,
            train_minibatch_fn=None,
            transformation_fn=None,
        )
        kwargs = self._input_kwargs
        if "loss" in kwargs and "loss_constructors" in kwargs:
            raise ValueError("only one of loss_constructors and loss parameters can be specified.")
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        # None stands for the default (Horovod's signature has None where its param has one).
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        self.setParams(**kwargs)

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.getCallbacks():
            raise ValueError(
                "TorchEstimator: callbacks are not supported (Horovod's TorchEstimator does not "
                "call them either); use metrics, or train_minibatch_fn for per-step work"
            )

    def _get_optimizer(self) -> Any:
        return self.getOrDefault(self.optimizer)

    def getOptimizer(self) -> Any:  # noqa: N802 - Horovod's name
        """The optimizer, rebuilt on the current model's parameters (Horovod's behaviour)."""
        optimizer = self._get_optimizer()
        model = self.getModel()
        if model is None or optimizer is None:
            return optimizer
        rebuilt = optimizer.__class__(model.parameters(), lr=1)
        rebuilt.load_state_dict(optimizer.state_dict())
        return rebuilt

    def _fit_on_prepared_data(
        self, backend: Any, train_rows: int, val_rows: int, metadata: Any, avg_row_size: Any,
        dataset_idx: Any = None,
    ) -> Any:  # fmt: skip
        from bagua_hvd.spark.torch import remote

        optimizer = self._get_optimizer()
        if optimizer is None:
            raise ValueError("the optimizer parameter is required")
        labels = self.getLabelCols()
        if self.getLossConstructors():
            loss_fns = [c() for c in _to_list(self.getLossConstructors(), len(labels))]
        else:
            loss_fns = _to_list(self.getLoss(), len(labels))
        if len(loss_fns) != len(labels):
            raise ValueError(f"{len(loss_fns)} losses for {len(labels)} label columns")
        weights = self.getLossWeights() or [1.0 / len(labels)] * len(labels)
        run_id = self._run_id()
        checkpoint, history = self._load_run(run_id)
        settings = self._settings(run_id, metadata, train_rows, val_rows, dataset_idx, history,
                                  round_steps=int)  # fmt: skip
        results = backend.run(
            remote.train,
            args=(
                settings,
                self.getModel(),
                optimizer.__class__,
                optimizer.state_dict(),
                checkpoint,
                loss_fns,
                list(weights),
                list(self.getMetrics() or []),
                self.getInputShapes(),
                self.getTrainMinibatchFn(),
            ),
            env={},
        )
        history, state = results[0]
        return self._create_model(history, state, run_id, metadata)

    def _create_model(
        self, history: Any, state: bytes, run_id: str, metadata: Dict[str, Any]
    ) -> TorchModel:
        import torch

        checkpoint = torch.load(io.BytesIO(state), map_location="cpu", weights_only=False)
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(checkpoint["model"])
        model.eval()
        optimizer = self._get_optimizer().__class__(model.parameters(), lr=1)
        optimizer.load_state_dict(checkpoint["optimizer"])
        return TorchModel(
            history=history,
            model=model,
            optimizer=optimizer,
            feature_columns=self.getFeatureCols(),
            input_shapes=self.getInputShapes(),
            label_columns=self.getLabelCols(),
            run_id=run_id,
            _metadata=metadata,
            loss=self.getLoss(),
            loss_constructors=self.getLossConstructors(),
        )


add_accessors(TorchEstimator, ["data_module", "input_shapes", "loss_constructors",
                               "train_minibatch_fn"])  # fmt: skip


class TorchModel(HorovodModel):
    """Spark Transformer wrapping a trained PyTorch model: ``transform(df)`` adds a column per
    label, ``<label>__output``: the label's type when the model gives one value per row for a
    scalar label, else a DenseVector of the output (Horovod's columns). ``getModel()`` is the
    ``torch.nn.Module``."""

    optimizer = Param(Params._dummy(), "optimizer", "optimizer")
    input_shapes = Param(Params._dummy(), "input_shapes", "input layer shapes")
    loss = Param(Params._dummy(), "loss", "loss")
    loss_constructors = Param(
        Params._dummy(), "loss_constructors", "functions that construct the loss"
    )

    @keyword_only
    def __init__(
        self,
        history: Any = None,
        model: Any = None,
        feature_columns: Any = None,
        input_shapes: Any = None,
        label_columns: Any = None,
        optimizer: Any = None,
        run_id: Optional[str] = None,
        _metadata: Any = None,
        loss: Any = None,
        loss_constructors: Any = None,
    ) -> None:
        super().__init__()
        if label_columns:
            self.setOutputCols([col + "__output" for col in label_columns])
        self._setDefault(optimizer=None, loss=None, loss_constructors=None, input_shapes=None)
        self.setParams(**self._input_kwargs)

    def _shapes(self) -> List[List[int]]:
        shapes = self.getInputShapes()
        if shapes:
            return [[1, *[int(d) for d in list(s)[1:]]] for s in shapes]
        meta = self._get_metadata() or {}
        return [[1, int(meta.get(c, {}).get("shape", 1))] for c in self.getFeatureColumns()]

    def _predict_factory(self) -> Any:
        model = self.getModel()
        input_shapes = self.getInputShapes()

        def factory() -> Any:
            import numpy as np
            import torch

            from bagua_hvd.spark.common import util

            torch.set_num_threads(1)  # one Spark task per core
            model.eval()

            def predict(inputs: List[Any]) -> List[Any]:
                cols = [f"f{i}" for i in range(len(inputs))]
                arrays = util.as_inputs(dict(zip(cols, inputs)), cols, input_shapes, np.float32)
                with torch.no_grad():
                    out = model(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])
                outs = out if isinstance(out, (list, tuple)) else [out]
                return [o.detach().cpu().numpy().reshape(len(inputs[0]), -1) for o in outs]

            return predict

        return factory

    def _probe(self) -> List[int]:
        import torch

        model = self.getModel()
        model.eval()
        with torch.no_grad():
            out = model(*[torch.zeros(s) for s in self._shapes()])
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [int(o[0].numel()) for o in outs]


add_accessors(TorchModel, ["optimizer", "input_shapes", "loss", "loss_constructors"])
