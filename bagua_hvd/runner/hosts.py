"""Host lists and rank placement for the launcher.

Ranks are placed node-major: node ``i`` of ``n`` runs global ranks ``i*L .. i*L+L-1`` with
``L = np / n``. Local ranks count within a node; the cross rank of a process is the index of its
node among the nodes that have its local rank, which for this even placement is the node index.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from typing import List, Optional, Sequence, Tuple

from bagua_hvd.rendezvous.hostlist import HostError

# launch() (one node) starts ranks on this machine only; other hosts go through launch_hosts.
REMOTE_HOSTS_HINT = (
    "this launch starts ranks on this machine only; start a job on other hosts with "
    "`bagua-run -np N -H HOST1:SLOTS,HOST2:SLOTS COMMAND` or "
    "`bagua_hvd.run(func, np=N, hosts='HOST1:SLOTS,HOST2:SLOTS')` (over ssh)"
)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one rank runs and the rank variables it gets."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str

    def env(self) -> dict:
        """Horovod's rank variables. Like horovodrun, not torch.distributed's RANK, WORLD_SIZE
        and LOCAL_RANK: libraries that find them (Accelerate, Lightning) would then expect a
        torch.distributed master address that this job does not have."""
        return {
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
            "HOROVOD_HOSTNAME": self.hostname,
        }


def slot_among(hostnames: Sequence[str], rank: int) -> Slot:
    """The slot of ``rank`` given every rank's host (ranks already grouped by host, as the Ray
    and Spark runners number them): local and cross ranks as the bootstrap computes them."""
    from bagua_hvd.common.bootstrap import placement

    local_rank, local_size, cross_rank, cross_size = placement(hostnames, rank)
    return Slot(
        rank=rank,
        size=len(hostnames),
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        hostname=hostnames[rank],
    )


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """Parses horovodrun's ``-H`` value ``host1:slots,host2:slots`` (slots default to 1)."""
    hosts: List[Tuple[str, int]] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise HostError(f"empty entry in host list {spec!r}")
        name, slots = item, 1
        # "host:N"; a bare IPv6 address ("::1") has several colons and no slot count.
        if item.count(":") == 1 or (item.startswith("[") and "]:" in item):
            name, _, count = item.rpartition(":")
            try:
                slots = int(count)
            except ValueError:
                raise HostError(
                    f"bad slot count {count!r} in host entry {item!r}; "
                    "expected HOST:SLOTS, e.g. localhost:4"
                ) from None
            if slots < 1:
                raise HostError(f"slot count must be >= 1 in host entry {item!r}")
        elif ":" in item and not item.startswith("["):
            # Several colons: only a bare IPv6 address may have them (Horovod refuses them all).
            try:
                ipaddress.IPv6Address(item.split("%", 1)[0])
            except ValueError:
                raise HostError(
                    f"host entry {item!r} has more than one ':' and is not an IPv6 address; "
                    "expected HOST:SLOTS, e.g. localhost:4 (IPv6 as [ADDR]:SLOTS)"
                ) from None
        name = name.strip("[]")
        if not name:
            raise HostError(f"missing host name in host entry {item!r}")
        hosts.append((name, slots))
    return hosts


def parse_hostfile(path: str) -> List[Tuple[str, int]]:
    """Parses horovodrun's ``--hostfile``: one ``HOST slots=N`` per line (``slots=`` optional,
    default 1; ``HOST:N`` also accepted); blank lines and ``#`` comments are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise HostError(f"cannot read --hostfile {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise HostError(
            f"--hostfile {path!r} is not UTF-8 text: byte {e.object[e.start]:#04x} at offset "
            f"{e.start}"
        ) from None
    entries: List[Tuple[str, int]] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        spec = words[0]
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if key != "slots" or not eq:
                raise HostError(
                    f"--hostfile {path!r} line {number}: expected 'HOST slots=N', got {raw!r}"
                )
            if words[0].count(":") == 1 or "]:" in words[0]:
                raise HostError(
                    f"--hostfile {path!r} line {number}: {raw.strip()!r} gives the slot count "
                    f"twice (':N' and 'slots=N'); write 'HOST slots=N'"
                )
            # A bare IPv6 address goes in brackets, so that its colons are not the slots'.
            host = f"[{words[0]}]" if ":" in words[0] and "[" not in words[0] else words[0]
            spec = f"{host}:{value}"
        try:
            entries += parse_hosts(spec)
        except HostError as e:
            raise HostError(f"--hostfile {path!r} line {number}: {e}") from None
    if not entries:
        raise HostError(f"--hostfile {path!r} lists no host")
    return entries


def assign_slots(entries: List[Tuple[str, int]], np: int) -> List[Tuple[str, List[Slot]]]:
    """Horovod's placement over a host list: ranks fill the hosts in the order given, each up to
    its slots; a host's ranks are its local ranks; the cross rank of a process is the index of
    its host among the hosts that have its local rank. Hosts left without a rank are dropped."""
    names = [name for name, _ in entries]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise HostError(f"host {duplicate!r} is listed more than once; list each host once")
    total = sum(slots for _, slots in entries)
    if np > total:
        raise HostError(f"Requested more processes ({np}) than there are available slots ({total})")
    counts: List[Tuple[str, int]] = []
    left = np
    for name, slots in entries:
        if left == 0:
            break
        counts.append((name, min(slots, left)))
        left -= counts[-1][1]
    out: List[Tuple[str, List[Slot]]] = []
    rank = 0
    for name, count in counts:
        slots = []
        for local_rank in range(count):
            having = [h for h, c in counts if c > local_rank]
            slots.append(
                Slot(
                    rank=rank,
                    size=np,
                    local_rank=local_rank,
                    local_size=count,
                    cross_rank=having.index(name),
                    cross_size=len(having),
                    hostname=name,
                )
            )
            rank += 1
        out.append((name, slots))
    return out


def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine: localhost, a loopback address or our host name."""
    lowered = name.lower()
    if lowered in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(lowered).is_loopback
    except ValueError:
        pass
    own = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return lowered in own


def only_this_machine(entries: List[Tuple[str, int]]) -> bool:
    """True when a host list is one entry naming this machine (ranks start without ssh)."""
    return len(entries) == 1 and is_local_host(entries[0][0])


def local_slots(np: int, hosts: Optional[str]) -> int:
    """Checks ``-H`` for a one-node run and returns its slot count (``np`` when not given)."""
    if hosts is None:
        return np
    entries = parse_hosts(hosts)
    remote = [name for name, _ in entries if not is_local_host(name)]
    if remote:
        raise HostError(f"host {remote[0]!r} is not this machine: {REMOTE_HOSTS_HINT}")
    if len(entries) > 1:
        names = ", ".join(name for name, _ in entries)
        raise HostError(
            f"hosts {names} all name this machine; list it once, e.g. -H localhost:{np}"
        )
    slots = entries[0][1]
    if np > slots:
        raise HostError(
            f"requested {np} processes but the host list {hosts!r} has only "
            f"{slots} slot{'s' if slots > 1 else ''}"
        )
    return slots


def node_hostname(num_nodes: int, node_rank: int) -> str:
    """The HOROVOD_HOSTNAME of this node's ranks.

    With several launchers each node gets its own id, so ranks of different launchers never
    treat each other as local (shared memory) even when the launchers share a machine.
    """
    host = socket.gethostname() or "localhost"
    return host if num_nodes == 1 else f"{host}-node{node_rank}"


def place_ranks(np: int, num_nodes: int = 1, node_rank: int = 0) -> List[Slot]:
    """The slots of node ``node_rank`` when ``np`` ranks are spread node-major over the nodes."""
    if np < 1:
        raise HostError(f"-np must be >= 1, got {np}")
    if num_nodes < 1:
        raise HostError(f"--num-nodes must be >= 1, got {num_nodes}")
    if not 0 <= node_rank < num_nodes:
        raise HostError(f"--node-rank must be in [0, {num_nodes - 1}], got {node_rank}")
    if np % num_nodes:
        raise HostError(
            f"-np {np} is not divisible by --num-nodes {num_nodes}; every node "
            "runs the same number of ranks"
        )
    local_size = np // num_nodes
    hostname = node_hostname(num_nodes, node_rank)
    return [
        Slot(
            rank=node_rank * local_size + local_rank,
            size=np,
            local_rank=local_rank,
            local_size=local_size,
            cross_rank=node_rank,
            cross_size=num_nodes,
            hostname=hostname,
        )
        for local_rank in range(local_size)
    ]
