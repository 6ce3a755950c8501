"""Ports on one host: workers side by side, and a taken port as one line and exit status 2.

Real worker, edge and ``sluice serve`` processes on 127.0.0.1 (workers and edges run to their exit
forked from the test zygote, as started ones are: tests/zygote.py). A taken port is held
by a plain listening socket in the test (or by the first worker). "Before the model
loads" is checked from the log: the process never logged that it started loading.
"""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tests.processes
from sluice.cli import edge_command, worker_command
from sluice.ports import METRICS_PORT_OFFSET
from tests.processes import EdgeProcess, WorkerProcess, free_port, free_port_pair, run_to_exit

pytestmark = pytest.mark.integration

EXIT_TIMEOUT_S = 120.0  # a bound for a hang, not a timing claim
# The workers that serve here run no model: the ports are claimed the same way.
FAKE = ["--fake-tokens"]


@pytest.fixture
def held_port() -> Iterator[tuple[socket.socket, int]]:
    """A port held by a listening socket, as another process would hold it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock, int(sock.getsockname()[1])


def assert_one_line_naming(output: str, expected: str) -> None:
    assert "Traceback" not in output, output
    assert "Event loop is closed" not in output, output
    errors = [line for line in output.splitlines() if "ERROR" in line or line.startswith("sluice:")]
    assert len(errors) == 1, output
    assert expected in errors[0], output
    # Claimed before the model: the worker never reached "loading model".
    assert "loading model" not in output, output


def test_two_workers_differing_only_in_port_both_serve_with_metrics(
    tiny_model_dir: Path, model_cache: Path, tmp_path: Path
) -> None:
    workers = []
    for name in ("gpu0", "gpu1"):
        (tmp_path / name).mkdir()
        workers.append(
            WorkerProcess(
                cache_dir=model_cache,
                log_dir=tmp_path / name,
                model=str(tiny_model_dir),
                extra=["--served-model-name", "tiny", *FAKE],
                default_metrics_port=True,
            )
        )
    first, second = workers
    # The two command lines differ only in the value of --port.
    differ = [i for i, (a, b) in enumerate(zip(first.args, second.args, strict=True)) if a != b]
    assert [first.args[i - 1] for i in differ] == ["--port"]
    assert "--metrics-port" not in first.args
    # least-outstanding: the same prompt four times must reach both workers (prefix affinity, the
    # default, would keep it on the worker that has it cached).
    routing = ["--routing", "least-outstanding"]
    with first, second, EdgeProcess([first.address, second.address], log_dir=tmp_path, extra=routing) as edge:
        for worker in workers:
            assert worker.metrics_port == worker.port + METRICS_PORT_OFFSET
            metrics = worker.metrics()
            assert metrics["sluice_worker_running_requests"] == 0
        served = set()
        with httpx.Client(base_url=edge.base_url, timeout=60) as client:
            for _ in range(4):
                response = client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                )
                assert response.status_code == 200, response.text
                served.add(response.headers["x-sluice-worker-id"])
        assert len(served) == 2, served
        assert sum(w.metrics()["sluice_worker_requests_finished_total"] for w in workers) == 4


def test_a_taken_grpc_port_is_one_line_and_status_2(
    held_port, tiny_model_dir: Path, model_cache: Path, tmp_path: Path
):
    _, port = held_port
    code, output = run_to_exit(
        worker_command(port, free_port(), "--model", str(tiny_model_dir), "--cache-dir", str(model_cache)),
        tmp_path,
        EXIT_TIMEOUT_S,
    )
    assert code == 2, output
    assert_one_line_naming(output, f"--port {port} is in use")


def test_a_taken_metrics_port_is_one_line_and_status_2(
    held_port, tiny_model_dir: Path, model_cache: Path, tmp_path: Path
):
    _, port = held_port
    code, output = run_to_exit(
        worker_command(free_port(), port, "--model", str(tiny_model_dir), "--cache-dir", str(model_cache)),
        tmp_path,
        EXIT_TIMEOUT_S,
    )
    assert code == 2, output
    assert_one_line_naming(output, f"--metrics-port {port} is in use")


def test_a_taken_default_metrics_port_says_where_it_came_from(
    tiny_model_dir: Path, model_cache: Path, tmp_path: Path
):
    grpc_port = free_port_pair(METRICS_PORT_OFFSET)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", grpc_port + METRICS_PORT_OFFSET))
        holder.listen()
        code, output = run_to_exit(
            worker_command(grpc_port, None, "--model", str(tiny_model_dir), "--cache-dir", str(model_cache)),
            tmp_path,
            EXIT_TIMEOUT_S,
        )
    assert code == 2, output
    assert_one_line_naming(output, f"--metrics-port {grpc_port + METRICS_PORT_OFFSET} is in use")
    assert f"--port + {METRICS_PORT_OFFSET}" in output


def test_a_second_worker_on_the_same_ports_exits_2_and_the_first_keeps_serving(
    tiny_model_dir: Path, model_cache: Path, tmp_path: Path
) -> None:
    with WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path,
        model=str(tiny_model_dir),
        extra=FAKE,
        default_metrics_port=True,
    ) as first:
        code, output = run_to_exit(first.args, tmp_path, EXIT_TIMEOUT_S)
        assert code == 2, output
        assert_one_line_naming(output, "is in use")
        assert first.ready()
        assert "sluice_worker_steps_total" in first.metrics()


def test_a_taken_edge_port_is_one_line_and_status_2(held_port, tmp_path: Path) -> None:
    _, port = held_port
    code, output = run_to_exit(edge_command(["127.0.0.1:1"], port), tmp_path, EXIT_TIMEOUT_S)
    assert code == 2, output
    assert_one_line_naming(output, f"--port {port} is in use")


def test_sluice_serve_with_a_taken_port_is_one_line_and_status_2(held_port, tmp_path: Path) -> None:
    _, port = held_port
    code, output = run_to_exit(
        [sys.executable, "-m", "sluice", "serve", "--port", str(free_port()), "--worker-port", str(port)],
        tmp_path,
        EXIT_TIMEOUT_S,
    )
    assert code == 2, output
    assert_one_line_naming(output, f"--worker-port {port} is in use")


def test_a_model_that_fails_to_load_exits_1_and_frees_its_ports(tmp_path: Path) -> None:
    # A model folder that is not a model: the load fails after the ports were claimed.
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    grpc_port, metrics_port = free_port(), free_port()
    code, output = run_to_exit(
        worker_command(grpc_port, metrics_port, "--model", str(broken)), tmp_path, EXIT_TIMEOUT_S
    )
    assert code == 1, output
    assert "Traceback" not in output, output
    assert f"metrics on :{metrics_port}" in output
    with pytest.raises(OSError):  # released at exit
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)


def test_a_test_process_whose_port_was_taken_before_it_bound_starts_again_on_new_ports(
    held_port, tiny_model_dir: Path, model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suite's own helper (tests/processes.py): a port chosen free and taken before the process
    binds it (here by the held socket) costs a second start on new ports, not the test."""
    _, port = held_port
    chosen = iter([port])
    monkeypatch.setattr(tests.processes, "free_port", lambda: next(chosen, None) or free_port())
    with WorkerProcess(
        cache_dir=model_cache, log_dir=tmp_path, model=str(tiny_model_dir), extra=FAKE
    ) as worker:
        assert worker.port != port and worker.ready()
    log = (tmp_path / "worker.log").read_text()
    assert f"--port {port} is in use" in log  # the first start, in the same log
