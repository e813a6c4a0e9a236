"""Tenant keys' secrets, for the control plane and the router alike: made once, shown once, kept only
as a keyed hash.

`lp_<key id>_<secret>`: 12 hex digits of key id (public: the row's name) and 43 characters of URL-safe
randomness (256 bits). Nobody guesses that, so a slow password hash protects nothing; it would only make
every wrong guess cost the verifier far more CPU than the guess costs an attacker. The stored hash is
`$hmac-sha256$<base64url>`: HMAC-SHA256 of the whole key under a server-side pepper
(LORAPLANE_KEY_PEPPER or LORAPLANE_KEY_PEPPER_FILE), which the control plane and every router share, as
API-key issuers do. A verification is one HMAC (docs/performance.md#router-and-fleet) and compares in
constant time; a table read without the pepper is of no use.

Hashes made earlier (argon2id PHC strings, `$argon2…`: `is_legacy`) still verify, slowly and off the
event loop (`check`), and are rewritten as HMAC on their next successful use. Without a pepper a process
verifies those alone: `KeyHasher.hash` and the HMAC check raise NoPepperError (503). Callers cache a
verified key's `digest` and compare later offers' with hmac.compare_digest.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from shared.errors import OverloadedError
from shared.tenants import KEY_ID_HEX, KEY_PREFIX

PEPPER_ENV = "LORAPLANE_KEY_PEPPER"  # or a file: LORAPLANE_KEY_PEPPER_FILE
MIN_PEPPER_CHARS = 32
HMAC_SCHEME = "$hmac-sha256$"
_LEGACY_SCHEME = "$argon2"
_legacy = PasswordHasher()  # verifies argon2 hashes of keys made before the HMAC; never hashes


class NoPepperError(OverloadedError):
    """This process cannot make or check HMAC key hashes: it was given no pepper."""

    def __init__(self) -> None:
        super().__init__(f"Tenant keys cannot be made or checked here: this process has no {PEPPER_ENV} (or "
                         f"{PEPPER_ENV}_FILE). The operator must give the control plane and every router the "
                         "same one.")


class KeyHasher:
    """HMAC-SHA256 under the pepper; `pepper` None: legacy hashes only (see the module doc)."""

    def __init__(self, pepper: str | None) -> None:
        if pepper is not None and len(pepper) < MIN_PEPPER_CHARS:
            raise ValueError(f"{PEPPER_ENV} must be at least {MIN_PEPPER_CHARS} characters")
        self._pepper = pepper.encode() if pepper else None

    def __repr__(self) -> str:
        return f"KeyHasher(pepper={'<hidden>' if self._pepper else None})"

    @property
    def ready(self) -> bool:
        return self._pepper is not None

    def hash(self, key_id: str, secret: str) -> str:
        if self._pepper is None:
            raise NoPepperError
        mac = hmac.digest(self._pepper, f"{KEY_PREFIX}{key_id}_{secret}".encode(), "sha256")
        return HMAC_SCHEME + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def verify(self, key_id: str, secret: str, stored: str) -> bool:
        """The fast check of an HMAC hash; False for a wrong secret or a hash of no known scheme."""
        if not stored.startswith(HMAC_SCHEME):
            return False
        return hmac.compare_digest(self.hash(key_id, secret).encode(), stored.encode())


def new_key(hasher: KeyHasher) -> tuple[str, str, str]:
    """(key id, the whole key to show once, the hash to store); NoPepperError without a pepper."""
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    secret = secrets.token_urlsafe(32)
    return key_id, f"{KEY_PREFIX}{key_id}_{secret}", hasher.hash(key_id, secret)


def is_legacy(stored: str) -> bool:
    """An argon2 hash, made before the HMAC: slow to check, rewritten after its next success."""
    return stored.startswith(_LEGACY_SCHEME)


def _verify_legacy(stored: str, secret: str) -> bool:
    try:
        return _legacy.verify(stored, secret)
    except (VerificationError, InvalidHashError):
        return False


async def check(hasher: KeyHasher, key_id: str, secret: str, stored: str) -> bool:
    """Whether `secret` is key `key_id`'s: an HMAC hash at once, a legacy one in a thread (tens of ms)."""
    if is_legacy(stored):
        return await asyncio.to_thread(_verify_legacy, stored, secret)
    return hasher.verify(key_id, secret, stored)


def digest(secret: str) -> bytes:
    """What a cache keeps of a verified secret: sha256, never the secret."""
    return hashlib.sha256(secret.encode()).digest()

