"""Horovod's ``horovod.runner.mpi_run``: ``mpi_run`` (bagua_hvd.runner.programmatic)."""

from bagua_hvd.runner.programmatic import mpi_run

__all__ = ["mpi_run"]
