"""Two "hosts" on this machine joined by a shaped link: network namespaces on a Linux bridge.

    python bench/_netns.py up [--rate 1gbit]   # create (and shape), measure the link, keep it
    python bench/_netns.py down                # remove everything this module creates
    python bench/_netns.py check               # up, measure unshaped/1gbit/100mbit, down

Topology (needs root; ``iproute2``'s ``ip`` and ``tc``)::

    namespace bhvdb0                 root namespace                 namespace bhvdb1
    lo, bhvdb0v 10.213.0.1/24 --- bhvdb0r  [bridge bhvdbbr]  bhvdb1r --- bhvdb1v 10.213.0.2/24, lo

Each namespace is a host: its end of a veth pair (``bhvdbIv``) carries its address, the other
end (``bhvdbIr``) is a port of the bridge ``bhvdbbr`` (no address) in the root namespace.

Shaping: ``tc qdisc replace dev bhvdbIv root tbf rate RATE burst B latency 50ms`` inside BOTH
namespaces, i.e. on each host's egress, like a NIC of that rate: a byte from host 0 to host 1
passes exactly one shaper (host 0's), and the two directions are shaped independently (full
duplex). The bridge-side ends (``bhvdbIr``) are left unshaped: shaping them too would only put
a second, identical limiter on the same path.

Burst ``B = max(128 KiB, RATE x 4 ms)`` (1gbit: 500 kB, 100mbit: 128 KiB): tbf needs at least
RATE / HZ bytes of bucket to reach its rate when it is refilled once per timer tick (4 ms at
HZ = 250), and more than one 64 KiB GSO packet, which it would otherwise have to split; a bigger
bucket would only let the first bytes of a transfer pass faster than the rate (500 kB is
0.5 % of the ~100 MB a step of the benchmark model sends). ``latency 50ms`` bounds the queue
(RATE x 50 ms of backlog before drops), not a delay: there is no ``netem`` on this kernel, so
round-trip time cannot be emulated.

Teardown deletes the root-side veth ends (which deletes the pairs), the bridge and the
namespaces, stops leftover processes inside the namespaces (by pid: only this harness runs
there), and waits until none of the names is left: namespace deletion is asynchronous, and an
immediate re-creation would fail with "File exists". ``up`` first removes leftovers of a run
that crashed. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

PREFIX = "bhvdb"
SUBNET = "10.213.0"
BRIDGE = PREFIX + "br"
HOSTS = 2
TC_LATENCY = "50ms"
MIN_BURST = 128 * 1024
BURST_TIME_S = 0.004
CMD_TIMEOUT_S = 30.0
GONE_TIMEOUT_S = 20.0
PROBE_PORT = 29400  # the link check's port inside the namespaces (fresh namespaces: free)


def ns_name(i: int) -> str:
    return f"{PREFIX}{i}"


def ns_iface(i: int) -> str:
    """The namespace-side veth end of host i (its 'NIC')."""
    return f"{PREFIX}{i}v"


def root_iface(i: int) -> str:
    return f"{PREFIX}{i}r"


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def parse_rate(text: str) -> float:
    """A tc rate ('1gbit', '100mbit', '500kbit', '2.5gbit') in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", text.lower())
    if m is None:
        raise ValueError(f"rate {text!r} is not like 1gbit, 100mbit or 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def burst_bytes(rate_bps: float) -> int:
    return max(MIN_BURST, int(rate_bps / 8 * BURST_TIME_S))


class NetnsError(RuntimeError):
    pass


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except FileNotFoundError as e:
        raise NetnsError(f"{cmd[0]} not found: install iproute2 (ip, tc)") from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(cmd)}` took more than {CMD_TIMEOUT_S:g} s") from e
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _namespaces() -> set[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = _run(["ip", "-o", "link", "show"]).stdout
    names = set()
    for line in out.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if m:
            names.add(m.group(1))
    return names


def leftovers() -> list[str]:
    """Names of ours still present (namespaces, root-side links)."""
    ours = [n for n in sorted(_namespaces()) if n.startswith(PREFIX)]
    ours += [n for n in sorted(_links()) if n.startswith(PREFIX)]
    return ours


def require_root() -> None:
    if os.geteuid() != 0:
        raise NetnsError("the shaped-link networks need root (ip netns, tc): run as root")


def down(quiet: bool = False) -> None:
    """Removes everything of ours; returns once nothing is left (NetnsError after a bound)."""
    namespaces = {n for n in _namespaces() if n.startswith(PREFIX)}
    for ns in sorted(namespaces):
        # Leftover processes keep a namespace alive after `ip netns del`: stop them by pid.
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            if pid.isdigit() and int(pid) != os.getpid():
                if not quiet:
                    print(f"netns: stopping leftover process {pid} in {ns}", flush=True)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for name in sorted(n for n in _links() if n.startswith(PREFIX) and n != BRIDGE):
        _run(["ip", "link", "del", name], check=False)  # deletes the veth pair
    if BRIDGE in _links():
        _run(["ip", "link", "del", BRIDGE], check=False)
    for ns in sorted(namespaces):
        _run(["ip", "netns", "del", ns], check=False)
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        left = leftovers()
        if not left:
            return
        if time.monotonic() > deadline:
            raise NetnsError(
                f"still present {GONE_TIMEOUT_S:g} s after teardown: {', '.join(left)}"
            )
        time.sleep(0.2)


def up() -> None:
    """Creates the namespaces, veth pairs and the bridge (unshaped); removes leftovers first."""
    require_root()
    left = leftovers()
    if left:
        print(f"netns: removing leftovers of an earlier run: {', '.join(left)}", flush=True)
        down()
    _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "link", "set", BRIDGE, "up"])
    for i in range(HOSTS):
        ns = ns_name(i)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", root_iface(i), "type", "veth", "peer", "name", ns_iface(i)])
        _run(["ip", "link", "set", ns_iface(i), "netns", ns])
        _run(["ip", "link", "set", root_iface(i), "master", BRIDGE])
        _run(["ip", "link", "set", root_iface(i), "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", ns_iface(i)])
        _run(["ip", "-n", ns, "link", "set", ns_iface(i), "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])


def shape(rate: str | None) -> None:
    """Shapes each host's egress to ``rate`` (a tc rate), or removes the shaping (None)."""
    for i in range(HOSTS):
        base = ["tc", "-n", ns_name(i), "qdisc"]
        if rate is None:
            _run(base + ["del", "dev", ns_iface(i), "root"], check=False)
        else:
            burst = burst_bytes(parse_rate(rate))
            _run(base + ["replace", "dev", ns_iface(i), "root", "tbf", "rate", rate,
                         "burst", str(burst), "latency", TC_LATENCY])  # fmt: skip


def qdisc(i: int) -> str:
    return _run(["tc", "-n", ns_name(i), "qdisc", "show", "dev", ns_iface(i)]).stdout.strip()


def ns_exec(i: int, cmd: list[str]) -> list[str]:
    """``cmd`` run inside host i's namespace."""
    return ["ip", "netns", "exec", ns_name(i), *cmd]


def run_job(argv: list[str], env: dict, port: int, timeout: float, ranks_per_host: int = 2,
            cwd: str | None = None) -> list[int] | None:  # fmt: skip
    """Runs ``argv`` as one job of HOSTS x ``ranks_per_host`` ranks: one bagua-run per host
    namespace (``--num-nodes``), host 0 serving the rendezvous at ``port``, each host's
    ``GLOO_SOCKET_IFNAME`` its interface. Returns the launchers' exit statuses, or None when
    the job ran past ``timeout`` seconds (the launchers, which stop their ranks, are then
    stopped)."""
    procs = []
    try:
        for i in range(HOSTS):
            cmd = [sys.executable, "-m", "bagua_hvd.runner.launch",
                   "-np", str(ranks_per_host * HOSTS), "--num-nodes", str(HOSTS),
                   "--node-rank", str(i), "--rendezvous-addr", f"{address(0)}:{port}",
                   "--network-interfaces", ns_iface(i), *argv]  # fmt: skip
            env_i = dict(env, GLOO_SOCKET_IFNAME=ns_iface(i))
            procs.append(subprocess.Popen(ns_exec(i, cmd), env=env_i, cwd=cwd))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---- link check: a bounded bulk TCP transfer between the namespaces --------------------------

SKIP_BYTES = 2 << 20  # rate measured after these: excludes slow start and tbf's initial bucket


def _sink(host: str, port: int, nbytes: int, timeout: float) -> dict:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(1)
        srv.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout)
            got, skip, t_skip, buf = 0, 0, None, bytearray(1 << 20)
            while got < nbytes:
                k = conn.recv_into(buf)
                if k == 0:
                    raise NetnsError(f"sender closed after {got} of {nbytes} bytes")
                got += k
                if t_skip is None and got >= SKIP_BYTES:
                    t_skip, skip = time.perf_counter(), got
            t_end = time.perf_counter()
            conn.sendall(b"k")
    return {"bytes": got, "rate_Bps": (got - skip) / (t_end - t_skip)}


def _source(host: str, port: int, nbytes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with sock:
        chunk = b"\0" * (1 << 20)
        left = nbytes
        while left > 0:
            sent = sock.send(chunk[: min(left, len(chunk))])
            left -= sent
        if sock.recv(1) != b"k":
            raise NetnsError("no acknowledgement from the receiver")


def measure_between(
    src_prefix: list[str], dst_prefix: list[str], host: str, port: int, nbytes: int, timeout: float
) -> float:
    """Goodput in bytes/s of one TCP stream of ``nbytes`` to ``host:port``: the receiver runs
    as ``dst_prefix + [python, this file, ...]``, the sender likewise with ``src_prefix`` (e.g.
    ``ip netns exec NS``; empty for this namespace)."""
    me = os.path.abspath(__file__)
    py = sys.executable
    args = [host, str(port), str(nbytes), str(timeout)]
    sink = subprocess.Popen(
        [*dst_prefix, py, me, "_sink", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Bounded: the sink prints 'ready' or exits (its accept() has a timeout).
        if sink.stdout.readline().strip() != "ready":
            raise NetnsError(f"link check receiver failed: {sink.stderr.read().strip()}")
        source = subprocess.run(
            [*src_prefix, py, me, "_source", *args],
            capture_output=True,
            text=True,
            timeout=timeout + 10,
        )
        if source.returncode != 0:
            raise NetnsError(f"link check sender failed: {source.stderr.strip()}")
        out, err = sink.communicate(timeout=timeout + 10)
        if sink.returncode != 0:
            raise NetnsError(f"link check receiver failed: {err.strip()}")
        return json.loads(out.strip().splitlines()[-1])["rate_Bps"]
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()


def measure(src: int, dst: int, nbytes: int, timeout: float = 60.0) -> float:
    """Goodput in bytes/s of one TCP stream of ``nbytes`` from host src to host dst."""
    return measure_between(
        ns_exec(src, []), ns_exec(dst, []), address(dst), PROBE_PORT, nbytes, timeout
    )


def check_link(rate: str | None) -> tuple[float, float]:
    """Measured goodput host0->host1 and host1->host0 in bytes/s: about one second's worth of
    data at the nominal rate, at least 20 MB."""
    nominal = parse_rate(rate) / 8 if rate else 1e9
    nbytes = max(20_000_000, int(nominal))
    timeout = max(30.0, 4 * nbytes / nominal)
    return measure(0, 1, nbytes, timeout), measure(1, 0, nbytes, timeout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_sink", "_source"):
        host, port, nbytes, timeout = argv[1], int(argv[2]), int(argv[3]), float(argv[4])
        if argv[0] == "_sink":
            print(json.dumps(_sink(host, port, nbytes, timeout)), flush=True)
        else:
            _source(host, port, nbytes, timeout)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down", "check"))
    parser.add_argument("--rate", help="tc rate of each host's egress (up), e.g. 1gbit")
    args = parser.parse_args(argv)
    try:
        require_root()
        if args.action == "down":
            down()
            print("netns: down; nothing of ours left")
            return 0
        if args.action == "up":
            up()
            shape(args.rate)
            a, b = check_link(args.rate)
            print(f"netns: up, {args.rate or 'unshaped'}: {a * 8e-6:.1f} / {b * 8e-6:.1f} Mbit/s")
            return 0
        try:
            up()
            for rate in (None, "1gbit", "100mbit"):
                shape(rate)
                a, b = check_link(rate)
                print(
                    f"netns {rate or 'unshaped'}: host0->host1 {a / 1e6:.1f} MB/s "
                    f"({a * 8e-6:.0f} Mbit/s), host1->host0 {b / 1e6:.1f} MB/s; qdisc: {qdisc(0)}",
                    flush=True,
                )
        finally:
            down()
            print(f"netns: torn down; ip netns list: {sorted(_namespaces()) or 'empty'}")
        return 0
    except NetnsError as e:
        print(f"netns: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
