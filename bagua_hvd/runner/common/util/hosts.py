"""Horovod's ``horovod.runner.common.util.hosts``: host lists and Horovod's assignment of ranks
to slots (the placement bagua-run uses as well: each host's slots filled in the order given)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


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


@dataclass
class SlotInfo:
    """One rank's place: its host, global, local and cross ranks and the sizes."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_response_string(self) -> str:
        """``"rank,size,local_rank,local_size,cross_rank,cross_size"``."""
        values = (self.rank, self.size, self.local_rank, self.local_size, self.cross_rank,
                  self.cross_size)  # fmt: skip
        return ",".join(str(v) for v in values)


INVALID_SLOT_INFO = SlotInfo(hostname="", rank=-1, local_rank=-1, cross_rank=-1, size=-1,
                             local_size=-1, cross_size=-1)  # fmt: skip


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
    that have a rank with its local rank. ValueError when fewer than ``min_num_proc`` slots."""
    placed: List[Tuple[str, List[int]]] = []
    rank = 0
    for host in hosts:
        ranks: List[int] = []
        for _ in range(host.slots):
            if rank == max_num_proc:
                break
            ranks.append(rank)
            rank += 1
        placed.append((host.hostname, ranks))
    if rank < min_num_proc:
        raise ValueError(
            f"Requested more processes ({min_num_proc}) than there are available slots ({rank})"
        )
    # hosts having local rank l, in host order
    having: Dict[int, List[str]] = {}
    for name, ranks in placed:
        for local in range(len(ranks)):
            having.setdefault(local, []).append(name)
    out: List[SlotInfo] = []
    for name, ranks in placed:
        for local, r in enumerate(ranks):
            out.append(SlotInfo(hostname=name, rank=r, local_rank=local,
                                cross_rank=having[local].index(name), size=rank,
                                local_size=len(ranks), cross_size=len(having[local])))  # fmt: skip
    return out
