"""Which workers the pool has: the static ``--workers`` and the addresses a DNS name resolves
to (re-resolved on a schedule; an address that leaves is closed once its calls end; a failed
resolution keeps the current set)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from edge.workers.addresses import split_host_port
from edge.workers.worker import Worker, WorkerHealth, WorkerStatus
from sluice.client import WorkerClient

log = logging.getLogger("sluice.edge")

Resolver = Callable[[str, int], Awaitable[list[str]]]
ClientFactory = Callable[[str], WorkerClient]


class Membership:
    """The pool's workers by address; :meth:`apply_resolved` makes the DNS ones exactly a new answer."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        dns_name: str | None,
        dns_timeout_s: float,
        client_factory: ClientFactory,
        resolver: Resolver,
    ) -> None:
        if not addresses and not dns_name:
            raise ValueError("a worker pool needs at least one address or a DNS name")
        self._dns = split_host_port(dns_name) if dns_name else None
        self._dns_name = dns_name
        self._dns_timeout_s = dns_timeout_s
        self._client_factory = client_factory
        self._resolver = resolver
        self._workers: dict[str, Worker] = {}
        for address in dict.fromkeys(addresses):
            self._workers[address] = Worker(address, client_factory(address), static=True)
        self._wake: asyncio.Event | None = None

    @property
    def addresses(self) -> list[str]:
        """Every known worker address (static and resolved), removed ones included."""
        return list(self._workers)

    def outstanding(self) -> dict[str, int]:
        """Calls in flight per worker address."""
        return {w.address: w.outstanding for w in self._workers.values()}

    def snapshot(self) -> list[WorkerHealth]:
        """Every worker's state as of the last check or call, without asking anyone."""
        return [
            WorkerHealth(
                w.address,
                WorkerStatus.REMOVED if w.removed else w.status,
                w.outstanding,
                w.load_fraction if w.status == WorkerStatus.LOADING else None,
            )
            for w in self._workers.values()
        ]

    def release(self, worker: Worker) -> None:
        """A call on ``worker`` ended (called once per call by :class:`edge.workers.call.WorkerCall`)."""
        worker.outstanding -= 1
        if worker.removed and worker.outstanding == 0:
            self._poke()  # the loop closes its channel

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _refresh_dns(self) -> None:
        assert self._dns is not None  # only called with a DNS name
        host, port = self._dns
        try:
            async with asyncio.timeout(self._dns_timeout_s):
                resolved = await self._resolver(host, port)
        except (OSError, TimeoutError) as error:
            # Keep the workers we have: they are health-checked anyway.
            log.warning(
                "cannot resolve %s (%s); keeping %d workers", self._dns_name, error, len(self._workers)
            )
            return
        self.apply_resolved(resolved)

    def apply_resolved(self, resolved: Iterable[str]) -> None:
        """Makes the DNS workers exactly ``resolved``: new addresses are added (checked
        next), addresses gone are marked removed (no new calls; closed when idle)."""
        current = set(resolved)
        for address in sorted(current):
            worker = self._workers.get(address)
            if worker is None:
                self._workers[address] = Worker(address, self._client_factory(address), static=False)
                log.info("worker %s added (resolved from %s)", address, self._dns_name)
                self._poke()
            elif worker.removed:
                worker.removed = False
                worker.next_check_at = 0.0
                log.info("worker %s is back in %s", address, self._dns_name)
        for worker in self._workers.values():
            if not worker.static and not worker.removed and worker.address not in current:
                worker.removed = True
                log.info("worker %s left %s; closing it once its calls end", worker.address, self._dns_name)

    async def _close_removed(self) -> None:
        gone = [w for w in self._workers.values() if w.removed and w.outstanding <= 0]
        for worker in gone:
            del self._workers[worker.address]
        await asyncio.gather(*(w.client.close() for w in gone), return_exceptions=True)
