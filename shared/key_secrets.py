"""Tenant keys' secrets, for the control plane and the router alike: made once, shown once, kept only
as an argon2 hash.

`lp_<key id>_<secret>`: 12 hex digits of key id (public: the row's name) and 43 characters of URL-safe
randomness (256 bits). argon2id (argon2-cffi's defaults: salted, memory-hard, tens of milliseconds) makes
a stolen table slow to attack; its verification compares digests in constant time inside libargon2.
Callers cache a verified key and compare later offers with `same_secret` (hmac.compare_digest over
sha256 digests), so the slow hash runs once per key and process, not per request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from shared.tenants import KEY_ID_HEX, KEY_PREFIX

_hasher = PasswordHasher()


def new_key() -> tuple[str, str, str]:
    """(key id, the whole key to show once, the hash to store)."""
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    secret = secrets.token_urlsafe(32)
    return key_id, f"{KEY_PREFIX}{key_id}_{secret}", _hasher.hash(secret)


def verify(secret_hash: str, secret: str) -> bool:
    """The slow check (run it off the event loop); False for a wrong secret or a damaged hash."""
    try:
        return _hasher.verify(secret_hash, secret)
    except (VerificationError, InvalidHashError):
        return False


def digest(secret: str) -> bytes:
    """What a cache keeps of a verified secret: sha256, never the secret."""
    return hashlib.sha256(secret.encode()).digest()


def same_secret(cached: bytes, secret: str) -> bool:
    return hmac.compare_digest(cached, digest(secret))
