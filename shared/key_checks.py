"""Checks of offered tenant keys, for the control plane and the router alike: failed attempts are limited
per client address and per key id, so that guessing stops before it costs a record lookup or a hash.

A failure is an attempt with an unknown key id or a wrong secret (`InvalidKeyError` from the block of
`attempt`); it counts against the client's address (an IPv6 address by its /64) and against the key
id, in fixed windows of `window_s`.

- Past `per_address` failures, an address is refused (429 with Retry-After: the window's end) before
  any lookup or hash, whatever key it offers.
- Past `per_key` failures of one key id, offers of that id are refused alike. One address stops at
  `per_address`, so this takes several addresses (per_key / per_address of them at the defaults: 5).
- An offer of the secret already verified for the key id (`holder`) is never refused: the key's holder
  keeps working, from any address, however long its id is hammered (what a guesser could learn there
  needs the secret). A holder whose key this process has not verified yet waits (429) while an attack
  on its id from many addresses lasts: the price of computing no hash for guesses meanwhile.

`check` verifies an offer against the stored hash: an HMAC one at once (a microsecond); a legacy argon2
one (tens of CPU-milliseconds) with at most SLOW_AT_ONCE of them under way, each started only once the
limits still allow it (concurrent guesses cannot all slip in under a limit), and one for concurrent
offers of the same secret. Counts are this process's own (each router, each control-plane replica);
both tables are bounded (`max_tracked` names, the oldest window forgotten first).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shared import key_secrets
from shared.errors import AuthenticationError, RateLimitError
from shared.key_secrets import KeyHasher

logger = logging.getLogger(__name__)
MAX_TRACKED = 100_000
SLOW_AT_ONCE = 2  # legacy (argon2) checks under way at once, in threads


class InvalidKeyError(AuthenticationError):
    """401 for an unknown key id or a wrong secret: a failure that KeyChecks counts."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


@dataclass
class _Window:
    start: float  # time.monotonic()
    count: int = 0


def address_of(host: str) -> str:
    """What failures are counted against: the IPv4 address, an IPv6 address's /64 (one subscriber's)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(getattr(address, "ipv4_mapped", None) or address)


class _Counts:
    """Failures per name in fixed windows; at most `size` names (the oldest window dropped first)."""

    def __init__(self, what: str, limit: int, window_s: float, size: int) -> None:
        self.what, self.limit, self.window_s, self.size = what, limit, window_s, size
        self._windows: dict[str, _Window] = {}

    def _current(self, name: str, now: float) -> _Window | None:
        window = self._windows.get(name)
        if window is not None and now - window.start >= self.window_s:
            del self._windows[name]
            return None
        return window

    def wait_s(self, name: str, now: float) -> float | None:
        """Seconds until `name` may try again; None while it is under its limit."""
        window = self._current(name, now)
        if window is None or window.count < self.limit:
            return None
        return window.start + self.window_s - now

    def fail(self, name: str, now: float) -> None:
        window = self._current(name, now)
        if window is None:
            while len(self._windows) >= self.size:
                del self._windows[next(iter(self._windows))]
            window = self._windows[name] = _Window(now)
        window.count += 1
        if window.count == self.limit:
            logger.warning("tenant keys: %d failed attempts of %s %s within %.0f s; its further attempts are "
                           "refused (429) until the window ends", self.limit, self.what, name, self.window_s)


class KeyChecks:
    def __init__(self, per_address: int, per_key: int, window_s: float, max_tracked: int = MAX_TRACKED) -> None:
        self._addresses = _Counts("address", per_address, window_s, max_tracked)
        self._keys = _Counts("key id", per_key, window_s, max_tracked)
        self._slow = asyncio.Semaphore(SLOW_AT_ONCE)
        self._pending: dict[tuple[str, str, bytes], asyncio.Future[bool]] = {}

    def refusal(self, key_id: str, host: str) -> RateLimitError | None:
        """The 429 for an offer of `key_id` from `host` that is not its verified secret, or None."""
        now = time.monotonic()
        wait = self._addresses.wait_s(address_of(host), now)
        if wait is not None:
            return RateLimitError(f"Too many failed API key attempts from this address; retry in {wait:.0f} s.",
                                  retry_after_s=wait)
        wait = self._keys.wait_s(key_id, now)
        if wait is not None:
            return RateLimitError(f"Too many failed attempts with this API key id; retry in {wait:.0f} s.",
                                  retry_after_s=wait)
        return None

    @contextlib.contextmanager
    def attempt(self, key_id: str, host: str, *, holder: bool = False) -> Iterator[None]:
        """Around the lookup and check of an offer: RateLimitError before the block when refused (never
        the `holder`'s); an InvalidKeyError from the block is counted as a failure."""
        if not holder and (refused := self.refusal(key_id, host)) is not None:
            raise refused
        try:
            yield
        except InvalidKeyError:
            now = time.monotonic()
            self._addresses.fail(address_of(host), now)
            self._keys.fail(key_id, now)
            raise

    async def check(self, hasher: KeyHasher, key_id: str, secret: str, stored: str, host: str) -> bool:
        """Whether `secret` is the key's (see the module doc); NoPepperError (503) for an HMAC hash
        without a pepper, RateLimitError when a legacy check's turn comes past a limit."""
        if not key_secrets.is_legacy(stored):
            return hasher.verify(key_id, secret, stored)
        offer = (key_id, stored, key_secrets.digest(secret))
        pending = self._pending.get(offer)
        if pending is None:
            pending = self._pending[offer] = asyncio.ensure_future(self._slow_check(hasher, key_id, secret, stored,
                                                                                    host))
            pending.add_done_callback(lambda done: self._done(offer, done))
        return await asyncio.shield(pending)

    def _done(self, offer: tuple[str, str, bytes], done: asyncio.Future[bool]) -> None:
        self._pending.pop(offer, None)
        if not done.cancelled():
            done.exception()  # retrieved: no "never retrieved" warning when every waiter had gone

    async def _slow_check(self, hasher: KeyHasher, key_id: str, secret: str, stored: str, host: str) -> bool:
        async with self._slow:
            if (refused := self.refusal(key_id, host)) is not None:
                raise refused
            return await key_secrets.check(hasher, key_id, secret, stored)
