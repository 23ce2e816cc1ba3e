"""``bagua-run --check-build``: what this installation can do, in horovodrun's "[X]" table style.

Frameworks are probed with importlib.util.find_spec (importable without paying for the import);
the controllers, transports and GPU support come from the core library, and are shown as missing
(with the reason) when it cannot be loaded.
"""

from __future__ import annotations

import importlib.util
from typing import List, Optional, Tuple

from bagua_hvd.version import __version__


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _nccl_version(code: int) -> str:
    # NCCL_VERSION_CODE is major*10000+minor*100+patch since 2.9, major*1000+minor*100+patch before.
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _core_info() -> Tuple[Optional[str], bool, int]:
    """(error or None, cuda built, NCCL version code) from the core library. A core built from
    another version of the sources (a stale library beside newer Python code) is an error."""
    try:
        from bagua_hvd.common import _native
        from bagua_hvd.common.frontend import basics

        core = _native.ffi.string(_native.lib().bhvd_version()).decode()
        if core != __version__:
            return (
                f"the core library {_native._library_path()} is version {core}, the Python "
                f"package {__version__}: rebuild it",
                False,
                0,
            )
        return None, basics.cuda_built(), basics.nccl_built()
    except Exception as e:  # missing library, missing header, cffi/dlopen failure
        return f"{type(e).__name__}: {e}", False, 0


def _section(title: str, rows: List[Tuple[str, bool]]) -> List[str]:
    return [f"{title}:"] + [f"    [{'X' if ok else ' '}] {name}" for name, ok in rows] + [""]


def check_build_text() -> str:
    """The --check-build report."""
    error, cuda, nccl = _core_info()
    core_ok = error is None
    nccl_name = f"NCCL {_nccl_version(nccl)}" if nccl else "NCCL"
    lines = [f"bagua_hvd v{__version__}:", ""]
    lines += _section(
        "Available Frameworks",
        [
            ("TensorFlow", _importable("tensorflow")),
            ("PyTorch", _importable("torch")),
        ],
    )
    lines += _section("Available Controllers", [("MPI", False), ("Gloo", core_ok)])
    lines += _section("Available Transports", [("Shared memory", core_ok), ("TCP", core_ok)])
    lines += _section(
        "Available Tensor Operations",
        [
            (nccl_name, core_ok and nccl > 0),
            ("DDL", False),
            ("CCL", False),
            ("MPI", core_ok),  # HOROVOD_CPU_OPERATIONS=mpi, with the MPI that runs the job
            ("Gloo", core_ok),
        ],
    )
    lines += _section("GPU Support", [("CUDA", core_ok and cuda)])
    if not core_ok:
        lines.append(f"Core library not loaded ({error}); build it with `pip install .`.")
        lines.append("")
    return "\n".join(lines)
