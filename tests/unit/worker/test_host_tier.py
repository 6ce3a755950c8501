"""The prefix cache's host tier alone: evicted prefix blocks move to host slots (their children still
reachable), a hit brings them back with copies queued in order, slots are evicted LRU, no block or
slot leaks; the host memory's copies (worker/attention/host_kv.py) and the tier's metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker.attention.host_kv import HostKV
from worker.attention.kv_pool import KVPool, KVShape
from worker.engine.host_tier import Copy, HostTier, TierStats, tiered
from worker.engine.kv_blocks import BlockManager, SequenceBlocks
from worker.model.loader import ModelLoadError


def computed(blocks: BlockManager, tokens: list[int]) -> SequenceBlocks:
    """A sequence whose ``tokens`` were all computed (blocks taken, whole ones registered)."""
    seq = SequenceBlocks()
    assert blocks.ensure(seq, len(tokens))
    blocks.commit(seq, tokens, len(tokens))
    return seq


def tiered_manager(blocks: int, slots: int) -> BlockManager:
    manager = BlockManager(blocks, 2)
    manager.tier = HostTier(slots, block_bytes=10)
    return manager


def sound(blocks: BlockManager, *live: SequenceBlocks) -> None:
    assert blocks.audit(live) is None


def test_an_evicted_prefix_moves_to_the_host_and_a_hit_copies_it_back():
    blocks = tiered_manager(3, 8)
    tier = blocks.tier
    assert tier is not None
    prompt = [1, 2, 3, 4, 5]
    first = computed(blocks, prompt)
    kept = list(first.table[:2])
    blocks.free(first)
    tier.drain()
    other = computed(blocks, [7, 7, 7, 7, 7, 7])  # all three blocks: both prefix blocks evicted
    assert tier.used == 2 and blocks.cached_length(prompt) == 4  # still reachable, parent and child
    assert tier.drain() == [Copy(True, kept[1], 0), Copy(True, kept[0], 1)]  # the child went first
    sound(blocks, other)
    blocks.free(other)
    again = SequenceBlocks()
    assert blocks.attach_prefix(again, prompt) == 4
    back = tier.drain()
    assert [c.to_host for c in back].count(False) == 2
    assert [c.block for c in back if not c.to_host] == again.table
    assert tier.hits == 2 and tier.used == 0 + sum(c.to_host for c in back)
    stats = tier.stats()
    assert stats.bytes_to_device == 20 and stats.bytes_to_host >= 20
    sound(blocks, again)


def test_host_slots_are_evicted_least_recently_stored_first():
    blocks = tiered_manager(2, 2)
    prompts = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # one whole block each
    for prompt in prompts:
        blocks.free(computed(blocks, prompt))
        hog = SequenceBlocks()
        assert blocks.ensure(hog, 4)  # unregistered: the prompt's reusable block goes to the host
        blocks.free(hog)
    assert [blocks.cached_length(p) for p in prompts] == [0, 2, 2]  # the oldest slot went first
    sound(blocks)


def test_a_full_tier_without_evictable_slots_forgets_instead():
    blocks = tiered_manager(2, 1)
    tier = blocks.tier
    assert tier is not None
    a = computed(blocks, [1, 2, 3])
    blocks.free(a)
    hog = computed(blocks, [5, 5, 5, 5])  # [1, 2] and [5, 5] registered; [1, 2] went to the host
    assert blocks.cached_length([1, 2, 3]) == 2
    tier.pin(next(iter(tier._lru)))  # as a hit in progress does
    blocks.free(hog)
    blocks.allocate()  # a reusable block evicted while the only slot is pinned: forgotten, not moved
    assert tier.used == 1 and blocks.cached_length([5, 5, 5, 5, 5]) == 2


def test_recycled_host_slots_leak_no_block_and_no_slot():
    blocks = tiered_manager(3, 2)
    tier = blocks.tier
    assert tier is not None
    long = computed(blocks, [1, 2, 3, 4, 5])  # two blocks: [1, 2] -> [3, 4]
    blocks.free(long)
    for filler in ([6, 6, 6, 6, 6, 6], [8, 8, 8, 8, 8, 8]):
        seq = computed(blocks, filler)
        sound(blocks, seq)
        blocks.free(seq)
    assert blocks.cached_length([1, 2, 3, 4, 5]) == 0  # both slots recycled LRU: [1, 2] first
    sound(blocks)
    assert tier.used == 2 and blocks.available == 3


def test_a_hit_that_cannot_find_device_blocks_stops_at_the_device_part():
    blocks = tiered_manager(2, 4)
    prompt = [1, 2, 3]
    seq = computed(blocks, prompt)
    blocks.free(seq)
    hog = computed(blocks, [4, 4, 4, 4])  # holds both blocks; [1, 2] is on the host
    again = SequenceBlocks()
    assert blocks.attach_prefix(again, prompt) == 0 and again.table == []
    assert blocks.cached_length(prompt) == 2  # still on the host for later
    sound(blocks, hog)


def test_host_memory_copies_run_in_order_and_round_trip_an_int8_cache():
    shape = KVShape.uniform(2, kv_heads=2, head_dim=32, dtype=torch.float32, cache="int8")
    pool = KVPool(shape, 4, 2, torch.device("cpu"))
    host = HostKV(pool, 3)
    keys = torch.randn(8, 2, 32)
    for layer in pool.layers:
        layer.write(torch.arange(8), keys, -keys)
    before = [t.clone() for device, _ in host.pairs for t in (device,)]
    # block 1 -> slot 2, slot 2 -> block 3, then block 0 -> slot 2 (the last copy to slot 2 wins).
    host.apply([Copy(True, 1, 2), Copy(False, 3, 2), Copy(True, 2, 0), Copy(True, 0, 0)])
    for (device, _), original in zip(host.pairs, before, strict=True):
        assert torch.equal(device[3], original[1])
    host.apply([Copy(False, 1, 0)])
    for (device, _), original in zip(host.pairs, before, strict=True):
        assert torch.equal(device[1], original[0])
    assert host.block_bytes == shape.bytes_per_token * 2


def test_the_runner_wrapper_applies_queued_copies_before_the_forward():
    tier = HostTier(2, 1)
    order: list[str] = []
    run = tiered(
        lambda work: order.append(f"forward {work}"),
        tier,
        lambda copies: order.append(f"{len(copies)} copies"),
    )
    tier.store(5, block=3)
    run("a")
    run("b")
    assert order == ["1 copies", "forward a", "forward b"]


def test_the_metrics_show_the_tier():
    from worker import metrics
    from worker.engine.stats import EngineCounters, EngineStats

    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters(), host_tier=TierStats(8, 3, 5, 40, 20))
    text = metrics.render(stats, "m")
    for line in (
        'sluice_worker_kv_host_blocks{model="m"} 8.0',
        'sluice_worker_kv_host_blocks_used{model="m"} 3.0',
        'sluice_worker_kv_host_hits_total{model="m"} 5.0',
        'sluice_worker_kv_host_bytes_to_host_total{model="m"} 40.0',
        'sluice_worker_kv_host_bytes_to_device_total{model="m"} 20.0',
    ):
        assert line in text
    assert "kv_host" not in metrics.render(EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters()), "m")


def test_a_hybrid_model_is_refused_at_load_saying_why():
    """A hybrid model's prefix hit needs its recurrent state checkpoint too, which has no host copy:
    refused at load in one line (the engine process is refused at parsing: test_config.py)."""
    from worker.config import WorkerConfig
    from worker.server import host_tier

    with pytest.raises(ModelLoadError) as refused:
        host_tier(WorkerConfig(kv_offload_bytes=1 << 20), SimpleNamespace(states=object()))  # type: ignore[arg-type]
    assert refused.value.param == "kv_offload_bytes"
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("--kv-offload-bytes does not serve hybrid (recurrent-state) models")
    assert "state checkpoint, which has no host copy" in str(refused.value)


def test_auto_takes_the_smaller_of_llama_cpps_8_gib_and_a_quarter_of_available_memory():
    from worker.engine.host_tier import auto_offload_bytes

    assert auto_offload_bytes(None, 64 << 30)[0] == 8 << 30
    size, why = auto_offload_bytes(None, 10 << 30)
    assert size == (10 << 30) // 4 and why.startswith("2.50 GiB (the smaller of 8 GiB and a quarter")
    assert auto_offload_bytes(None, None) == (0, "off (the host's available memory is unknown)")
    assert auto_offload_bytes("a hybrid model", 64 << 30) == (0, "off (a hybrid model)")


def test_available_memory_comes_from_meminfo_without_psutil(tmp_path, monkeypatch):
    import sys

    from worker.engine.host_tier import available_host_bytes

    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_host_bytes(meminfo) == 8000000 * 1024
    assert available_host_bytes(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("flags", "device", "states", "want", "logged"),
    [
        ([], "cuda", None, 2 << 30, "2.00 GiB (the smaller of 8 GiB and a quarter of the host's 8.00"),
        ([], "cpu", None, 0, "off (the CPU: both tiers would be the same memory)"),
        ([], "cuda", object(), 0, "off (a hybrid model)"),
        (["--kv-offload-bytes", "0"], "cuda", None, 0, None),
        (["--kv-offload-bytes", "4096"], "cpu", None, 4096, None),
        (["--kv-offload-bytes", "auto", "--fake-tokens"], "cuda", None, 0, "off (--fake-tokens)"),
    ],
)
def test_the_setting_resolves_at_start_up_and_logs_auto(
    flags, device, states, want, logged, monkeypatch, caplog
):
    """``auto`` (the default): on CUDA from the host's memory (faked: 8 GiB available), off on the
    CPU and for hybrid models, logged; a number is taken as it is."""
    import logging

    from worker import server
    from worker.config import parse_config

    monkeypatch.setattr(server, "available_host_bytes", lambda: 8 << 30)
    config = parse_config(flags, environ={})
    runner = SimpleNamespace(device=torch.device(device), states=states)
    with caplog.at_level(logging.INFO, logger=server.log.name):
        assert server.offload_bytes(config, runner) == want  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if "--kv-offload-bytes auto" in r.getMessage()]
    assert len(lines) == (0 if logged is None else 1)
    assert logged is None or lines[0].startswith(f"KV host tier: --kv-offload-bytes auto: {logged}")
