"""bagua_hvd's TensorFlow kernels (kernels.cc: Horovod's collectives; bucket_kernels.cc and
weight_kernels.cc: BAGUA's algorithms; kernels.h what they share), compiled on first use into
one library against the installed TensorFlow (docs/tensorflow.md, "How tensors reach the core"):

- ``BaguaHvdCollective`` (allreduce, broadcast), ``BaguaHvdReducescatter``,
  ``BaguaHvdAllgather``, ``BaguaHvdAlltoall``: the collectives inside ``tf.function`` as
  asynchronous kernels that hand the tensors' buffers to the core and complete from the core's
  callback (no Python, no GIL in the step);
- BAGUA's algorithms (``BaguaHvdCounter``, ``BaguaHvdBuckets``, ``BaguaHvdLpInit``,
  ``BaguaHvdLpStep``, ``BaguaHvdLpFlush``, ``BaguaHvdLpReplicas``, ``BaguaHvdAsyncStep``,
  ``BaguaHvdAsyncControl``), driven by ``algorithm_kernels.py``;
- ``BaguaHvdRaise``: where a step runs through ``tf.numpy_function`` (every collective with
  ``mpi_ops._collective_kernel`` off, or without the library), this op fails the step
  with the status the callback returns, so that graph mode raises the same
  ``tf.errors.OpError`` classes as eager mode.

The library is built once per TensorFlow build, core library and sources (compiled side by
side, then linked), with the compiler in ``$CXX`` (default ``g++``) and ``tf.sysconfig``'s
flags, linked to the package's core library, into ``$BAGUA_HVD_CACHE_DIR`` (default
``~/.cache/bagua_hvd``), under a file lock so that the ranks of a job build it once (about
20 s on 2 cores). Torch-only users never build it. Where it cannot be
built (no compiler, no TensorFlow headers) every graph-mode collective of Horovod's API takes the
numpy_function path and errors surface as ``tf.errors.UnknownError`` carrying the class name and
Horovod's text, with one warning; BAGUA's algorithms have no such path: importing
``bagua_hvd.tensorflow.algorithms`` raises ImportError with the reason (:func:`require`).
``BAGUA_HVD_TF_KERNELS=0`` switches the library off (the collectives' fallback; the algorithms'
ImportError).
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
from typing import Any, List, Optional

import tensorflow as tf

from bagua_hvd.common import _native, config
from bagua_hvd.common import ops as _ops

# Horovod's collectives; BAGUA's gradient path; its weight averaging; what they share.
_SOURCES = [
    Path(__file__).with_name(n) for n in ("kernels.cc", "bucket_kernels.cc", "weight_kernels.cc")
]
_HEADER = Path(__file__).with_name("kernels.h")
_COMPILE_TIMEOUT_S = 300
_lock = threading.Lock()
_loaded: list = []  # [module or None] once tried
_why: List[str] = []  # why it is None


def _cache_dir() -> Path:
    return config.cache_dir()


def _core() -> Path:
    """The core library this process uses (loaded first: the kernels link to the same copy)."""
    _ops.native()
    return Path(_native._library_path()).resolve()


def _build(target: Path) -> None:
    """Compiles the sources side by side (each parses TensorFlow's headers: one process each),
    then links them with the core library."""
    cxx = shlex.split(config.compiler())
    core = _core()
    flags = [
        "-std=c++17", "-fPIC", "-O2", "-w",
        f"-I{_native.header_path().parent}", *tf.sysconfig.get_compile_flags(),
    ]  # fmt: skip
    objects = [target.with_name(f"{target.stem}-{src.stem}.o") for src in _SOURCES]
    procs: List[subprocess.Popen] = []
    try:
        for src, obj in zip(_SOURCES, objects):
            procs.append(
                subprocess.Popen(
                    [*cxx, *flags, "-c", str(src), "-o", str(obj)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            _, err = proc.communicate(timeout=_COMPILE_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(proc.args)} failed:\n{err[-2000:]}")
        cmd = [
            *cxx, "-shared", *map(str, objects), "-o", str(target), str(core),
            f"-Wl,-rpath,{core.parent}", *tf.sysconfig.get_link_flags(),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for obj in objects:
            obj.unlink(missing_ok=True)


def _library_path() -> Path:
    """The cached library for this TensorFlow and source, built if missing."""
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    core = _core()
    header = _native.header_path().read_text()
    key = hashlib.sha256(
        "\0".join(
            [
                *(p.read_text() for p in [*_SOURCES, _HEADER]),
                header,
                str(core),
                tf.__version__,
                tf.__file__,
                *flags,
            ]
        ).encode()
    ).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"tf_kernels-{key}.so"
    if target.exists():
        return target
    with open(directory / f"tf_kernels-{key}.lock", "w") as lock:
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


def loaded() -> Optional[Any]:
    """The op module when :func:`load` has loaded it already, else None (builds nothing)."""
    return _loaded[0] if _loaded else None


def load() -> Optional[Any]:
    """The op module (``.bagua_hvd_collective``, ``.bagua_hvd_reducescatter``,
    ``.bagua_hvd_allgather``, ``.bagua_hvd_alltoall``, ``.bagua_hvd_raise``), or None where it
    cannot be built or ``BAGUA_HVD_TF_KERNELS=0``."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            module = None
            if not config.tf_kernels_enabled():
                _why.append("BAGUA_HVD_TF_KERNELS=0 switches it off")
            else:
                try:
                    module = tf.load_op_library(str(_library_path()))
                except Exception as e:  # noqa: BLE001 - any failure means: fall back
                    _why.append(f"{type(e).__name__}: {e}")
                    warnings.warn(
                        "bagua_hvd.tensorflow: could not build its TensorFlow kernels, so "
                        "collectives inside tf.function run through tf.numpy_function and their "
                        "errors surface as tf.errors.UnknownError (eager mode is not affected): "
                        f"{e}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            _loaded.append(module)
    return _loaded[0]


def require(purpose: str) -> Any:
    """The op module; ImportError naming ``purpose``, why the library is missing and what to
    install where it cannot be built (as Horovod's ``check_extension`` for its compiled ops)."""
    module = load()
    if module is not None:
        return module
    why = _why[0] if _why else "unknown"
    raise ImportError(
        f"{purpose} needs bagua_hvd's TensorFlow kernel library, which is not available: "
        f"{why}\nIt is compiled at first use with $CXX (default g++; C++17) against the "
        "headers of the installed tensorflow wheel (tf.sysconfig.get_include()): install a C++ "
        "compiler (e.g. `apt install g++`) or set CXX to one, unset BAGUA_HVD_TF_KERNELS=0, and "
        "run `python -m bagua_hvd.tensorflow.build_kernels` to see the build's output. "
        "Horovod's collectives and DistributedOptimizer without algorithm= do not need it."
    )
