"""``bagua-run`` inside a Slurm allocation: its hosts and slots, when no -H/--hostfile is given.

Slurm describes the allocation in the batch script's environment: ``SLURM_JOB_NODELIST`` in
its compressed form (``node[01-04,07],gpu5``) and the tasks per node (``SLURM_TASKS_PER_NODE``,
``2(x3),1``; ``SLURM_JOB_CPUS_PER_NODE`` when no task count was requested). The ranks are then
started on those nodes over ssh like any -H host list (Slurm lets a job's user ssh to the
job's nodes).
"""

from __future__ import annotations

import os
from typing import List, Mapping, Optional, Tuple

from bagua_hvd.rendezvous.hostlist import HostError, expand_counts, expand_nodelist


def allocation(environ: Optional[Mapping[str, str]] = None) -> Optional[List[Tuple[str, int]]]:
    """(host, slots) of the Slurm allocation this process runs in, None outside one."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    counts_text = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE")
    counts = expand_counts(counts_text) if counts_text else [1] * len(hosts)
    if len(counts) != len(hosts):
        raise HostError(
            f"Slurm lists {len(hosts)} nodes ({nodelist}) but {len(counts)} per-node counts "
            f"({counts_text})"
        )
    return list(zip(hosts, counts))
