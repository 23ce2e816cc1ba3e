"""The ``BaguaHvdRaise`` op (status_op.cc), compiled on first use against the installed
TensorFlow, so that a collective inside ``tf.function`` fails with the same
``tf.errors.OpError`` class as eagerly (docs/tensorflow.md, "Errors").

The library is built once per TensorFlow build and source, with the compiler in ``$CXX`` (default
``g++``) and ``tf.sysconfig``'s flags, into ``$BAGUA_HVD_CACHE_DIR`` (default
``~/.cache/bagua_hvd``), under a file lock so that the ranks of a job build it once. Where it
cannot be built (no compiler, no TensorFlow headers) graph-mode errors fall back to
``tf.errors.UnknownError`` carrying the class name and Horovod's text, with one warning.
``BAGUA_HVD_TF_STATUS_OP=0`` disables it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import tensorflow as tf

_SOURCE = Path(__file__).with_name("status_op.cc")
_COMPILE_TIMEOUT_S = 300
_lock = threading.Lock()
_loaded: list = []  # [module or None] once tried


def _cache_dir() -> Path:
    root = os.environ.get("BAGUA_HVD_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "bagua_hvd"


def _build(target: Path) -> None:
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    cmd = [
        *cxx, "-std=c++17", "-shared", "-fPIC", "-O2", "-w", str(_SOURCE), "-o",
        str(target), *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def _library_path() -> Path:
    """The cached library for this TensorFlow and source, built if missing."""
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), tf.__version__, tf.__file__, *flags]).encode()
    ).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"tf_status_op-{key}.so"
    if target.exists():
        return target
    with open(directory / f"tf_status_op-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it
        if not target.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
            os.close(fd)
            try:
                _build(Path(tmp))
                os.replace(tmp, target)  # atomic: readers never see a partial file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return target


def load() -> Optional[Any]:
    """The op module (``.bagua_hvd_raise(code, message)``), or None where it cannot be built."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            module = None
            if os.environ.get("BAGUA_HVD_TF_STATUS_OP", "1") != "0":
                try:
                    module = tf.load_op_library(str(_library_path()))
                except Exception as e:  # noqa: BLE001 - any failure means: fall back
                    warnings.warn(
                        "bagua_hvd.tensorflow: could not build the BaguaHvdRaise op, so errors "
                        "of collectives inside tf.function surface as tf.errors.UnknownError "
                        f"(eager mode is not affected): {e}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            _loaded.append(module)
    return _loaded[0]
