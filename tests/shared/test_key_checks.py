"""Tenant keys' hashes (shared/key_secrets.py) and the checks of offered keys (shared/key_checks.py): HMAC
under the pepper, argon2 hashes of keys made before it still verified, and concurrent guesses against an
argon2 hash held to the failures allowed (each check waits for its turn, then looks at the limits again)."""

from __future__ import annotations

import asyncio
import time

import pytest
from argon2 import PasswordHasher

from shared.errors import RateLimitError
from shared.key_checks import SLOW_AT_ONCE, InvalidKeyError, KeyChecks
from shared.key_secrets import HMAC_SCHEME, KeyHasher, NoPepperError, is_legacy, new_key
from shared.tenants import split_key

PEPPER = "a-pepper-of-the-key-checks-tests-" + "p" * 16


def test_keys_are_hashed_with_hmac_under_the_pepper() -> None:
    hasher = KeyHasher(PEPPER)
    key_id, key, stored = new_key(hasher)
    assert split_key(key) is not None and split_key(key)[0] == key_id
    secret = split_key(key)[1]
    assert stored.startswith(HMAC_SCHEME) and secret not in stored and not is_legacy(stored)
    assert hasher.verify(key_id, secret, stored)
    assert not hasher.verify(key_id, secret[:-1] + ("x" if secret[-1] != "x" else "y"), stored)
    assert not hasher.verify("0" * 12, secret, stored)  # the hash is of the whole key: another id fails
    assert not KeyHasher(PEPPER + "!").verify(key_id, secret, stored)
    assert not hasher.verify(key_id, secret, "$pbkdf2$whatever")  # no known scheme
    assert PEPPER not in repr(hasher)
    with pytest.raises(NoPepperError, match="LORAPLANE_KEY_PEPPER"):
        new_key(KeyHasher(None))
    with pytest.raises(NoPepperError):
        KeyHasher(None).verify(key_id, secret, stored)
    with pytest.raises(ValueError, match="at least 32"):
        KeyHasher("short")


async def guess(checks: KeyChecks, stored: str, secret: str) -> str:
    """One offer through `attempt` and `check`, as the router and the control plane make it."""
    try:
        with checks.attempt("0123456789ab", "10.0.0.9"):
            if not await checks.check(KeyHasher(PEPPER), "0123456789ab", secret, stored, "10.0.0.9"):
                raise InvalidKeyError("wrong")
    except InvalidKeyError:
        return "hashed, wrong"
    except RateLimitError:
        return "429"
    return "ok"


async def test_concurrent_guesses_against_an_argon2_hash_stop_at_the_limit() -> None:
    stored = PasswordHasher().hash("s" * 43)
    checks = KeyChecks(per_address=3, per_key=1000, window_s=60.0)
    outcomes = await asyncio.gather(*(guess(checks, stored, f"{i:02d}" + "x" * 41) for i in range(30)))
    # every guess passed the first look at the limits at once; each hash waited for its turn and looked again
    assert 3 <= outcomes.count("hashed, wrong") <= 3 + SLOW_AT_ONCE and outcomes.count("429") >= 30 - 3 - SLOW_AT_ONCE
    assert await guess(checks, stored, "s" * 43) == "429"  # the address is refused now, whatever it offers


async def test_concurrent_offers_of_one_secret_share_one_argon2_check() -> None:
    secret = "s" * 43
    stored = PasswordHasher().hash(secret)
    checks = KeyChecks(per_address=3, per_key=1000, window_s=60.0)
    start = time.process_time()
    assert await guess(checks, stored, secret) == "ok"
    one_s = time.process_time() - start
    start = time.process_time()
    assert await asyncio.gather(*(guess(checks, stored, secret) for _ in range(10))) == ["ok"] * 10
    assert time.process_time() - start < 3 * one_s  # ten offers, one hash (ten would be 10x)
