"""Horovod's helpers (``horovod.common.util``) that user code and frontends import."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sysconfig
import warnings
from typing import Any, Callable, Iterator, Sequence


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Horovod checks that its per-framework extension was built; bagua_hvd has none.

    The core library is framework-neutral and loaded through cffi, so there is nothing to check
    here; the frontend raises ImportError at import if the core library itself is missing.
    """
    return None


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when the framework behind ``ext_base_name`` (e.g. ``horovod.torch``) is installed.

    There is no per-framework extension to build, so a frontend is available exactly when its
    framework is importable.
    """
    framework = ext_base_name.rsplit(".", 1)[-1]
    try:
        return importlib.util.find_spec(framework) is not None
    except (ImportError, ValueError):
        return False


def get_ext_suffix() -> str:
    """Suffix of Python extension modules on this platform (Horovod API)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """Path of an extension module next to ``pkg_path`` (Horovod API)."""
    path = os.path.join(os.path.dirname(pkg_path), *args[:-1], args[-1] + get_ext_suffix())
    return path


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when the framework sees a GPU (only torch is checked without importing the rest)."""
    if ext_base_name in ("torch", "bagua_hvd.torch", "horovod.torch"):
        try:
            import torch

            return bool(torch.cuda.is_available())
        except ImportError:
            return False
    if ext_base_name in ("tensorflow", "bagua_hvd.tensorflow", "horovod.tensorflow"):
        try:
            import tensorflow as tf

            return bool(tf.config.list_physical_devices("GPU"))
        except ImportError:
            return False
    return False


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoizes ``f`` on its arguments (Horovod's ``horovod.common.util._cache``: the build
    facts below are computed once per process)."""
    results: dict = {}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = (args, frozenset(kwargs.items()))
        if key not in results:
            results[key] = f(*args, **kwargs)
        return results[key]

    return wrapper


def _build_fact(method: str, verbose: bool) -> Any:
    """``HorovodBasics().<method>()`` of the core library, the same answer every frontend's
    ``hvd.<method>()`` gives (no ``init()`` needed). As Horovod's helpers, None when it cannot
    be told (here: the core library does not load); ``verbose`` prints what was checked."""
    try:
        from bagua_hvd.common.basics import HorovodBasics

        result = getattr(HorovodBasics(), method)()
    except (ImportError, OSError) as e:
        if verbose:
            print(f"Could not load the bagua_hvd core to check {method}: {e}")
        return None
    if verbose:
        print(f"bagua_hvd core: {method}() = {result!r}")
    return result


@_cache
def mpi_built(verbose: bool = False) -> bool | None:
    """True: MPI support is built in (Horovod's ``horovod.common.util.mpi_built``); mpirun
    jobs use the MPI mpi4py loads. ``verbose=False``: print what was checked when True."""
    return _build_fact("mpi_built", verbose)


@_cache
def gloo_built(verbose: bool = False) -> bool | None:
    """True: the core plays Horovod's Gloo role (its own controller and CPU operations)."""
    return _build_fact("gloo_built", verbose)


@_cache
def nccl_built(verbose: bool = False) -> int | None:
    """NCCL_VERSION_CODE of the NCCL that serves CUDA tensors (loaded at run time), or 0: a core
    built without CUDA, or no NCCL found (docs/gpu.md)."""
    return _build_fact("nccl_built", verbose)


@_cache
def ddl_built(verbose: bool = False) -> bool | None:
    """False: no IBM DDL support."""
    return _build_fact("ddl_built", verbose)


@_cache
def ccl_built(verbose: bool = False) -> bool | None:
    """False: no oneCCL support."""
    return _build_fact("ccl_built", verbose)


@_cache
def cuda_built(verbose: bool = False) -> bool | None:
    """True when the core library was built with CUDA support (its CUDA engine)."""
    return _build_fact("cuda_built", verbose)


@_cache
def rocm_built(verbose: bool = False) -> bool | None:
    """False: no ROCm support."""
    return _build_fact("rocm_built", verbose)


def check_installed_version(name: str, version: str) -> None:
    """Horovod compares framework versions against build time; nothing is compiled per framework
    here, so any installed version is accepted."""
    return None


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, Any], int]:
    """Reconciles the deprecated ``average=`` with ``op=`` (Horovod's rules).

    ``reduce_ops`` is any object with ``Average`` and ``Sum`` attributes.
    """

    def impl(op: int | None, average: bool | None) -> int:
        if op is not None:
            if average is not None:
                raise ValueError(
                    "The op parameter supersedes average. Please provide only one of them."
                )
            return op
        if average is not None:
            warnings.warn(
                "Parameter `average` has been replaced with `op` and will be removed in v1.0",
                DeprecationWarning,
                stacklevel=3,
            )
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


def num_rank_is_power_2(num_rank: int) -> bool:
    """True if ``num_rank`` is a power of two (Adasum's requirement)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(values: Sequence[Any], n: int) -> list:
    """Splits ``values`` into ``n`` contiguous chunks whose lengths differ by at most one."""
    d, r = divmod(len(values), n)
    return [values[i * d + min(i, r) : (i + 1) * d + min(i + 1, r)] for i in range(n)]


def is_iterable(x: Any) -> bool:
    """True if ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Compares dotted versions numerically (``'2.13.0+cpu' >= '2.1'``)."""

    def parts(v: str) -> tuple:
        out = []
        for piece in v.split("+")[0].split("."):
            digits = "".join(ch for ch in piece if ch.isdigit())
            out.append(int(digits) if digits else 0)
        return tuple(out)

    return parts(ver) >= parts(target)


@contextlib.contextmanager
def env(**kwargs: Any) -> Iterator[None]:
    """Sets environment variables for the duration of the block, then restores them."""
    saved = {k: os.environ.get(k) for k in kwargs}
    os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_predivide_and_groups(
    op: int,
    gradient_predivide_factor: float,
    num_groups: int,
    groups: Any,
    rocm: bool,
    stacklevel: int = 3,
) -> Any:
    """Horovod's shared argument checks of DistributedOptimizer and DistributedGradientTape:
    gradient_predivide_factor only with Average (and not on ROCm), and the deprecated
    ``num_groups`` folded into ``groups`` with Horovod's warning. Returns ``groups``."""
    from bagua_hvd.common.ops import Average

    if gradient_predivide_factor != 1.0:
        if rocm:
            raise ValueError("gradient_predivide_factor not supported yet with ROCm")
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        if groups is None:
            groups = num_groups
    return groups
