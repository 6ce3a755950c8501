"""worker/metrics.py: one engine snapshot rendered by prometheus_client, under Sluice's names,
the endpoint picker's default (vLLM) names, or both; parsed back with the library's own parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.prometheus import Histogram
from worker.engine.class_stats import MAX_CLASSES, ClassStats
from worker.engine.stats import EngineCounters, EngineStats
from worker.metrics import MetricNames, render
from worker.types import Scheduling

PICKER_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def _stats() -> EngineStats:
    ttft = Histogram()
    ttft.observe(0.03)
    ttft.observe(7.0)
    counters = EngineCounters(
        requests_submitted=5,
        generated_tokens=40,
        steps=12,
        preemptions=2,
        speculative_proposed_tokens=9,
        speculative_accepted_tokens=6,
        speculative_paused_rows=1,
        time_to_first_token=ttft,
    )
    return EngineStats(
        waiting_requests=3,
        running_requests=2,
        running_sequences=4,
        live_caches=4,
        cache_tokens=100,
        cache_bytes=4096,
        reserved_tokens=300,
        counters=counters,
        kv_block_size=16,
        kv_blocks_total=200,
        kv_blocks_used=50,
        speculative_proposer="ngram",
        state_cache_bytes=2048,
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_sluice_names_keep_their_names_labels_and_kinds():
    text = render(_stats(), "m")
    samples = _samples(text)
    model = (("model", "m"),)
    assert samples[("sluice_worker_queue_depth", model)] == 3
    assert samples[("sluice_worker_running_requests", model)] == 2
    assert samples[("sluice_worker_reserved_tokens", model)] == 300
    assert samples[("sluice_worker_state_cache_bytes", model)] == 2048
    assert samples[("sluice_worker_requests_submitted_total", model)] == 5
    assert samples[("sluice_worker_steps_total", model)] == 12
    assert samples[("sluice_worker_preemptions_total", model)] == 2
    proposer = (("model", "m"), ("proposer", "ngram"))
    assert samples[("sluice_worker_speculative_proposed_tokens_total", proposer)] == 9
    assert samples[("sluice_worker_speculative_accepted_tokens_total", proposer)] == 6
    assert samples[("sluice_worker_speculative_paused_rows_total", proposer)] == 1
    assert samples[("sluice_worker_kv_cache_usage_ratio", model)] == 0.25
    assert samples[("sluice_worker_kv_cache_blocks", model)] == 200
    assert samples[("sluice_worker_kv_cache_blocks_used", model)] == 50
    info = (("block_size", "16"), ("model", "m"), ("num_blocks", "200"))
    assert samples[("sluice_worker_kv_cache_config_info", info)] == 1
    assert samples[("sluice_worker_time_to_first_token_seconds_bucket", (("le", "0.05"), *model))] == 1
    assert samples[("sluice_worker_time_to_first_token_seconds_bucket", (("le", "+Inf"), *model))] == 2
    assert samples[("sluice_worker_time_to_first_token_seconds_count", model)] == 2
    assert "# TYPE sluice_worker_requests_submitted_total counter" in text
    assert "# TYPE sluice_worker_queue_depth gauge" in text
    assert not any(name.startswith("vllm:") for name, _ in samples)
    assert "sluice_worker_fake_tokens" not in text


def test_vllm_names_are_what_the_endpoint_picker_reads():
    samples = _samples(render(_stats(), "m", MetricNames.VLLM))
    model = (("model_name", "m"),)
    assert samples[("vllm:num_requests_waiting", model)] == 3
    assert samples[("vllm:num_requests_running", model)] == 2
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.25  # a fraction, as vLLM's is
    assert samples[("vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "200")))] == 1
    assert not any(name.startswith("sluice_") for name, _ in samples)


def test_vllm_lora_requests_info_names_running_and_waiting_adapters():
    from dataclasses import replace

    assert not any(
        name == "vllm:lora_requests_info" for name, _ in _samples(render(_stats(), "m", MetricNames.VLLM))
    )
    stats = replace(_stats(), max_loras=2, running_loras=("a", "b"), waiting_loras=("c",))
    samples = _samples(render(stats, "m", MetricNames.VLLM))
    labels = (("max_lora", "2"), ("running_lora_adapters", "a,b"), ("waiting_lora_adapters", "c"))
    assert samples[("vllm:lora_requests_info", labels)] > 1.7e9  # the scrape's time, as vLLM's


def test_both_gives_both_and_fake_workers_say_so():
    text = render(_stats(), "m", MetricNames.BOTH, fake_tokens=True)
    names = {name for name, _ in _samples(text)}
    assert {*PICKER_GAUGES, "vllm:cache_config_info", "sluice_worker_queue_depth"} <= names
    assert 'sluice_worker_fake_tokens{model="m"} 1.0' in text.splitlines()


def test_an_empty_cache_reports_zero_usage_and_label_values_are_escaped():
    stats = EngineStats(0, 0, 0, 0, 0, 0, 0, EngineCounters())
    samples = _samples(render(stats, 'a"b\\c', MetricNames.BOTH))
    assert samples[("vllm:kv_cache_usage_perc", (("model_name", 'a"b\\c'),))] == 0.0
    assert samples[("sluice_worker_kv_cache_usage_ratio", (("model", 'a"b\\c'),))] == 0.0
    # No --speculative: no speculation counters.
    assert not any(name.startswith("sluice_worker_speculative") for name, _ in samples)


@pytest.mark.parametrize("value", ["sluice", "vllm", "both"])
def test_every_setting_value_is_a_metric_names_choice(value):
    from worker.config import parse_config

    assert MetricNames(parse_config(["--metrics-names", value], environ={}).metrics_names) == value


def test_every_scrape_gets_an_answer():
    """200 with the exposition, 404 elsewhere, 503 while the model loads, and 500 (not a connection
    closed with no answer) when rendering fails."""
    import asyncio
    import socket

    from worker.metrics import serve_metrics

    def failing() -> str | None:
        raise RuntimeError("no stats")

    async def status(text, path: str = "/metrics") -> str:  # type: ignore[no-untyped-def]
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        server = await serve_metrics(listener, text)
        try:
            reader, writer = await asyncio.open_connection(*listener.getsockname())
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = await reader.read()
            writer.close()
            return answer.decode().split("\r\n", 1)[0]
        finally:
            server.close()

    async def scrapes() -> list[str]:
        return [
            await status(lambda: "up 1\n"),
            await status(lambda: "up 1\n", "/other"),
            await status(lambda: None),
            await status(failing),
        ]

    assert asyncio.run(scrapes()) == [
        "HTTP/1.1 200 OK",
        "HTTP/1.1 404 Not Found",
        "HTTP/1.1 503 Service Unavailable",
        "HTTP/1.1 500 Internal Server Error",
    ]


def test_scheduling_metrics_are_labelled_by_priority_and_tenant_within_a_bounded_set():
    classes = ClassStats()
    for tenant in range(MAX_CLASSES + 10):
        classes.observe_queue_wait(Scheduling(priority=1, tenant=f"t{tenant}"), 0.5)
    classes.observe_first_token(Scheduling(priority=-3), 0.2)
    classes.preempted("priority")
    classes.preempted("priority")
    classes.preempted("fairness")
    classes.deadline_refusals = 4
    stats = EngineStats(
        waiting_requests=0,
        running_requests=0,
        running_sequences=0,
        live_caches=0,
        cache_tokens=0,
        cache_bytes=0,
        reserved_tokens=0,
        counters=EngineCounters(),
        classes=classes,
    )
    samples = _samples(render(stats, "m"))
    waits = {labels for name, labels in samples if name == "sluice_worker_queue_wait_seconds_count"}
    assert len(waits) == MAX_CLASSES + 1  # the first pairs, then one "other"
    other = (("model", "m"), ("priority", "other"), ("tenant", "other"))
    assert samples[("sluice_worker_queue_wait_seconds_count", other)] == 10
    first = (("model", "m"), ("priority", "-3"), ("tenant", "default"))
    assert samples[("sluice_worker_class_time_to_first_token_seconds_sum", first)] == 0.2
    cause = lambda name: (("cause", name), ("model", "m"))  # noqa: E731
    assert samples[("sluice_worker_preemptions_by_cause_total", cause("priority"))] == 2
    assert samples[("sluice_worker_preemptions_by_cause_total", cause("fairness"))] == 1
    assert samples[("sluice_worker_preemptions_by_cause_total", cause("blocks"))] == 0
    assert samples[("sluice_worker_deadline_refusals_total", (("model", "m"),))] == 4
