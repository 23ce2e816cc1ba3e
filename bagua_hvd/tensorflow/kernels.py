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
``bagua_hvd.tensorflow.algorithms`` raises ImportError with the reason and what to do
(:func:`require`): the compiler not found, TensorFlow's C++ headers missing, the compiler's
command and output, or the switch. ``BAGUA_HVD_TF_KERNELS=0`` switches the library off (the
collectives' fallback; the algorithms' ImportError).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, List, Optional, Tuple

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
_why: List[Tuple[str, str]] = []  # why it is None, and what to do about it

_SWITCHED_OFF = "BAGUA_HVD_TF_KERNELS=0 switches it off"
_SWITCH_HELP = "Unset BAGUA_HVD_TF_KERNELS (or set it to 1) to build and use it."
# What to do where the compiler ran and failed, or the library failed to load.
_BUILD_HELP = (
    "It is compiled at first use with $CXX (default g++; C++17) against the headers of the "
    "installed tensorflow wheel (tf.sysconfig.get_include()): install a C++ compiler (e.g. "
    "`apt install g++`) or set CXX to one, and run `python -m bagua_hvd.tensorflow.build_kernels` "
    "to see the build's output."
)


class BuildError(RuntimeError):
    """Why the library cannot be built (the message), and what to do about it (``remedy``)."""

    def __init__(self, why: str, remedy: str = _BUILD_HELP) -> None:
        super().__init__(why)
        self.remedy = remedy


def _cache_dir() -> Path:
    return config.cache_dir()


def _core() -> Path:
    """The core library this process uses (loaded first: the kernels link to the same copy)."""
    _ops.native()
    return Path(_native._library_path()).resolve()


def _check_prerequisites(cxx: List[str]) -> None:
    """The two causes a user can fix, named before the compiler's own words about them
    (BuildError): no compiler ``cxx[0]``, no TensorFlow C++ headers."""
    if not cxx or shutil.which(cxx[0]) is None:
        name = cxx[0] if cxx else ""
        raise BuildError(
            f"the C++ compiler {name!r} ($CXX, default g++) was not found or is not executable",
            "Install a C++17 compiler (g++ 7 or newer, e.g. `apt install g++`, or clang) or set "
            "CXX to one, then run `python -m bagua_hvd.tensorflow.build_kernels` to build the "
            "library and see the build's output.",
        )
    include = Path(tf.sysconfig.get_include())
    if not (include / "tensorflow" / "core" / "framework" / "op.h").exists():
        raise BuildError(
            "TensorFlow's C++ headers are missing (no tensorflow/core/framework/op.h under "
            f"{include}, tf.sysconfig.get_include())",
            "Install a TensorFlow that ships them (the tensorflow wheel from PyPI does: `pip "
            "install tensorflow`; builds without headers cannot compile ops), then run "
            "`python -m bagua_hvd.tensorflow.build_kernels` to build the library and see the "
            "build's output.",
        )


def _build(target: Path) -> None:
    """Compiles the sources side by side (each parses TensorFlow's headers: one process each),
    then links them with the core library. BuildError says why it cannot."""
    cxx = shlex.split(config.compiler())
    _check_prerequisites(cxx)
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
                raise _failed(proc.args, proc.returncode, err)
        cmd = [
            *cxx, "-shared", *map(str, objects), "-o", str(target), str(core),
            f"-Wl,-rpath,{core.parent}", *tf.sysconfig.get_link_flags(),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise _failed(cmd, proc.returncode, proc.stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for obj in objects:
            obj.unlink(missing_ok=True)


def _failed(cmd: List[str], status: int, stderr: str) -> BuildError:
    """A compiler command's failure: the command, its exit status, the end of its output."""
    out = stderr[-2000:].rstrip()
    text = f"{' '.join(cmd)} failed (exit status {status})"
    return BuildError(f"{text}:\n{out}" if out else text)


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
                _why.append((_SWITCHED_OFF, _SWITCH_HELP))
            else:
                try:
                    module = tf.load_op_library(str(_library_path()))
                except Exception as e:  # noqa: BLE001 - any failure means: fall back
                    if isinstance(e, BuildError):
                        _why.append((str(e), e.remedy))
                    else:  # the library built but did not load, or the build broke down
                        _why.append((f"{type(e).__name__}: {e}", _BUILD_HELP))
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
    """The op module; where it cannot be loaded, ImportError (as Horovod's ``check_extension``
    for its compiled ops): ``purpose`` and why the library is missing (the switch; the compiler
    not found; TensorFlow's headers missing; or the compiler's command, exit status and output,
    on the lines that follow), then, on the last line, what to do about that cause."""
    module = load()
    if module is not None:
        return module
    why, remedy = _why[0] if _why else ("unknown", _BUILD_HELP)
    raise ImportError(
        f"{purpose} needs bagua_hvd's TensorFlow kernel library, which is not available: "
        f"{why}\n{remedy} Horovod's collectives and DistributedOptimizer without algorithm= do "
        "not need it."
    )
