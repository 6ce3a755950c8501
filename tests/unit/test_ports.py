"""sluice.ports: claiming a port, and the one-line message when it cannot be claimed."""

from __future__ import annotations

import socket

import pytest

from sluice.ports import PortUnavailableError, check_port_free, claim_port


def test_a_claimed_port_is_held_until_closed_and_then_free_again() -> None:
    sock = claim_port("127.0.0.1", 0, "--port")
    port = sock.getsockname()[1]
    with pytest.raises(PortUnavailableError) as taken:
        check_port_free("127.0.0.1", port, "--metrics-port")
    assert taken.value.message.startswith(f"--metrics-port {port} is in use on 127.0.0.1")
    sock.close()
    check_port_free("127.0.0.1", port, "--metrics-port")


def test_a_port_held_by_another_listener_is_named() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(PortUnavailableError, match=f"^--port {port} is in use"):
            claim_port("127.0.0.1", port, "--port")


def test_an_address_that_is_not_this_machines_names_the_host_setting() -> None:
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    with pytest.raises(PortUnavailableError, match=r"--host 192\.0\.2\.1 is not an address of this machine"):
        claim_port("192.0.2.1", 0, "--port")


def test_no_reuseport_two_claims_cannot_share_a_port() -> None:
    first = claim_port("127.0.0.1", 0, "--port")
    try:
        assert not first.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
        with pytest.raises(PortUnavailableError):
            claim_port("127.0.0.1", first.getsockname()[1], "--port")
    finally:
        first.close()
