"""Launching jobs: the ``bagua-run`` command line (launch.py) and ``bagua_hvd.run`` (api.py).

``run`` is resolved lazily so that ``python -m bagua_hvd.runner.launch`` does not import the
launcher twice and ``import bagua_hvd`` stays cheap.
"""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from bagua_hvd.runner.api import run

        return run
    if name == "_HorovodArgs":  # horovod.runner._HorovodArgs, for launch._run
        from bagua_hvd.runner.programmatic import _HorovodArgs

        return _HorovodArgs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
