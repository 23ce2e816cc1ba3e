"""Strangers connecting to a job's ports while it starts (loopback only, bounded counts): silent,
trickling and garbage connections to rank 0's peer listener and to the rendezvous store must not
delay the real ranks, and their rejections must not flood the log."""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest

from bagua_hvd.rendezvous import store
from bagua_hvd.rendezvous.store import StoreClient, StoreServer, new_secret

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "start_under_strangers.py"
HTTP_PROBE = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
# A well-framed (so not rejected at once) hello-sized message, sent a byte at a time.
TRICKLE = struct.pack("<I", 200) + b"BHVD" + bytes(196)


def listening_ports(pid: int) -> List[int]:
    """The TCP ports process pid listens on (from /proc, as `ss -ltnp` would show)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rpartition(":")[2], 16))
    return ports


def _recv_frame(s: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = s.recv(n - len(data))
            assert chunk, f"closed after {data!r}"
            data += chunk
        return data

    (length,) = struct.unpack("<I", exact(4))
    assert length <= 4096
    return exact(length)


def probe(port: int, purpose: bytes, timeout: float = 10) -> tuple:
    """A stranger's handshake (no secret: a random proof); returns the server's challenge and
    result payloads (docs/protocol.md); the result is b"" when the server hung up instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        hello = b"BHVD\x02\x01" + bytes([len(purpose)]) + purpose + b"\x00\x00" + os.urandom(32)
        s.sendall(struct.pack("<I", len(hello)) + hello)
        challenge = _recv_frame(s)
        try:
            s.sendall(struct.pack("<I", 38) + b"BHVD\x02\x03" + os.urandom(32))
            return challenge, _recv_frame(s)
        except (AssertionError, OSError):
            return challenge, b""


def assert_reveals_nothing(challenge: bytes, result: bytes, may_hang_up: bool = False) -> None:
    # The challenge is a bare nonce: no proof of the server's before the client proved its own
    # (nothing to guess the secret from offline); the refusal has no reason (no job id, purpose).
    assert challenge[:7] == b"BHVD\x02\x02\x00" and len(challenge) == 7 + 32, challenge
    assert result == b"BHVD\x02\x04\x01" or (may_hang_up and result == b""), result


class Strangers:
    """Silent, trickling (one byte every 0.5 s) and garbage connections to 127.0.0.1:port."""

    def __init__(self) -> None:
        self.socks: List[socket.socket] = []
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []

    def connect(self, port: int, silent: int, trickling: int, garbage: int) -> None:
        for kind in ["silent"] * silent + ["trickling"] * trickling + ["garbage"] * garbage:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            self.socks.append(s)
            if kind == "garbage":
                s.sendall(HTTP_PROBE)
            elif kind == "trickling":
                t = threading.Thread(target=self._trickle, args=(s,), daemon=True)
                t.start()
                self.threads.append(t)

    def _trickle(self, s: socket.socket) -> None:
        for byte in TRICKLE[:120]:  # at most 60 s
            if self.stop.wait(0.5):
                return
            try:
                s.send(bytes([byte]))
            except OSError:
                return  # dropped by the listener

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)
        for s in self.socks:
            s.close()


def _read_line(proc: subprocess.Popen, pattern: bytes, buffer: bytearray, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(pattern, bytes(buffer))
        if match:
            return match
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} within {timeout} s: {bytes(buffer)!r}"
        if select.select([proc.stdout], [], [], left)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the job ended early: {bytes(buffer)!r}"
            buffer += chunk


def test_job_starts_while_strangers_hold_connections(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    ready = tmp_path / "strangers_ready"
    env = dict(os.environ, BAGUA_HVD_TRANSPORT="tcp", HOROVOD_GLOO_TIMEOUT_SECONDS="30",
               STRANGERS_READY=str(ready))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2", sys.executable,
         str(WORKER)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    strangers = Strangers()
    out = bytearray()
    rest: Optional[bytes] = None
    try:
        match = _read_line(proc, rb"\[0\]<stdout>:pid=(\d+) store=(\d+)", out, 60)
        pid, store_port = int(match.group(1)), int(match.group(2))
        # Rank 0's peer listener opens inside hvd.init(); rank 1 is held back meanwhile.
        deadline = time.monotonic() + 60
        while not listening_ports(pid):
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)
        (peer_port,) = listening_ports(pid)
        # More silent ones than a listener handshakes at once (16), queued ahead of rank 1. With
        # one handshake at a time, 5 s each, they made every hvd.init() time out (30 s).
        strangers.connect(peer_port, silent=24, trickling=4, garbage=4)
        strangers.connect(store_port, silent=8, trickling=4, garbage=4)
        # Probes (newest, so not evicted) learn nothing. Rank 0 answers once rank 1 started;
        # it may close the listener before our proof arrives (then it just hangs up).
        probed: list = []
        prober = threading.Thread(
            target=lambda: probed.append(probe(peer_port, b"peer/x/0", timeout=60)), daemon=True
        )
        prober.start()
        assert_reveals_nothing(*probe(store_port, b"store"))
        time.sleep(0.2)  # the probe's connection is queued before rank 1's
        ready.touch()
        rest, _ = proc.communicate(timeout=120)
        prober.join(timeout=60)
        assert probed, "rank 0 never answered the probe"
        assert_reveals_nothing(*probed[0], may_hang_up=True)
    finally:
        strangers.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = (bytes(out) + (rest or b"")).decode(errors="replace")
    assert proc.returncode == 0, text
    assert len(re.findall(r"rank \d OK", text)) == 2, text
    took = float(re.search(r"rank 1 init took ([0-9.]+) s", text).group(1))
    assert took < 10, text  # about 1 s without strangers on a loaded machine
    # One warning, then at most one per 5 s with a count: strangers cannot flood the log.
    rejected = re.findall(r"rejected a connection from 127\.0\.0\.1:\d+ to the peer listener", text)
    assert 1 <= len(rejected) <= 3, text


@pytest.fixture
def server() -> StoreServer:
    secret = new_secret()
    with StoreServer(secret, host="127.0.0.1", handshake_timeout=1.0) as srv:
        srv.secret = secret  # type: ignore[attr-defined]
        yield srv


def _store_works(srv: StoreServer, within: float) -> None:
    start = time.monotonic()
    with StoreClient("127.0.0.1", srv.port, srv.secret, timeout=10) as c:  # type: ignore
        c.set("k", b"v")
        assert c.get("k", timeout=0) == b"v"
    assert time.monotonic() - start < within


def test_store_handshake_has_one_deadline(server: StoreServer) -> None:
    # One byte every 0.3 s: each read is well within the 1 s limit, the whole handshake is not.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        start = time.monotonic()
        for byte in TRICKLE[:20]:  # 6 s at most
            try:
                s.send(bytes([byte]))
            except OSError:
                break
            if select.select([s], [], [], 0.3)[0] and not s.recv(64):
                break  # closed by the server
        held = time.monotonic() - start
    assert held < 2.5, f"a trickling stranger held its connection for {held:.1f} s"
    _store_works(server, within=2)


def test_store_bounds_unauthenticated_connections() -> None:
    n = store.MAX_PENDING_HANDSHAKES + 20
    secret = new_secret()
    # Silent strangers could each hold a thread for handshake_timeout (10 s): only the newest
    # MAX_PENDING_HANDSHAKES may.
    with StoreServer(secret, host="127.0.0.1", handshake_timeout=10.0) as srv:
        srv.secret = secret  # type: ignore[attr-defined]
        silent = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(n)]
        try:
            _store_works(srv, within=2)  # never behind the strangers
            deadline = time.monotonic() + 2
            while True:  # evicted handshakes end at once: threads stay bounded
                names = [t.name for t in threading.enumerate()]
                threads = [n for n in names if n.startswith("bagua_hvd-store-1")]
                if len(threads) <= store.MAX_PENDING_HANDSHAKES or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert len(threads) <= store.MAX_PENDING_HANDSHAKES, len(threads)
        finally:
            for s in silent:
                s.close()


def test_store_refusals_reveal_nothing(server: StoreServer) -> None:
    for purpose in (b"store", b"peer/0123456789abcdef/0"):
        assert_reveals_nothing(*probe(server.port, purpose))
    _store_works(server, within=2)


def test_store_rate_limits_rejection_warnings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(store, "REJECT_LOG_INTERVAL_S", 1.0)
    caplog.set_level(logging.WARNING, logger="bagua_hvd.rendezvous.store")
    secret = new_secret()
    with StoreServer(secret, host="127.0.0.1") as srv:

        def garbage() -> None:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
                s.sendall(HTTP_PROBE)
                s.settimeout(5)
                try:
                    assert s.recv(64) == b""  # dropped
                except ConnectionResetError:
                    pass  # dropped with our bytes unread

        for _ in range(30):
            garbage()
        time.sleep(1.2)
        garbage()
    messages = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(messages) == 2, messages
    assert "(29 more rejected since the last warning)" in messages[1], messages
