"""Horovod's ``horovod.runner.common.service.compute_service``: ``ComputeService`` and
``ComputeClient``, defined in :mod:`bagua_hvd.rendezvous.compute_service` (the ranks of a
compute job run them, and ranks import ``bagua_hvd.rendezvous``, not the launcher)."""

from bagua_hvd.rendezvous.compute_service import ComputeClient, ComputeService

__all__ = ["ComputeClient", "ComputeService"]
