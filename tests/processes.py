"""Real worker and edge processes on 127.0.0.1 with free ports, for integration and e2e tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.cli import edge_command, worker_command
from sluice.ports import EXIT_PORT_TAKEN, METRICS_PORT_OFFSET
from tests.zygote import ForkedProcess, Zygote

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair(offset: int) -> int:
    """A port ``p`` such that ``p`` and ``p + offset`` are both free now (a worker's gRPC port
    whose default metrics port, ``p + 1000``, is free too)."""
    for _ in range(200):
        port = free_port()
        if port + offset > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port p with p + {offset} free")


def scrape_metrics(port: int) -> dict[str, float]:
    """Reads a Prometheus endpoint into {metric name: value}: labels dropped, so a metric's series
    (one per surface, model, ...) are summed."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            bare = name.split("{")[0]
            values[bare] = values.get(bare, 0.0) + float(value)
    return values


class PortTaken(RuntimeError):
    """The process exited because a port it was given was taken (:data:`EXIT_PORT_TAKEN`)."""


class _Process:
    name = "process"

    def __init__(
        self, args: list[str], log_dir: Path, env: dict[str, str] | None = None, root: Path = REPO_ROOT
    ):
        """``root``: the source tree it runs from (another than this one's: never forked from the
        zygote, whose modules come from this one)."""
        self.args, self.root = args, root
        self.log_path = log_dir / f"{self.name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None

    def start(self) -> None:
        """Starts the process and waits until it is ready (raises if it exits or times out). A port
        taken between its choice and the process's bind (any outgoing connection of the machine may
        take a free port as its own) is chosen again, where the process can (:meth:`choose_ports`)."""
        for attempt in range(3):
            self.launch()
            try:
                self.wait_ready()
                return
            except PortTaken:
                if attempt == 2 or not self.choose_ports():
                    raise

    def choose_ports(self) -> bool:
        """Chooses new free ports for the next :meth:`launch`; False where the ports are fixed."""
        return False

    def launch(self) -> None:
        """Starts the process without waiting for it (a restart appends to the first start's log)."""
        append = self.proc is not None
        zygote = Zygote.shared() if self.root == REPO_ROOT else None
        forked = zygote and zygote.start(
            self.args, env=self.env, cwd=REPO_ROOT, log=self.log_path, append=append
        )
        if forked:
            self.proc = forked
            return
        with self.log_path.open("ab" if append else "wb") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self) -> None:
        """Waits until :meth:`ready` (raises if the process exits or :data:`START_TIMEOUT_S` passes)."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                error = PortTaken if self.proc.returncode == EXIT_PORT_TAKEN else RuntimeError
                raise error(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def ready(self) -> bool:
        raise NotImplementedError

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> int | None:
        """SIGKILL (no drain, no goodbye) and reap; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process ended within ``timeout`` seconds, else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> _Process:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class WorkerProcess(_Process):
    name = "worker"

    def __init__(
        self,
        *,
        cache_dir: Path,
        log_dir: Path,
        model: str | None = None,
        extra: list[str] | None = None,
        default_metrics_port: bool = False,
        torch_threads: int = 1,
        root: Path = REPO_ROOT,
    ):
        """``default_metrics_port``: pass no --metrics-port (the worker's default, --port + 1000).
        ``torch_threads``: the worker's ``--torch-threads`` unless ``extra`` names it (see
        docs/testing.md, "Processes": one thread, as the test process and the edge share the cores).
        ``root``: the source tree the worker runs from."""
        self._default_metrics_port = default_metrics_port
        rest = ["--cache-dir", str(cache_dir), "--grace-period", "2"]
        if model:
            rest += ["--model", model]
        if "--torch-threads" not in (extra or []):
            rest += ["--torch-threads", str(torch_threads)]
        self._rest = rest + (extra or [])
        super().__init__([], log_dir, root=root)
        self.choose_ports()

    def choose_ports(self) -> bool:
        if self._default_metrics_port:
            self.port = free_port_pair(METRICS_PORT_OFFSET)
            self.metrics_port = self.port + METRICS_PORT_OFFSET
        else:
            self.port, self.metrics_port = free_port(), free_port()
        metrics = None if self._default_metrics_port else self.metrics_port
        self.args = worker_command(self.port, metrics, *self._rest)
        return True

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with grpc.insecure_channel(self.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port)

    def __enter__(self) -> WorkerProcess:
        self.start()
        return self


class NodeProcess(_Process):
    """``python -m worker`` as a tensor-parallel node above 0 (``--node-rank``): it claims no ports
    and serves nothing, so it counts as started once launched; :meth:`wait_exit` gives its status."""

    name = "node"

    def __init__(self, args: list[str], log_dir: Path):
        super().__init__([sys.executable, "-m", "worker", *args], log_dir)

    def ready(self) -> bool:
        return True


class EdgeProcess(_Process):
    name = "edge"

    def __init__(self, workers: list[str], *, log_dir: Path, extra: list[str] | None = None):
        self._workers, self._extra = workers, extra or []
        # No load balancer watches a test edge's readiness: stop without the drain delay
        # (a test that wants one passes --drain-delay, which wins over the env var).
        super().__init__([], log_dir, env={"SLUICE_EDGE_DRAIN_DELAY": "0"})
        self.choose_ports()

    def choose_ports(self) -> bool:
        self.port = free_port()
        self.args = edge_command(self._workers, self.port) + self._extra
        return True

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def __enter__(self) -> EdgeProcess:
        self.start()
        return self


class LiveEdgeProcess(EdgeProcess):
    """An edge that counts as started once ``/health`` answers (its workers may all be down)."""

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def run_to_exit(args: list[str], log_dir: Path, timeout: float) -> tuple[int, str]:
    """Runs a service command (``python -m worker|edge ...``: forked from the zygote, as a started
    worker is; anything else fresh) to its exit; returns the status and its whole output (stdout
    and stderr, in order). Raises if it runs past ``timeout`` seconds (a bound for a hang)."""
    process = _Process(args, log_dir)
    process.launch()
    status = process.wait_exit(timeout)
    if status is None:
        process.kill()
        raise AssertionError(f"{args[:3]} did not exit in {timeout} s:\n{process.log_tail()}")
    return status, process.log_path.read_text(errors="replace")


def build_tiny_model(folder: Path, tokenizer_dir: Path, *, positions: int = 512) -> Path:
    """Saves a tiny random Llama (2 layers, ``positions`` positions) with the tokenizer and chat
    template of ``tokenizer_dir`` into ``folder``, loadable like any checkpoint. Greedy decoding
    of random weights practically never picks EOS, so requests run to ``max_tokens``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_hybrid(folder: Path, tokenizer_dir: Path) -> Path:
    """Saves a tiny random Qwen3.5 text model (hybrid: three Gated DeltaNet layers and one attention
    layer) with the tokenizer and chat template of ``tokenizer_dir`` into ``folder``."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


Started = TypeVar("Started", bound=_Process)


@contextlib.contextmanager
def side_by_side(processes: Sequence[Started]) -> Iterator[Sequence[Started]]:
    """Starts ``processes`` together (every one launched, then each waited for: their loads overlap)
    and stops them all when the block ends, however it ends."""
    try:
        for process in processes:
            process.launch()
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        for process in processes:
            process.stop()
