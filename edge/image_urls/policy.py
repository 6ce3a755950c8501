"""Which addresses the edge may fetch an image from: public unicast ones only, so that an image URL
cannot make the edge reach loopback, private, link-local (cloud metadata) or other internal services.
Design notes: docs/edge-internals.md, "Images"."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Special-purpose IPv4 blocks (IANA's registry) that Python's ``is_global`` lets through here.
_NOT_PUBLIC_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "100.64.0.0/10",  # carrier-grade NAT (also Alibaba's metadata address 100.100.100.200)
        "192.0.0.0/24",  # IETF protocol assignments
        "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
        "198.18.0.0/15",  # benchmarking
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the broadcast address
    )
)
# IPv6 prefixes that embed an IPv4 address, which decides for them.
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


def is_public_address(ip: IPAddress) -> bool:
    """Whether ``ip`` is a public unicast address: not loopback, private, link-local, shared (CGN),
    multicast, reserved, unspecified or documentation; an IPv6 address that carries an IPv4 one
    (mapped ``::ffff:a.b.c.d``, NAT64, 6to4) is judged by that IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_v4(ip)
        if embedded is not None:
            return is_public_address(embedded)
        if ip.teredo is not None or ip.is_site_local:
            return False
    elif any(ip in network for network in _NOT_PUBLIC_V4):
        return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in network for network in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def parse_address(text: str) -> IPAddress:
    """An address as ``getaddrinfo`` gives it (an IPv6 scope ``%eth0`` dropped); ValueError if bad."""
    return ipaddress.ip_address(text.split("%", 1)[0])
