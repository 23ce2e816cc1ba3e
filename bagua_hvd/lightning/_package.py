"""Imports of a Lightning package for bagua_hvd's strategy, with the error that says what to
install when it is missing or too old."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(package: str, distribution: str, module: str) -> ModuleType:
    """``package.module`` (e.g. ``lightning.pytorch.strategies``), or ModuleNotFoundError
    naming the pip package (``distribution``) and the version needed (2.0 or later)."""
    try:
        top = importlib.import_module(package.split(".")[0])
        found = importlib.import_module(f"{package}.{module}")
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != package.split(".")[0]:
            raise  # something else is missing: its own message says what
        raise ModuleNotFoundError(
            f"bagua_hvd's Lightning strategy needs the {distribution!r} package (Lightning 2), "
            f"which is not installed: pip install 'bagua_hvd[lightning]' or pip install "
            f"'{distribution}>=2'",
            name=e.name,
        ) from e
    version = str(getattr(top, "__version__", "0"))
    if int(version.split(".")[0] or 0) < 2:
        raise ModuleNotFoundError(
            f"bagua_hvd's HorovodStrategy needs Lightning 2 or later, found {distribution} "
            f"{version}: pip install '{distribution}>=2'",
            name=package,
        )
    return found
