"""The edge's worker pool: where a call may go (the best available worker: fewest outstanding calls,
round-robin ties, or the routing policy's pick) and what each call tells about its worker; plus the
fleet-wide queries (models, health) and the one-message calls. A ``Generate`` call's attempts are
:mod:`edge.workers.call`'s. docs/edge-internals.md, "The worker pool".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from edge.errors import EdgeError, InvalidRequestError, NotFoundError, ServiceUnavailableError, from_grpc
from edge.workers.addresses import resolve
from edge.workers.failures import RETRY_ELSEWHERE
from edge.workers.health import HealthChecks
from edge.workers.membership import ClientFactory, Resolver
from edge.workers.routing import PrefixAffinity, PrefixBlock, RoutingPolicy, prefix_blocks
from edge.workers.worker import ModelListing, Worker, WorkerHealth, WorkerStatus
from sluice.client import WorkerCallError, WorkerClient
from sluice.streams import EventCall
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")

# The worker tasks (ModelInfo.task, the worker's --task) that serve each pooled call.
# The tasks whose workers answer each one-message call (tokenizing needs only the model's tokenizer).
POOLED_TASKS = {
    "embed": ("embed",),
    "score": ("embed", "score"),
    "tokenize": ("generate", "embed", "score"),
}
_Reply = TypeVar("_Reply")


@dataclass(frozen=True)
class Placement:
    """Where a ``Generate`` call may go: the workers to try, best first, and the request's prompt
    blocks (what the routing policy records for the worker that takes it)."""

    workers: list[Worker]
    blocks: list[PrefixBlock]


class WorkerPool(HealthChecks):
    """The workers of one edge process. Use inside one event loop; ``close()`` at shutdown.

    ``addresses``: static ``host:port`` workers. ``dns_name``: a ``host:port``
    re-resolved every ``dns_refresh_interval_s``. At least one of the two is
    required. ``routing``: how a worker is chosen (:mod:`edge.workers.routing`).
    ``multiplexed``: streams go on each worker's one ``GenerateStreams`` call
    (``WorkerClient.open_stream``) instead of a ``Generate`` call each.
    ``client_factory`` and ``resolver`` exist for tests.
    """

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        connect_timeout_s: float,
        health_timeout_s: float,
        health_interval_s: float = 5.0,
        dns_name: str | None = None,
        dns_refresh_interval_s: float = 10.0,
        client_factory: ClientFactory = WorkerClient,
        resolver: Resolver = resolve,
        routing: RoutingPolicy = RoutingPolicy.LEAST_OUTSTANDING,
        multiplexed: bool = False,
    ) -> None:
        super().__init__(
            addresses,
            health_timeout_s=health_timeout_s,
            health_interval_s=health_interval_s,
            dns_name=dns_name,
            dns_refresh_interval_s=dns_refresh_interval_s,
            client_factory=client_factory,
            resolver=resolver,
        )
        self._rotation = itertools.count()
        self._affinity = PrefixAffinity() if routing == RoutingPolicy.PREFIX_AFFINITY else None
        self._connect_timeout_s = connect_timeout_s
        self._multiplexed = multiplexed

    def _candidates(self, preferred: str | None = None) -> list[Worker]:
        """The available workers, best first: ``preferred`` (the routing policy's pick), then
        fewest outstanding calls, then round-robin."""
        workers = [w for w in self._workers.values() if w.available]
        if not workers:
            return []
        # The round-robin turns only for requests that the load decides: were it to turn for
        # every request, requests placed by affinity would skew which worker the next new
        # conversation gets (four turns per conversation on two workers: always the same one).
        start = next(self._rotation) if preferred is None else 0
        order = {id(w): (i - start) % len(workers) for i, w in enumerate(workers)}
        return sorted(workers, key=lambda w: (w.address != preferred, w.outstanding, order[id(w)]))

    def _holding(self, model: str) -> list[Worker]:
        """The available workers whose listing has ``model`` as a LoRA adapter (``parent`` set);
        none for a base model's name or a name no listing has."""
        return [
            w
            for w in self._workers.values()
            if w.available and any(m.id == model and m.parent for m in w.models or ())
        ]

    def _loading_candidates(self) -> list[Worker]:
        """The workers still loading their model: furthest along first, then fewest calls."""
        loading = [w for w in self._workers.values() if not w.removed and w.status == WorkerStatus.LOADING]
        return sorted(loading, key=lambda w: (-(w.load_fraction or 0.0), w.outstanding))

    @property
    def connect_timeout_s(self) -> float:
        """How long a worker may take to accept a call (send its first event) before it is ejected."""
        return self._connect_timeout_s

    async def place(self, request: worker_pb2.GenerateRequest) -> Placement:
        """The workers to try for ``request``, best first (:meth:`_candidates`, with the routing
        policy's pick), leaving out those known to serve only embeddings or scores.

        When no worker serves and ``request.model_load_wait_seconds`` is positive, the workers
        still loading their model (LOADING) are the candidates instead: such a worker holds the
        call until its model is loaded (at most that long), sending MODEL_LOAD progress events.
        Raises :class:`ServiceUnavailableError` (503, ``Retry-After``) when no worker is available,
        400 when the available ones serve only other tasks.
        """
        self._ensure_started()
        if self._dns is not None and not self._workers:
            await self.wait_first_round()  # first requests after start-up, before DNS answered
        blocks = prefix_blocks(request) if self._affinity is not None else []
        holding = self._holding(request.model)
        preferred = None
        if self._affinity is not None:
            load = {w.address: w.outstanding for w in holding or self._workers.values() if w.available}
            preferred = self._affinity.choose(blocks, load)
        candidates = self._candidates(preferred)
        if holding:  # a LoRA adapter's request: the workers that have it loaded first
            candidates.sort(key=lambda w: w not in holding)
        # Workers known (from their ListModels answers) to serve only embeddings or scores are
        # left out; workers not asked yet stay in (their refusal names their task).
        generating = [w for w in candidates if w.models is None or w.serves("", ("generate",))]
        if candidates and not generating:
            raise self._no_task("generate", request.model, ("generate",), candidates)
        candidates = generating
        if not candidates and request.model_load_wait_seconds > 0:
            candidates = self._loading_candidates()
        if not candidates:
            raise self._none_available()
        return Placement(candidates, blocks)

    def dial(
        self,
        worker: Worker,
        request: worker_pb2.GenerateRequest,
        timeout_s: float,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> EventCall:
        """Starts ``request`` on ``worker`` (on its multiplexed call, or as a ``Generate`` call),
        taking one of its outstanding slots: :meth:`release` it once the call ended."""
        worker.outstanding += 1
        if self._multiplexed:
            return worker.client.open_stream(request, timeout=timeout_s, metadata=metadata)
        return worker.client.generate(request, timeout=timeout_s, metadata=metadata)

    def accepted(self, worker: Worker, first: worker_pb2.GenerateResponse, placement: Placement) -> None:
        """``worker`` took a call placed by ``placement`` (its first event is ``first``): learn its
        id, take it back if it was loading, and let the routing policy remember it."""
        if first.WhichOneof("event") == "started":
            if first.started.worker_id:
                worker.worker_id = first.started.worker_id
            if worker.status == WorkerStatus.LOADING:
                self._restore(worker)  # it answered a call: its model is loaded
        if self._affinity is not None:
            self._affinity.record(placement.blocks, worker.address)

    def too_slow(self, worker: Worker) -> None:
        """``worker`` did not accept a call within :attr:`connect_timeout_s`: it is ejected."""
        self._eject(worker, WorkerStatus.UNREACHABLE, "did not accept a call in time")

    async def pooled(
        self,
        call: str,
        model: str,
        send: Callable[[WorkerClient, float], Awaitable[_Reply]],
        timeout_s: float,
    ) -> tuple[_Reply, Worker]:
        """A one-message call (``call``: "embed", "score" or "tokenize", see :data:`POOLED_TASKS`) on the best
        worker that serves ``model`` for it: ``send(client, remaining seconds)`` makes the call. The
        workers' tasks come from their ListModels answers (asked here for the ones not asked yet).

        Raises 404 ``model_not_found`` when no worker serves ``model``, 400 naming ``model`` when
        none serves it for ``call``, 503 when none is available, the worker's mapped error otherwise
        (after trying the next worker for UNAVAILABLE and RESOURCE_EXHAUSTED).
        """
        self._ensure_started()
        if self._dns is not None and not self._workers:
            await self.wait_first_round()
        deadline = time.monotonic() + timeout_s
        candidates = self._candidates()
        if not candidates:
            raise self._none_available()
        unknown = [w for w in candidates if w.models is None]
        if unknown:
            await self._learn_models(unknown)
        tasks = POOLED_TASKS[call]
        serving = [w for w in candidates if w.serves(model, tasks)]
        if not serving:
            raise self._no_task(call, model, tasks, candidates)
        last_error: EdgeError | None = None
        for worker in serving:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not worker.available:
                continue
            worker.outstanding += 1
            try:
                reply = await send(worker.client, remaining)
            except WorkerCallError as error:
                self.note_call_failure(worker, error)
                last_error = from_grpc(error)
                last_error.worker_id = worker.worker_id
                if error.code() in RETRY_ELSEWHERE:
                    continue
                raise last_error from None
            finally:
                self.release(worker)
            self.note_call_success(worker)
            return reply, worker
        raise last_error or ServiceUnavailableError(
            "The request timed out before a worker could take it.", retry_after=1.0
        )

    async def accepts_images(self, model: str) -> bool:
        """Whether ``model`` (any, when empty) takes images, as its generating workers' ListModels
        answers say (``accepts_images``). False only when workers known to serve it all say no;
        True when none is known to (the call itself then fails as it would without images: 404, 503)."""
        served = await self._generating(model)
        return not served or any(m.accepts_images for m in served)

    async def most_choices(self, model: str) -> int | None:
        """The largest ``n`` a worker generating with ``model`` (any, when empty) serves, as their
        ListModels answers say (``max_n``: the contract's bound and their --max-running). None when
        none is known to serve it or one does not say (0: the worker then decides itself)."""
        served = await self._generating(model)
        if not served or any(m.max_n == 0 for m in served):
            return None
        return max(m.max_n for m in served)

    async def _generating(self, model: str) -> list[worker_pb2.ModelInfo]:
        """What the available workers say of ``model`` (any, when empty) where they generate with it
        (ListModels, asked here of the available workers not asked yet)."""
        self._ensure_started()
        if self._dns is not None and not self._workers:
            await self.wait_first_round()
        workers = [w for w in self._workers.values() if w.available]
        unknown = [w for w in workers if w.models is None]
        if unknown:
            await self._learn_models(unknown)
        return [
            m
            for w in workers
            for m in w.models or ()
            if (m.task or "generate") == "generate" and model in ("", m.id)
        ]

    async def _learn_models(self, workers: list[Worker]) -> None:
        """Asks each of ``workers`` what it serves (ListModels), at once; a worker that does not
        answer keeps ``models`` None and serves nothing here."""
        results = await asyncio.gather(
            *(w.client.list_models(timeout=self._health_timeout_s) for w in workers), return_exceptions=True
        )
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, WorkerCallError):
                self.note_call_failure(worker, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                worker.worker_id = result.worker_id or worker.worker_id
                worker.models = list(result.models)

    @staticmethod
    def _no_task(call: str, model: str, tasks: tuple[str, ...], workers: list[Worker]) -> EdgeError:
        served = {m.id: m.task or "generate" for w in workers for m in w.models or ()}
        if model and model not in served:
            return NotFoundError(
                f"The model '{model}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        what = {
            "generate": "generation",
            "embed": "embeddings",
            "score": "scores and reranking",
            "tokenize": "tokenizing",
        }[call]
        shown = ", ".join(f"'{name}' ({task})" for name, task in served.items()) or "none"
        return InvalidRequestError(
            f"No worker serves {f'the model {model!r}' if model else 'a model'} for {what}: that needs a "
            f"worker started with --task {' or '.join(tasks)}. Served: {shown}.",
            param="model",
            code="model_not_supported",
        )

    async def lora_adapter(
        self, request: worker_pb2.LoadLoraAdapterRequest | worker_pb2.UnloadLoraAdapterRequest
    ) -> list[str]:
        """Loads or unloads a LoRA adapter on every available generating worker at once, then asks
        them what they serve; the ids of the workers that did it. Raises the first worker's
        mapped error (an unload NOT_FOUND only when no worker had the adapter), 503 for none."""
        self._ensure_started()
        workers = [w for w in self._candidates() if w.models is None or w.serves("", ("generate",))]
        if not workers:
            raise self._none_available()
        results = await asyncio.gather(
            *(w.client.lora_adapter(request) for w in workers), return_exceptions=True
        )
        await self._learn_models(workers)
        done = [r.worker_id for r in results if isinstance(r, worker_pb2.LoraAdapterResponse)]
        for result in results:
            if isinstance(result, WorkerCallError):
                unload = isinstance(request, worker_pb2.UnloadLoraAdapterRequest)
                if unload and done and result.code() == grpc.StatusCode.NOT_FOUND:
                    continue
                raise from_grpc(result)
            if isinstance(result, BaseException):
                raise result
        return done

    async def learn_worker_id(self, worker: Worker) -> str | None:
        """The worker's id: known from an earlier answer, else asked with ListModels
        (only on error paths; ``None`` when it does not answer in time)."""
        if worker.worker_id is None:
            try:
                reply = await worker.client.list_models(timeout=self._health_timeout_s)
            except WorkerCallError:
                return None
            worker.worker_id = reply.worker_id or None
        return worker.worker_id

    async def list_models(self) -> ModelListing:
        """Every model any available worker serves, deduplicated by id, in worker order,
        with the ids of the workers that answered.

        Raises :class:`ServiceUnavailableError` when no worker answered.
        """
        self._ensure_started()
        if self._dns is not None and not self._workers:
            await self.wait_first_round()
        workers = [w for w in self._workers.values() if w.available]
        results = await asyncio.gather(
            *(w.client.list_models(timeout=self._health_timeout_s) for w in workers),
            return_exceptions=True,
        )
        models: dict[str, worker_pb2.ModelInfo] = {}
        answered: list[str] = []
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, WorkerCallError):
                    raise result
                log.info("ListModels on %s failed: %s", worker.address, result.code().name)
                self.note_call_failure(worker, result)
                continue
            worker.worker_id = result.worker_id or worker.worker_id
            worker.models = list(result.models)
            answered.append(worker.worker_id or "")
            for model in result.models:
                models.setdefault(model.id, model)
        if not answered:
            raise self._none_available()
        return ModelListing(list(models.values()), [i for i in dict.fromkeys(answered) if i])

    async def health(self) -> list[WorkerHealth]:
        """Every worker's state from the pool's own checks (after the first round of
        checks has run, bounded); never calls the workers itself."""
        await self.wait_first_round()
        return self.snapshot()
