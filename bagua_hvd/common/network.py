"""Which local address peers reach this process at: shared by the launcher
(bagua_hvd.runner) and the bootstrap under mpirun (bagua_hvd.common.bootstrap)."""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import List, Optional

from bagua_hvd.common import config

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of network interface ``name``, None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def local_addresses() -> List[str]:
    """This host's IPv4 addresses, loopback excluded, in interface order."""
    out = []
    for _, name in socket.if_nameindex():
        addr = interface_address(name)
        if addr is not None and not addr.startswith("127.") and addr not in out:
            out.append(addr)
    return out


def address_toward(host: str, port: int) -> str:
    """The local address that traffic to ``host`` leaves from (OSError when there is no
    route; socket.gaierror when the name does not resolve)."""
    last: Optional[OSError] = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)  # UDP: picks the route, sends nothing
                return s.getsockname()[0]
        except OSError as e:
            last = e
    raise last or OSError(f"no address for {host}")


def iface_address() -> Optional[str]:
    """The address of ``HOROVOD_GLOO_IFACE`` (the interface the job was told to use); None when
    it is unset, ValueError when that interface has no IPv4 address."""
    iface = config.network_interface()
    if not iface:
        return None
    addr = interface_address(iface)
    if addr is None:
        raise ValueError(f"HOROVOD_GLOO_IFACE={iface}: no IPv4 address on that interface")
    return addr
