"""bagua_hvd: a drop-in replacement for Horovod (``import bagua_hvd.torch as hvd``).

Importing this package stays light (no framework, no core library): ``bagua_hvd.run`` is loaded
on first use.
"""

from typing import Any

from bagua_hvd.version import __version__

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from bagua_hvd.runner.api import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
