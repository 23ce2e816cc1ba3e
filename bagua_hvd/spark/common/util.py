"""What both estimators share around the data: the DataFrame written to the Store as Parquet
(driver), each rank's shard read back with ``pyarrow.dataset`` (ranks), and the rows of a
DataFrame turned into model inputs and predictions into columns (``transform``).

Columns: a feature or label column is a numeric scalar, an array of numbers, or a Spark ML
vector (``VectorUDT``, written as an array of doubles; a SparseVector comes back dense). Arrays
must have the same length in every row (the column's ``shape`` in the metadata).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

# The run's metrics by epoch, in its logs directory: how many epochs a resume starts after.
HISTORY_FILE = "history.json"

# The datasets this process wrote, by what they were written from: a later fit on the same
# DataFrame with the same columns and split reuses them (Horovod's intermediate data cache).
_DATASETS: Dict[Tuple[Any, ...], int] = {}
_DATASETS_LOCK = threading.Lock()


def column_metadata(df: Any, columns: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Per column: ``spark_data_type`` (the Spark type's class), ``intermediate_format``
    (``"array"`` for vectors written as arrays, else ``"nochange"``), ``shape`` (elements per
    row) and ``dtype`` (the numpy type of its elements). One Spark job for array lengths."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    fields = {f.name: f for f in df.schema.fields}
    meta: Dict[str, Dict[str, Any]] = {}
    sized = []
    for name in columns:
        if name not in fields:
            continue
        dtype = fields[name].dataType
        if isinstance(dtype, VectorUDT):
            meta[name] = dict(spark_data_type=type(dtype), intermediate_format="array",
                              dtype="float64")  # fmt: skip
            sized.append(name)
        elif isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.NumericType):
            element = _numpy_dtype(dtype.elementType)
            meta[name] = dict(spark_data_type=type(dtype), intermediate_format="nochange",
                              dtype=element, element_type=type(dtype.elementType))  # fmt: skip
            sized.append(name)
        elif isinstance(dtype, (T.NumericType, T.BooleanType)):
            meta[name] = dict(spark_data_type=type(dtype), intermediate_format="nochange",
                              dtype=_numpy_dtype(dtype), shape=1)  # fmt: skip
        else:
            raise ValueError(
                f"column {name!r} has type {dtype.simpleString()}: the estimators take numeric "
                "scalars, arrays of numbers and ml.linalg vectors"
            )
    if sized:

        def length(c: str) -> Any:
            if meta[c]["spark_data_type"] is VectorUDT:
                from pyspark.ml.functions import vector_to_array

                return F.size(vector_to_array(F.col(c)))
            return F.size(F.col(c))

        aggs = []
        for c in sized:
            aggs += [F.min(length(c)).alias(f"min_{c}"), F.max(length(c)).alias(f"max_{c}")]
        row = df.agg(*aggs).first()
        for c in sized:
            low, high = row[f"min_{c}"], row[f"max_{c}"]
            if low is None or low < 0:
                raise ValueError(f"column {c!r}: no rows, or a null value")
            if low != high:
                raise ValueError(
                    f"column {c!r}: arrays of different lengths ({low} to {high}); the "
                    "estimators need the same length in every row"
                )
            meta[c]["shape"] = int(high)
    return meta


def _numpy_dtype(spark_type: Any) -> str:
    from pyspark.sql import types as T

    table = {
        T.ByteType: "int8",
        T.ShortType: "int16",
        T.IntegerType: "int32",
        T.LongType: "int64",
        T.FloatType: "float32",
        T.DoubleType: "float64",
        T.BooleanType: "bool",
    }
    for cls, name in table.items():
        if isinstance(spark_type, cls):
            return name
    return "float64"  # decimals


def _dataset_key(df: Any, store: Any, *parts: Any) -> Tuple[Any, ...]:
    try:
        plan = df.semanticHash()
    except Exception:  # noqa: BLE001 - no plan hash (Spark Connect): the object's identity
        plan = ("id", id(df))
    return (store.get_train_data_path(), plan, *parts)


@contextlib.contextmanager
def prepare_data(
    num_processes: int,
    store: Any,
    df: Any,
    label_columns: Sequence[str],
    feature_columns: Sequence[str],
    validation: Any = None,
    sample_weight_col: Optional[str] = None,
    partitions_per_process: int = 10,
    verbose: int = 0,
    random_seed: Optional[int] = None,
) -> Iterator[int]:
    """Writes ``df``'s columns to the store's intermediate paths as Parquet (train, and val
    when ``validation`` is a fraction or a column of 1/True for validation rows) and yields the
    dataset index; a dataset this process already wrote from the same DataFrame and arguments
    is reused while its files remain."""
    columns = list(dict.fromkeys([*feature_columns, *label_columns]))
    if sample_weight_col:
        columns.append(sample_weight_col)
    missing = [c for c in columns if c not in df.columns]
    if isinstance(validation, str) and validation not in df.columns:
        missing.append(validation)
    if missing:
        raise ValueError(f"columns {missing} not found in the DataFrame ({df.columns})")
    partitions = max(1, num_processes * partitions_per_process)
    key = _dataset_key(df, store, tuple(columns), validation, partitions, random_seed)
    with _DATASETS_LOCK:
        idx = _DATASETS.get(key)
        if idx is not None and not store.exists(store.get_train_data_path(idx)):
            idx = None
        if idx is None:
            idx = 0
            taken = {v for k, v in _DATASETS.items() if k[0] == key[0]}  # this store's
            while idx in taken or store.exists(store.get_train_data_path(idx)):
                idx += 1
            _write(store, df, idx, columns, validation, partitions, random_seed, verbose)
            _DATASETS[key] = idx
        elif verbose:
            print(f"Reusing the intermediate data of dataset {idx} in {store}")
    yield idx


def _write(
    store: Any,
    df: Any,
    idx: int,
    columns: Sequence[str],
    validation: Any,
    partitions: int,
    seed: Optional[int],
    verbose: int,
) -> None:
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    selected = [
        vector_to_array(F.col(c)).alias(c)
        if isinstance(df.schema[c].dataType, VectorUDT)
        else F.col(c)
        for c in columns
    ]
    train_path = store.get_train_data_path(idx)
    val_path = store.get_val_data_path(idx)
    if isinstance(validation, str):
        flag = F.col(validation).cast("boolean")
        train = df.where(~flag | flag.isNull()).select(*selected)
        val = df.where(flag).select(*selected)
    elif validation:
        part = df.select(*selected)
        train, val = part.randomSplit([1.0 - float(validation), float(validation)], seed=seed)
    else:
        train, val = df.select(*selected), None
    if verbose:
        print(f"Writing the DataFrame to {train_path} ({partitions} partitions)")
    train.repartition(partitions).write.mode("overwrite").parquet(train_path)
    if val is not None:
        val.repartition(partitions).write.mode("overwrite").parquet(val_path)
    elif store.exists(val_path):
        store.delete(val_path)


def dataset_rows(store: Any, path: str) -> int:
    """Rows in the Parquet dataset at ``path`` (0 when there is none), from its metadata."""
    if not store.exists(path):
        return 0
    return int(store.get_parquet_dataset(path).count_rows())


# -- ranks ------------------------------------------------------------------------------------


def read_shard(
    store: Any, path: str, columns: Sequence[str], rank: int, size: int
) -> Dict[str, np.ndarray]:
    """Rank ``rank``'s contiguous ``1/size`` of the rows of the dataset at ``path`` (files in
    name order, whole files or slices of them read with ``pyarrow.dataset``), as numpy arrays by
    column: ``(rows,)`` for scalars, ``(rows, n)`` for arrays. Shards differ by one row at most,
    whatever the number of files."""
    import pyarrow as pa

    dataset = store.get_parquet_dataset(path)
    fragments = sorted(dataset.get_fragments(), key=lambda f: f.path)
    counts = [f.count_rows() for f in fragments]
    total = sum(counts)
    low, high = total * rank // size, total * (rank + 1) // size
    tables = []
    start = 0
    for fragment, count in zip(fragments, counts):
        a, b = max(low, start), min(high, start + count)
        if a < b:
            tables.append(fragment.to_table(columns=list(columns)).slice(a - start, b - a))
        start += count
    if tables:
        table = pa.concat_tables(tables)
    else:
        table = dataset.schema.empty_table().select(list(columns))
    return table_to_numpy(table)


def table_to_numpy(table: Any) -> Dict[str, np.ndarray]:
    import pyarrow as pa

    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if col.null_count:
            raise ValueError(f"column {name!r} has null values")
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            values = col.flatten().to_numpy(zero_copy_only=False)
            out[name] = values.reshape(len(col), -1) if len(col) else values.reshape(0, 0)
        elif pa.types.is_fixed_size_list(col.type):
            out[name] = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), -1)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def apply_transformation(fn: Any, data: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``transformation_fn`` on a shard: a pandas DataFrame in (arrays as lists), one out."""
    import pandas as pd

    frame = pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in data.items()})
    result = fn(frame)
    return {
        c: np.stack(result[c].to_numpy()) if result[c].dtype == object else result[c].to_numpy()
        for c in result.columns
    }


class Batches:
    """Endless batches of a rank's shard: each pass over it in a fresh random order (seeded by
    ``seed``) when ``shuffle``; the last batch of a pass may be short."""

    def __init__(
        self, data: Dict[str, np.ndarray], batch_size: int, shuffle: bool, seed: Optional[int]
    ) -> None:
        self.data = data
        self.rows = len(next(iter(data.values()))) if data else 0
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        if self.rows == 0:
            raise ValueError("this rank's shard of the data is empty: fewer rows than processes")
        while True:
            order = self.rng.permutation(self.rows) if self.shuffle else np.arange(self.rows)
            for start in range(0, self.rows, self.batch_size):
                pick = order[start : start + self.batch_size]
                yield {k: v[pick] for k, v in self.data.items()}


def as_inputs(
    data: Dict[str, np.ndarray],
    columns: Sequence[str],
    shapes: Optional[Sequence[Any]],
    dtype: Any,
) -> List[np.ndarray]:
    """The arrays of ``columns`` as model inputs of ``dtype`` (None keeps each column's own),
    each reshaped to ``[-1, *shape]`` when ``shapes`` gives one."""
    out = []
    for i, c in enumerate(columns):
        a = data[c] if dtype is None else data[c].astype(dtype, copy=False)
        if shapes is not None and shapes[i] is not None:
            a = a.reshape([-1, *[int(s) for s in list(shapes[i])[1:]]])
        out.append(a)
    return out


def label_dtype(values: np.ndarray) -> Any:
    """Labels keep integer types (int64: class indices) and become float32 otherwise."""
    return np.int64 if np.issubdtype(values.dtype, np.integer) else np.float32


def fmt_metrics(metrics: Dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())


# -- transform --------------------------------------------------------------------------------


def rows_to_arrays(rows: Sequence[Any], columns: Sequence[str]) -> Dict[str, np.ndarray]:
    """A batch of Spark Rows as numpy arrays by column (vectors and arrays as 2-D rows)."""
    out = {}
    for c in columns:
        values = [r[c] for r in rows]
        if values and hasattr(values[0], "toArray"):
            out[c] = np.stack([v.toArray() for v in values])
        elif values and isinstance(values[0], (list, tuple, np.ndarray)):
            out[c] = np.asarray(values, dtype=np.float64)
        else:
            out[c] = np.asarray(values)
    return out


def output_field(label: str, output_col: str, per_row: int, metadata: Dict[str, Any]) -> Any:
    """The Spark field of a prediction column: the label's own type when the model gives one
    value per row for a scalar label, else a DenseVector (Horovod's choice)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    meta = metadata.get(label, {})
    cls = meta.get("spark_data_type")
    if per_row == 1 and cls is not None and issubclass(cls, (T.NumericType, T.BooleanType)):
        return T.StructField(output_col, cls(), True)
    return T.StructField(output_col, VectorUDT(), True)


def to_output_value(pred: np.ndarray, field: Any) -> Any:
    """One row's prediction as the value of its output field."""
    from pyspark.ml.linalg import DenseVector, VectorUDT
    from pyspark.sql import types as T

    if isinstance(field.dataType, VectorUDT):
        return DenseVector(np.asarray(pred, dtype=np.float64).reshape(-1))
    value = np.asarray(pred).reshape(-1)[0].item()
    if isinstance(field.dataType, T.BooleanType):
        return bool(round(value))
    if isinstance(field.dataType, T.IntegralType):
        return int(round(value))
    return float(value)


def transform_df(
    df: Any,
    feature_cols: Sequence[str],
    label_cols: Sequence[str],
    output_cols: Sequence[str],
    metadata: Dict[str, Any],
    predict_factory: Any,
    probe: Any,
    batch_size: int = 256,
) -> Any:
    """``df`` with the output columns added: ``predict_factory()`` (called once per partition,
    on the executor) gives ``predict(list of input arrays) -> list of output arrays``;
    ``probe()`` (on the driver) gives the number of values per row of each output."""
    from pyspark.sql import Row
    from pyspark.sql import types as T

    sizes = probe()
    fields = [
        output_field(label, out, n, metadata)
        for label, out, n in zip(label_cols, output_cols, sizes)
    ]
    kept = [f for f in df.schema.fields if f.name not in set(output_cols)]
    schema = T.StructType([*kept, *fields])
    names = [f.name for f in kept]
    features = list(feature_cols)

    def predict_partition(rows: Iterator[Any]) -> Iterator[Any]:
        predict = None
        batch: List[Any] = []

        def flush() -> Iterator[Any]:
            arrays = rows_to_arrays(batch, features)
            outputs = predict([arrays[c] for c in features])
            for i, row in enumerate(batch):
                values = [row[n] for n in names]
                values += [to_output_value(o[i], f) for o, f in zip(outputs, fields)]
                yield Row(*values)

        for row in rows:
            if predict is None:
                predict = predict_factory()
            batch.append(row)
            if len(batch) >= batch_size:
                yield from flush()
                batch = []
        if batch:
            yield from flush()

    spark = df.sparkSession
    return spark.createDataFrame(df.rdd.mapPartitions(predict_partition), schema)
