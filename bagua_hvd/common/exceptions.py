"""Exceptions with Horovod's names and bases (``horovod.common.exceptions``)."""

from __future__ import annotations

# Horovod's text for any use before hvd.init() (common.h's NOT_INITIALIZED_ERROR): the one copy.
NOT_INITIALIZED_ERROR = "Horovod has not been initialized; use hvd.init()."


class HorovodInternalError(RuntimeError):
    """A collective failed (cross-rank mismatch, lost peer, shutdown).

    Elastic mode treats it as recoverable: the state is restored and the job reset.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts in the job changed.

    Elastic mode resets without restoring the committed state; ``skip_sync`` is True when hosts
    were only removed, so the surviving ranks need not re-broadcast their state.
    """

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    """Horovod's text for a framework upgraded after installation."""
    return (
        f"Framework {name} installed with version {installed_version} but found version "
        f"{version}.\n             This can result in unexpected behavior including runtime "
        "errors.\n             Reinstall Horovod using `pip install --no-cache-dir` to build "
        "with the new version."
    )


class HorovodVersionMismatchError(ImportError):
    """The runtime version of a framework differs from its version at installation time.

    bagua_hvd builds no per-framework extension, so it never raises this itself; the class
    exists so that code catching it keeps working.
    """

    def __init__(self, name: str, version: str, installed_version: str) -> None:
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name = name
        self.version = version
        self.installed_version = installed_version
