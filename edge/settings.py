"""Edge settings: each a field of :class:`Settings` made with :func:`sluice.settings.setting`,
hence a flag and a ``SLUICE_EDGE_*`` variable, in ``--help`` and docs/configuration.md."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.cors import parse_origins
from edge.event_loop import EVENT_LOOPS, uvloop_available
from edge.rate_limits import KEY_FIELDS, KeyLimits
from edge.requests.limits import RequestLimits
from edge.store.opening import POSTGRES_SCHEMES
from edge.store.responses import Retention
from edge.workers.addresses import split_host_port
from edge.workers.routing import RoutingPolicy
from sluice.limits import INT32_MAX, MAX_N, MAX_TOP_LOGPROBS
from sluice.logs import LOG_FORMATS
from sluice.settings import describe, int_at_least, optional_text, parse_settings, seconds, setting, text
from sluice.tracing import otlp_endpoint

ENV_PREFIX = "SLUICE_EDGE_"
PROG = "sluice-edge"
DESCRIPTION = "OpenAI-compatible HTTP/SSE edge in front of Sluice gRPC workers."


def parse_worker_address(raw: str) -> str:
    """Checks one ``host:port`` (IPv6 as ``[::1]:port``) and returns it stripped."""
    address = raw.strip()
    split_host_port(address)
    return address


def parse_worker_list(raw: str) -> tuple[str, ...]:
    """Parses ``host:port[,host:port...]``; blanks between commas are ignored."""
    return tuple(parse_worker_address(part) for part in raw.split(",") if part.strip())


def parse_routing(raw: str) -> RoutingPolicy:
    """A ``--routing`` value (:class:`edge.workers.routing.RoutingPolicy`)."""
    try:
        return RoutingPolicy(raw.strip())
    except ValueError:
        raise ValueError(f"must be one of {', '.join(RoutingPolicy)}, got {raw!r}") from None


def parse_api_keys(raw: str) -> tuple[str, ...]:
    """Comma-separated API keys; blanks are ignored. Errors never quote a key."""
    return _check_keys(part.strip() for part in raw.split(","))


@dataclass(frozen=True)
class ApiKeyEntry:
    """One line of ``--api-keys-file``: a key, the tenant it counts against (None: its own) and its
    rate limits."""

    key: str
    tenant: str | None = None
    limits: KeyLimits = field(default_factory=KeyLimits)


MAX_TENANT_CHARS = 256  # the worker's bound (worker/service/convert.py)


def read_api_key_entries(path: str) -> tuple[ApiKeyEntry, ...]:
    """One API key per line, optionally followed by ``name=value`` fields (whitespace between):
    ``tenant=NAME`` and the limits ``requests_per_minute=60 tokens_per_minute=100000``; blank lines
    and lines starting with ``#`` are ignored. Errors name the line, never a key."""
    try:
        content = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path!r}: {error.__class__.__name__}") from None
    entries = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, *fields = line.split()
        try:
            entries.append(_entry(key, fields))
        except ValueError as error:
            raise ValueError(f"line {number}: {error}") from None
    _check_keys(entry.key for entry in entries)
    return tuple(entries)


def _entry(key: str, fields: list[str]) -> ApiKeyEntry:
    """A key's ``name=value`` fields: its tenant (at most 256 ASCII characters) and its limits
    (each a whole number >= 1)."""
    tenant: str | None = None
    values: dict[str, int] = {}
    for item in fields:
        name, equals, raw = item.partition("=")
        if not equals or not raw:  # not quoted: a key with a space would show here
            raise ValueError("after the key, only name=value fields may follow (a key has no spaces)")
        if name in values or (name == "tenant" and tenant is not None):
            raise ValueError(f"{name!r} is given twice")
        if name == "tenant":
            if len(raw) > MAX_TENANT_CHARS or not raw.isascii():
                raise ValueError(f"a tenant is at most {MAX_TENANT_CHARS} ASCII characters")
            tenant = raw
            continue
        if name not in KEY_FIELDS:
            known = ", ".join(("tenant", *KEY_FIELDS))
            raise ValueError(f"unknown field {name!r} (known: {known}, as name=value)")
        try:
            values[name] = int_at_least(1)(raw)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return ApiKeyEntry(key, tenant, KeyLimits(**values))


def read_api_keys_file(path: str) -> tuple[tuple[str, KeyLimits], ...]:
    """The keys of ``--api-keys-file`` and their limits (:func:`read_api_key_entries`)."""
    return tuple((entry.key, entry.limits) for entry in read_api_key_entries(path))


def api_key_tenants(path: str | None) -> dict[str, str]:
    """Key -> tenant, for the keys of ``--api-keys-file`` that name one."""
    if path is None:
        return {}
    return {entry.key: entry.tenant for entry in read_api_key_entries(path) if entry.tenant is not None}


def _check_keys(candidates: Any) -> tuple[str, ...]:
    keys = tuple(key for key in candidates if key)
    for position, key in enumerate(keys, 1):
        # A bearer token is visible ASCII; anything else could never match a header.
        if not all("!" <= ch <= "~" for ch in key):
            raise ValueError(f"API key #{position} contains a space or a non-printable/non-ASCII character")
    return keys


_POSITIVE = seconds(positive=True)
_AT_LEAST_0 = seconds()


@dataclass(frozen=True)
class Settings:
    """Everything the edge needs to run; immutable once built; field order is ``--help`` order.

    ``workers`` may be empty when ``worker_dns`` names the workers. Times are seconds, sizes bytes.
    ``__post_init__`` rejects bad values with ``ValueError("field: reason")``.
    """

    workers: tuple[str, ...] = setting(
        parse=parse_worker_list, help="worker gRPC addresses, host:port[,host:port...]"
    )
    host: str = setting("127.0.0.1", text, "address to listen on")
    port: int = setting(8080, int_at_least(0, 65535), "port to listen on")
    heartbeat_interval_s: float = setting(
        15.0, _POSITIVE, "seconds of stream silence before a heartbeat", flag="heartbeat-interval"
    )
    request_timeout_s: float = setting(
        600.0,
        _POSITIVE,
        "default total deadline of one generation (X-Sluice-Timeout), seconds",
        flag="request-timeout",
    )
    max_request_timeout_s: float = setting(
        3600.0, _POSITIVE, "largest total deadline a caller may ask for, seconds", flag="max-request-timeout"
    )
    idle_timeout_s: float = setting(
        120.0,
        _POSITIVE,
        "default seconds a stream may go without a worker event (X-Sluice-Idle-Timeout)",
        flag="idle-timeout",
    )
    max_idle_timeout_s: float = setting(
        600.0, _POSITIVE, "largest idle timeout a caller may ask for, seconds", flag="max-idle-timeout"
    )
    write_timeout_s: float = setting(
        30.0,
        _POSITIVE,
        "seconds a client may accept no response bytes before it is disconnected",
        flag="write-timeout",
    )
    stream_write_interval_s: float = setting(
        0.02,
        _AT_LEAST_0,
        "shortest gap, seconds, between two output writes of one stream; deltas arriving "
        "sooner are merged into the next chunk, and the workers keep a stream's tokens back for "
        "it (0 = write each at once, for the smoothest streams at the most CPU per token; "
        "docs/operations.md)",
        flag="stream-write-interval",
    )
    worker_connect_timeout_s: float = setting(
        10.0, _POSITIVE, "seconds a worker has to accept a call", flag="worker-connect-timeout"
    )
    wait_for_load_s: float = setting(
        60.0,
        _AT_LEAST_0,
        "seconds a request waits for a worker that is still loading its model when none "
        "serves (0 = 503 at once)",
        flag="wait-for-load-seconds",
    )
    health_timeout_s: float = setting(
        2.0, _POSITIVE, "deadline of health checks and model listing, seconds", flag="health-timeout"
    )
    health_interval_s: float = setting(
        5.0,
        _POSITIVE,
        "seconds between health checks of each worker (ejected ones: sooner, with backoff)",
        flag="health-interval",
    )
    worker_dns: str | None = setting(
        None,
        optional_text,
        "host:port whose DNS addresses are all workers (e.g. a Kubernetes headless service)",
    )
    dns_refresh_interval_s: float = setting(
        10.0, _POSITIVE, "seconds between re-resolutions of --worker-dns", flag="dns-refresh-interval"
    )
    max_body_bytes: int = setting(4 * 1024 * 1024, int_at_least(1), "largest accepted request body, bytes")
    drain_delay_s: float = setting(
        5.0,
        _AT_LEAST_0,
        "seconds the listener stays open after SIGTERM while /ready answers 503",
        flag="drain-delay",
    )
    graceful_timeout_s: float = setting(
        5.0,
        _AT_LEAST_0,
        "seconds open streams get after the listener closed on shutdown",
        flag="graceful-timeout",
    )
    log_level: str = setting("INFO", text, "DEBUG, INFO, WARNING or ERROR")
    # Never in repr or an error message: the settings object may be logged.
    api_keys: tuple[str, ...] = setting(
        (),
        parse_api_keys,
        "comma-separated API keys; when set, /v1/* needs 'Authorization: Bearer <key>'",
        secret=True,
    )
    api_keys_file: str | None = setting(
        None,
        optional_text,
        "file with one API key per line (added to --api-keys), each optionally followed by "
        "tenant=NAME (the tenant its requests count against on workers run with --scheduling-policy "
        "fair; a key without one is a tenant of its own) and its limits: requests_per_minute=N "
        "tokens_per_minute=N (docs/http.md)",
    )
    rate_limit_redis_url: str | None = setting(
        None,
        optional_text,
        "redis://host:port[/db] whose counters every edge process and pod shares, for exact fleet-wide "
        "per-key rate limits; unset: each edge process counts alone (docs/operations.md)",
        secret=True,
    )
    log_format: str = setting("text", text, "text or json: one JSON object per line")
    otlp_traces_endpoint: str | None = setting(
        None,
        otlp_endpoint,
        "OpenTelemetry traces to this OTLP/HTTP collector (http://host:4318; no path: /v1/traces), "
        'as service sluice-edge; unset: no tracing (docs/observability.md, "Traces")',
    )
    log_requests: bool = setting(
        False,
        help="one JSON line per API request on stderr: ids, the API key's id (never the key), model, "
        'token counts, timings, finish reasons (docs/observability.md, "Request logs")',
    )
    log_request_text: int = setting(
        0,
        int_at_least(0),
        "with --log-requests: the first N characters of each prompt and output in its line (0 = none)",
    )
    max_concurrent_per_key: int = setting(
        0,
        int_at_least(0),
        "generation requests one API key (client address without keys) may have in flight; 0 = no limit",
    )
    max_messages: int = setting(1024, int_at_least(1), "most messages in one chat request")
    max_prompt_chars: int = setting(
        1_000_000,
        int_at_least(1),
        "most characters of message text (chat) or prompt (completions) in one request",
    )
    max_n: int = setting(
        MAX_N,
        int_at_least(1),
        f"largest n (choices per prompt), at most {MAX_N}; above what the model's workers serve "
        "(their --max-running) is refused too",
    )
    max_tokens_limit: int = setting(
        0,
        int_at_least(0),
        "largest max_tokens / max_completion_tokens a request may set; 0 = no edge limit",
    )
    max_top_logprobs: int = setting(
        MAX_TOP_LOGPROBS,
        int_at_least(0),
        f"largest top_logprobs (chat) or logprobs (completions), at most {MAX_TOP_LOGPROBS}",
    )
    max_images: int = setting(8, int_at_least(0), "most image parts in one request (0 = no images)")
    max_image_bytes: int = setting(
        4 * 1024 * 1024,
        int_at_least(1),
        "largest image, bytes once decoded (a data URL's) or fetched (an http(s) URL's); all the "
        "images of a request together stay within --max-body-bytes",
    )
    allow_image_urls: bool = setting(
        False,
        help="fetch http(s) image URLs (chat image_url, Anthropic url sources, Responses input_image); "
        "only public addresses are ever fetched (docs/http.md); off: such parts are a 400",
    )
    image_url_timeout_s: float = setting(
        10.0,
        _POSITIVE,
        "seconds one image URL's fetch may take, redirects included",
        flag="image-url-timeout",
    )
    strict_fields: bool = setting(
        False,
        help="refuse (400 naming it) a request body field no surface knows, instead of ignoring it; "
        "the no-op fields listed in docs/http.md are still accepted",
    )
    processes: int = setting(
        1,
        int_at_least(0),
        "edge processes sharing the port (SO_REUSEPORT), each with its own state; 0 = one per CPU core",
    )
    routing: RoutingPolicy = setting(  # noqa: RUF009 (an enum member is immutable)
        RoutingPolicy.PREFIX_AFFINITY,
        parse_routing,
        "how a worker is chosen per request: prefix-affinity (the worker that served the longest "
        "shared prompt prefix, unless the load is unbalanced; docs/operations.md) or "
        "least-outstanding (fewest calls in flight)",
    )
    multiplexed_streams: bool = setting(
        True,
        help="send streams to a worker on one multiplexed GenerateStreams call per worker (one "
        'message per engine step for all of them; docs/grpc.md, "Multiplexed streams"): about half '
        "the CPU per token of edge and worker at 64 and 256 streams, the same first-token time "
        "and gaps at 1 and 16 (docs/benchmarks.md). --no-multiplexed-streams: one Generate call "
        "per request. A worker whose ListModels does not say it serves GenerateStreams gets "
        "Generate calls either way",
    )
    worker_connections: int = setting(
        1,
        int_at_least(1, 64),
        "connections (each with its own multiplexed call) this edge process spreads a worker's "
        "streams over, in turn: the kernel hands each to one of a worker's serving processes "
        "(worker --api-server-count), so give it a few times that count; each costs CPU per "
        "token, so keep 1 for a worker with one (docs/operations.md)",
    )
    allow_runtime_lora: bool = setting(
        False,
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies), applied "
        "to every worker (started with --enable-lora); off: those routes are 404. Behind the API "
        "keys like every route: give them to operators only (docs/operations.md)",
    )
    migrate_streams: bool = setting(
        True,
        help="continue a stream on another worker when its worker dies mid-stream (same text for "
        "greedy and seeded requests)",
    )
    max_stream_migrations: int = setting(
        2, int_at_least(0), "most times one call may move to another worker mid-stream (0 = never)"
    )
    event_loop: str = setting(
        "auto",
        text,
        "the event loop of each edge process: auto (uvloop where installed, else asyncio), uvloop (refuse "
        "to start without it) or asyncio (the standard library's loop, when uvloop is suspected of a "
        "fault; slower, docs/operations.md)",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        parse_origins,
        "browser origins (scheme://host[:port], comma-separated) whose pages may call the edge (CORS); "
        "* allows any origin, without credentials; none by default",
        shown_default="none",
    )
    state_dir: str | None = setting(
        None,
        optional_text,
        'folder of the embedded SQLite state store (stored Responses; docs/operations.md, "State"), '
        "created if missing; unused with --state-url",
        shown_default="$XDG_STATE_HOME/sluice (~/.local/state/sluice)",
    )
    # Never in repr or an error message: the URL may hold a password.
    state_url: str | None = setting(
        None,
        optional_text,
        "postgresql://user:password@host:port/database: the state store in PostgreSQL instead, shared "
        "by several edge processes and hosts",
        secret=True,
    )
    state_ttl_s: float = setting(
        30 * 24 * 3600.0,
        _POSITIVE,
        "seconds a stored response is kept after its creation (30 days, as OpenAI)",
        flag="state-ttl",
    )
    state_max_bytes: int = setting(
        1024**3,
        int_at_least(0),
        "most bytes stored responses (with their stream events) and conversations may hold together; "
        "above it the purge deletes what expires soonest first (0 = no limit)",
    )
    state_lease_s: float = setting(
        30.0,
        _POSITIVE,
        "seconds an edge's claim on a running background response lasts (renewed every third of it); "
        "after an edge crashes, an edge sharing its store re-runs its background responses this long after",
        flag="state-lease",
    )
    max_file_bytes: int = setting(
        100 * 1024 * 1024,
        int_at_least(1),
        "largest file /v1/files accepts (a batch's JSONL input), bytes; a larger one is a 400",
    )
    batch_concurrency: int = setting(
        8,
        int_at_least(1),
        'batch lines this edge process runs at once (docs/operations.md, "Batches")',
    )
    batch_priority: int = setting(
        INT32_MAX,
        int_at_least(0),
        "the scheduling priority batch lines are sent with (lower is served first; the default is "
        "the lowest, for workers run with --scheduling-policy priority or fair)",
    )

    # The limits of --api-keys-file's keys that name some, read with the file (no flag of its own).
    key_limits: tuple[tuple[str, KeyLimits], ...] = field(default=(), repr=False)

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
            "image_url_timeout_s",
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
        url = self.rate_limit_redis_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("rate_limit_redis_url: must start with redis://, rediss:// or unix://")
        if self.max_concurrent_per_key < 0:
            raise ValueError(
                f"max_concurrent_per_key: must be >= 0 (0 = off), got {self.max_concurrent_per_key}"
            )
        if self.log_request_text < 0:
            raise ValueError(f"log_request_text: must be >= 0, got {self.log_request_text}")
        if self.log_request_text and not self.log_requests:
            raise ValueError("log_request_text: needs --log-requests")
        if self.state_url is not None and not self.state_url.startswith(POSTGRES_SCHEMES):
            raise ValueError("state_url: must start with postgresql:// (the URL is not shown)")
        if not math.isfinite(self.state_ttl_s) or self.state_ttl_s <= 0:
            raise ValueError(f"state_ttl_s: must be a positive number of seconds, got {self.state_ttl_s}")
        if not math.isfinite(self.state_lease_s) or self.state_lease_s <= 0:
            raise ValueError(f"state_lease_s: must be a positive number of seconds, got {self.state_lease_s}")
        if self.state_max_bytes < 0:
            raise ValueError(f"state_max_bytes: must be >= 0 (0 = no limit), got {self.state_max_bytes}")
        try:
            _ = self.limits  # building them validates them
        except ValueError as error:
            # RequestLimits names its own fields; max_tokens is max_tokens_limit here.
            name, _, reason = str(error).partition(": ")
            raise ValueError(f"{'max_tokens_limit' if name == 'max_tokens' else name}: {reason}") from None

    @functools.cached_property
    def limits(self) -> RequestLimits:
        """The per-request limits the request parsers enforce."""
        return RequestLimits(
            max_messages=self.max_messages,
            max_prompt_chars=self.max_prompt_chars,
            max_n=self.max_n,
            max_tokens=self.max_tokens_limit,
            max_top_logprobs=self.max_top_logprobs,
            max_images=self.max_images,
            max_image_bytes=self.max_image_bytes,
            allow_image_urls=self.allow_image_urls,
        )

    @property
    def retention(self) -> Retention:
        """How long and how much the state store keeps."""
        return Retention(ttl_s=self.state_ttl_s, max_bytes=self.state_max_bytes)

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

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
        """Builds settings from flags, falling back to ``SLUICE_EDGE_*`` variables (``argv`` defaults
        to ``sys.argv[1:]``, ``env`` to ``os.environ``); exits with status 2 naming a bad setting."""
        environ = os.environ if env is None else env
        return parse_settings(
            cls, ENV_PREFIX, argv, environ, prog=PROG, description=DESCRIPTION, combine=_combine
        )


def _combine(values: dict[str, Any], sources: Mapping[str, str]) -> dict[str, Any]:
    """Keys from --api-keys-file join --api-keys; the workers may be left to --worker-dns."""
    if path := values.get("api_keys_file"):
        try:
            file_keys = read_api_keys_file(path)
        except ValueError as error:
            raise ValueError(f"{sources['api_keys_file']}: {error}") from None
        values["api_keys"] = tuple(dict.fromkeys((*values.get("api_keys", ()), *(k for k, _ in file_keys))))
        values["key_limits"] = tuple((key, limits) for key, limits in file_keys if limits.limited)
    if not values.get("workers") and "worker_dns" not in values:
        raise ValueError(
            f"--workers (or {ENV_PREFIX}WORKERS) is required: host:port[,host:port...], "
            "unless --worker-dns is set"
        )
    values.setdefault("workers", ())
    return values


def describe_settings(*, testing: bool | None = None) -> list[tuple[str, str, object, str]]:
    """Every edge setting as ``(flag, env var, default, help)``, in field order; ``testing``:
    None for all, False for the production settings, True for the test doubles (none yet)."""
    return describe(Settings, ENV_PREFIX, testing=testing)
