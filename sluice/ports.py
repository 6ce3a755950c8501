"""Claiming listening ports at start, with one clear message when one is taken.

Notes: docs/shared.md."""

from __future__ import annotations

import errno
import socket

# The exit status of a service that cannot listen: the same as a bad setting (argparse's 2).
EXIT_PORT_TAKEN = 2
# Unless --metrics-port is set, a worker's /metrics listens on its gRPC port plus this: workers that
# differ only in --port (one per GPU on one host) get distinct metrics ports with no other
# setting, and the pair is easy to tell apart (50051 -> 51051, 50052 -> 51052). Here, not in
# worker/config.py, because ``sluice serve`` checks that port before it starts the worker.
METRICS_PORT_OFFSET = 1000


class PortUnavailableError(Exception):
    """A port could not be claimed; ``message`` is the one line to log (names the setting)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _family_and_host(host: str) -> tuple[socket.AddressFamily, str]:
    bare = host.removeprefix("[").removesuffix("]")
    return (socket.AF_INET6 if ":" in bare else socket.AF_INET), bare


def claim_port(host: str, port: int, setting: str, *, host_setting: str = "--host") -> socket.socket:
    """A listening TCP socket on ``host:port`` (non-blocking, ready for asyncio).

    ``setting`` is the flag that chose the port (``--metrics-port``), named in the
    message of the :class:`PortUnavailableError` raised when the port is taken or
    ``host`` is not an address of this machine (``host_setting`` is then named).
    """
    family, bare = _family_and_host(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Lets a restarted service take its port back from connections in TIME_WAIT; it does
        # not let two live listeners share a port (that is SO_REUSEPORT, never set here).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as error:
        sock.close()
        raise PortUnavailableError(_explain(error, host, port, setting, host_setting)) from None
    return sock


def check_port_free(host: str, port: int, setting: str, *, host_setting: str = "--host") -> None:
    """Raises :class:`PortUnavailableError` if ``host:port`` cannot be claimed now; frees it again.

    For a server that binds the port itself (gRPC, hypercorn): call this right before it
    binds, so a taken port is reported by name instead of by the server's own error.
    """
    claim_port(host, port, setting, host_setting=host_setting).close()


def _explain(error: OSError, host: str, port: int, setting: str, host_setting: str) -> str:
    if error.errno == errno.EADDRINUSE:
        return (
            f"{setting} {port} is in use on {host}: another process listens there; "
            f"stop it or choose another {setting}"
        )
    if error.errno == errno.EACCES:
        return f"{setting} {port}: permission denied on {host} (ports below 1024 need privileges)"
    if error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(error, socket.gaierror):
        return f"{host_setting} {host} is not an address of this machine (cannot listen for {setting} {port})"
    return f"cannot listen on {host}:{port} ({setting}): {error.strerror or error}"
