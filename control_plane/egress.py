"""Egress guard: the control plane's engine calls connect only to addresses the engine-URL policy allows.

Registration checks an engine URL once (shared.engine_urls), but a name can resolve
elsewhere later (DNS rebinding), and rows may predate the check. So every connection is checked too:
the host is resolved here, every address it resolves to must pass `address_problem` (link-local,
cloud-metadata, unspecified addresses refused; LORAPLANE_ENGINE_ALLOWED_NETWORKS when set), and the
socket is opened to the checked address itself, so that no second lookup can answer differently. TLS
still verifies the URL's host name (httpcore sends it as SNI and checks the certificate against it).
Nothing, not even the request line, is sent to a refused address.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import certifi
import httpcore
import httpx

from shared.engine_urls import RESOLVE_TIMEOUT_S, address_problem

REFUSED = "egress refused"


class EgressRefused(httpcore.ConnectError):
    """httpx maps it to httpx.ConnectError keeping the message, which starts with REFUSED."""


class GuardedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, allowed: tuple[str, ...]) -> None:
        self.allowed = allowed
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        failure: Exception | None = None
        for address in await self._checked_addresses(host):  # in resolver order, the first that answers
            try:
                return await self._inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                     socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise EgressRefused(f"{REFUSED}: unix sockets are not engine addresses")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)

    async def _checked_addresses(self, host: str) -> list[str]:
        try:
            return [str(self._check(ipaddress.ip_address(host)))]
        except ValueError:
            pass  # a name
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            raise httpcore.ConnectError(f"{host}: does not resolve ({type(exc).__name__})") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for address in addresses:  # all of them: no answer may point somewhere refused
            self._check(ipaddress.ip_address(address), host)
        return addresses

    def _check(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address, host: str | None = None
               ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        problem = address_problem(address, self.allowed)
        if problem is not None:
            raise EgressRefused(f"{REFUSED}: {host + ' resolves to ' if host else ''}{problem}")
        return address


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default verification (certifi's CA bundle), made once per process: loading the bundle is the
    costly part, and one context serves any number of connections."""
    return ssl.create_default_context(cafile=certifi.where())


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over an httpcore pool whose connections go through GuardedBackend. No proxies
    (a proxy would see the engine admin token and connect wherever it likes)."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        super().__init__(verify=_ssl_context(), trust_env=False)
        # httpx has no option for the network backend; its pool is httpcore's public connection pool,
        # so it is made again here with the guard (and httpx's default limits and CA bundle).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=_ssl_context(),
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0,
            network_backend=GuardedBackend(allowed))
