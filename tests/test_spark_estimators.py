"""The Spark estimators (bagua_hvd.spark.torch.TorchEstimator, bagua_hvd.spark.keras
.KerasEstimator) on the local standalone cluster of tests/spark_cluster.py: each fits
scikit-learn's digits at 2 processes from a DataFrame, through the Store (Parquet data, then
checkpoints), resumes a run from its checkpoint, and its model's ``transform`` predicts a held-out
split; plus the Store's layout and errors, and the params it refuses or ignores."""

from __future__ import annotations

import io
import pickle
import shutil
import sys
import warnings

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
pytest.importorskip("sklearn")
if shutil.which("java") is None:
    pytest.skip("no java on PATH: Spark needs a Java runtime", allow_module_level=True)

# The ranks and Spark's Python workers cannot import this test module: its model classes and
# functions travel by value.
import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

from bagua_hvd.spark.common.store import (  # noqa: E402
    DBFSLocalStore,
    HDFSStore,
    LocalStore,
    Store,
)

RUN = "digits_run"
EPOCHS = 6  # per fit; the resumed fit trains as many again
# What both estimators' tests give their estimator besides the model and its training.
FIT = dict(
    num_proc=2,
    label_cols=["label"],
    validation=0.1,
    batch_size=32,
    epochs=EPOCHS,
    partitions_per_process=2,
    run_id=RUN,
    random_seed=1,
)


def _digits():
    """Pixels in [0, 1] and labels, split 80/20 by a permutation seeded 0 (test: the 20 %)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    y = data.target.astype(np.int64)
    order = np.random.RandomState(0).permutation(len(x))
    n_test = len(x) // 5
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


@pytest.fixture(scope="module")
def digits(spark_cluster):
    """(train DataFrame, test DataFrame, test labels): an ``id``, the 64 pixels both as an ML
    vector (``features``) and as an array (``pixels``), the ``label``."""
    from pyspark.ml.linalg import Vectors

    x_train, y_train, x_test, y_test = _digits()

    def frame(x, y):
        rows = [(i, Vectors.dense(f), f.tolist(), int(t)) for i, (f, t) in enumerate(zip(x, y))]
        return spark_cluster.createDataFrame(rows, ["id", "features", "pixels", "label"])

    # One partition to predict: one Spark Python worker loads the model (and its framework).
    return frame(x_train, y_train), frame(x_test, y_test).coalesce(1), y_test


def _accuracy(model, test_df, y_test) -> float:
    """The predicted class (numpy argmax of ``label__output``) against the true labels."""
    rows = model.transform(test_df).select("id", "label__output").collect()
    rows.sort(key=lambda r: r["id"])
    assert len(rows) == len(y_test)
    predicted = np.array([np.argmax(r["label__output"].toArray()) for r in rows])
    return float((predicted == y_test).mean())


def _check_store_after_fit(store: LocalStore, checkpoint_magic: bytes) -> bytes:
    assert store.is_parquet_dataset(store.get_train_data_path(0))
    assert store.is_parquet_dataset(store.get_val_data_path(0))
    checkpoint = f"{store.get_checkpoint_path(RUN)}/checkpoint"
    assert store.exists(checkpoint) and store.exists(f"{store.get_logs_path(RUN)}/history.json")
    data = store.read(checkpoint)
    assert data.startswith(checkpoint_magic)
    return data


# -- the Store ------------------------------------------------------------------------------


def test_store_create_gives_a_local_store_with_horovods_layout(tmp_path):
    root = tmp_path / "store"
    store = Store.create(str(root))
    assert type(store) is LocalStore
    prefix = f"file://{root}"
    assert store.prefix_path == prefix
    assert store.get_train_data_path() == f"{prefix}/intermediate_train_data"
    assert store.get_train_data_path(2) == f"{prefix}/intermediate_train_data.2"
    assert store.get_val_data_path(2) == f"{prefix}/intermediate_val_data.2"
    assert store.get_test_data_path(2) == f"{prefix}/intermediate_test_data.2"
    assert store.get_runs_path() == f"{prefix}/runs"
    assert store.get_run_path("r1") == f"{prefix}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{prefix}/runs/r1"
    assert store.get_logs_path("r1") == f"{prefix}/runs/r1/logs"
    assert store.get_checkpoint_filename() == "checkpoint"
    assert store.saving_runs()
    assert type(Store.create(prefix)) is LocalStore
    assert Store.create(prefix).get_run_path("r1") == store.get_run_path("r1")

    path = store.get_run_path("r1") + "/checkpoint"
    assert not store.exists(path)
    store.write(path, b"one")
    store.write(path, b"two")  # replaced as a whole
    assert store.exists(path) and store.read(path) == b"two"
    assert (root / "runs" / "r1" / "checkpoint").read_bytes() == b"two"
    assert sorted(p.name for p in (root / "runs" / "r1").iterdir()) == ["checkpoint"]
    copy = pickle.loads(pickle.dumps(store))  # as the ranks get it: reconnects
    assert copy.read(path) == b"two"
    assert LocalStore(str(root), save_runs=False).get_checkpoint_path("r1") is None


def test_dbfs_store_on_databricks(monkeypatch):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    for path in ("dbfs:/ml/run", "/dbfs/ml/run", "file:/dbfs/ml/run", "file:///dbfs/ml/run"):
        store = Store.create(path)
        assert type(store) is DBFSLocalStore, path
        assert store.prefix_path == "file:///dbfs/ml/run"
        assert store.get_localized_path(store.get_run_path("r")) == "/dbfs/ml/run/runs/r"
    with pytest.raises(ValueError, match="not a DBFS path"):
        DBFSLocalStore("/tmp/x")


def test_hdfs_store_without_a_reachable_hdfs_is_a_clear_error(monkeypatch):
    for var in ("HADOOP_HOME", "ARROW_LIBHDFS_DIR", "CLASSPATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(OSError, match="HDFSStore: cannot reach HDFS at nn.example:8020") as info:
        Store.create("hdfs://nn.example:8020/user/me/runs")
    assert "libhdfs" in str(info.value)
    with pytest.raises(ValueError, match="Mismatched HDFS namespace"):
        HDFSStore("s3://bucket/path")


# -- params ---------------------------------------------------------------------------------


def test_refused_and_ignored_params(digits, tmp_path):
    import torch

    from bagua_hvd.spark.torch import TorchEstimator

    train_df = digits[0]
    model = torch.nn.Linear(64, 10)
    common = dict(
        num_proc=2,
        store=Store.create(str(tmp_path)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
    )
    with pytest.raises(ValueError, match="only one of loss_constructors and loss"):
        TorchEstimator(**common, loss_constructors=[torch.nn.CrossEntropyLoss])
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        TorchEstimator(**common, backward_passes_per_step=0)
    estimator = TorchEstimator(**common, reader_pool_type="process", continuous_cols=["features"])
    with pytest.warns(UserWarning, match="reader_pool_type='process' has no effect"):
        with pytest.raises(ValueError, match="continuous_cols is not supported"):
            estimator.fit(train_df)
    with pytest.raises(ValueError, match="callbacks are not supported"):
        TorchEstimator(**common, callbacks=[object()]).fit(train_df)
    with pytest.raises(ValueError, match=r"Label columns \['nope'\] not found"):
        TorchEstimator(**{**common, "label_cols": ["nope"]}).fit(train_df)
    with pytest.raises(ValueError, match="num_proc"):
        TorchEstimator(**common, backend=object()).fit(train_df)
    assert not list((tmp_path).iterdir())  # refused before anything was written


def test_estimators_import_as_horovod_under_the_alias(monkeypatch):
    from bagua_hvd import as_horovod
    from bagua_hvd.spark import keras as spark_keras
    from bagua_hvd.spark import torch as spark_torch
    from bagua_hvd.spark.common import store

    monkeypatch.setenv("BAGUA_HVD_AS_HOROVOD", "1")
    as_horovod.install()
    try:
        from horovod.spark.common.store import Store as HorovodStore
        from horovod.spark.keras import KerasEstimator, KerasModel
        from horovod.spark.torch import TorchEstimator, TorchModel
    finally:
        as_horovod.uninstall()
    assert HorovodStore is store.Store
    assert (TorchEstimator, TorchModel) == (spark_torch.TorchEstimator, spark_torch.TorchModel)
    assert (KerasEstimator, KerasModel) == (spark_keras.KerasEstimator, spark_keras.KerasModel)


# -- TorchEstimator -------------------------------------------------------------------------


def _torch_net():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(64, 64)
            self.out = nn.Linear(64, 10)

        def forward(self, x):
            return self.out(torch.relu(self.hidden(x)))

    torch.manual_seed(0)
    return Net()


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def test_torch_estimator_fits_digits_and_resumes_from_its_checkpoint(digits, tmp_path, capfd):
    import torch

    from bagua_hvd.spark.torch import TorchEstimator, TorchModel

    train_df, test_df, y_test = digits
    store = Store.create(str(tmp_path / "store"))
    model = _torch_net()
    estimator = TorchEstimator(
        store=store,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.003),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=[accuracy],
        feature_cols=["features"],
        input_shapes=[[-1, 64]],
        **FIT,
    )
    first = estimator.fit(train_df)
    assert isinstance(first, TorchModel) and first.getRunId() == RUN
    assert first.getOutputCols() == ["label__output"]
    history = first.getHistory()
    assert [h["epoch"] for h in history] == list(range(EPOCHS))
    assert set(history[0]["train"]) == {"loss", "accuracy_label"}
    assert set(history[0]["validation"]) == {"loss", "accuracy_label"}
    # Rank 0's epoch lines, forwarded by bagua_hvd.spark.run.
    out = capfd.readouterr().out
    assert f"[0]<stdout>:epoch {EPOCHS}/{EPOCHS}  loss " in out, out
    saved = torch.load(io.BytesIO(_check_store_after_fit(store, b"PK")), weights_only=False)
    for name, value in first.getModel().state_dict().items():
        assert torch.equal(saved["model"][name], value), name
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.003)  # one process's

    second = estimator.fit(train_df)  # the same run_id: from the checkpoint
    history = second.getHistory()
    assert [h["epoch"] for h in history] == list(range(2 * EPOCHS))
    assert history[:EPOCHS] == first.getHistory()
    # The resumed epochs start where the first fit ended, far below a fresh start's loss.
    assert history[EPOCHS]["train"]["loss"] < 0.5 * history[0]["train"]["loss"]
    assert history[EPOCHS]["train"]["loss"] < 1.5 * history[EPOCHS - 1]["train"]["loss"]
    assert "Resuming training from last checkpoint" in capfd.readouterr().out
    assert _accuracy(second, test_df, y_test) >= 0.95


# -- KerasEstimator -------------------------------------------------------------------------


def test_keras_estimator_fits_digits_and_resumes_from_its_checkpoint(digits, tmp_path):
    pytest.importorskip("tensorflow")
    import keras

    from bagua_hvd.spark.keras import KerasEstimator, KerasModel

    train_df, test_df, y_test = digits
    store = Store.create(str(tmp_path / "store"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    estimator = KerasEstimator(
        store=store,
        model=model,
        optimizer=keras.optimizers.Adam(0.003),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["pixels"],
        **FIT,
    )
    first = estimator.fit(train_df)
    assert isinstance(first, KerasModel) and first.getOutputCols() == ["label__output"]
    history = first.getHistory()
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history)
    assert len(history["loss"]) == EPOCHS
    _check_store_after_fit(store, b"PK")  # a .keras file (a zip)
    lr = first.getModel().optimizer.learning_rate
    assert float(keras.ops.convert_to_numpy(lr)) == pytest.approx(0.003)  # one process's

    second = estimator.fit(train_df)
    history = second.getHistory()
    assert len(history["loss"]) == 2 * EPOCHS
    assert history["loss"][EPOCHS] < 0.5 * history["loss"][0]
    assert history["loss"][EPOCHS] < 1.5 * history["loss"][EPOCHS - 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _accuracy(second, test_df, y_test) >= 0.95
