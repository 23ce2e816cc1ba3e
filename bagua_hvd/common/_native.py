"""Loads the core library through cffi in ABI mode from its one C header (c_api.h)."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Dict

import cffi

from bagua_hvd.common import config

_PKG = Path(__file__).resolve().parent.parent
_lock = threading.Lock()
_lib = None
_declared = False
ffi = cffi.FFI()


def header_path() -> Path:
    """The core's C header: installed beside the library, or in the source tree (editable)."""
    for candidate in (
        _PKG / "_lib" / "c_api.h",
        _PKG.parent / "native" / "include" / "bagua_hvd" / "c_api.h",
    ):
        if candidate.exists():
            return candidate
    raise ImportError("bagua_hvd: c_api.h not found; reinstall with `pip install .`")


def _header_text() -> str:
    path = header_path()
    match = re.search(r"/\* BHVD_CDEF_BEGIN \*/(.*)/\* BHVD_CDEF_END \*/", path.read_text(), re.S)
    if match is None:
        raise ImportError(f"{path} lacks the BHVD_CDEF markers")
    return match.group(1)


def _library_path() -> Path:
    override = config.library_override()
    if override is not None:
        return override
    path = _PKG / "_lib" / "libbagua_hvd.so"
    if not path.exists():
        raise ImportError(
            f"bagua_hvd core library not found at {path}; build it with `pip install .` "
            "(or `pip install -e .` for a development tree)"
        )
    return path


def _declare() -> None:
    """Reads the header into ``ffi`` (once): its types and enums, no library needed."""
    global _declared
    if not _declared:
        with _lock:
            if not _declared:
                ffi.cdef(_header_text())
                _declared = True


def enum(name: str, prefix: str) -> Dict[str, int]:
    """The members of ``enum name`` of c_api.h, without ``prefix``:
    ``enum("bhvd_status", "BHVD_")["OK"] == 0``. The header is the one source of these values."""
    _declare()
    members = ffi.typeof(f"enum {name}").relements
    return {k[len(prefix) :]: v for k, v in members.items() if k.startswith(prefix)}


def lib():
    """The loaded core library (cffi ABI-mode handle); loaded on first use."""
    global _lib
    if _lib is None:
        _declare()
        with _lock:
            if _lib is None:
                _lib = ffi.dlopen(str(_library_path()))
    return _lib


def last_error() -> str:
    return ffi.string(lib().bhvd_last_error()).decode("utf-8", "replace")
