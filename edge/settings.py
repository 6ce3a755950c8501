"""Edge configuration: one frozen :class:`Settings`, built from flags and env vars.

Every flag ``--some-name`` also reads ``SLUICE_EDGE_SOME_NAME`` from the
environment; a flag given on the command line wins. Invalid values end the
program with a message naming the setting (``SystemExit``), never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from edge.event_loop import EVENT_LOOPS, uvloop_available
from edge.surfaces.shared.validation import RequestLimits
from edge.workers.addresses import split_host_port
from edge.workers.routing import RoutingPolicy
from sluice.logs import LOG_FORMATS

ENV_PREFIX = "SLUICE_EDGE_"


def parse_worker_address(text: str) -> str:
    """Checks one ``host:port`` (IPv6 as ``[::1]:port``) and returns it stripped."""
    address = text.strip()
    split_host_port(address)
    return address


def parse_worker_list(text: str) -> tuple[str, ...]:
    """Parses ``host:port[,host:port...]``; blanks between commas are ignored."""
    return tuple(parse_worker_address(part) for part in text.split(",") if part.strip())


def parse_routing(text: str) -> RoutingPolicy:
    """A ``--routing`` value (:class:`edge.workers.routing.RoutingPolicy`)."""
    try:
        return RoutingPolicy(text.strip())
    except ValueError:
        raise ValueError(f"must be one of {', '.join(RoutingPolicy)}") from None


def parse_api_keys(text: str) -> tuple[str, ...]:
    """Comma-separated API keys; blanks are ignored. Errors never quote a key."""
    return _check_keys(part.strip() for part in text.split(","))


def read_api_keys_file(path: str) -> tuple[str, ...]:
    """One API key per line; blank lines and lines starting with ``#`` are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path!r}: {error.__class__.__name__}") from None
    return _check_keys(line.strip() for line in text.splitlines() if not line.lstrip().startswith("#"))


def _check_keys(candidates: Any) -> tuple[str, ...]:
    keys = tuple(key for key in candidates if key)
    for position, key in enumerate(keys, 1):
        # A bearer token is visible ASCII; anything else could never match a header.
        if not all("!" <= ch <= "~" for ch in key):
            raise ValueError(f"API key #{position} contains a space or a non-printable/non-ASCII character")
    return keys


def parse_bool(value: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``, any case)."""
    lowered = value.strip().lower()
    if lowered in {"true", "1", "yes", "on"}:
        return True
    if lowered in {"false", "0", "no", "off"}:
        return False
    raise ValueError("expected true or false")


# Options whose values are secrets: never echoed in an error message.
_SECRET_FLAGS = frozenset({"api-keys"})


@dataclass(frozen=True)
class Settings:
    """Everything the edge needs to run; immutable once built.

    ``workers`` is the static list of worker gRPC addresses; it may be empty
    when ``worker_dns`` names workers instead.
    Times are seconds, sizes bytes. ``__post_init__`` rejects bad values with
    ``ValueError`` naming the field.
    """

    workers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    # A ": heartbeat" comment goes out when a stream was silent this long.
    heartbeat_interval_s: float = 15.0
    # Total deadline of one generation request (queueing included), the default for
    # ``X-Sluice-Timeout``; a caller may ask for up to ``max_request_timeout_s``.
    request_timeout_s: float = 600.0
    max_request_timeout_s: float = 3600.0
    # A stream whose workers sent no event (progress events count) for this long is cut:
    # the default for ``X-Sluice-Idle-Timeout``, which may ask for up to ``max_idle_timeout_s``.
    idle_timeout_s: float = 120.0
    max_idle_timeout_s: float = 600.0
    # A client that accepted no bytes of its response for this long is disconnected.
    write_timeout_s: float = 30.0
    # Shortest time between two writes of one stream that carry model output: deltas that
    # arrive sooner wait and go out merged in one chunk (edge/streaming/pump.py). 0 = no wait.
    stream_write_interval_s: float = 0.02
    # How long a worker may take to accept a call (send `started`) before the
    # edge gives up on it and tries the next one.
    worker_connect_timeout_s: float = 10.0
    # A request that arrives while no worker serves but one is still loading its model waits
    # up to this long for the load (the native stream shows model_load.* events meanwhile);
    # 0 = answer 503 at once.
    wait_for_load_s: float = 60.0
    # Deadline of one health check or ListModels call.
    health_timeout_s: float = 2.0
    # Workers are health-checked this often; an ejected one sooner, with backoff.
    health_interval_s: float = 5.0
    # A DNS name (host:port) whose addresses are all workers, e.g. a Kubernetes
    # headless service; re-resolved every dns_refresh_interval_s.
    worker_dns: str | None = None
    dns_refresh_interval_s: float = 10.0
    max_body_bytes: int = 4 * 1024 * 1024
    # On SIGINT/SIGTERM, readiness turns 503 and new generations are refused at once, but the
    # listener stays open this long (so load balancers see readiness flip before it closes).
    drain_delay_s: float = 5.0
    # After the listener closes, open streams get this long to finish before they are cut.
    graceful_timeout_s: float = 5.0
    log_level: str = "INFO"
    # When non-empty, every /v1/* request needs "Authorization: Bearer <one of these>".
    # repr=False: the settings object may be logged; the keys must never be.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # "text" or "json" (one JSON object per line, with the request id); see docs/observability.md.
    log_format: str = "text"
    # Generation requests one API key (or one client address when keys are off) may have in
    # flight; 0 = no limit. See edge/concurrency.py.
    max_concurrent_per_key: int = 0
    # Per-request limits (edge.surfaces.shared.chat_request.RequestLimits); max_tokens_limit 0 = no edge cap.
    max_messages: int = 1024
    max_prompt_chars: int = 1_000_000
    max_n: int = 128
    max_tokens_limit: int = 0
    max_top_logprobs: int = 20
    # Edge processes serving the port (SO_REUSEPORT), each with its own pool and state;
    # 0 = one per CPU core. See docs/running.md.
    processes: int = 1
    # How the pool picks a worker per request (edge/workers/routing.py): prefix-affinity or least-outstanding.
    routing: RoutingPolicy = RoutingPolicy.PREFIX_AFFINITY
    # A stream whose worker dies mid-stream continues on another worker (edge/workers/migration.py), at
    # most max_stream_migrations times per call.
    migrate_streams: bool = True
    max_stream_migrations: int = 2
    # The event loop each edge process runs on (edge/event_loop.py): auto (uvloop where it is
    # installed, else asyncio's own), uvloop, or asyncio.
    event_loop: str = "auto"

    def __post_init__(self) -> None:
        if not self.workers and not self.worker_dns:
            raise ValueError("workers: at least one worker address (host:port) or worker_dns is required")
        if self.worker_dns is not None:
            try:
                parse_worker_address(self.worker_dns)
            except ValueError as error:
                raise ValueError(f"worker_dns: {error}") from None
        for address in self.workers:
            try:
                parse_worker_address(address)
            except ValueError as error:
                raise ValueError(f"workers: {error}") from None
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not in 0..65535")
        for name in (
            "heartbeat_interval_s",
            "request_timeout_s",
            "max_request_timeout_s",
            "idle_timeout_s",
            "max_idle_timeout_s",
            "write_timeout_s",
            "worker_connect_timeout_s",
            "health_timeout_s",
            "health_interval_s",
            "dns_refresh_interval_s",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
        for name in ("drain_delay_s", "graceful_timeout_s", "wait_for_load_s", "stream_write_interval_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be >= 0 seconds, got {value}")
        for default, cap in (
            ("request_timeout_s", "max_request_timeout_s"),
            ("idle_timeout_s", "max_idle_timeout_s"),
        ):
            if getattr(self, default) > getattr(self, cap):
                raise ValueError(
                    f"{default}: {getattr(self, default)} s is above the cap {cap} ({getattr(self, cap)} s)"
                )
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"log_level: unknown level {self.log_level!r}")
        try:
            _check_keys(self.api_keys)
        except ValueError as error:
            raise ValueError(f"api_keys: {error}") from None
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.routing not in tuple(RoutingPolicy):
            choices = ", ".join(RoutingPolicy)
            raise ValueError(f"routing: must be one of {choices}, got {self.routing!r}")
        if self.processes < 0:
            raise ValueError(f"processes: must be >= 0 (0 = one per CPU core), got {self.processes}")
        if self.process_count > 1 and self.port == 0:
            raise ValueError("processes: several processes need a fixed port (port 0 picks one per process)")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop: must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.event_loop == "uvloop" and not uvloop_available():
            raise ValueError("event_loop: uvloop is not installed (install it, or use auto or asyncio)")
        if not 0 <= self.max_stream_migrations <= 16:
            raise ValueError(f"max_stream_migrations: must be in 0..16, got {self.max_stream_migrations}")
        if self.max_concurrent_per_key < 0:
            raise ValueError(
                f"max_concurrent_per_key: must be >= 0 (0 = off), got {self.max_concurrent_per_key}"
            )
        try:
            _ = self.limits  # building them validates them
        except ValueError as error:
            # RequestLimits names its own fields; max_tokens is max_tokens_limit here.
            name, _, reason = str(error).partition(": ")
            raise ValueError(f"{'max_tokens_limit' if name == 'max_tokens' else name}: {reason}") from None

    @property
    def limits(self) -> RequestLimits:
        """The per-request limits the request parsers enforce."""
        return RequestLimits(
            max_messages=self.max_messages,
            max_prompt_chars=self.max_prompt_chars,
            max_n=self.max_n,
            max_tokens=self.max_tokens_limit,
            max_top_logprobs=self.max_top_logprobs,
        )

    @property
    def process_count(self) -> int:
        """How many edge processes to run: ``processes``, or the CPU count when it is 0."""
        if self.processes:
            return self.processes
        # The cores this process may run on (a container's CPU set), not the machine's.
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    @property
    def base_url(self) -> str:
        """The URL callers use (an IPv6 host is bracketed)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"

    @staticmethod
    def options() -> list[tuple[str, str, Callable[[str], Any], str]]:
        """Every setting as (flag without ``--``, dataclass field, converter, help).

        ``from_args`` builds its parser from this list and ``describe_settings``
        (docs, deploy checks) reads it, so a setting added here is documented too.
        """
        return [
            ("workers", "workers", parse_worker_list, "worker gRPC addresses, host:port[,host:port...]"),
            ("host", "host", str, "address to listen on (default 127.0.0.1)"),
            ("port", "port", int, "port to listen on (default 8080)"),
            (
                "heartbeat-interval",
                "heartbeat_interval_s",
                float,
                "seconds of stream silence before a heartbeat",
            ),
            (
                "request-timeout",
                "request_timeout_s",
                float,
                "default total deadline of one generation (X-Sluice-Timeout), seconds",
            ),
            (
                "max-request-timeout",
                "max_request_timeout_s",
                float,
                "largest total deadline a caller may ask for, seconds",
            ),
            (
                "idle-timeout",
                "idle_timeout_s",
                float,
                "default seconds a stream may go without a worker event (X-Sluice-Idle-Timeout)",
            ),
            (
                "max-idle-timeout",
                "max_idle_timeout_s",
                float,
                "largest idle timeout a caller may ask for, seconds",
            ),
            (
                "write-timeout",
                "write_timeout_s",
                float,
                "seconds a client may accept no response bytes before it is disconnected",
            ),
            (
                "stream-write-interval",
                "stream_write_interval_s",
                float,
                "shortest gap, seconds, between two output writes of one stream; deltas arriving "
                "sooner are merged into the next chunk (0 = write each at once)",
            ),
            (
                "worker-connect-timeout",
                "worker_connect_timeout_s",
                float,
                "seconds a worker has to accept a call",
            ),
            (
                "wait-for-load-seconds",
                "wait_for_load_s",
                float,
                "seconds a request waits for a worker that is still loading its model when none "
                "serves (0 = 503 at once)",
            ),
            (
                "health-timeout",
                "health_timeout_s",
                float,
                "deadline of health checks and model listing, seconds",
            ),
            (
                "health-interval",
                "health_interval_s",
                float,
                "seconds between health checks of each worker (ejected ones: sooner, with backoff)",
            ),
            (
                "worker-dns",
                "worker_dns",
                parse_worker_address,
                "host:port whose DNS addresses are all workers (e.g. a Kubernetes headless service)",
            ),
            (
                "dns-refresh-interval",
                "dns_refresh_interval_s",
                float,
                "seconds between re-resolutions of --worker-dns",
            ),
            ("max-body-bytes", "max_body_bytes", int, "largest accepted request body, bytes"),
            (
                "drain-delay",
                "drain_delay_s",
                float,
                "seconds the listener stays open after SIGTERM while /ready answers 503",
            ),
            (
                "graceful-timeout",
                "graceful_timeout_s",
                float,
                "seconds open streams get after the listener closed on shutdown",
            ),
            ("log-level", "log_level", str, "DEBUG, INFO, WARNING or ERROR"),
            (
                "api-keys",
                "api_keys",
                parse_api_keys,
                "comma-separated API keys; when set, /v1/* needs 'Authorization: Bearer <key>'",
            ),
            ("api-keys-file", "api_keys_file", read_api_keys_file, "file with one API key per line"),
            ("log-format", "log_format", str, "text (default) or json: one JSON object per line"),
            (
                "max-concurrent-per-key",
                "max_concurrent_per_key",
                int,
                "generation requests one API key (client address without keys) may have in flight; "
                "0 = no limit",
            ),
            ("max-messages", "max_messages", int, "most messages in one chat request"),
            (
                "max-prompt-chars",
                "max_prompt_chars",
                int,
                "most characters of message text (chat) or prompt (completions) in one request",
            ),
            ("max-n", "max_n", int, "largest n (choices per prompt), at most 128"),
            (
                "max-tokens-limit",
                "max_tokens_limit",
                int,
                "largest max_tokens / max_completion_tokens a request may set; 0 = no edge limit",
            ),
            (
                "max-top-logprobs",
                "max_top_logprobs",
                int,
                "largest top_logprobs (chat) or logprobs (completions), at most 20",
            ),
            (
                "processes",
                "processes",
                int,
                "edge processes sharing the port (SO_REUSEPORT), each with its own state; "
                "0 = one per CPU core (default 1)",
            ),
            (
                "routing",
                "routing",
                parse_routing,
                "how a worker is chosen per request: prefix-affinity (default: the worker that served "
                "the longest shared prompt prefix, unless the load is unbalanced; docs/operations.md) "
                "or least-outstanding (fewest calls in flight)",
            ),
            (
                "migrate-streams",
                "migrate_streams",
                parse_bool,
                "true (default) or false: continue a stream on another worker when its worker dies "
                "mid-stream (same text for greedy and seeded requests)",
            ),
            (
                "max-stream-migrations",
                "max_stream_migrations",
                int,
                "most times one call may move to another worker mid-stream (default 2; 0 = never)",
            ),
            (
                "event-loop",
                "event_loop",
                str,
                "the event loop of each edge process: auto (default: uvloop where installed, else "
                "asyncio), uvloop or asyncio",
            ),
        ]

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
        """Builds settings from CLI flags, falling back to ``SLUICE_EDGE_*`` env vars.

        ``argv`` defaults to ``sys.argv[1:]`` and ``env`` to ``os.environ``.
        Raises ``SystemExit`` (via argparse) with a message naming the bad setting.
        """
        env = os.environ if env is None else env
        parser = argparse.ArgumentParser(
            prog="sluice-edge",
            description="OpenAI-compatible HTTP/SSE edge in front of Sluice gRPC workers. "
            f"Every flag also reads {ENV_PREFIX}<FLAG_NAME> (e.g. {ENV_PREFIX}WORKERS); flags win.",
        )
        options = cls.options()
        for flag, _field, _convert, help_text in options:
            parser.add_argument(
                f"--{flag}", default=None, metavar=flag.split("-")[-1].upper(), help=help_text
            )
        args = parser.parse_args(argv)

        values: dict[str, Any] = {}
        for flag, field_name, convert, _help in options:
            env_name = ENV_PREFIX + flag.upper().replace("-", "_")
            raw = getattr(args, flag.replace("-", "_"))
            source = f"--{flag}"
            if raw is None and env.get(env_name):
                raw, source = env[env_name], env_name
            if raw is None:
                continue
            try:
                values[field_name] = convert(raw)
            except ValueError as error:
                shown = "" if flag in _SECRET_FLAGS else f" {raw!r}"
                parser.error(f"{source}: invalid value{shown} ({error})")
        # Keys from the flag/env and from the file are all accepted.
        file_keys = values.pop("api_keys_file", ())
        if file_keys or "api_keys" in values:
            values["api_keys"] = tuple(dict.fromkeys((*values.get("api_keys", ()), *file_keys)))
        if not values.get("workers") and "worker_dns" not in values:
            parser.error(
                f"--workers (or {ENV_PREFIX}WORKERS) is required: host:port[,host:port...], "
                "unless --worker-dns is set"
            )
        values.setdefault("workers", ())
        try:
            return cls(**values)
        except ValueError as error:
            # "field_name: reason" from __post_init__ → name the flag the user typed.
            flags = {field_name: f"--{flag}" for flag, field_name, _c, _h in options}
            field_name, _, reason = str(error).partition(": ")
            parser.error(f"{flags.get(field_name, field_name)}: {reason}")


def describe_settings() -> list[tuple[str, str, object, str]]:
    """Every edge setting as ``(flag, env var, default, help)``, in ``--help`` order.

    Read by ``python -m tools.config_docs`` (docs/configuration.md) and the
    deploy checks. The default is the :class:`Settings` field's default,
    ``dataclasses.MISSING`` for a required setting, None for one with no field.
    """
    defaults = {f.name: f.default for f in fields(Settings)}
    return [
        (f"--{flag}", ENV_PREFIX + flag.upper().replace("-", "_"), defaults.get(name), help_text)
        for flag, name, _convert, help_text in Settings.options()
    ]
