"""Horovod's ``horovod.runner.gloo_run``: ``gloo_run`` (bagua_hvd.runner.programmatic)."""

from bagua_hvd.runner.programmatic import gloo_run

__all__ = ["gloo_run"]
