"""Fuzz target (atheris): the launcher's rendezvous store server, bagua_hvd/rendezvous/store.py, fed
arbitrary client bytes over a real localhost connection to a running StoreServer.

Input: a mode byte (mod 3), then
  0 raw: the client's whole byte stream: the handshake's framing and parsing. No stream carries
    the right proof (it covers the server's random nonce), so the server must refuse it.
  1 authenticated: the harness authenticates with the real client code (client_handshake), then
    sends the rest: the requests' framing and parsing. The replies must be the ones
    docs/protocol.md gives for these requests (the model below).
  2 scripted hello: u16 n, then n bytes sent as the HELLO payload; the harness answers the
    challenge with the right proof, then sends what is left: the paths behind the proof. The
    server must accept exactly the well-formed hellos of purpose "store".
The harness then closes its sending side and reads until the server closes the connection.
Findings (an exception, which atheris reports with the input): the server keeps the connection
open 10 s after the client's end of stream, logs an error (an exception escaped its handling of
the connection), answers against the protocol, or stops serving a second, well-behaved client.

Usage: python native/fuzz/store_server_fuzz.py [libFuzzer flags] CORPUS_DIR_OR_FILES...
       python native/fuzz/store_server_fuzz.py --write-seeds DIR
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import selectors
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import atheris

with atheris.instrument_imports(include=["bagua_hvd.rendezvous.store"]):
    from bagua_hvd.rendezvous import store

SECRET = bytes(range(32))
MAX_FRAME = 2048  # the server's request limit here: small, so inputs reach it
GET_WAIT_CAP_S = 0.01
CLOSE_TIMEOUT_S = 10.0

# The wire format, written from docs/protocol.md (not taken from store.py, which it checks).
HEADER = b"BHVD\x02"
HELLO, CHALLENGE, PROOF, RESULT = 1, 2, 3, 4


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def mac(label: bytes, hello: bytes, nonce: bytes) -> bytes:
    return hmac.new(SECRET, label + hello + nonce, hashlib.sha256).digest()


def hello_payload(purpose: bytes, info: bytes, nonce: bytes = b"n" * 32) -> bytes:
    return (
        HEADER
        + bytes([HELLO, len(purpose)])
        + purpose
        + struct.pack("<H", len(info))
        + info
        + nonce
    )


class BoundedWaitServer(store.StoreServer):
    """A GET may ask to wait up to 49 days for a missing key; here the wait (a Condition.wait, not
    parsing) is cut short so that each input ends quickly."""

    def _wait_for(
        self, key: bytes, timeout: float, client: Optional[socket.socket] = None
    ) -> Optional[bytes]:
        return super()._wait_for(key, min(timeout, GET_WAIT_CAP_S), client)


class ErrorRecords(logging.Handler):
    """Errors the server logs: logger.exception when an exception escaped a connection's
    handling. Warnings (rejected connections) are expected and not recorded."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def exchange(sock: socket.socket, payload: bytes, deadline: float) -> bytes:
    """Sends payload while reading (a server answering many requests must not block on a full
    socket), then the end of stream; returns what the server sent until it closed."""
    sock.setblocking(False)
    received = bytearray()
    sent = 0
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("the server kept the connection open after the client's end")
            for _, events in sel.select(left):
                if events & selectors.EVENT_WRITE:
                    try:
                        sent += sock.send(payload[sent:])
                    except (BrokenPipeError, ConnectionResetError):
                        sent = len(payload)  # the server hung up: expected after a refusal
                    if sent == len(payload):
                        try:
                            sock.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                        sel.modify(sock, selectors.EVENT_READ)
                if events & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(65536)
                    except ConnectionResetError:
                        return bytes(received)
                    if not chunk:
                        return bytes(received)
                    received += chunk


def split_frames(stream: bytes) -> tuple[list[bytes], bytes]:
    """The complete frames of a stream and the incomplete rest."""
    frames = []
    while len(stream) >= 4:
        (n,) = struct.unpack_from("<I", stream)
        if len(stream) < 4 + n:
            break
        frames.append(stream[4 : 4 + n])
        stream = stream[4 + n :]
    return frames, stream


def expected_replies(stream: bytes) -> list[bytes]:
    """The replies docs/protocol.md gives for a stream of requests on an authenticated
    connection (a fresh store; a GET of a missing key times out): b"K", b"V" + value, b"T", or
    b"E" (its reason not compared), after which the server closes."""
    data: dict[bytes, bytes] = {}
    replies = []
    while len(stream) >= 4:
        (n,) = struct.unpack_from("<I", stream)
        if n > MAX_FRAME:
            return replies + [b"E"]
        if len(stream) < 4 + n:
            break  # the end of stream inside a frame: the server closes without a reply
        req, stream = stream[4 : 4 + n], stream[4 + n :]
        reply = b"E"
        if req[:1] == b"S" and len(req) >= 5:
            (klen,) = struct.unpack_from("<I", req, 1)
            if 0 < klen <= store.MAX_KEY_BYTES and len(req) >= 5 + klen:
                data[req[5 : 5 + klen]] = req[5 + klen :]
                reply = b"K"
        elif req[:1] == b"G" and len(req) >= 9:
            (klen,) = struct.unpack_from("<I", req, 5)
            if 0 < klen <= store.MAX_KEY_BYTES and len(req) == 9 + klen:
                value = data.get(req[9:])
                reply = b"T" if value is None else b"V" + value
        replies.append(reply)
        if reply == b"E":
            break
    return replies


def check_replies(requests: bytes, stream: bytes) -> None:
    replies, rest = split_frames(stream)
    assert not rest, f"the server sent an incomplete frame: {rest!r}"
    got = [r[:1] if r[:1] == b"E" else r for r in replies]
    want = expected_replies(requests)
    assert got == want, f"replies {got!r} differ from the protocol's {want!r}"


def parse_hello(hello: bytes) -> Optional[bytes]:
    """The purpose of a well-formed HELLO (docs/protocol.md), else None."""
    if len(hello) < 7 or hello[:6] != HEADER + bytes([HELLO]):
        return None
    plen = hello[6]
    if len(hello) < 9 + plen:
        return None
    (ilen,) = struct.unpack_from("<H", hello, 7 + plen)
    if len(hello) != 9 + plen + ilen + 32:
        return None
    return hello[7 : 7 + plen]


def recv_frame(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "the server closed the connection before answering"
            buf += chunk
        return buf

    (n,) = struct.unpack("<I", exact(4))
    return exact(n)


def scripted_hello(sock: socket.socket, hello: bytes) -> bool:
    """Sends the HELLO and, if the server accepts it, the right proof; returns whether the
    server accepted the client."""
    purpose = parse_hello(hello)
    sock.sendall(frame(hello))
    challenge = recv_frame(sock)
    assert challenge[:6] == HEADER + bytes([CHALLENGE]) and len(challenge) >= 7, challenge
    assert (challenge[6] == 0) == (purpose is not None), "the hello's form decided the wrong answer"
    if purpose is None:
        return False
    assert len(challenge) == 7 + 32, "a challenge without a nonce"
    nonce = challenge[7:]
    sock.sendall(frame(HEADER + bytes([PROOF]) + mac(b"bagua_hvd auth v2 client", hello, nonce)))
    result = recv_frame(sock)
    assert result[:6] == HEADER + bytes([RESULT]) and len(result) >= 7, result
    accepted = purpose == b"store"
    assert (result[6] == 0) == accepted, f"purpose {purpose!r} got result status {result[6]}"
    if accepted:
        assert result[7:] == mac(b"bagua_hvd auth v2 server", hello, nonce), "no server proof"
    return accepted


class Harness:
    def __init__(self) -> None:
        self.errors = ErrorRecords()
        store.logger.addHandler(self.errors)
        store.logger.setLevel(logging.ERROR)  # rejected connections' warnings are expected
        store.logger.propagate = False
        self.server = BoundedWaitServer(
            SECRET, host="127.0.0.1", max_frame_bytes=MAX_FRAME, handshake_timeout=2.0
        ).start()
        # A well-behaved client connected all along: it must be served after every input.
        self.bystander = store.StoreClient("127.0.0.1", self.server.port, SECRET, timeout=10)
        self.count = 0

    def one_input(self, data: bytes) -> None:
        mode, rest = (data[0] % 3, data[1:]) if data else (0, b"")
        with self.server._cond:  # a fresh store per input: the model starts empty
            self.server._data.clear()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        authenticated = False
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if mode == 1:
                store.client_handshake(
                    sock, SECRET, store.STORE_PURPOSE, b"fuzz", "server", deadline
                )
                authenticated = True
            elif mode == 2:
                n = int.from_bytes(rest[:2], "little")
                hello, rest = rest[2 : 2 + n], rest[2 + n :]
                if len(hello) > store.MAX_HANDSHAKE_FRAME:
                    return  # dropped without an answer; raw inputs cover it
                authenticated = scripted_hello(sock, hello)
            replies = exchange(sock, rest, deadline)
        if authenticated:
            check_replies(rest, replies)
        elif mode == 0:
            # Whatever the stream, the server answers only handshake frames, never a RESULT with
            # status 0 (an acceptance).
            for f in split_frames(replies)[0]:
                assert f[:6] != HEADER + bytes([RESULT]) or f[6:7] != b"\x00", "accepted a stranger"
        if self.errors.records:
            record = self.errors.records[0]
            raise AssertionError(f"the server logged: {self.errors.format(record)}")
        self.count += 1
        value = str(self.count).encode()
        self.bystander.set(b"bystander", value)
        assert self.bystander.get(b"bystander", timeout=5) == value, "the bystander lost its key"
        assert threading.active_count() < 32, f"{threading.active_count()} threads alive"


def seeds() -> dict[str, bytes]:
    hello = hello_payload(b"store", b"pid=1 host=h")
    stranger = hello_payload(b"peer/job/0", b"from=1 to=0 ch=ctrl")
    requests = (
        frame(b"S" + struct.pack("<I", 3) + b"key" + b"value")
        + frame(b"G" + struct.pack("<II", 10, 3) + b"key")
        + frame(b"G" + struct.pack("<II", 10, 4) + b"miss")
    )
    return {
        "raw-handshake": b"\x00" + frame(hello) + frame(HEADER + bytes([PROOF]) + b"m" * 32),
        "raw-garbage": b"\x00GET / HTTP/1.0\r\n\r\n",
        "requests": b"\x01" + requests,
        "bad-requests": b"\x01" + frame(b"S\x00\x00\x00\x00") + frame(b"X"),
        "oversized-request": b"\x01" + struct.pack("<I", MAX_FRAME + 1),
        "scripted-hello": b"\x02" + struct.pack("<H", len(hello)) + hello + requests,
        "scripted-wrong-purpose": b"\x02" + struct.pack("<H", len(stranger)) + stranger,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        out = Path(sys.argv[2])
        out.mkdir(parents=True, exist_ok=True)
        for name, data in seeds().items():
            (out / name).write_bytes(data)
        return
    harness = Harness()
    atheris.Setup(sys.argv, harness.one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
