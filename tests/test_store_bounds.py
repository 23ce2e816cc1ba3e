"""The rendezvous store's bounds (bagua_hvd/rendezvous/store.py) over real sockets: a blocking GET
whose client went away ends and frees its thread, so clients that died cannot starve the ranks
of connections; what clients store is capped (bytes and keys) with an error naming the cap; the
end of a job logs nothing, and drop warnings are rate-limited."""

from __future__ import annotations

import logging
import struct
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from bagua_hvd.rendezvous import store as store_mod
from bagua_hvd.rendezvous.store import StoreClient, StoreError, StoreServer, new_secret

pytestmark = pytest.mark.timeout(60)
LOGGER = "bagua_hvd.rendezvous.store"


@pytest.fixture
def secret() -> bytes:
    return new_secret()


@pytest.fixture
def server(secret: bytes) -> Iterator[StoreServer]:
    with StoreServer(secret, host="127.0.0.1") as srv:
        yield srv


def _client(server: StoreServer, secret: bytes, timeout: float = 10) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, secret, timeout=timeout)


def _send_blocking_get(client: StoreClient, key: bytes) -> str:
    """Sends a GET that waits ~49 days without reading the reply; returns the name of the
    server thread serving this client."""
    sock = client._sock
    host, port = sock.getsockname()[:2]
    store_mod._send_frame(sock, b"G" + struct.pack("<II", 0xFFFFFFFF, len(key)) + key)
    return f"bagua_hvd-store-{host}:{port}"


def _until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _threads_named(names: set) -> list:
    return [t for t in threading.enumerate() if t.name in names]


def _waiting_in_get(count: int) -> bool:
    """Whether ``count`` server threads are inside the store's wait for a key."""
    frames = sys._current_frames().values()
    waiting = 0
    for frame in frames:
        while frame is not None:
            if frame.f_code.co_name == "_wait_for":
                waiting += 1
                break
            frame = frame.f_back
    return waiting >= count


def test_a_get_whose_client_disconnected_ends(server, secret):
    c = _client(server, secret)
    name = _send_blocking_get(c, b"never-set")
    assert _until(lambda: _waiting_in_get(1))
    c.close()
    assert _until(lambda: not _threads_named({name}), 5.0), "the GET still holds its thread"


def test_dead_clients_do_not_starve_the_ranks(server, secret, monkeypatch):
    monkeypatch.setattr(store_mod, "MAX_CONNECTIONS", 8)
    dead = [_client(server, secret) for _ in range(8)]
    names = {_send_blocking_get(c, f"never-{i}".encode()) for i, c in enumerate(dead)}
    assert _until(lambda: _waiting_in_get(8))
    for c in dead:
        c.close()  # as a killed process's sockets are
    # A rank connecting now is served (before, its connection was dropped: 8 open).
    with _client(server, secret, timeout=5) as rank:
        rank.set("addr", b"10.0.0.1")
        assert rank.get("addr", timeout=1) == b"10.0.0.1"
    assert _until(lambda: not _threads_named(names), 5.0)


def test_stored_bytes_are_capped(secret):
    with StoreServer(secret, host="127.0.0.1", max_stored_bytes=1 << 20) as srv:
        with _client(srv, secret) as c:
            c.set("a", b"x" * (600 << 10))
            c.set("a", b"y" * (600 << 10))  # a replaced value is not counted twice
            assert c.get("a") == b"y" * (600 << 10)
        with _client(srv, secret) as c:
            with pytest.raises(StoreError, match=r"store is full: .*over its cap of 1048576"):
                c.set("b", b"z" * (600 << 10))
        with _client(srv, secret) as c:
            assert c.get("a", timeout=0) == b"y" * (600 << 10)  # the store goes on
            c.set("a", b"")  # freeing room lets others in
            c.set("b", b"z" * (600 << 10))


def test_stored_keys_are_capped(secret):
    with StoreServer(secret, host="127.0.0.1", max_stored_keys=4) as srv:
        with _client(srv, secret) as c:
            for i in range(4):
                c.set(f"k{i}", b"v")
            c.set("k0", b"again")  # replacing is not a new key
        with _client(srv, secret) as c:
            with pytest.raises(StoreError, match=r"store is full: it holds 4 keys"):
                c.set("k4", b"v")


def test_defaults_bound_the_store():
    assert store_mod.MAX_STORED_BYTES == 512 << 20
    assert store_mod.MAX_STORED_KEYS == 1 << 20


def test_stop_logs_nothing(secret, caplog):
    """The end of every elastic job: the workers' update readers wait in a GET when the
    launcher stops the store. They get the store's reason; nothing is logged."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv = StoreServer(secret, host="127.0.0.1").start()
    c = _client(srv, secret)
    errors = []

    def wait() -> None:
        try:
            c.get("elastic/update/7", timeout=3600)
        except StoreError as e:
            errors.append(str(e))

    reader = threading.Thread(target=wait)
    reader.start()
    assert _until(lambda: _waiting_in_get(1))
    srv.stop()
    reader.join(10)
    assert errors and "store is shutting down" in errors[0], errors
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == []


def test_drop_warnings_are_rate_limited(secret, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    # One interval spans the whole test, however slow the machine.
    monkeypatch.setattr(store_mod, "REJECT_LOG_INTERVAL_S", 600.0)
    server = StoreServer(secret, host="127.0.0.1").start()
    names = set()
    for _ in range(10):
        c = _client(server, secret)
        host, port = c._sock.getsockname()[:2]
        names.add(f"bagua_hvd-store-{host}:{port}")
        with pytest.raises(StoreError, match="unknown request type"):
            c._request(b"X", 5.0)
        c.close()
    assert _until(lambda: not _threads_named(names))
    server.stop()
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1, drops
