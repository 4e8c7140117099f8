"""One typed settings object, read once from the environment at the edge.

Every variable is named once here with its type, default and unit. Code below
the edge (the app factory, the Celery factory, the store) takes a ``Settings``
and never reads ``os.environ`` itself, so tests build one by hand.

Provider credentials are the exception to "named once here": the catalog
names the variable each provider's credential is in (``providers.<name>.
credentials``), so adding a provider or a second account with one is
configuration. Their values are still read here, once, with the rest.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .provider_pools import credential_variables
from .redis_urls import CLUSTER_SCHEME, ClusterAddress, RedisUrlError, SentinelAddress

DEFAULT_CATALOG = Path(__file__).with_name("catalog.json")


class SettingsError(ValueError):
    """A variable had a value we cannot use; the message names the variable."""


def _int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, got {raw!r}") from None
    if value < 0:
        raise SettingsError(f"{name} must not be negative, got {value}")
    return value


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if value < 0:
        raise SettingsError(f"{name} must not be negative, got {value}")
    return value


def _percent(name: str, raw: str) -> int:
    value = _int(name, raw)
    if value > 100:
        raise SettingsError(f"{name} must be a percent (0 to 100), got {value}")
    return value


def _str(name: str, raw: str) -> str:
    return raw.strip()


def _url(name: str, raw: str) -> str:
    raw = raw.strip().rstrip("/")
    if raw and "://" not in raw:
        raise SettingsError(f"{name} must be a URL with a scheme, got {raw!r}")
    return raw


def _redis_url(name: str, raw: str) -> str:
    """A ``redis://`` URL, a ``sentinel://`` one that names its primary, or a
    ``redis+cluster://`` one that names its seeds."""
    raw = _url(name, raw)
    try:
        SentinelAddress.parse(raw)
        ClusterAddress.parse(raw)
    except RedisUrlError as exc:
        raise SettingsError(f"{name}: {exc}") from None
    return raw


def _object_store_url(name: str, raw: str) -> str:
    """``s3://bucket/prefix``, ``gs://bucket/prefix`` or ``file:///path``."""
    raw = raw.strip().rstrip("/")
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme not in ("s3", "gs", "file") or not rest.strip("/"):
        raise SettingsError(f"{name} must be s3://bucket/prefix, gs://bucket/prefix or file:///path, got {raw!r}")
    return raw


def without_password(url: str) -> str:
    """``url`` fit to print: any user and password replaced by ``***``."""
    return re.sub(r"://[^@/;]*@", "://***@", url)


class Secret(str):
    """A string that masks itself in ``repr`` so settings can be logged."""

    def __repr__(self) -> str:
        return "Secret('***')" if self else "Secret('')"


def _secret(name: str, raw: str) -> Secret:
    return Secret(raw.strip())


def _fernet_keys(name: str, raw: str) -> tuple[Secret, ...]:
    """Comma-separated Fernet keys (32 bytes, URL-safe base64), newest first."""
    values = tuple(Secret(part.strip()) for part in raw.split(","))
    for value in values:
        try:
            if len(base64.urlsafe_b64decode(value.encode())) == 32:
                continue
        except ValueError:
            pass
        raise SettingsError(f"{name} must be Fernet keys (32 bytes, URL-safe base64, e.g. from "
                            f"`openssl rand -base64 32 | tr '+/' '-_'`), comma-separated, newest first")
    return values


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be 1 or 0 (true or false), got {raw!r}")


def _names(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated host names (or patterns), lower-cased, none empty."""
    values = tuple(part.strip().lower() for part in raw.split(","))
    if not all(values):
        raise SettingsError(f"{name} must be host names, comma-separated, got {raw!r}")
    return values


def _networks(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated addresses or CIDR networks, as gunicorn reads the same
    variable; ``*`` alone: every peer."""
    values = tuple(part.strip() for part in raw.split(","))
    if values == ("*",):
        return values
    try:
        return tuple(str(ipaddress.ip_network(value, strict=False)) for value in values)
    except ValueError:
        raise SettingsError(f"{name} must be IP addresses or CIDR networks, comma-separated (or *), "
                            f"got {raw!r}") from None


def _port(name: str, raw: str) -> int:
    value = _int(name, raw)
    if value > 65535:
        raise SettingsError(f"{name} must be a TCP port (0 to 65535), got {value}")
    return value


def _floats(name: str, raw: str) -> tuple[float, ...]:
    """Comma-separated seconds, at least one, each above 0."""
    values = tuple(_float(name, part) for part in raw.split(","))
    if not values or min(values) <= 0:
        raise SettingsError(f"{name} must be seconds above 0, comma-separated, got {raw!r}")
    return values


#: environment variable -> (field name, parser). docs/CONFIGURATION.md is
#: generated from these and the fields' comments (``router_queue/settings_doc.py``).
_ENV: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "REDIS_URL": ("redis_url", _redis_url),
    "CELERY_BROKER_URL": ("broker_url", _redis_url),
    "REDIS_READ_URL": ("redis_read_url", _redis_url),
    "PUBLIC_BASE_URL": ("public_base_url", _url),
    "TRUSTED_HOSTS": ("trusted_hosts", _names),
    "OPS_PORT": ("ops_port", _port),
    "OPS_HOST": ("ops_host", _str),
    "OPS_TOKEN": ("ops_token", _secret),
    "READYZ_CACHE_SECONDS": ("readyz_cache_s", _float),
    "FORWARDED_ALLOW_IPS": ("forwarded_allow_ips", _networks),
    "WORKER_METRICS_PORT": ("worker_metrics_port", _port),
    "PROVIDER_HOSTS": ("provider_hosts", _names),
    "RESULT_RETENTION_SECONDS": ("result_retention_s", _int),
    "IDEMPOTENCY_TTL_SECONDS": ("idempotency_ttl_s", _int),
    "LEDGER_RETENTION_SECONDS": ("ledger_retention_s", _int),
    "MAX_BODY_BYTES": ("max_body_bytes", _int),
    "CATALOG_PATH": ("catalog_path", _str),
    "MEMBER_GROW_SECONDS": ("member_grow_s", _float),
    "FALLBACK_AFTER_SECONDS": ("fallback_after_s", _float),
    "REGION_PIN_CACHE_SECONDS": ("region_pin_cache_s", _float),
    "PROVIDER_ORIGIN_OVERRIDE": ("provider_origin_override", _url),
    "REPUBLISH_AFTER_SECONDS": ("republish_after_s", _float),
    "SWEEP_INTERVAL_SECONDS": ("sweep_interval_s", _float),
    "WORKER_HEARTBEAT_SECONDS": ("worker_heartbeat_s", _float),
    "VISIBILITY_TIMEOUT_SECONDS": ("visibility_timeout_s", _int),
    "LEASE_SECONDS": ("lease_s", _float),
    "MAX_TAKEOVERS": ("max_takeovers", _int),
    "MAX_QUEUED_PER_WORKSPACE": ("max_queued", _int),
    "LOW_PRIORITY_HEADROOM_PERCENT": ("low_priority_headroom_pct", _percent),
    "RETRY_MAX_PER_REQUEST": ("retry_max_per_request", _int),
    "MAX_BULK_REQUESTS": ("max_bulk_requests", _int),
    "MAX_BULK_ACTIONS_RUNNING": ("max_bulk_actions_running", _int),
    "SYNC_DEADLINE_SECONDS": ("sync_deadline_s", _float),
    "DEFAULT_RATE_LIMIT": ("default_rate_limit", _str),
    "LOG_LEVEL": ("log_level", _str),
    "FRONT_DOOR_REDIS_WAIT_SECONDS": ("front_door_redis_wait_s", _float),
    "REDIS_WAIT_REPLICAS": ("wait_replicas", _int),
    "REDIS_WAIT_TIMEOUT_MS": ("wait_timeout_ms", _int),
    "WEBHOOK_ALLOW_LOOPBACK_HTTP": ("webhook_allow_loopback_http", _bool),
    "WEBHOOK_SECRETS_KEY": ("webhook_secrets_keys", _fernet_keys),
    "WEBHOOK_TIMEOUT_SECONDS": ("webhook_timeout_s", _float),
    "WEBHOOK_RESOLVE_TIMEOUT_SECONDS": ("webhook_resolve_timeout_s", _float),
    "WEBHOOK_LEASE_SECONDS": ("webhook_lease_s", _float),
    "WEBHOOK_RETRY_SCHEDULE": ("webhook_retry_schedule_s", _floats),
    "WEBHOOK_RETRY_FOR_SECONDS": ("webhook_retry_for_s", _float),
    "WEBHOOK_MAX_IN_FLIGHT_PER_WORKSPACE": ("webhook_max_in_flight_per_workspace", _int),
    "WEBHOOK_WAIT_SECONDS": ("webhook_wait_s", _float),
    "WEBHOOK_PROGRESS_EVERY_SECONDS": ("webhook_progress_every_s", _float),
    "WEBHOOK_CIRCUIT_FAILURES": ("webhook_circuit_failures", _int),
    "WEBHOOK_CIRCUIT_COOLING_SECONDS": ("webhook_circuit_cooling_s", _float),
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("otel_endpoint", _url),
    "OBJECT_STORE_URL": ("object_store_url", _object_store_url),
    "AWS_ALLOW_HTTP": ("object_store_allow_http", _bool),
    "RESULT_INLINE_MAX_BYTES": ("result_inline_max_bytes", _int),
    "BODY_INLINE_MAX_BYTES": ("body_inline_max_bytes", _int),
    "RESULT_LINK_SECONDS": ("result_link_s", _int),
    "OBJECT_STORE_PUT_WINDOW_SECONDS": ("object_store_put_window_s", _float),
    "OBJECT_STORE_FALLBACK_MAX_BYTES": ("object_store_fallback_max_bytes", _int),
    # -- batches (issue 35) --
    "MAX_BATCH_LINES": ("max_batch_lines", _int),
    "MAX_BATCH_BYTES": ("max_batch_bytes", _int),
    "MAX_OPEN_BATCHES_PER_WORKSPACE": ("max_open_batches", _int),
}


@dataclass(frozen=True)
class Settings:
    #: Redis holding requests, queues, keys and results. ``router-queue dev``
    #: starts an embedded server instead when the variable is not set at all.
    #: ``redis://``, ``sentinel://...?master_name=NAME`` or ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (then
    #: ``CELERY_BROKER_URL`` must be set).
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Celery broker; empty means the same Redis as ``redis_url``.
    #: ``redis://``, ``sentinel://`` or ``amqp://``; never a cluster.
    broker_url: str = ""
    #: A replica of ``redis_url`` that serves status polls and event streams'
    #: position reads (``redis://``; a ``sentinel://`` URL reads the replicas
    #: those sentinels name). Empty: the primary serves them.
    #: With ``REDIS_URL`` a cluster URL, the same URL: each slot's replicas serve them (docs/DELIVERY.md,
    #: "Status polls served by a replica").
    redis_read_url: str = ""
    #: Origin the absolute status/response/cancel URLs (and a webhook's
    #: ``response_url``) are built on. Empty: the origin the caller used, when
    #: its Host is one of ``trusted_hosts``. The web process needs one of the
    #: two (:meth:`require_public_origin`): never a caller's Host echoed blindly.
    #: With neither, the web process refuses to start, naming both.
    public_base_url: str = ""
    #: Hosts the front door answers for when ``public_base_url`` is empty
    #: (werkzeug's patterns: ``example.com``, ``.example.com`` for it and its
    #: subdomains; a port is ignored). A call naming another gets 400.
    #: URLs then follow the caller's ``Host``; another ``Host`` is ``400 invalid_input``. ``router-queue dev``
    #: and the tests set ``127.0.0.1,localhost``.
    trusted_hosts: tuple[str, ...] = ()
    #: The operator listener's port: ``/metrics``, ``/ops`` and
    #: ``/ops/summary.json`` answer only on connections gunicorn accepted on it
    #: (the Procfile binds it, on ``OPS_HOST``), and 404 on every other port.
    #: 0: nowhere.
    ops_port: int = 8900
    #: The address operator listeners bind: gunicorn's (the Procfile's
    #: ``--bind``) and a worker's metrics endpoint.
    ops_host: str = "127.0.0.1"
    #: The bearer token the operator listeners ask for (``/metrics``, ``/ops``;
    #: ``/healthz`` and ``/readyz`` stay open). Required once ``ops_host`` is
    #: beyond loopback (:meth:`require_ops_token`); empty on loopback: open.
    #: Sent as ``Authorization: Bearer <token>``; in a browser, the password of any user name. Beyond loopback
    #: without it, the process refuses to start.
    ops_token: Secret = Secret("")
    #: Seconds a process reuses its ``/readyz`` answer: one check of Redis
    #: (an INFO per primary) per this, whatever the call rate. 0: every call.
    #: Concurrent calls share one check.
    readyz_cache_s: float = 1.0
    #: The proxies whose ``X-Forwarded-For`` names the caller (the rate bucket
    #: of callers without a key): the variable gunicorn reads for the same
    #: trust (addresses or CIDR networks; ``*``: any peer). = nginx's
    #: ``set_real_ip_from`` plus the address nginx reaches gunicorn from.
    #: ``X-Forwarded-For`` is walked from the right past these to the first other address; gunicorn reads the
    #: same variable for ``X-Forwarded-Proto`` (deploy/README.md).
    forwarded_allow_ips: tuple[str, ...] = ("127.0.0.1", "::1")
    #: The port a Celery worker serves its own counters and histograms on
    #: (``/metrics``, prometheus_client's server on ``ops_host``; workers/main.py),
    #: for Prometheus to scrape each worker. 0: none (``router-queue dev`` and the
    #: tests share one metrics directory, served by the front door instead).
    #: 9100 in Kubernetes. A port already taken is logged, and the worker runs on.
    worker_metrics_port: int = 0
    #: Hosts provider calls may go to (``fnmatch`` patterns on the host name),
    #: over https; plus the origin of ``provider_origin_override`` when set. A
    #: catalog URL or a provider-given URL (BFL's ``polling_url``) elsewhere is
    #: refused as a provider error and never sent our key.
    provider_hosts: tuple[str, ...] = ("api.bfl.ai", "*.bfl.ai", "api.bfl.ml", "*.bfl.ml",
                                       "aiplatform.googleapis.com", "*-aiplatform.googleapis.com",
                                       "api.openai.com")
    #: Seconds a finished request and its result are kept; then ``410``.
    result_retention_s: int = 86_400
    #: Seconds an ``Idempotency-Key`` stays bound to its request.
    idempotency_ttl_s: int = 86_400
    #: Seconds a workspace's credit ledger keeps an entry (35 days): older
    #: ones are trimmed as new holds are written (``router-queue workspace
    #: ledger`` exports it before then).
    ledger_retention_s: int = 3_024_000
    #: Largest submit body accepted, in bytes; larger gets ``413``. The
    #: largest inline request any catalog provider takes: Vertex AI Gemini's
    #: 20 MB total request size (inline images, base64; larger is its own
    #: 413: firebase.google.com/docs/vertex-ai/input-file-requirements), read
    #: as 20,000,000 bytes, the stricter reading. BFL's input_image fields and
    #: OpenAI TTS's 4,096-character input are smaller. Bodies over
    #: BODY_INLINE_MAX_BYTES live in the object store, not Redis; without
    #: one, set this lower (bodies then sit in Redis).
    max_body_bytes: int = 20_000_000
    #: The model catalog (JSON). Defaults to the one shipped in the package.
    catalog_path: str = str(DEFAULT_CATALOG)
    #: Seconds without a 429 after which a provider pool's member's learned cap
    #: (halved at each 429) grows back by one, up to its catalog cap (docs/POOLS.md).
    member_grow_s: float = 10.0
    #: Seconds a request that named X-Comfy-Fallback-Models waits on its model's
    #: pool (every member paused, out or failing) before it runs on the next
    #: model it named; sooner when its start deadline comes first (docs/POOLS.md).
    fallback_after_s: float = 30.0
    #: Seconds each worker process reuses a workspace's region pin read at a
    #: delivery, so a pin set or cleared applies within that many seconds
    #: (0: read at every delivery; docs/POOLS.md, "Region pins").
    region_pin_cache_s: float = 5.0
    #: Replaces the scheme and host of every upstream URL (the stub provider
    #: in tests and the demo). Empty in production.
    provider_origin_override: str = ""
    #: The value of each environment variable the catalog's providers name for
    #: their credentials (``BFL_API_KEY``, ...), masked in ``repr``; a variable
    #: that is unset or empty is absent. Workers hand them to the adapters
    #: (workers/credentials.py).
    #: ``VERTEXAI_ACCESS_TOKEN`` is a fixed Vertex AI token (the stub, tests); leave it unset in production:
    #: tokens then come from google-auth, refreshed before they expire (docs/OPERATIONS.md, "Provider
    #: credentials").
    provider_credentials: Mapping[str, Secret] = field(default_factory=dict, hash=False)
    #: Seconds a request granted a provider slot may wait for its delivery to
    #: claim it before the sweeper publishes it again (its message was lost:
    #: a crash between the grant and the publish, or a worker that died
    #: holding the message).
    republish_after_s: float = 30.0
    #: Seconds between two sweeper runs (Celery beat): lost publishes, expired
    #: leases, queue timeouts.
    #: Caller deadlines too: a deadline is acted on within this.
    sweep_interval_s: float = 5.0
    #: Seconds between two heartbeats of a worker's consumer
    #: (``store/fleet.py``); three missed count it dead.
    #: Dead shows on ``/ops``, in ``ops depths`` and in ``router_queue_workers_alive``.
    worker_heartbeat_s: float = 10.0
    #: Seconds the Redis broker waits for an ack before redelivering. Must be
    #: longer than any task runs; see router_queue/broker/celery_app.py.
    visibility_timeout_s: int = 43_200
    #: Seconds a running request's lease lasts without a heartbeat. A worker
    #: renews its leases every third of this; a request whose lease runs out
    #: (its worker died) is taken over by another delivery.
    lease_s: float = 30.0
    #: How many times a request whose worker died is taken over before it
    #: ends provider_error (a request that kills its worker every time).
    max_takeovers: int = 3
    #: Requests a workspace may have waiting IN_QUEUE (a workspace's own limit,
    #: ``workspace set-limits --max-queued``, wins); past it, ``429 queue_backlog_full``.
    max_queued: int = 1000
    #: Percent of each provider's cap (a pool's: its members' summed),
    #: rounded up, that ``low``-priority work (batch lines, bulk retries)
    #: never takes, so a normal or high request finds a slot free at once
    #: however much low work waits. Never the whole cap (a cap of 1 keeps
    #: none). The cost: low work alone runs on the rest (cap 16 at 10: 14
    #: slots). 0 turns it off.
    low_priority_headroom_pct: int = 10
    #: Retries a request's chain (it, its retries and theirs) may have all
    #: told, sharing its kept body; past it, ``409 retry_limit_reached``.
    retry_max_per_request: int = 10
    #: Most requests one bulk action (``POST /v2/requests/bulk``) matches and
    #: acts on, newest first; its dry run counts as far. Past it, the action
    #: ends with ``limited: true`` (run it again, with ``until``, for the rest).
    max_bulk_requests: int = 10_000
    #: Bulk actions a workspace may have unfinished at once; another is
    #: ``409 concurrency_limit_exceeded`` with Retry-After, nothing written.
    max_bulk_actions_running: int = 10
    #: Calls per caller across all routes, polls included, in Flask-Limiter's
    #: notation ("50/second;2000/minute"); a workspace's own ``rate_limit`` wins.
    #: A change to a workspace's limit applies within 2 s: each front door reuses a key's resolution, its
    #: workspace's limit with it, that long.
    default_rate_limit: str = "50/second"
    #: Seconds the synchronous route holds a connection before it answers
    #: ``504 deadline_exceeded`` (the generation runs on; the same
    #: Idempotency-Key re-attaches). Clients read with a 600 s timeout, so the
    #: answer leaves ``sync_margin_s`` before this mark.
    sync_deadline_s: float = 600.0
    #: The level of every process's log lines (Python logging's names: DEBUG, INFO, WARNING, ...).
    log_level: str = "INFO"
    #: Seconds the front door waits on Redis (connect or answer) before it
    #: answers ``503 service_unavailable``: a stalled or restarting Redis costs a
    #: caller this long, not the workers' 5 s. Admissions and cancels carry a
    #: deadline inside it, checked against Redis's own clock, so one the caller
    #: was told failed never takes effect when Redis wakes.
    #: A submit whose reply was lost reads its outcome back for up to that long again.
    front_door_redis_wait_s: float = 0.8
    #: Replicas that must hold an admission, a cancel or a completion before
    #: it is answered (Redis ``WAIT``). 0: answer as soon as the primary has
    #: it, so a failover can lose what its replica had not yet received.
    #: See docs/DELIVERY.md, "Redis: restarts, stalls and failover".
    wait_replicas: int = 0
    #: Milliseconds such a write waits for its replicas; past it, it is
    #: answered anyway, logged and counted (the write is on the primary).
    #: Keep it well inside ``front_door_redis_wait_s``.
    wait_timeout_ms: int = 100
    #: Let webhooks go to a host that resolves to loopback addresses only, over
    #: http too (``router-queue dev`` and the tests). Off in production:
    #: webhooks go to public https URLs only (router_queue/webhooks/safety.py).
    webhook_allow_loopback_http: bool = False
    #: Keys that encrypt workspaces' webhook signing secrets in Redis
    #: (``store/secret_box.py``), newest first: new secrets are sealed with the
    #: first, any opens. Empty: secrets are stored as given, until the store
    #: holds a sealed one; then every process refuses to start without them.
    #: Unset: ``workspace webhook-secret`` refuses, and plaintext secrets from before encryption keep signing
    #: until ``ops migrate-keys`` seals them. Rotation: deploy/README.md, "Webhook secrets".
    webhook_secrets_keys: tuple[Secret, ...] = ()
    #: OpenTelemetry's OTLP/HTTP collector (``router_queue/tracing.py``): set,
    #: each process exports its spans there; empty, nothing is instrumented.
    #: The exporter reads the other ``OTEL_*`` variables itself.
    #: Spans go to ``.../v1/traces`` under it (docs/OPERATIONS.md, "Tracing (OpenTelemetry)").
    otel_endpoint: str = ""
    #: Seconds one webhook attempt may take: the connect, each read, and the
    #: (capped) response body in all.
    #: It runs from the host's lookup to the answer's status.
    webhook_timeout_s: float = 10.0
    #: Seconds a webhook host's name lookup may take, at submit (past it:
    #: ``400 invalid_input``) and within an attempt's ``webhook_timeout_s``
    #: (past it: a failed attempt); then it is abandoned (webhooks/lookup.py).
    #: At most 8 lookups run per process.
    webhook_resolve_timeout_s: float = 2.0
    #: Seconds an attempt holds its event: a worker killed mid-delivery leaves
    #: the event due again this long after its attempt began. Keep it above
    #: ``webhook_timeout_s``.
    webhook_lease_s: float = 30.0
    #: Seconds before attempt 2, 3, ... of a failed webhook; the last repeats
    #: (router_queue/webhooks/retry_policy.py).
    #: Each wait is +-20 %.
    webhook_retry_schedule_s: tuple[float, ...] = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 7200.0)
    #: Seconds after a webhook event was owed past which no attempt is made: it is given up.
    #: No wait ends later than this either.
    webhook_retry_for_s: float = 86_400.0
    #: Webhook attempts one workspace may have in flight at once, fleet-wide;
    #: its other events wait their turn (not an attempt, not a failure). 0: no cap.
    webhook_max_in_flight_per_workspace: int = 4
    #: Seconds before an event that waited its turn is published again: a
    #: random point of twice this, doubling with each wait in a row up to x64
    #: (beat's sweep publishes it, so up to a sweep later).
    webhook_wait_s: float = 1.0
    #: Seconds between a request's progress events at least; a newer value
    #: replaces one not yet sent instead (``progress.lua``).
    webhook_progress_every_s: float = 2.0
    #: Failed attempts in a row (timeouts, refused connections, HTTP errors) at
    #: one of a workspace's endpoints (a URL origin) that open its circuit. 0: none.
    webhook_circuit_failures: int = 5
    #: Seconds an open circuit keeps that endpoint's events waiting; then one
    #: attempt probes it: an answer closes it, a failure opens it again.
    #: Each waiting event comes back at a random point of the next cooling (doubling with each wait, up to
    #: x64).
    webhook_circuit_cooling_s: float = 30.0
    #: The object store big results live in (``router_queue/blobs``):
    #: ``s3://bucket/prefix`` (AWS and S3-compatible stores, configured by the
    #: standard ``AWS_*`` variables), ``gs://bucket/prefix``, ``file:///path``.
    #: Empty: every result stays in Redis. ``router-queue dev`` uses a directory.
    #: It holds results over ``RESULT_INLINE_MAX_BYTES`` and bodies over ``BODY_INLINE_MAX_BYTES``. S3:
    #: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or an instance/container role or web identity,
    #: ``AWS_REGION``, ``AWS_ENDPOINT_URL`` for R2, MinIO or Ceph; GCS: ``GOOGLE_APPLICATION_CREDENTIALS`` or
    #: the metadata server.
    object_store_url: str = ""
    #: The object store's endpoint may be plain http (``AWS_ALLOW_HTTP=true``: a
    #: local MinIO or test server). Off: https only.
    object_store_allow_http: bool = False
    #: Results up to this many bytes stay in Redis; larger ones go to the
    #: object store when there is one (Redis keeps a pointer).
    #: The pointer: key, size, sha256, content type.
    result_inline_max_bytes: int = 65_536
    #: Request bodies up to this many bytes stay in Redis; larger ones go to
    #: the object store at admission when there is one (Redis keeps a pointer).
    #: Written before the ``201`` (the pointer: key, size, sha256); a store that does not answer is ``503``,
    #: nothing admitted or charged. The worker reads the body back before it claims the request and checks its
    #: sha256.
    body_inline_max_bytes: int = 65_536
    #: Seconds a signed result link (the ``/link`` route) stays valid.
    result_link_s: int = 300
    #: Seconds a worker tries to put a big output into an unanswering object
    #: store (with backoff, its lease renewed) before keeping it in Redis.
    #: Kept within ``OBJECT_STORE_FALLBACK_MAX_BYTES``.
    object_store_put_window_s: float = 300.0
    #: Bytes of big outputs Redis may hold for an unanswering object store,
    #: over the whole store (each provider's family a share: ``store/fallback.py``);
    #: the sweeper moves them to the store when it answers again.
    #: 256 MiB; each provider's share is this divided by the catalog's providers. Full too: the request stays
    #: ``IN_PROGRESS``, uncharged, until one store takes its output.
    object_store_fallback_max_bytes: int = 256 * 1024 * 1024
    # -- batches (issue 35: POST /v2/batches) --
    #: Most lines one batch call may carry (a blank last line is not one); more is ``413 invalid_input``.
    max_batch_lines: int = 10_000
    #: Largest batch call body, in bytes (256 MiB); larger is ``413 invalid_input``. nginx's limit for
    #: ``/v2/batches`` (deploy/nginx/nginx.conf) matches it. Each line's body is still held to MAX_BODY_BYTES.
    max_batch_bytes: int = 256 * 1024 * 1024
    #: Batches a workspace may have open (not yet COMPLETED) at once; one more is ``429
    #: concurrency_limit_exceeded``. Bounds what one tenant makes us keep: at most this many times
    #: MAX_BATCH_LINES lines waiting in batches.
    max_open_batches: int = 5

    @property
    def sync_hold_s(self) -> float:
        """How long the synchronous route really holds: the deadline less a
        margin (5 s, or a tenth of a short deadline) for the 504 to arrive."""
        return max(0.5, self.sync_deadline_s - min(5.0, self.sync_deadline_s / 10))

    def __post_init__(self) -> None:
        cluster = f"{CLUSTER_SCHEME}://"
        if self.broker_url.startswith(cluster):
            raise SettingsError("CELERY_BROKER_URL cannot be a Redis Cluster (kombu has no transport for one): "
                                "name RabbitMQ (amqp://) or a Redis of its own")
        if self.redis_url.startswith(cluster):
            if not self.broker_url:
                raise SettingsError("REDIS_URL names a Redis Cluster, which cannot carry Celery's messages: set "
                                    "CELERY_BROKER_URL to RabbitMQ (amqp://) or a Redis of its own")
            if self.redis_read_url and self.redis_read_url != self.redis_url:
                raise SettingsError("with REDIS_URL a Redis Cluster, REDIS_READ_URL is the same URL (the cluster's "
                                    "replicas serve the reads) or unset")

    @property
    def store_is_cluster(self) -> bool:
        """A Redis Cluster holds the store: its steps run split per slot
        (``store/consistency.py``, chosen by ``Services.build``)."""
        return self.redis_url.startswith(f"{CLUSTER_SCHEME}://")

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    def require_public_origin(self) -> None:
        """The web process's check at start: absolute URLs need an origin that
        is not whatever ``Host`` a caller sends (``router-queue dev`` and the
        tests set ``TRUSTED_HOSTS`` to loopback)."""
        if not self.public_base_url and not self.trusted_hosts:
            raise SettingsError("PUBLIC_BASE_URL (the origin callers reach, e.g. https://router.example.com) "
                                "or TRUSTED_HOSTS (the host names the front door answers for) must be set: "
                                "without either, a caller's Host header would be echoed into status_url and "
                                "into signed webhooks' response_url")

    def require_ops_token(self, port: int) -> None:
        """The check at start of a process that serves an operator listener on
        ``port`` (0: none): one bound beyond loopback never answers without a token."""
        if port and not _loopback(self.ops_host) and not self.ops_token:
            raise SettingsError(f"OPS_TOKEN must be set: OPS_HOST={self.ops_host!r} exposes the operator listener "
                                f"(port {port}: /metrics, /ops) beyond loopback, where it would show every "
                                "tenant's figures to anyone who reaches it. Set OPS_TOKEN to a long random secret "
                                "(Prometheus sends it as a bearer token), or OPS_HOST=127.0.0.1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Build settings from ``environ`` (default ``os.environ``)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (attr, parse) in _ENV.items():
            raw = environ.get(name)
            if raw is not None and raw != "":
                values[attr] = parse(name, raw)
        values.update(overrides)
        if "provider_credentials" not in values:
            values["provider_credentials"] = _credentials(environ, values.get("catalog_path") or DEFAULT_CATALOG)
        return cls(**values)


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, assume it is reachable


def _credentials(environ: Mapping[str, str], catalog_path: str | Path) -> dict[str, Secret]:
    """The credential variables the catalog at ``catalog_path`` names, as set."""
    try:
        names = credential_variables(catalog_path)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"CATALOG_PATH: cannot read the providers' credentials from {catalog_path}: {exc}") \
            from None
    return {name: _secret(name, environ[name]) for name in names if (environ.get(name) or "").strip()}
