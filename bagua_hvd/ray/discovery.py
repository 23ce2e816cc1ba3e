"""``RayHostDiscovery``: an elastic job's hosts are the live nodes of the Ray cluster
(Horovod's ``horovod.ray.elastic.RayHostDiscovery``).

Hosts are named by Ray node id, not by IP as Horovod does: several Ray nodes may run on one
machine and share its IP, and each must be a host of its own (the actors are pinned to a node,
and a removed node must take only its own slots with it). RayExecutor names its hosts the same
way.
"""

from __future__ import annotations

import logging
from typing import Dict

from bagua_hvd.runner.elastic.discovery import HostDiscovery

logger = logging.getLogger(__name__)


class RayHostDiscovery(HostDiscovery):
    """The slots of every live Ray node: its CPUs // ``cpus_per_slot``, and with ``use_gpu``
    at most its GPUs // ``gpus_per_slot``; nodes with no slot are left out. Counts each node's
    total resources, as Horovod does: the executor assumes the whole cluster is its own.

    Args:
        use_gpu: count GPUs too (default False).
        cpus_per_slot: CPUs per worker (default 1).
        gpus_per_slot: GPUs per worker with use_gpu (default 1).
    """

    def __init__(self, use_gpu: bool = False, cpus_per_slot: int = 1, gpus_per_slot: int = 1):
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        logger.debug(
            "Ray discovery: %s CPU / %s GPU per slot",
            cpus_per_slot,
            gpus_per_slot if use_gpu else 0,
        )

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """``{node id: slots}`` of the live nodes with at least one slot."""
        import ray

        hosts: Dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // self.cpus_per_slot)
            if self.use_gpu:
                slots = min(slots, int(resources.get("GPU", 0) // self.gpus_per_slot))
            if slots > 0:
                hosts[node["NodeID"]] = slots
        return hosts
