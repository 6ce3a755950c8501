"""Worker addresses: ``host:port`` parsing (the one parser, settings use it too), formatting,
and resolving a DNS name to every address behind it."""

from __future__ import annotations

import asyncio
import socket


def split_host_port(name: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``) → (host without brackets, port); ValueError if bad."""
    host, sep, port = name.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{name!r} is not host:port")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"{name!r} is not host:port (unbalanced IPv6 bracket)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name!r} is not host:port (invalid port)")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_address(ip: str, port: int) -> str:
    """An address gRPC accepts: IPv6 literals are bracketed."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), as sorted ``ip:port`` strings.
    Raises ``OSError`` (``socket.gaierror``) when the name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(str(info[4][0]), port) for info in infos})
