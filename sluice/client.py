"""A typed asyncio client for a Sluice worker's gRPC API (``sluice.v1.Worker`` and health).

Notes: docs/shared.md."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.status import ErrorDetails
from sluice.status import WorkerCallError as WorkerCallError  # its home is sluice.status
from sluice.streams import EventCall, StreamsChannel
from sluice.v1 import worker_pb2, worker_pb2_grpc

WORKER_SERVICE = "sluice.v1.Worker"
ReplyT = TypeVar("ReplyT", bound=Message)
# Largest gRPC message either side accepts. A request carries a whole prompt
# (the edge accepts 4 MiB bodies, and a token-id prompt is larger on the wire
# than as JSON digits); a response event is small, except a `started` that
# echoes the prompt. 16 MiB leaves room for both; the gRPC default (4 MiB
# received) would refuse the largest requests the edge accepts.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# The recommended client channel settings. Why each one:
# - keepalive pings every 20 s, and a connection whose ping is not answered in
#   10 s is closed: a worker that vanished without a FIN/RST (node lost, network
#   partition) is noticed in about 30 s instead of the kernel's TCP timeout
#   (minutes), and its open streams fail instead of hanging;
# - pings are also sent with no call open (permit_without_calls) and without
#   data in between (max_pings_without_data = 0: unlimited), so an idle
#   channel is known to be dead before the next request is sent on it. The
#   worker's server settings (worker/server.py) permit exactly this;
# - reconnect backoff capped at 5 s (gRPC's default grows to 120 s): a worker
#   restarted on the same address is reconnected within seconds (the edge's
#   pool goes further: it replaces a channel that is backing off at each
#   re-check of an ejected worker, see edge/workers/pool.py);
# - a channel of its own (local subchannel pool): by default gRPC shares one
#   connection, and its backoff state, between channels with the same address
#   and settings, so a fresh channel would inherit the old one's backoff;
# - message sizes: see MAX_MESSAGE_BYTES;
# - a small receive window per call (STREAM_WINDOW_BYTES, and no BDP probing,
#   which would grow it): a caller that reads slower than the worker
#   generates stops the worker's sends after that many unread bytes, and the
#   worker then merges the tokens of the steps it could not send into one
#   message (worker/engine/core.py). gRPC's default window (64 KiB, grown by the
#   probe) holds a whole stream of small token messages (about 15 bytes each),
#   so without this a lagging caller read one message per token out of its
#   own buffers. A message larger than the window still arrives whole: gRPC
#   opens the window as far as the message being read needs.
# Connection age is a server setting (worker/server.py): workers close each
# connection after a few minutes, so clients that resolve a DNS name
# re-resolve and spread over new replicas.
# Unread bytes of one call the worker may send ahead of the caller (see above).
STREAM_WINDOW_BYTES = 256
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
)

# The multiplexed call's channel (sluice/streams.py): the same settings but gRPC's own window and
# its probing. Credit holds back each stream there; a 256-byte window would make every message,
# which carries a step of all the streams, wait for the caller to open the window first.
STREAMS_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = tuple(
    option
    for option in CHANNEL_OPTIONS
    if option[0] not in ("grpc.http2.bdp_probe", "grpc.http2.lookahead_bytes")
)

# How long the ListModels that learns whether a worker serves GenerateStreams may take; the
# requests opened meanwhile wait for it (then go as Generate calls, should it fail).
PROBE_TIMEOUT_S = 5.0

Metadata = Sequence[tuple[str, str | bytes]]


class ServingStatus(enum.StrEnum):
    """A grpc.health.v1 answer (the names of ``HealthCheckResponse.ServingStatus``)."""

    UNKNOWN = "UNKNOWN"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"


def _locally_cancelled() -> WorkerCallError:
    return WorkerCallError(ErrorDetails(grpc.StatusCode.CANCELLED, "the call was cancelled by this client"))


class GenerateCall:
    """One open ``Generate`` call: an async iterator of ``GenerateResponse`` events.

    Iterate it (or :meth:`read` it) once. Iteration ends when the call ends
    OK and raises :class:`WorkerCallError` when it fails; reading after
    :meth:`cancel` raises ``WorkerCallError`` with ``CANCELLED``. A task
    cancelled while reading cancels the call and re-raises the cancellation.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def read(self) -> worker_pb2.GenerateResponse | None:
        """The next event, or ``None`` once the call ended OK."""
        try:
            event = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise WorkerCallError.from_rpc_error(error) from None
        except asyncio.CancelledError:
            self._call.cancel()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller is being cancelled: let it
            # grpc raises CancelledError on reads of a call this side cancelled.
            raise _locally_cancelled() from None
        if event is grpc.aio.EOF:
            return None
        return cast(worker_pb2.GenerateResponse, event)  # grpc's read() is untyped

    def __aiter__(self) -> GenerateCall:
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        event = await self.read()
        if event is None:
            raise StopAsyncIteration
        return event

    def cancel(self) -> bool:
        """Cancels the call on the worker; idempotent. False if it had already ended."""
        return bool(self._call.cancel())

    def done(self) -> bool:
        """True once the call ended (OK, failed or cancelled)."""
        return bool(self._call.done())

    async def aclose(self) -> None:
        """Cancels the call (the async-generator-style way to stop early)."""
        self.cancel()

    async def __aenter__(self) -> GenerateCall:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()

    def __del__(self) -> None:
        # A caller that dropped the call (`break` out of `async for client.generate(...)`)
        # is done with it. grpc's own call object sits in a reference cycle and would
        # only be cancelled whenever the cycle collector runs; this object is freed at once.
        call = getattr(self, "_call", None)
        if call is not None and not call.done():
            with contextlib.suppress(Exception):  # e.g. the loop already closed at exit
                call.cancel()


class WorkerClient:
    """A channel to one worker and its typed calls; ``async with`` it, or :meth:`close` it.

    ``address`` is anything ``grpc.aio.insecure_channel`` takes
    (``host:port``, ``dns:///name:port``...); ``options`` are channel
    arguments (default :data:`CHANNEL_OPTIONS`). ``streams_connections``: how many connections
    (each with its own multiplexed call) :meth:`open_stream` spreads requests over, in turn: a
    worker with several serving processes (``--api-server-count``) gets each connection in one.
    """

    def __init__(
        self,
        address: str,
        *,
        options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
        streams_connections: int = 1,
    ) -> None:
        if not address or not address.strip():
            raise ValueError("WorkerClient: address must be a non-empty host:port")
        if streams_connections < 1:
            raise ValueError(f"WorkerClient: streams_connections must be >= 1, got {streams_connections}")
        self.address = address
        self._options = tuple(options)
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._streams_connections = streams_connections
        self._streams: list[StreamsChannel] = []
        self._turn = itertools.count()
        self._streams_channels: dict[int, grpc.aio.Channel] = {}  # the multiplexed calls' own

    def _connect(self) -> tuple[worker_pb2_grpc.WorkerStub, health_pb2_grpc.HealthStub]:
        if self._stub is None or self._health is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub, self._health

    def connect(self) -> None:
        """Creates the channel (if needed) and starts connecting; never waits, never raises
        for an unreachable worker. Must run inside the event loop that will use the client."""
        self._connect()
        assert self._channel is not None  # set by _connect
        self._channel.get_state(try_to_connect=True)

    def generate(
        self,
        request: worker_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        wait_for_ready: bool = False,
    ) -> GenerateCall:
        """Starts ``Generate``; iterate the result for events (see :class:`GenerateCall`).

        ``timeout``: the call's deadline in seconds (None: none). ``metadata``:
        call metadata, e.g. ``[("x-request-id", "...")]``. ``wait_for_ready``:
        wait for the channel to connect instead of failing at once with
        ``UNAVAILABLE`` while the worker is unreachable.
        """
        if timeout is not None and not timeout > 0:
            raise ValueError(f"generate: timeout must be > 0 seconds or None, got {timeout}")
        stub, _ = self._connect()
        call = stub.Generate(
            request, timeout=timeout, metadata=tuple(metadata), wait_for_ready=wait_for_ready
        )
        return GenerateCall(call)

    def open_stream(
        self, request: worker_pb2.GenerateRequest, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> EventCall:
        """Starts ``request`` on this client's multiplexed ``GenerateStreams`` call (the faster
        path for many concurrent requests, :mod:`sluice.streams`): its call reads like
        :meth:`generate`'s. A worker that does not serve ``GenerateStreams`` gets ``Generate``
        calls instead. ``metadata``: its string values travel with the request."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"open_stream: timeout must be > 0 seconds or None, got {timeout}")
        if not self._streams:
            self._streams = [
                StreamsChannel(
                    functools.partial(self._streams_stub, index),
                    lambda request, timeout, metadata: self.generate(
                        request, timeout=timeout, metadata=metadata
                    ),
                    self._serves_streams,
                )
                for index in range(self._streams_connections)
            ]
        return self._streams[next(self._turn) % len(self._streams)].open(request, timeout, metadata)

    async def _serves_streams(self) -> bool:
        """Whether the worker serves ``GenerateStreams``, as its ListModels answer says (False
        from an older worker or another server of the contract)."""
        return (await self.list_models(timeout=PROBE_TIMEOUT_S)).generate_streams

    async def list_models(
        self,
        *,
        # The gRPC deadline the worker sees (grpc's own name for it), not a local wait.
        timeout: float | None = 10.0,  # noqa: ASYNC109
    ) -> worker_pb2.ListModelsResponse:
        """The worker's model and id; raises :class:`WorkerCallError`."""
        request = worker_pb2.ListModelsRequest()
        return await self._unary("ListModels", request, worker_pb2.ListModelsResponse, timeout)

    async def embed(
        self,
        request: worker_pb2.EmbedRequest,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline, as for list_models)
        metadata: Metadata = (),
    ) -> worker_pb2.EmbedResponse:
        """``Embed``: one vector per input; raises :class:`WorkerCallError`."""
        return await self._unary("Embed", request, worker_pb2.EmbedResponse, timeout, metadata)

    async def score(
        self,
        request: worker_pb2.ScoreRequest,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline, as for list_models)
        metadata: Metadata = (),
    ) -> worker_pb2.ScoreResponse:
        """``Score``: one score per pair; raises :class:`WorkerCallError`."""
        return await self._unary("Score", request, worker_pb2.ScoreResponse, timeout, metadata)

    async def tokenize(
        self,
        request: worker_pb2.TokenizeRequest,
        *,
        timeout: float | None = 10.0,  # noqa: ASYNC109 (a gRPC deadline, as for list_models)
        metadata: Metadata = (),
    ) -> worker_pb2.TokenizeResponse:
        """The ids of a prompt or a rendered chat; raises :class:`WorkerCallError`."""
        return await self._unary("Tokenize", request, worker_pb2.TokenizeResponse, timeout, metadata)

    async def detokenize(
        self,
        request: worker_pb2.DetokenizeRequest,
        *,
        timeout: float | None = 10.0,  # noqa: ASYNC109 (a gRPC deadline, as for list_models)
        metadata: Metadata = (),
    ) -> worker_pb2.DetokenizeResponse:
        """The text of token ids; raises :class:`WorkerCallError`."""
        return await self._unary("Detokenize", request, worker_pb2.DetokenizeResponse, timeout, metadata)

    async def lora_adapter(
        self,
        request: worker_pb2.LoadLoraAdapterRequest | worker_pb2.UnloadLoraAdapterRequest,
        *,
        timeout: float | None = 60.0,  # noqa: ASYNC109 (a gRPC deadline, as for list_models)
    ) -> worker_pb2.LoraAdapterResponse:
        """``LoadLoraAdapter`` or ``UnloadLoraAdapter`` (by the request's type); raises
        :class:`WorkerCallError`."""
        rpc = (
            "LoadLoraAdapter"
            if isinstance(request, worker_pb2.LoadLoraAdapterRequest)
            else "UnloadLoraAdapter"
        )
        return await self._unary(rpc, request, worker_pb2.LoraAdapterResponse, timeout)

    async def _unary(
        self,
        rpc: str,
        request: Message,
        reply_type: type[ReplyT],
        timeout: float | None,  # noqa: ASYNC109 (a gRPC deadline)
        metadata: Metadata = (),
    ) -> ReplyT:
        """One unary call ``rpc`` (the stub's method name); raises :class:`WorkerCallError`."""
        stub, _ = self._connect()
        try:
            reply = await getattr(stub, rpc)(request, timeout=timeout, metadata=tuple(metadata))
        except grpc.aio.AioRpcError as error:
            raise WorkerCallError.from_rpc_error(error) from None
        assert isinstance(reply, reply_type)  # narrows grpc's untyped result
        return reply

    async def health(
        self,
        service: str = WORKER_SERVICE,
        *,
        timeout: float | None = 5.0,  # noqa: ASYNC109 (a gRPC deadline, as for list_models)
    ) -> ServingStatus:
        """grpc.health.v1 ``Check`` of ``service`` (``""``: the whole server).

        Raises :class:`WorkerCallError`: ``UNAVAILABLE`` when unreachable,
        ``NOT_FOUND`` when the server does not know ``service``.
        """
        _, health = self._connect()
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise WorkerCallError.from_rpc_error(error) from None
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return ServingStatus(name) if name in ServingStatus.__members__ else ServingStatus.UNKNOWN

    def backing_off(self) -> bool:
        """True while the channel waits out gRPC's reconnect backoff after a failed connection
        (``TRANSIENT_FAILURE``): calls fail at once with UNAVAILABLE until its next attempt."""
        channel = self._channel
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def _streams_stub(self, index: int) -> worker_pb2_grpc.WorkerStub:
        """A stub on the ``index``-th multiplexed call's channel (:data:`STREAMS_CHANNEL_OPTIONS`,
        its own connection), made on first use; the client's own options when they are not the
        defaults."""
        if index not in self._streams_channels:
            options = STREAMS_CHANNEL_OPTIONS if self._options == CHANNEL_OPTIONS else self._options
            self._streams_channels[index] = grpc.aio.insecure_channel(self.address, options=options)
        return worker_pb2_grpc.WorkerStub(self._streams_channels[index])

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel; calls still open are cancelled (after ``grace`` seconds if given).
        Idempotent; the client reconnects if used again."""
        channel, self._channel, self._stub, self._health = self._channel, None, None, None
        streams, self._streams = self._streams, []
        for one in streams:
            one.close()
        channels, self._streams_channels = self._streams_channels, {}
        for streams_channel in channels.values():
            await streams_channel.close(grace=grace)
        if channel is not None:
            await channel.close(grace=grace)

    async def __aenter__(self) -> WorkerClient:
        self._connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
