"""Which engine URLs the control plane accepts at registration (it sends them its engine admin token and
every load body, so an engine URL must not be a way to reach anything else). An engine's inference URL
(`inference_url`: routers send it clients' requests and the engines' inference key) passes the same rules,
and a refusal names the field it is about.

Accepted: `http(s)://host[:port][/]` with no userinfo, query, fragment or further path. The host is a
canonical IPv4/IPv6 literal or an ASCII DNS name; refused by default: link-local addresses
(169.254.0.0/16, fe80::/10, where the cloud metadata services live), the other cloud-metadata
addresses and names, unspecified/multicast/broadcast addresses, and the odd spellings of addresses that
some resolvers accept (`0x7f.1`, `2130706433`, `127.1`, `0177.0.0.1`). An IPv6 address that carries an
IPv4 address (IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible `::a.b.c.d`, IPv4-translated
`::ffff:0:a.b.c.d`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002::/16`, Teredo) is refused
when the IPv4 address inside would be. With `allowed_networks` (CIDR) the address, or every address a
name resolves to, must lie in one of them.

A name is resolved at registration; it can resolve elsewhere later (DNS rebinding), so the same
address policy (`address_problem`) is applied again on every connection (control_plane.egress).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from urllib.parse import urlsplit

from shared.errors import InvalidRequestError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
RESOLVE_TIMEOUT_S = 2.0

_METADATA_NAMES = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
    "metadata.azure.internal", "metadata.platformequinix.com",
})
_METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "192.0.0.192", "fd00:ec2::254", "fd00:ec2::23",
))
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def _refuse(problem: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"engine {param} refused: {problem}", param=param, code="invalid_engine_url")


def parse_engine_url(url: str, param: str = "url") -> tuple[str, str]:
    """(normalized url without a trailing `/`, host) of an acceptable URL; raises a 400 naming the problem
    and the field (`param`) that holds it."""
    if any(not c.isprintable() or c.isspace() for c in url):
        raise _refuse("it contains whitespace or control characters", param)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _refuse(f"not a valid URL ({exc})", param) from None
    if parts.scheme.lower() not in ("http", "https"):
        raise _refuse("the scheme must be http or https", param)
    if "@" in parts.netloc:
        raise _refuse("it may not contain userinfo (user:password@)", param)
    if "?" in url or parts.query:
        raise _refuse("it may not contain a query (?…)", param)
    if "#" in url or parts.fragment:
        raise _refuse("it may not contain a fragment (#…)", param)
    if parts.path not in ("", "/"):
        raise _refuse("it may not have a path beyond `/` (the engine's routes are appended to it)", param)
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise _refuse("it has no host", param)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme.lower()}://{netloc}", host


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


_IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
# RFC 6052: where the 32 IPv4 bits sit for each NAT64 prefix length (bits 64..71 are always skipped).
_NAT64_LAYOUTS = {32: 32, 40: 40, 48: 48, 56: 56, 64: 72, 96: 96}


def _bits_at(value: int, start: int, count: int) -> int:
    return (value >> (128 - start - count)) & ((1 << count) - 1)


def _nat64_embedded(value: int, prefix_len: int) -> ipaddress.IPv4Address:
    start = _NAT64_LAYOUTS[prefix_len]
    if start >= 72 or start + 32 <= 64:
        return ipaddress.IPv4Address(_bits_at(value, start, 32))
    before = 64 - start  # the IPv4 bits are split around the reserved octet
    return ipaddress.IPv4Address((_bits_at(value, start, before) << (32 - before)) | _bits_at(value, 72, 32 - before))


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address can reach through a translator or tunnel (empty for a plain one)."""
    value, found = int(address), []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address in _IPV4_TRANSLATED or (address in _IPV4_COMPATIBLE and value > 1):  # `::` and `::1` are not
        found.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
    if address in _NAT64_WELL_KNOWN:
        found.append(_nat64_embedded(value, 96))
    if address in _NAT64_LOCAL:  # the operator picks the prefix length inside it: every layout counts
        found.extend(_nat64_embedded(value, n) for n in (48, 56, 64, 96))
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    return found


def address_problem(address: IPAddress, allowed: tuple[str, ...]) -> str | None:
    """Why the control plane must not call `address`, or None."""
    if isinstance(address, ipaddress.IPv6Address):
        for inner in embedded_ipv4(address):
            # an all-zero field is where one prefix layout finds nothing, not an address in disguise
            problem = None if inner.is_unspecified else _own_problem(inner, ())
            if problem is not None:
                return f"{address} embeds {problem}"
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
    return _own_problem(address, allowed)


def _own_problem(address: IPAddress, allowed: tuple[str, ...]) -> str | None:
    if address in _METADATA_ADDRESSES:
        return f"{address} is a cloud metadata address"
    if address.is_link_local:
        return f"{address} is link-local (where cloud metadata services answer)"
    if address.is_unspecified or address.is_multicast or str(address) == "255.255.255.255":
        return f"{address} is not a unicast address"
    if allowed and not any(address in ipaddress.ip_network(n) for n in allowed):
        return f"{address} is outside the allowed engine networks (LORAPLANE_ENGINE_ALLOWED_NETWORKS)"
    return None


def host_problem(host: str) -> str | None:
    """Why `host` (not an address literal) is not an acceptable DNS name, or None."""
    lowered = host.lower()
    if not host.isascii() or "%" in host:
        return "the host must be an IP address or an ASCII DNS name"
    try:
        socket.inet_aton(host)
    except OSError:
        pass
    else:  # accepted by inet_aton but not canonical dotted-quad: an address in disguise
        return f"{host!r} is an unusual spelling of an IPv4 address; write it as a dotted quad"
    labels = lowered.split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return f"{host!r} is not a valid DNS name"
    if labels[-1].isdigit() or labels[-1].startswith("0x"):
        return f"{host!r} looks like an address, not a DNS name"
    if lowered in _METADATA_NAMES:
        return f"{host!r} is a cloud metadata name"
    return None


async def check_engine_url(url: str, allowed: tuple[str, ...], param: str = "url") -> str:
    """The normalized URL when the control plane may call it; else a 400 naming the problem and `param`."""
    normalized, host = parse_engine_url(url, param)
    literal = _literal(host)
    if literal is not None:
        problem = address_problem(literal, allowed)
    else:
        problem = host_problem(host) or await _resolved_problem(host, allowed)
    if problem is not None:
        raise _refuse(problem, param)
    return normalized


async def _resolved_problem(host: str, allowed: tuple[str, ...]) -> str | None:
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        # Unresolvable now (maybe not yet in DNS): harmless without an allow-list, refused with one.
        return f"{host!r} does not resolve, so it cannot be checked against the allowed networks" if allowed else None
    for info in infos:
        address = _literal(str(info[4][0]).split("%")[0])
        problem = address and address_problem(address, allowed)
        if problem:
            return f"{host!r} resolves to {problem}"
    return None
