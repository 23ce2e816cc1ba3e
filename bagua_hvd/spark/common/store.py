"""horovod.spark.common.store for bagua_hvd: where the estimators keep their data and runs.

A Store is a directory tree under ``prefix_path`` (Horovod's layout)::

    <prefix>/intermediate_train_data.<idx>/   Parquet: the training rows of a fit (dataset idx)
    <prefix>/intermediate_val_data.<idx>/     Parquet: its validation rows (when validation is set)
    <prefix>/intermediate_test_data.<idx>/    (named for Horovod's API; the estimators write none)
    <prefix>/runs/<run_id>/checkpoint         the last epoch's checkpoint of run ``run_id``
    <prefix>/runs/<run_id>/logs/              the run's logs (history.json: metrics by epoch)

Files are read and written through ``pyarrow.fs`` (``LocalFileSystem``, ``HadoopFileSystem``);
Spark writes the Parquet data itself, to :meth:`AbstractFilesystemStore.get_full_path` (a URL
Spark understands: ``file:///...``, ``hdfs://...``). A store pickles without its filesystem
connection (the ranks reconnect), so it travels to the ranks with their function.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any, Dict, List, Optional, Tuple

_DATABRICKS_ENV = "DATABRICKS_RUNTIME_VERSION"


def is_databricks() -> bool:
    """Whether this process runs on Databricks (its runtime sets DATABRICKS_RUNTIME_VERSION)."""
    return _DATABRICKS_ENV in os.environ


def _pyarrow_fs() -> Any:
    try:
        import pyarrow.fs as pafs
    except ImportError as e:  # pragma: no cover - pyarrow is in the spark extra
        raise ImportError(
            "bagua_hvd.spark's Store needs pyarrow (pip install bagua_hvd[spark])"
        ) from e
    return pafs


class Store:
    """Storage of the estimators' intermediate data (the DataFrame as Parquet) and of their
    runs (checkpoints, logs): horovod.spark.common.store.Store's interface.

    Every fit writes its data under a dataset index and its run under ``runs/<run_id>``; the
    data is kept after the fit (a later fit on the same DataFrame reuses it), and a fit with the
    ``run_id`` of an earlier one resumes from its checkpoint.
    """

    def is_parquet_dataset(self, path: str) -> bool:
        """Whether ``path`` is the root of a Parquet dataset."""
        raise NotImplementedError()

    def get_parquet_dataset(self, path: str) -> Any:
        """The ``pyarrow.dataset.Dataset`` at ``path``."""
        raise NotImplementedError()

    def get_train_data_path(self, idx: Optional[int] = None) -> str:
        raise NotImplementedError()

    def get_val_data_path(self, idx: Optional[int] = None) -> str:
        raise NotImplementedError()

    def get_test_data_path(self, idx: Optional[int] = None) -> str:
        raise NotImplementedError()

    def saving_runs(self) -> bool:
        """Whether run output (checkpoints, logs) is saved during training."""
        raise NotImplementedError()

    def get_runs_path(self) -> str:
        raise NotImplementedError()

    def get_run_path(self, run_id: str) -> str:
        raise NotImplementedError()

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        """The directory holding the checkpoint of ``run_id`` (None when runs are not saved)."""
        raise NotImplementedError()

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> List[str]:
        raise NotImplementedError()

    def get_logs_path(self, run_id: str) -> Optional[str]:
        raise NotImplementedError()

    def get_checkpoint_filename(self) -> str:
        raise NotImplementedError()

    def get_logs_subdir(self) -> str:
        raise NotImplementedError()

    def exists(self, path: str) -> bool:
        raise NotImplementedError()

    def read(self, path: str) -> bytes:
        raise NotImplementedError()

    def write(self, path: str, data: bytes) -> None:
        """Writes ``data`` to ``path`` (a bagua_hvd addition), replacing it as a whole."""
        raise NotImplementedError()

    def write_text(self, path: str, text: str) -> None:
        raise NotImplementedError()

    def sync_fn(self, run_id: str) -> Any:
        """A function copying a local directory into the run path of ``run_id``."""
        raise NotImplementedError()

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        """The store for ``prefix_path``: :class:`HDFSStore` for ``hdfs://`` URLs,
        :class:`DBFSLocalStore` for DBFS paths on Databricks, else :class:`LocalStore`."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if is_databricks() and DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        return LocalStore(prefix_path, *args, **kwargs)


class AbstractFilesystemStore(Store):
    """A store on a filesystem reached through ``pyarrow.fs`` (``self.fs``)."""

    def __init__(
        self,
        prefix_path: str,
        train_path: Optional[str] = None,
        val_path: Optional[str] = None,
        test_path: Optional[str] = None,
        runs_path: Optional[str] = None,
        save_runs: bool = True,
        storage_options: Optional[Dict[str, Any]] = None,
        checkpoint_filename: Optional[str] = None,
    ) -> None:
        if storage_options:
            raise ValueError(
                "storage_options (fsspec's) are not supported by bagua_hvd's stores, which use "
                "pyarrow.fs: pass HDFSStore's host/port/user/kerb_ticket/extra_conf instead"
            )
        self.prefix_path = self.get_full_path(prefix_path)
        self._train_path = self._full_or_default(train_path, "intermediate_train_data")
        self._val_path = self._full_or_default(val_path, "intermediate_val_data")
        self._test_path = self._full_or_default(test_path, "intermediate_test_data")
        self._runs_path = self._full_or_default(runs_path, "runs")
        self._save_runs = save_runs
        self.checkpoint_filename = checkpoint_filename or "checkpoint"
        self._fs: Any = None

    # -- pickling: the filesystem connection stays behind, the ranks open their own ----------
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"] = None
        return state

    @property
    def fs(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` of the store (connected on first use)."""
        if self._fs is None:
            self._fs = self._connect()
        return self._fs

    def _connect(self) -> Any:
        raise NotImplementedError()

    def get_full_path(self, path: str) -> str:
        """``path`` as a URL Spark writes to."""
        raise NotImplementedError()

    def get_localized_path(self, path: str) -> str:
        """``path`` as ``self.fs`` names it."""
        raise NotImplementedError()

    def _full_or_default(self, path: Optional[str], default: str) -> str:
        if path is not None:
            return self.get_full_path(path)
        return posixpath.join(self.prefix_path, default)

    # -- layout ----------------------------------------------------------------------------
    def get_train_data_path(self, idx: Optional[int] = None) -> str:
        return f"{self._train_path}.{idx}" if idx is not None else self._train_path

    def get_val_data_path(self, idx: Optional[int] = None) -> str:
        return f"{self._val_path}.{idx}" if idx is not None else self._val_path

    def get_test_data_path(self, idx: Optional[int] = None) -> str:
        return f"{self._test_path}.{idx}" if idx is not None else self._test_path

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        return self.get_run_path(run_id) if self._save_runs else None

    def get_logs_path(self, run_id: str) -> Optional[str]:
        if not self._save_runs:
            return None
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir())

    def get_checkpoint_filename(self) -> str:
        return self.checkpoint_filename

    def get_logs_subdir(self) -> str:
        return "logs"

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> List[str]:
        path = self.get_checkpoint_path(run_id)
        if path is None or not self.exists(path):
            return []
        pafs = _pyarrow_fs()
        infos = self.fs.get_file_info(pafs.FileSelector(self.get_localized_path(path)))
        return sorted(i.path for i in infos if i.path.endswith(suffix))

    # -- files -----------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        pafs = _pyarrow_fs()
        info = self.fs.get_file_info(self.get_localized_path(path))
        return info.type != pafs.FileType.NotFound

    def read(self, path: str) -> bytes:
        with self.fs.open_input_stream(self.get_localized_path(path)) as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        local = self.get_localized_path(path)
        self.fs.create_dir(posixpath.dirname(local), recursive=True)
        # Written beside, then renamed over: a reader never sees half a checkpoint.
        tmp = f"{local}.tmp-{os.getpid()}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        try:
            self.fs.move(tmp, local)
        except OSError:  # filesystems whose rename does not replace (HDFS)
            self.fs.delete_file(local)
            self.fs.move(tmp, local)

    def write_text(self, path: str, text: str) -> None:
        self.write(path, text.encode("utf-8"))

    def delete(self, path: str) -> None:
        """Removes ``path`` (a file or a directory tree) if it exists."""
        pafs = _pyarrow_fs()
        local = self.get_localized_path(path)
        info = self.fs.get_file_info(local)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(local)
        elif info.type != pafs.FileType.NotFound:
            self.fs.delete_file(local)

    def is_parquet_dataset(self, path: str) -> bool:
        try:
            return len(self.get_parquet_dataset(path).files) > 0
        except (OSError, ValueError):
            return False

    def get_parquet_dataset(self, path: str) -> Any:
        import pyarrow.dataset as ds

        return ds.dataset(self.get_localized_path(path), format="parquet", filesystem=self.fs)

    def sync_fn(self, run_id: str) -> Any:
        run_path = self.get_run_path(run_id)
        store = self

        def sync(local_run_path: str) -> None:
            for root, _dirs, files in os.walk(local_run_path):
                rel = os.path.relpath(root, local_run_path)
                for name in files:
                    target = posixpath.normpath(posixpath.join(run_path, rel, name))
                    with open(os.path.join(root, name), "rb") as f:
                        store.write(target, f.read())

        return sync

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class LocalStore(AbstractFilesystemStore):
    """A store on the local filesystem (or one mounted at the same path on every machine of
    the cluster: the ranks and Spark's executors read and write it too). ``prefix_path`` is a
    path or a ``file://`` URL."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(prefix_path, *args, **kwargs)

    def _connect(self) -> Any:
        return _pyarrow_fs().LocalFileSystem()

    def get_full_path(self, path: str) -> str:
        if path.startswith("file://"):
            return path
        if "://" in path:
            raise ValueError(f"{type(self).__name__}: {path!r} is not a local path")
        return "file://" + os.path.abspath(path)

    def get_localized_path(self, path: str) -> str:
        if path.startswith("file://"):
            return path[len("file://") :]
        return os.path.abspath(path)

    @classmethod
    def matches(cls, path: str) -> bool:
        return True


# Horovod's newer name for the local store.
FilesystemStore = LocalStore


class HDFSStore(AbstractFilesystemStore):
    """A store on HDFS, reached through ``pyarrow.fs.HadoopFileSystem`` (which needs libhdfs:
    ``HADOOP_HOME``, ``JAVA_HOME`` and the Hadoop ``CLASSPATH``, as pyarrow documents).

    ``prefix_path`` takes Horovod's forms: ``hdfs://namenode:8020/user/me/run``,
    ``hdfs:///user/me/run`` or ``/user/me/run``. ``host``/``port`` default to the URL's, else
    ``"default"`` and 0 (the namenode of the Hadoop configuration). The connection is made at
    construction: an unreachable HDFS fails at once with what pyarrow said.
    """

    FS_PREFIX = "hdfs://"
    URL_PATTERN = "^(?:(.+://))?(?:([^/:]+))?(?:[:]([0-9]+))?(?:(.+))?$"

    def __init__(
        self,
        prefix_path: str,
        host: Optional[str] = None,
        port: Optional[int] = None,
        user: Optional[str] = None,
        kerb_ticket: Optional[str] = None,
        driver: str = "libhdfs",
        extra_conf: Optional[Dict[str, str]] = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        prefix, url_host, url_port, path, offset = self.parse_url(prefix_path)
        if prefix is not None and prefix != self.FS_PREFIX:
            raise ValueError(
                f"Mismatched HDFS namespace for URL: {prefix_path}. Found {prefix} but "
                f"expected {self.FS_PREFIX}"
            )
        if not path:
            raise ValueError(f"Failed to parse path from URL: {prefix_path}")
        if driver != "libhdfs":
            raise ValueError(f"HDFSStore: driver={driver!r}: pyarrow.fs only has libhdfs")
        self._url_prefix = prefix_path[:offset] if prefix else self.FS_PREFIX
        self._hdfs_kwargs = dict(
            host=host or url_host or "default",
            port=int(port or url_port or 0),
            user=user,
            kerb_ticket=kerb_ticket,
            extra_conf=extra_conf,
        )
        super().__init__(prefix_path, *args, **kwargs)
        self._fs = self._connect()

    def parse_url(self, url: str) -> Tuple[Optional[str], Optional[str], Optional[int], str, int]:
        match = re.search(self.URL_PATTERN, url)
        if match is None:
            raise ValueError(f"Failed to parse HDFS URL: {url}")
        port = int(match.group(3)) if match.group(3) is not None else None
        return match.group(1), match.group(2), port, match.group(4), match.start(4)

    def _connect(self) -> Any:
        pafs = _pyarrow_fs()
        hadoop = getattr(pafs, "HadoopFileSystem", None)
        where = f"{self._hdfs_kwargs['host']}:{self._hdfs_kwargs['port']}"
        if hadoop is None:
            raise ImportError(
                "HDFSStore: this pyarrow has no pyarrow.fs.HadoopFileSystem (built without "
                "HDFS support); install a pyarrow wheel with it"
            )
        kwargs = {k: v for k, v in self._hdfs_kwargs.items() if v is not None}
        try:
            fs = hadoop(**kwargs)
            fs.get_file_info(self.get_localized_path(self.prefix_path))
        except (OSError, RuntimeError) as e:
            raise OSError(
                f"HDFSStore: cannot reach HDFS at {where} for {self.prefix_path} through "
                "pyarrow.fs.HadoopFileSystem (it needs libhdfs: HADOOP_HOME, JAVA_HOME and the "
                f"Hadoop CLASSPATH set, and a reachable namenode): {e}"
            ) from e
        return fs

    def get_full_path(self, path: str) -> str:
        if not self.matches(path):
            return self._url_prefix + path
        return path

    def get_localized_path(self, path: str) -> str:
        if self.matches(path):
            return path[len(self._url_prefix) :]
        return path

    @classmethod
    def matches(cls, path: str) -> bool:
        return path.startswith(cls.FS_PREFIX)


class DBFSLocalStore(LocalStore):
    """A store on the Databricks File System through its local file API (``/dbfs/...``).
    ``prefix_path`` is ``/dbfs/...``, ``dbfs:/...``, ``file:/dbfs/...`` or ``file:///dbfs/...``.
    """

    DBFS_PATH_FORMAT_ERROR = (
        "The provided path is not a DBFS path: {}, Please provide a path starting with "
        "`/dbfs/...` or `dbfs:/...` or `file:/dbfs/...` or `file:///dbfs/...`."
    )

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.normalize_path(prefix_path), *args, **kwargs)

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        return (
            (path.startswith("dbfs:/") and not path.startswith("dbfs://"))
            or path.startswith("/dbfs/")
            or path.startswith("file:///dbfs/")
            or path.startswith("file:/dbfs/")
        )

    @staticmethod
    def normalize_path(path: str) -> str:
        """``path`` in the form ``/dbfs/...``."""
        if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
            return "/dbfs" + path[len("dbfs:") :]
        if path.startswith("/dbfs/"):
            return path
        if path.startswith("file:///dbfs/"):
            return path[len("file://") :]
        if path.startswith("file:/dbfs/"):
            return path[len("file:") :]
        raise ValueError(DBFSLocalStore.DBFS_PATH_FORMAT_ERROR.format(path))

    def get_full_path(self, path: str) -> str:
        return "file://" + self.normalize_path(path)

    def get_localized_path(self, path: str) -> str:
        return self.normalize_path(path)
