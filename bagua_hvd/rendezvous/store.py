"""Rendezvous key-value store served by the launcher (``bagua-run``) to its workers, or by rank 0
under a bare mpirun or srun (common/bootstrap.py); ranks read it too (common/elastic.py).

Workers' C++ core connects with ``connect_tcp_store`` (native/src/transport/store.cc). Every
connection starts with a mutual HMAC-SHA256 challenge over fresh nonces proving knowledge of the
per-job secret (which never crosses the wire); then length-prefixed requests follow. The wire
format is documented in docs/protocol.md.

The launcher generates a secret with :func:`new_secret`, passes it to workers as hex in
``BAGUA_HVD_SECRET`` (:func:`secret_to_env`), and runs a :class:`StoreServer`::

    with StoreServer(secret) as server:
        env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(server.port)
        ...
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from types import TracebackType
from typing import Callable, Optional, Union

logger = logging.getLogger(__name__)

SECRET_ENV = "BAGUA_HVD_SECRET"
DEFAULT_MAX_FRAME_BYTES = 16 << 20
MAX_HANDSHAKE_FRAME = 4096
MAX_KEY_BYTES = 4096
MAX_CONNECTIONS = 4096
# What clients may store in all (keys and values); a SET beyond it is refused with an error
# naming the cap, so a buggy or hostile client cannot take the launcher's memory.
MAX_STORED_BYTES = 512 << 20
MAX_STORED_KEYS = 1 << 20
# How often a blocking GET checks that its client is still connected (a client that went away
# frees its thread within this).
CLIENT_CHECK_S = 0.5
# TCP keepalive on authenticated clients: a client whose machine vanished without closing its
# connection is noticed within about KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3
# Connections handshaking at once; a newcomer beyond that evicts the oldest one (see StoreServer).
MAX_PENDING_HANDSHAKES = 64
# At most one warning about rejected connections per this many seconds.
REJECT_LOG_INTERVAL_S = 5.0
# After an error reply, how long the server reads on (and discards) what the client still sends.
ERROR_LINGER_S = 1.0
# stop() lets the GETs it woke send their "shutting down" answer for this long before it cuts
# the connections (a client that does not read cannot hold stop() longer).
STOP_REPLY_S = 5.0
STORE_PURPOSE = b"store"

_MAGIC = b"BHVD"
_VERSION = 2  # 2: the server proves the secret only after the client did
_HELLO, _CHALLENGE, _PROOF, _RESULT = 1, 2, 3, 4
_STATUS_OK, _STATUS_REFUSED = 0, 1
_NONCE_LEN = 32
_MAC_LEN = 32
_SERVER_LABEL = b"bagua_hvd auth v2 server"
_CLIENT_LABEL = b"bagua_hvd auth v2 client"
_WRONG_PROOF = "wrong proof of the job secret"

KeyLike = Union[str, bytes]
ValueLike = Union[str, bytes]


class StoreError(RuntimeError):
    """A store request failed (connection lost, protocol error, refused request)."""


class StoreConnectionClosed(StoreError):
    """The peer closed the connection (between requests: a client's orderly end)."""


class AuthenticationError(StoreError):
    """The other end does not know the job secret, or talks to the wrong kind of endpoint."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A key did not appear in time, or the store could not be reached in time."""


def new_secret() -> bytes:
    """Returns a fresh random 32-byte job secret."""
    return secrets.token_bytes(32)


def secret_to_env(secret: bytes) -> str:
    """Encodes a secret for ``BAGUA_HVD_SECRET`` (hex)."""
    return secret.hex()


def secret_from_env(value: str | None = None) -> bytes:
    """Decodes ``BAGUA_HVD_SECRET`` (or ``value``) from hex; raises ValueError if absent/bad."""
    text = os.environ.get(SECRET_ENV, "") if value is None else value
    if not text:
        raise ValueError(f"{SECRET_ENV} is not set; the launcher passes the job secret there")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{SECRET_ENV} is not a hex string") from None


def _as_bytes(x: ValueLike, what: str) -> bytes:
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise TypeError(f"{what} must be str or bytes, not {type(x).__name__}")


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, not {type(secret).__name__}")
    if not secret:
        raise ValueError("secret must not be empty")
    return bytes(secret)


# ---- framing ------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, what: str, deadline: Optional[float] = None) -> bytes:
    """Reads n bytes; with a deadline (time.monotonic()), all of them by then, however slowly
    they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeoutError(f"timed out waiting for data from {what}")
            sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise StoreTimeoutError(f"timed out waiting for data from {what}") from None
        if not chunk:
            raise StoreConnectionClosed(f"{what} closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(
    sock: socket.socket, max_len: int, what: str, deadline: Optional[float] = None
) -> bytes:
    (length,) = struct.unpack("<I", _recv_exact(sock, 4, what, deadline))
    if length > max_len:
        raise StoreError(
            f"frame of {length} bytes from {what} exceeds the limit of {max_len} bytes "
            "(is something else talking on this port?)"
        )
    return _recv_exact(sock, length, what, deadline)


def _send_frame(sock: socket.socket, payload: bytes, deadline: Optional[float] = None) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreTimeoutError("timed out before sending a handshake message")
        sock.settimeout(left)
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _header(kind: int) -> bytes:
    return _MAGIC + bytes([_VERSION, kind])


def _check_header(msg: bytes, kind: int, min_len: int) -> str:
    if len(msg) < 6 or msg[:4] != _MAGIC:
        return "not a bagua_hvd handshake message"
    if msg[4] != _VERSION:
        return f"unsupported handshake version {msg[4]}"
    if msg[5] != kind:
        return "unexpected handshake message type"
    if len(msg) < min_len:
        return "truncated handshake message"
    return ""


def _proof(secret: bytes, label: bytes, hello: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, label + hello + server_nonce, hashlib.sha256).digest()


def server_handshake(
    sock: socket.socket,
    secret: bytes,
    purpose: bytes,
    what: str,
    deadline: Optional[float] = None,
    claim: Optional[Callable[[], bool]] = None,
) -> bytes:
    """Runs the server side of the handshake, all of it by ``deadline`` (time.monotonic());
    returns the client's info or raises. ``claim()`` is called once the client proved the secret,
    before it is answered; False refuses it (the server dropped the connection meanwhile)."""
    hello = _recv_frame(sock, MAX_HANDSHAKE_FRAME, what, deadline)

    def refuse(reason: str) -> AuthenticationError:
        # Only the format of the client's message is named: nothing about this job.
        try:
            _send_frame(
                sock, _header(_CHALLENGE) + bytes([_STATUS_REFUSED]) + reason.encode(), deadline
            )
        except OSError:
            pass
        return AuthenticationError(reason)

    bad = _check_header(hello, _HELLO, 7)
    if bad:
        raise refuse(bad)
    plen = hello[6]
    pos = 7
    if len(hello) < pos + plen + 2:
        raise refuse("truncated hello")
    got_purpose = hello[pos : pos + plen]
    pos += plen
    (ilen,) = struct.unpack_from("<H", hello, pos)
    pos += 2
    if len(hello) != pos + ilen + _NONCE_LEN:
        raise refuse("malformed hello")
    info = hello[pos : pos + ilen]
    server_nonce = secrets.token_bytes(_NONCE_LEN)
    _send_frame(sock, _header(_CHALLENGE) + bytes([_STATUS_OK]) + server_nonce, deadline)
    proof = _recv_frame(sock, MAX_HANDSHAKE_FRAME, what, deadline)
    reason = _check_header(proof, _PROOF, 6 + _MAC_LEN)
    if not reason and len(proof) != 6 + _MAC_LEN:
        reason = "malformed proof"
    if not reason:
        expected = _proof(secret, _CLIENT_LABEL, hello, server_nonce)
        if not hmac.compare_digest(expected, proof[6:]):
            reason = _WRONG_PROOF
    proved = not reason
    # From here on the client knows the secret: it may learn why it is refused.
    if proved and got_purpose != purpose:
        reason = (
            f"wrong endpoint: this listener serves '{purpose.decode()}' connections, "
            f"not '{got_purpose[:64].decode(errors='replace')}'"
        )
    if not reason and claim is not None and not claim():
        reason = "too many connections were handshaking at once"
    if reason:
        detail = reason.encode() if proved else b""  # strangers only learn they were rejected
        try:
            _send_frame(sock, _header(_RESULT) + bytes([_STATUS_REFUSED]) + detail, deadline)
        except OSError:
            pass
        raise AuthenticationError(reason)
    mac = _proof(secret, _SERVER_LABEL, hello, server_nonce)
    _send_frame(sock, _header(_RESULT) + bytes([_STATUS_OK]) + mac, deadline)
    return info


def client_handshake(
    sock: socket.socket,
    secret: bytes,
    purpose: bytes,
    info: bytes,
    what: str,
    deadline: Optional[float] = None,
) -> None:
    """Runs the client side of the handshake (all of it by ``deadline``, time.monotonic());
    raises AuthenticationError if it fails."""
    if len(purpose) > 255 or len(info) > 1024:
        raise ValueError("handshake purpose or info too long")
    hello = (
        _header(_HELLO)
        + bytes([len(purpose)])
        + purpose
        + struct.pack("<H", len(info))
        + info
        + secrets.token_bytes(_NONCE_LEN)
    )
    _send_frame(sock, hello, deadline)
    challenge = _recv_frame(sock, MAX_HANDSHAKE_FRAME, what, deadline)
    bad = _check_header(challenge, _CHALLENGE, 7)
    if bad:
        raise AuthenticationError(f"{what} did not answer the handshake properly: {bad}")
    if challenge[6] != _STATUS_OK:
        raise AuthenticationError(
            f"{what} refused the connection: {challenge[7:519].decode(errors='replace')}"
        )
    if len(challenge) != 7 + _NONCE_LEN:
        raise AuthenticationError(f"{what} sent a malformed challenge")
    server_nonce = challenge[7:]
    _send_frame(
        sock, _header(_PROOF) + _proof(secret, _CLIENT_LABEL, hello, server_nonce), deadline
    )
    result = _recv_frame(sock, MAX_HANDSHAKE_FRAME, what, deadline)
    bad = _check_header(result, _RESULT, 7)
    if bad:
        raise AuthenticationError(f"{what} sent a malformed handshake result: {bad}")
    if result[6] != _STATUS_OK:
        detail = result[7:519].decode(errors="replace") or "bad proof of the job secret"
        raise AuthenticationError(f"{what} rejected this client: {detail}")
    # The server proves the secret last, once we did: see docs/protocol.md.
    expected = _proof(secret, _SERVER_LABEL, hello, server_nonce)
    if len(result) != 7 + _MAC_LEN or not hmac.compare_digest(expected, result[7:]):
        raise AuthenticationError(f"{what} could not prove it knows the job secret")


class _RateLimitedWarning:
    """Logs at most one warning per ``interval`` seconds, counting those it left out
    (``what``: how the count's note calls them)."""

    def __init__(self, interval: float, what: str = "rejected") -> None:
        self._interval = interval
        self._what = what
        self._lock = threading.Lock()
        self._last: Optional[float] = None
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last < self._interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += f" (%d more {self._what} since the last warning)"
            args += (suppressed,)
        logger.warning(message, *args)


# ---- server -------------------------------------------------------------------------------


class StoreServer:
    """Threaded rendezvous store: a thread accepts, one thread per authenticated client.

    Args:
        secret: the per-job secret (raw bytes; workers get it as hex in BAGUA_HVD_SECRET).
        host: address to listen on.
        port: port to listen on; 0 picks a free one (see :attr:`port`).
        max_frame_bytes: largest accepted request (key + value + 5 bytes).
        handshake_timeout: seconds a new connection has to authenticate (the whole handshake).
        on_set: called with (key, value) after a client's SET is stored, on that client's
            thread (the elastic driver hears its workers this way); it must return quickly.
        max_stored_bytes, max_stored_keys: what clients may store in all; a SET beyond either
            is refused (the client gets an error naming the cap).

    At most ``MAX_PENDING_HANDSHAKES`` connections handshake at once: a newcomer beyond that
    evicts the oldest one still handshaking (its client retries, see :class:`StoreClient`), so
    silent, trickling or garbage connections neither hold threads for long nor keep the ranks
    out. Rejections, and clients dropped for errors, are logged at most once per
    ``REJECT_LOG_INTERVAL_S`` each; nothing is logged about clients cut off by :meth:`stop`. A
    blocking GET ends when its client disconnects (checked every ``CLIENT_CHECK_S``; TCP
    keepalive notices a vanished machine), so clients that went away do not hold threads or
    count against ``MAX_CONNECTIONS``.
    """

    def __init__(
        self,
        secret: bytes,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        handshake_timeout: float = 10.0,
        on_set: Optional[Callable[[bytes, bytes], None]] = None,
        max_stored_bytes: int = MAX_STORED_BYTES,
        max_stored_keys: int = MAX_STORED_KEYS,
    ) -> None:
        self._secret = _check_secret(secret)
        self._on_set = on_set
        self._host = host
        self._requested_port = int(port)
        self._max_frame = int(max_frame_bytes)
        self._handshake_timeout = float(handshake_timeout)
        self._data: dict[bytes, bytes] = {}
        self._stored_bytes = 0  # keys and values in _data, guarded by _cond
        self._max_stored_bytes = int(max_stored_bytes)
        self._max_stored_keys = int(max_stored_keys)
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # guards the fields below
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._clients: dict[threading.Thread, _Connection] = {}  # in accept order
        self._rejects = _RateLimitedWarning(REJECT_LOG_INTERVAL_S)
        self._drops = _RateLimitedWarning(REJECT_LOG_INTERVAL_S, "dropped")
        self._stopping = False
        self._answering_gets = 0  # GETs between their wait and their answer sent (self._cond)
        self._port = 0

    # -- lifecycle --

    def start(self) -> StoreServer:
        """Binds, listens and starts serving; returns self. Starting twice is an error."""
        with self._lock:
            if self._listener is not None or self._stopping:
                raise RuntimeError("StoreServer.start() called twice")
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self._host, self._requested_port))
                listener.listen(512)
                listener.setblocking(False)
            except OSError:
                listener.close()
                raise
            self._listener = listener
            self._port = listener.getsockname()[1]
            self._wake_r, self._wake_w = socket.socketpair()
            self._accept_thread = threading.Thread(
                target=self._accept_loop, name="bagua_hvd-store-accept", daemon=True
            )
            self._accept_thread.start()
        logger.debug("rendezvous store listening on %s:%d", self._host, self._port)
        return self

    @property
    def port(self) -> int:
        """The bound port (valid after :meth:`start`)."""
        if not self._port:
            raise RuntimeError("StoreServer is not started")
        return self._port

    @property
    def host(self) -> str:
        """The address the server listens on."""
        return self._host

    def stop(self) -> None:
        """Closes every socket and joins every thread. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            accept_thread = self._accept_thread
            if self._wake_w is not None:
                try:
                    self._wake_w.send(b"x")
                except OSError:
                    pass
        with self._cond:
            self._cond.notify_all()  # wake blocking gets
        if accept_thread is not None:
            accept_thread.join()
        with self._cond:  # the woken GETs answer "shutting down" before their connection is cut
            self._cond.wait_for(lambda: self._answering_gets == 0, timeout=STOP_REPLY_S)
        with self._lock:
            clients = list(self._clients.items())
            for _, conn in clients:
                conn.shutdown()  # wakes a thread blocked in recv
        for thread, _ in clients:
            thread.join(timeout=10)
            if thread.is_alive():
                logger.warning("rendezvous store client thread %s did not exit", thread.name)
        with self._lock:
            for sock in (self._listener, self._wake_r, self._wake_w):
                if sock is not None:
                    sock.close()
            self._listener = self._wake_r = self._wake_w = None

    def __enter__(self) -> StoreServer:
        if self._listener is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- local access (the launcher's own reads and writes) --

    def set(self, key: KeyLike, value: ValueLike) -> None:
        """Sets a key directly in this process (not bound by the caps on clients)."""
        with self._cond:
            self._store(_as_bytes(key, "key"), _as_bytes(value, "value"))

    def set_if_absent(self, key: KeyLike, value: ValueLike) -> bool:
        """Sets a key directly unless it is set already; returns whether it was set."""
        k = _as_bytes(key, "key")
        with self._cond:
            if k in self._data:
                return False
            self._store(k, _as_bytes(value, "value"))
            return True

    @property
    def client_count(self) -> int:
        """Connections being served now (handshaking or authenticated)."""
        with self._lock:
            return sum(1 for t in self._clients if t.is_alive())

    def _store(self, key: bytes, value: bytes) -> None:
        old = self._data.get(key)
        if old is not None:
            self._stored_bytes -= len(key) + len(old)
        self._data[key] = value
        self._stored_bytes += len(key) + len(value)
        self._cond.notify_all()

    def _client_set(self, key: bytes, value: bytes) -> Optional[str]:
        """A client's SET within the caps; returns why it was refused, else None."""
        with self._cond:
            old = self._data.get(key)
            after = self._stored_bytes + len(key) + len(value)
            if old is not None:
                after -= len(key) + len(old)
            elif len(self._data) >= self._max_stored_keys:
                return (
                    f"the rendezvous store is full: it holds {len(self._data)} keys, the most "
                    f"it takes (MAX_STORED_KEYS); refused SET of {key[:64]!r}"
                )
            if after > self._max_stored_bytes:
                return (
                    f"the rendezvous store is full: SET of {key[:64]!r} ({len(value)} bytes) "
                    f"would bring it to {after} bytes, over its cap of "
                    f"{self._max_stored_bytes} (MAX_STORED_BYTES)"
                )
            self._store(key, value)
            return None

    def get(self, key: KeyLike, timeout: float = 0.0) -> bytes:
        """Reads a key directly, waiting up to ``timeout`` seconds for it (values stay readable
        after :meth:`stop`)."""
        k = _as_bytes(key, "key")
        value = self._wait_for(k, timeout)
        if value is None:
            raise StoreTimeoutError(
                f"timed out after {timeout:g}s waiting for rendezvous key {k!r}"
            )
        return value

    # -- internals --

    def _wait_for(
        self, key: bytes, timeout: float, client: Optional[socket.socket] = None
    ) -> bytes | None:
        """The value of ``key`` once set, or None after ``timeout``, at stop, or (``client``
        given) once that client disconnected."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while key not in self._data and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if client is not None:
                    if _disconnected(client):
                        return None
                    left = min(left, CLIENT_CHECK_S)
                self._cond.wait(left)
            return self._data.get(key)

    def _accept_loop(self) -> None:
        assert self._listener is not None and self._wake_r is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    self._accept_ready()

    def _accept_ready(self) -> None:
        assert self._listener is not None
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # e.g. EMFILE: back off instead of spinning
            logger.warning("rendezvous store: accept failed: %s", e)
            time.sleep(0.05)
            return
        peer = _format_addr(addr)
        with self._lock:
            self._reap_finished()
            if self._stopping or len(self._clients) >= MAX_CONNECTIONS:
                if not self._stopping:
                    self._rejects.warning(
                        "rendezvous store: dropped connection from %s: %d connections open",
                        peer,
                        len(self._clients),
                    )
                sock.close()
                return
            pending = [c for c in self._clients.values() if c.evictable()]
            if len(pending) >= MAX_PENDING_HANDSHAKES:
                pending[0].evicted = True
                pending[0].shutdown()
            conn = _Connection(sock)
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name=f"bagua_hvd-store-{peer}", daemon=True
            )
            self._clients[thread] = conn
            thread.start()

    def _reap_finished(self) -> None:
        for thread in [t for t in self._clients if not t.is_alive()]:
            thread.join()
            del self._clients[thread]

    def _claim(self, conn: _Connection) -> bool:
        with self._lock:
            if conn.evicted:
                return False
            conn.claimed = True
            return True

    def _serve(self, conn: _Connection, peer: str) -> None:
        what = f"client {peer}"
        sock = conn.sock
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self._handshake_timeout
            try:
                info = server_handshake(
                    sock, self._secret, STORE_PURPOSE, what, deadline, lambda: self._claim(conn)
                )
            except (StoreError, OSError) as e:
                if not self._stopping:
                    self._rejects.warning(
                        "rendezvous store: rejected connection from %s: %s", peer, e
                    )
                return
            logger.debug(
                "rendezvous store: %s authenticated (%s)", peer, info.decode(errors="replace")
            )
            sock.settimeout(None)  # authenticated clients may stay idle
            _keepalive(sock)
            while not self._stopping:
                try:
                    request = _recv_frame(sock, self._max_frame, what)
                except StoreError as e:
                    if not isinstance(e, StoreConnectionClosed) and not self._stopping:
                        self._drops.warning("rendezvous store: dropped %s: %s", what, e)
                        self._reply_error(sock, str(e))
                    return
                get = request[:1] == b"G"
                if get:
                    with self._cond:
                        self._answering_gets += 1
                try:
                    reply = self._handle(request, what, sock)
                    if reply is None:
                        # The client's end of stream: gone, or only done sending (a half
                        # close). The wait ends either way; the answer is a timeout's, which a
                        # half-closed client still reads and a gone one never will.
                        logger.debug("rendezvous store: %s ended its stream during a GET", what)
                        try:
                            _send_frame(sock, b"T")
                        except OSError:
                            pass
                        return
                    _send_frame(sock, reply)
                finally:
                    if get:
                        with self._cond:
                            self._answering_gets -= 1
                            self._cond.notify_all()
                if reply[:1] == b"E" and self._stopping:
                    return  # stop() cuts every client off: nothing went wrong, nothing to log
                if reply[:1] == b"E":
                    self._drops.warning(
                        "rendezvous store: dropped %s: %s", what, reply[1:].decode()
                    )
                    self._linger(sock)
                    return
        except OSError as e:
            if not self._stopping:
                self._drops.warning("rendezvous store: connection from %s failed: %s", peer, e)
        except Exception:  # a bug must not pass silently, but must not stop the server either
            logger.exception("rendezvous store: error serving %s", peer)
        finally:
            with self._lock:  # not while the accept thread may shut it down
                sock.close()

    @staticmethod
    def _reply_error(sock: socket.socket, message: str) -> None:
        try:
            _send_frame(sock, b"E" + message.encode())
        except OSError:
            return
        StoreServer._linger(sock)

    @staticmethod
    def _linger(sock: socket.socket) -> None:
        """Ends the connection after an error reply without losing the reply: closing a socket
        with unread bytes (the rest of an oversized request) resets the connection, and the reset
        discards the replies the client has not received yet. So send the end of stream, then read
        and discard what the client still sends, until it closes or ERROR_LINGER_S passed."""
        try:
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + ERROR_LINGER_S
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv(65536):
                    return
        except OSError:  # the client is gone, or ERROR_LINGER_S passed (socket.timeout)
            pass

    def _handle(
        self, req: bytes, what: str, client: Optional[socket.socket] = None
    ) -> bytes | None:
        """The reply to one request; None when the client disconnected during a GET."""
        op = req[:1]
        if op == b"S":
            if len(req) < 5:
                return b"E" + b"truncated SET request"
            (klen,) = struct.unpack_from("<I", req, 1)
            if not 0 < klen <= MAX_KEY_BYTES or len(req) < 5 + klen:
                return b"E" + f"bad key length {klen} in SET request".encode()
            key, value = req[5 : 5 + klen], req[5 + klen :]
            refused = self._client_set(key, value)
            if refused is not None:
                return b"E" + refused.encode()
            if self._on_set is not None:
                self._on_set(key, value)
            return b"K"
        if op == b"G":
            if len(req) < 9:
                return b"E" + b"truncated GET request"
            timeout_ms, klen = struct.unpack_from("<II", req, 1)
            if not 0 < klen <= MAX_KEY_BYTES or len(req) != 9 + klen:
                return b"E" + f"bad key length {klen} in GET request".encode()
            value = self._wait_for(req[9:], timeout_ms / 1000.0, client)
            if value is None:
                if self._stopping:
                    return b"E" + b"store is shutting down"
                if client is not None and _disconnected(client):
                    return None
                return b"T"
            return b"V" + value
        return b"E" + f"unknown request type {req[:1]!r}".encode()


class _Connection:
    """A client connection of the store and how far its handshake got (guarded by the server's
    lock)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.claimed = False  # the client proved the secret: never evicted
        self.evicted = False

    def evictable(self) -> bool:
        return not self.claimed and not self.evicted and self.sock.fileno() >= 0

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already


def _disconnected(sock: socket.socket) -> bool:
    """Whether the client closed its end or its connection failed (without consuming data: a
    client may have sent its next request already)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or closed by stop()
        return True


def _keepalive(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    except OSError:
        pass  # not a TCP socket (tests), or the option is not supported


def _format_addr(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr)


# ---- client -------------------------------------------------------------------------------


class StoreClient:
    """Blocking client of a :class:`StoreServer` (the same protocol as the C++ client).

    Retries the initial connection until ``timeout`` seconds passed (the server may start
    later); an authentication failure is not retried.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        self._secret = _check_secret(secret)
        self._what = f"the rendezvous store at {_format_addr((host, port))}"
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        deadline = time.monotonic() + self._timeout
        delay = 0.01
        last: BaseException | None = None
        while True:
            try:
                sock = socket.create_connection(
                    (host, port), timeout=max(0.05, deadline - time.monotonic())
                )
            except OSError as e:
                last = e
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    info = f"pid={os.getpid()} host={socket.gethostname()}".encode()
                    client_handshake(
                        sock,
                        self._secret,
                        STORE_PURPOSE,
                        info,
                        self._what,
                        deadline,
                    )
                    sock.settimeout(None)
                    self._sock = sock
                    return
                except AuthenticationError:
                    sock.close()
                    raise
                except (StoreError, OSError) as e:
                    sock.close()
                    last = e
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"could not connect to {self._what} within {self._timeout:g}s: {last}"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.25)

    def _request(self, payload: bytes, timeout: float) -> bytes:
        with self._lock:
            if self._sock is None:
                raise StoreError(f"the connection to {self._what} is closed")
            sock = self._sock
            try:
                sock.settimeout(timeout)
                _send_frame(sock, payload)
                reply = _recv_frame(sock, DEFAULT_MAX_FRAME_BYTES + 64, self._what)
            except (OSError, StoreError) as e:
                self._close_locked()
                if isinstance(e, StoreError):
                    raise
                raise StoreError(f"request to {self._what} failed: {e}") from e
        if not reply:
            raise StoreError(f"empty reply from {self._what}")
        if reply[:1] == b"E":
            raise StoreError(
                f"{self._what} refused a request: {reply[1:].decode(errors='replace')}"
            )
        return reply

    def set(self, key: KeyLike, value: ValueLike) -> None:
        """Sets ``key`` to ``value``."""
        k, v = _as_bytes(key, "key"), _as_bytes(value, "value")
        if not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes")
        reply = self._request(b"S" + struct.pack("<I", len(k)) + k + v, self._timeout)
        if reply != b"K":
            raise StoreError(f"unexpected reply from {self._what} to SET {k!r}")

    def get(self, key: KeyLike, timeout: float | None = None) -> bytes:
        """Returns the value of ``key``, waiting up to ``timeout`` seconds (default: the
        client's timeout) for it to be set; raises StoreTimeoutError naming the key."""
        k = _as_bytes(key, "key")
        if not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes")
        wait = self._timeout if timeout is None else max(0.0, float(timeout))
        ms = min(int(wait * 1000), 0xFFFFFFFF)
        reply = self._request(
            b"G" + struct.pack("<II", ms, len(k)) + k, wait + max(5.0, self._timeout)
        )
        if reply[:1] == b"V":
            return reply[1:]
        if reply == b"T":
            raise StoreTimeoutError(
                f"timed out after {wait:g}s waiting for rendezvous key {k.decode(errors='replace')!r} "
                f"in {self._what}"
            )
        raise StoreError(f"unexpected reply from {self._what} to GET {k!r}")

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Closes the connection. Idempotent."""
        with self._lock:
            self._close_locked()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(
        self,
        exc_type: type | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
