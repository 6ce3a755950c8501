"""The edge's event loop choice (edge/event_loop.py): which loop each value runs.

The edge itself on uvloop (hypercorn, grpc.aio calls, the write timeout and the final abort,
which need the client's transport) is tested in test_edge_lifecycle.py on both loops, and every
integration test runs the edge process on uvloop, the default."""

from __future__ import annotations

import asyncio

import pytest

from edge import event_loop
from edge.streaming.connections import is_client_transport


def test_auto_picks_uvloop_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert event_loop.resolve("auto") == "uvloop"  # a project dependency
    assert event_loop.resolve("asyncio") == "asyncio"
    monkeypatch.setattr(event_loop, "uvloop_available", lambda: False)
    assert event_loop.resolve("auto") == "asyncio"
    assert event_loop.loop_factory("auto") is None
    with pytest.raises(ValueError, match="trio"):
        event_loop.resolve("trio")


LOOPS = [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]


@pytest.mark.parametrize(("choice", "kind"), LOOPS)
def test_run_uses_the_chosen_loop(choice: str, kind: str) -> None:
    async def which() -> str:
        return event_loop.running_kind()

    assert event_loop.run(which(), choice) == kind


def test_uvloop_transports_are_client_transports() -> None:
    async def body() -> bool:
        server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return is_client_transport(writer.transport) and not isinstance(
                writer.transport, asyncio.WriteTransport
            )
        finally:
            writer.close()
            server.close()

    assert event_loop.run(body(), "uvloop")
