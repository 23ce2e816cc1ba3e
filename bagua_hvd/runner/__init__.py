"""Launching jobs: the ``bagua-run`` command line (bagua_run.py; launch.py has Horovod's names
for it) and ``bagua_hvd.run`` (api.py). The ranks never import this package: what they share
with it is ``bagua_hvd.rendezvous``.

``run`` and ``_HorovodArgs`` are resolved lazily so that ``import bagua_hvd`` stays cheap. They
import most of this package, so its modules import each other by full name (``import
bagua_hvd.runner.ssh as ssh``, ``from bagua_hvd.runner.hosts import ...``), never ``from
bagua_hvd.runner import ssh``, which reads these lazy names and would close a cycle.
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
