"""Horovod's ``horovod.runner.common.util.hosts``: host lists and Horovod's assignment of ranks
to slots (the placement bagua-run uses as well: each host's slots filled in the order given)."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

from bagua_hvd.runner.elastic.hosts import INVALID_SLOT_INFO, SlotInfo
from bagua_hvd.runner.elastic.hosts import get_host_assignments as _assign

__all__ = [
    "INVALID_SLOT_INFO",
    "HostInfo",
    "SlotInfo",
    "get_host_assignments",
    "parse_host_files",
    "parse_hosts",
    "parse_hosts_and_slots",
]


class HostInfo:
    """A host and its number of slots."""

    def __init__(self, hostname: str, slots: int) -> None:
        self.hostname = hostname
        self.slots = slots

    @staticmethod
    def from_string(host_string: str) -> HostInfo:
        """``"host:slots"`` -> HostInfo."""
        hostname, slots = host_string.strip().split(":")
        return HostInfo(hostname, int(slots))

    def __repr__(self) -> str:
        return f"HostInfo(hostname={self.hostname!r}, slots={self.slots})"


def parse_host_files(filename: str) -> str:
    """A hostfile of ``host slots=N`` lines as ``"host1:N1,host2:N2"``."""
    hosts = []
    with open(filename) as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            hosts.append(f"{line.split()[0]}:{line.split('=')[1].strip()}")
    return ",".join(hosts)


_HOST_SLOTS = re.compile(r"^[\w.-]+:[0-9]+$")


def parse_hosts_and_slots(hosts: str) -> Tuple[List[str], Dict[str, int]]:
    """``"w0:2,w1:2"`` -> (["w0", "w1"], {"w0": 2, "w1": 2}); ValueError on another form."""
    names: List[str] = []
    slots: Dict[str, int] = {}
    for host in hosts.split(","):
        if not _HOST_SLOTS.match(host.strip()):
            raise ValueError(
                "Invalid host input, please make sure it has format as : worker-0:2,worker-1:2."
            )
        name, count = host.strip().split(":")
        names.append(name)
        slots[name] = int(count)
    return names, slots


def parse_hosts(hosts_string: str) -> List[HostInfo]:
    """``"w0:2,w1:2"`` -> [HostInfo("w0", 2), HostInfo("w1", 2)]."""
    return [HostInfo.from_string(h) for h in hosts_string.split(",")]


def get_host_assignments(
    hosts: Sequence[HostInfo], min_num_proc: int, max_num_proc: Optional[int] = None
) -> List[SlotInfo]:
    """Ranks over the hosts' slots, each host filled before the next (at most
    ``max_num_proc`` ranks); the cross rank of a rank is its host's index among the hosts
    that have a rank with its local rank. ValueError when fewer than ``min_num_proc`` slots.
    The elastic driver's assignment, over Horovod's HostInfo."""
    return _assign([(h.hostname, h.slots) for h in hosts], min_num_proc, max_num_proc)
