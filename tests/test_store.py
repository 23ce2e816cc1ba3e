"""The launcher's rendezvous store (bagua_hvd/rendezvous/store.py) over real sockets.

No core library needed: the Python client speaks the same protocol as the C++ one
(docs/protocol.md), and raw sockets play the strangers.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from bagua_hvd.rendezvous.store import (
    STORE_PURPOSE,
    AuthenticationError,
    StoreClient,
    StoreError,
    StoreServer,
    StoreTimeoutError,
    client_handshake,
    new_secret,
)

pytestmark = pytest.mark.timeout(60)
LOGGER = "bagua_hvd.rendezvous.store"


@pytest.fixture
def secret() -> bytes:
    return new_secret()


@pytest.fixture
def server(secret: bytes) -> Iterator[StoreServer]:
    with StoreServer(secret, host="127.0.0.1", handshake_timeout=2.0) as srv:
        yield srv


def client(server: StoreServer, secret: bytes, timeout: float = 10) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, secret, timeout=timeout)


def wait_for_log(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 5) -> str:
    """Server threads log asynchronously: poll for a warning containing text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in caplog.records:
            if rec.levelno >= logging.WARNING and text in rec.getMessage():
                return rec.getMessage()
        time.sleep(0.02)
    seen = [r.getMessage() for r in caplog.records]
    raise AssertionError(f"no warning containing {text!r}; got {seen}")


def recv_until_closed(sock: socket.socket, timeout: float = 5) -> bytes:
    """Reads until the server closes (EOF or reset); fails if it keeps the socket open."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data
    except socket.timeout:
        raise AssertionError("the server kept a bad connection open") from None


def assert_still_serves(server: StoreServer, secret: bytes) -> None:
    with client(server, secret) as c:
        c.set("alive", b"yes")
        assert c.get("alive", timeout=1) == b"yes"


def test_set_get_roundtrip(server: StoreServer, secret: bytes) -> None:
    with client(server, secret) as a, client(server, secret) as b:
        a.set("k", b"v1")
        assert b.get("k", timeout=1) == b"v1"
        b.set(b"k", "v2")  # str and bytes interchangeably; overwrite
        assert a.get("k", timeout=1) == b"v2"
        a.set("empty", b"")
        assert b.get("empty", timeout=1) == b""
        big = bytes(range(256)) * 4096  # 1 MiB, binary
        a.set("big", big)
        assert b.get("big", timeout=1) == big
    assert server.get("k") == b"v2"  # the launcher's direct access sees clients' writes


def test_blocking_get_waits_for_the_key(server: StoreServer, secret: bytes) -> None:
    with client(server, secret) as a, client(server, secret) as b:
        timer = threading.Timer(0.3, lambda: a.set("late", b"here"))
        timer.start()
        t0 = time.monotonic()
        try:
            assert b.get("late", timeout=10) == b"here"
        finally:
            timer.join()
        assert 0.25 <= time.monotonic() - t0 < 5


def test_get_times_out_naming_the_key(server: StoreServer, secret: bytes) -> None:
    with client(server, secret) as c:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"0\.3s waiting for rendezvous key 'nope'"):
            c.get("nope", timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 3
        c.set("after", b"1")  # the connection survives a timed-out get
        assert c.get("after", timeout=0) == b"1"


def test_wrong_secret_is_rejected(
    server: StoreServer, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match="rejected this client: bad proof of the job"):
        StoreClient("127.0.0.1", server.port, new_secret(), timeout=10)
    assert time.monotonic() - t0 < 3  # not retried until the timeout
    msg = wait_for_log(caplog, "rejected connection from 127.0.0.1:")
    assert "secret" in msg
    assert_still_serves(server, secret)


def test_client_rejects_a_server_without_the_secret(secret: bytes) -> None:
    with StoreServer(new_secret(), host="127.0.0.1") as other:
        with pytest.raises(AuthenticationError):
            StoreClient("127.0.0.1", other.port, secret, timeout=5)


def test_wrong_purpose_is_refused(
    server: StoreServer, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        with pytest.raises(AuthenticationError, match="serves 'store' connections, not 'peer/x/0'"):
            client_handshake(s, secret, b"peer/x/0", b"", "store")
    wait_for_log(caplog, "not 'peer/x/0'")
    assert_still_serves(server, secret)


@pytest.mark.parametrize(
    "payload",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # an HTTP probe: its "length" is ~542 MB
        struct.pack("<I", 1 << 31) + b"x" * 16,  # an oversize frame before authentication
        struct.pack("<I", 10) + b"BHVD\x07\x01abcd",  # a well-framed hello of a future version
        b"\x00" * 3,  # a truncated length, then silence
    ],
    ids=["http", "oversize", "bad-version", "truncated"],
)
def test_garbage_is_dropped_and_server_keeps_serving(
    server: StoreServer, secret: bytes, payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(payload)
        t0 = time.monotonic()
        recv_until_closed(s, timeout=5)
        # The truncated one is dropped by the handshake timeout (2 s in this fixture).
        assert time.monotonic() - t0 < 4
    wait_for_log(caplog, "rejected connection from 127.0.0.1:")
    assert_still_serves(server, secret)


def test_oversize_frame_after_authentication(
    secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with StoreServer(secret, host="127.0.0.1", max_frame_bytes=1024) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            client_handshake(s, secret, STORE_PURPOSE, b"test", "store")
            s.sendall(struct.pack("<I", 1025) + b"S")
            reply = recv_until_closed(s)
            assert reply[4:5] == b"E" and b"exceeds the limit of 1024 bytes" in reply
        wait_for_log(caplog, "exceeds the limit of 1024 bytes")
        with client(srv, secret) as c:
            with pytest.raises(StoreError, match="exceeds the limit"):
                c.set("k", b"x" * 2000)
            c2 = client(srv, secret)
            c2.set("k", b"x" * 100)  # within the limit
            assert c2.get("k", timeout=0) == b"x" * 100
            c2.close()


def test_error_reply_reaches_a_client_behind_on_reading(secret: bytes) -> None:
    """An oversized request is refused after its length alone, the rest of it unread: closing
    then reset the connection, which discarded the replies still queued for a client that reads
    late, the error reply included (found by native/fuzz/store_server_fuzz.py; its input is in
    native/fuzz/regressions/store_server/)."""
    set_request = b"S" + struct.pack("<I", 1) + b"k" + b"v"
    with StoreServer(secret, host="127.0.0.1", max_frame_bytes=1024) as srv:
        with socket.socket() as s:
            # A small receive window keeps the replies queued on the server's side.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(5)
            s.connect(("127.0.0.1", srv.port))
            client_handshake(s, secret, STORE_PURPOSE, b"test", "store")
            frame = struct.pack("<I", len(set_request)) + set_request
            s.sendall(frame * 2000 + struct.pack("<I", 1025) + b"S")
            time.sleep(0.5)  # the server refuses the last request meanwhile
            reply = recv_until_closed(s)
    assert reply.count(struct.pack("<I", 1) + b"K") == 2000
    assert b"exceeds the limit of 1024 bytes" in reply


def test_bad_request_is_refused(server: StoreServer, secret: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        client_handshake(s, secret, STORE_PURPOSE, b"test", "store")
        s.sendall(struct.pack("<I", 3) + b"XYZ")
        reply = recv_until_closed(s)
        assert reply[4:5] == b"E" and b"unknown request type" in reply
    assert_still_serves(server, secret)


def test_silent_connection_does_not_block_others(
    server: StoreServer, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]
    try:
        t0 = time.monotonic()
        assert_still_serves(server, secret)
        assert time.monotonic() - t0 < 1.5
        wait_for_log(caplog, "timed out", timeout=5)  # dropped after handshake_timeout
    finally:
        for s in silent:
            s.close()


def test_many_concurrent_clients(server: StoreServer, secret: bytes) -> None:
    n = 48
    results: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def worker(i: int) -> None:
        try:
            with client(server, secret, timeout=20) as c:
                barrier.wait(timeout=20)
                c.set(f"rank/{i}", f"addr-{i}".encode())
                results[i] = [c.get(f"rank/{j}", timeout=20) for j in range(n)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    assert not errors, errors
    expected = [f"addr-{j}".encode() for j in range(n)]
    assert len(results) == n and all(v == expected for v in results.values())


def test_client_retries_until_the_server_starts(secret: bytes) -> None:
    with socket.socket() as probe:  # a port that is free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = StoreServer(secret, host="127.0.0.1", port=port)
    timer = threading.Timer(0.5, srv.start)
    timer.start()
    try:
        with StoreClient("127.0.0.1", port, secret, timeout=10) as c:
            c.set("k", b"v")
            assert c.get("k", timeout=0) == b"v"
    finally:
        timer.join()
        srv.stop()


def test_connect_timeout_names_the_address(secret: bytes) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=f"rendezvous store at 127.0.0.1:{port} within"):
        StoreClient("127.0.0.1", port, secret, timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_stop_is_idempotent_and_frees_everything(secret: bytes) -> None:
    threads_before = threading.active_count()
    srv = StoreServer(secret, host="127.0.0.1").start()
    port = srv.port
    c = StoreClient("127.0.0.1", port, secret, timeout=5)
    blocked: list[BaseException] = []

    def blocked_get() -> None:
        try:
            c.get("never", timeout=30)
        except BaseException as e:  # noqa: BLE001
            blocked.append(e)

    t = threading.Thread(target=blocked_get)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    srv.stop()
    srv.stop()
    t.join(timeout=5)
    assert time.monotonic() - t0 < 3, "stop() must wake blocked gets"
    assert blocked and isinstance(blocked[0], StoreError)
    c.close()
    assert threading.active_count() == threads_before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(RuntimeError):
        srv.start()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="empty"):
        StoreServer(b"")
    with pytest.raises(TypeError):
        StoreServer("not-bytes")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not started"):
        _ = StoreServer(b"s").port
