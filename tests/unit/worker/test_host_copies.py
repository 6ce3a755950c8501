"""The host tier's copies on CUDA's side stream (worker/attention/host_copies.py): ordered by fake
streams and events on CPU tensors (what waits on what, and the blocks' contents), and on CUDA
(make gpu-check) without a host synchronisation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from worker.attention.host_copies import Streams
from worker.attention.host_kv import HostKV
from worker.attention.kv_pool import KVPool, KVShape
from worker.engine.host_tier import Copy


class FakeEvent:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def record(self, stream: FakeStream) -> None:
        self.log.append(f"{self.name} recorded on {stream.name}")


class FakeStream:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


def fake_streams(log: list[str], host: list[HostKV]) -> Streams:
    """Streams that log what is recorded and awaited; the side stream, while current, logs the
    copies done so far by the number of host slots and device blocks that changed."""
    compute, side = FakeStream(log, "compute"), FakeStream(log, "side")
    events = iter(f"event {i}" for i in range(100))

    @contextlib.contextmanager
    def using(stream: FakeStream) -> Iterator[None]:
        before = [t.clone() for pair in host[0].pairs for t in pair]
        log.append(f"{stream.name} current")
        yield
        after = [t for pair in host[0].pairs for t in pair]
        changed = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        log.append(f"{stream.name} done ({changed} tensors changed)")

    return Streams(lambda: compute, side, lambda: FakeEvent(log, next(events)), using)  # type: ignore[arg-type,return-value]


def test_copies_run_on_the_side_stream_between_the_forwards_events() -> None:
    """The side stream starts after the forwards queued so far (the evicted blocks' last writes),
    copies in queue order (a slot written then read back in one run), and the next forward waits
    for the copies (a block brought back is whole; an evicted one is read before reuse)."""
    shape = KVShape.uniform(2, kv_heads=2, head_dim=32, dtype=torch.float32, cache="int8")
    pool = KVPool(shape, 4, 2, torch.device("cpu"))
    keys = torch.randn(8, 2, 32)
    for layer in pool.layers:
        layer.write(torch.arange(8), keys, -keys)
    log: list[str] = []
    holder: list[HostKV] = []
    host = HostKV(pool, 3, fake_streams(log, holder))
    holder.append(host)
    original = [device.clone() for device, _ in host.pairs]
    host.apply([Copy(True, 1, 2), Copy(False, 3, 2), Copy(True, 0, 0)])
    changed = 2 * len(host.pairs)  # every host tensor (slots 0 and 2) and every device one (block 3)
    assert log == [
        "event 0 recorded on compute",
        "side waits for event 0",
        "side current",
        f"side done ({changed} tensors changed)",
        "event 1 recorded on side",
        "compute waits for event 1",
    ]
    for (device, host_slots), before in zip(host.pairs, original, strict=True):
        assert torch.equal(device[3], before[1]) and torch.equal(host_slots[0], before[0])
    log.clear()
    host.apply([Copy(False, 1, 0)])
    assert log[0] == "event 2 recorded on compute" and log[-1] == "compute waits for event 3"
    for (device, _), before in zip(host.pairs, original, strict=True):
        assert torch.equal(device[1], before[0])


def test_the_cpu_copies_take_no_side_stream() -> None:
    pool = KVPool(KVShape.uniform(1, kv_heads=1, head_dim=8, dtype=torch.float32), 2, 2, torch.device("cpu"))
    assert HostKV(pool, 1).side is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check runs it)")
def test_on_cuda_the_copies_never_block_the_host_and_round_trip() -> None:
    """Real streams: an eviction, a forward-like overwrite of the freed block, the copy back into
    another block, all queued without a host synchronisation (torch's sync detector), then the
    contents once the device is done."""
    import warnings

    shape = KVShape.uniform(2, kv_heads=2, head_dim=64, dtype=torch.bfloat16, cache="int8")
    pool = KVPool(shape, 4, 16, torch.device("cuda"))
    keys = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16)
    for layer in pool.layers:
        layer.write(torch.arange(64, device="cuda"), keys, -keys)
    host = HostKV(pool, 2)
    assert host.side is not None and all(h.is_pinned() for _, h in host.pairs)
    original = [device.clone() for device, _ in host.pairs]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            host.apply([Copy(True, 1, 0)])
            for device, _ in host.pairs:
                device[1].fill_(0)  # the next forward reuses the evicted block
            host.apply([Copy(False, 2, 0)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [w for w in seen if "synchroniz" in str(w.message)]
    torch.cuda.synchronize()
    for (device, _), before in zip(host.pairs, original, strict=True):
        assert torch.equal(device[2], before[1]) and not device[1].any()
