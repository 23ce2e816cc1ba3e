"""Horovod's ``horovod.runner.common.util.secret``: job keys and their HMAC-SHA256 digests."""

from __future__ import annotations

import hashlib
import hmac
import os

SECRET_LENGTH = 32  # bytes
DIGEST_LENGTH = 32  # bytes
# The variable Horovod's launchers pass their key in (base64 of a cloudpickle, codec.py).
HOROVOD_SECRET_KEY = "_HOROVOD_SECRET_KEY"


def make_secret_key() -> bytes:
    """A fresh random key of SECRET_LENGTH bytes."""
    return os.urandom(SECRET_LENGTH)


def compute_digest(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under ``key``."""
    return hmac.new(key, message, hashlib.sha256).digest()


def check_digest(key: bytes, message: bytes, digest: bytes) -> bool:
    """Whether ``digest`` is ``message``'s under ``key`` (compared in constant time)."""
    return hmac.compare_digest(compute_digest(key, message), digest)
