"""The ``router-queue`` command: accounts, and the one-command demo.

    router-queue workspace create | enable-queue | set-credits | set-limits | list | ledger
    router-queue workspace set-webhook | webhook-secret | set-budget | budgets | set-regions
    router-queue key mint | mint-legacy | list | revoke | rotate | audit | set-budget
    router-queue ops depths | inspect | cancel | requeue | drain | purge-expired | webhooks | migrate-keys
    router-queue dev                # the whole stack on this machine

Each command's arguments: ``--help``, and the synopsis in
``docs/ARCHITECTURE.md``, "The front door's parts".
"""

from __future__ import annotations

import datetime
import itertools
import json
import time

import click
import redis
from flask.cli import get_load_dotenv, load_dotenv
from limits import parse_many

from .. import logs
from ..dev.stack import dev
from ..settings import Settings, SettingsError, without_password
from ..store import quotas
from ..store.apikeys import DEFAULT_OVERLAP_S, NO_WORKSPACE
from ..web.auth import CACHE_TTL_S
from ..webhooks import event as webhook_event, safety
from .budgets import set_key_budget, set_workspace_budget, show_budgets
from .context import services
from .ops import ops, require_router_queue_data
from .regions import set_regions


def _accounts():
    return services().accounts


class RouterQueueGroup(click.Group):
    """The commands act on ``Services`` built from the environment
    (``context.py``), no Flask app; a ``.env`` is read as Flask's CLI reads it."""

    def make_context(self, info_name, args, parent=None, **extra):
        if get_load_dotenv():
            load_dotenv()
        return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context):
        """Every command, with an unreachable Redis said in one line that
        names it (never its password), exiting 1, instead of a traceback."""
        try:
            return super().invoke(ctx)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise click.ClickException(f"cannot reach the Redis at {_redis_where()}: {exc}") from None


def _redis_where() -> str:
    """The Redis the commands use, fit to print."""
    try:
        return without_password(Settings.from_env().redis_url)
    except SettingsError:
        return "REDIS_URL"


@click.group(cls=RouterQueueGroup)
@click.version_option(package_name="router-queue", prog_name="router-queue")
def main() -> None:
    """router-queue: queued delivery of AI model runs.

    `router-queue dev` runs the whole stack on this machine; the other commands
    act on the Redis that REDIS_URL names.
    """


@main.group()
def workspace() -> None:
    """Create and configure workspaces."""


@workspace.command("create")
@click.argument("name")
@click.option("--enable-queue/--no-enable-queue", default=False, help="Switch queued delivery on.")
@click.option("--credits", type=click.IntRange(min=0), default=0, help="Starting credit balance.")
def create_workspace(name: str, enable_queue: bool, credits: int) -> None:
    """Create a workspace and print its id."""
    click.echo(_accounts().create_workspace(name, queue_enabled=enable_queue, credits=credits))


@workspace.command("enable-queue")
@click.argument("workspace_id")
@click.option("--off", is_flag=True, help="Switch queued delivery off instead.")
def enable_queue(workspace_id: str, off: bool) -> None:
    """Switch queued delivery on (or off) for a workspace."""
    _or_fail(lambda: _accounts().set_queue_enabled(workspace_id, not off))
    click.echo(f"queued delivery {'off' if off else 'on'} for {workspace_id}")


@workspace.command("set-credits")
@click.argument("workspace_id")
@click.argument("credits", type=click.IntRange(min=0))
def set_credits(workspace_id: str, credits: int) -> None:
    """Set a workspace's credit balance."""
    _or_fail(lambda: _accounts().set_credits(workspace_id, credits))
    click.echo(f"{workspace_id} has {credits} credits")


@workspace.command("set-limits")
@click.argument("workspace_id")
@click.option("--max-queued", type=click.IntRange(min=0), help="Requests it may have waiting at once.")
@click.option("--rate", "rate_limit", help='Request rate over all routes, e.g. "20/second;1000/minute".')
@click.option("--weight", type=click.IntRange(min=1, max=1000),
              help="Its share of a provider's free slots against other waiting workspaces (default 1).")
@click.option("--max-in-flight", type=click.IntRange(min=0),
              help="Most of its requests in flight per provider; 0 for no cap of its own (the default).")
@click.option("--max-held", type=click.IntRange(min=0),
              help=f"Synchronous calls and event streams it may hold open at once, over every front door "
                   f"(default {quotas.DEFAULT_MAX_HELD}).")
@click.option("--max-queued-bytes", type=click.IntRange(min=0),
              help=f"Body bytes it may have stored for requests not yet completed "
                   f"(default {quotas.DEFAULT_MAX_QUEUED_BYTES}, 256 MiB).")
@click.option("--max-stored-bytes", type=click.IntRange(min=0),
              help=f"Bytes it may keep past its requests' ends: bodies kept for a retry, counted once however "
                   f"many retries share one, until they expire (default {quotas.DEFAULT_MAX_STORED_BYTES}, 10 GiB).")
@click.option("--max-pending-webhooks", type=click.IntRange(min=0),
              help=f"Webhook events it may have pending, owed or to be owed, not yet delivered "
                   f"(default {quotas.DEFAULT_MAX_PENDING_WEBHOOKS}).")
def set_limits(workspace_id: str, max_queued: int | None, rate_limit: str | None, weight: int | None,
               max_in_flight: int | None, max_held: int | None, max_queued_bytes: int | None,
               max_pending_webhooks: int | None, max_stored_bytes: int | None) -> None:
    """Set a workspace's own backlog cap, request rate, fair-share weight,
    concurrency and quotas (held connections, queued body bytes, kept bytes, pending webhook events)."""
    if rate_limit is not None:
        try:
            parse_many(rate_limit)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rate") from None
    _or_fail(lambda: _accounts().set_limits(workspace_id, max_queued=max_queued, rate_limit=rate_limit,
                                            weight=weight, max_in_flight=max_in_flight, max_held=max_held,
                                            max_queued_bytes=max_queued_bytes,
                                            max_pending_webhooks=max_pending_webhooks,
                                            max_stored_bytes=max_stored_bytes))
    click.echo(f"limits set for {workspace_id}")


@workspace.command("list")
def list_workspaces() -> None:
    """List workspaces under a header row: id, queue switch, balance, credits
    held, requests waiting, weight, in-flight cap, queued body bytes, bytes
    kept past requests' ends, pending webhook events, name."""
    require_router_queue_data()
    click.echo("id\tqueue\tcredits\theld\tqueued\tweight\tmax_in_flight\tqueued_bytes\tstored_bytes\t"
               "webhooks_pending\tname")
    for ws in _accounts().list():
        click.echo(f"{ws.id}\t{'on' if ws.queue_enabled else 'off'}\t{ws.credits}\t{ws.held}\t{ws.queued}\t"
                   f"{ws.weight}\t{ws.max_in_flight or '-'}\t{ws.queued_bytes}\t{ws.stored_bytes}\t"
                   f"{ws.webhooks_pending}\t{ws.name}")


class MomentType(click.ParamType):
    """A time given as ISO-8601 (``2026-12-01``, ``2026-12-01T10:00:00Z``;
    UTC unless it names an offset) or as Unix seconds; its value is Unix seconds."""

    name = "TIME"

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, float):
            return value
        try:
            return float(value)
        except ValueError:
            pass
        try:
            moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            self.fail(f"{value!r} is neither ISO-8601 (2026-12-01T10:00:00Z) nor Unix seconds", param, ctx)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.timezone.utc)
        return moment.timestamp()


@workspace.command("ledger")
@click.argument("workspace_id")
@click.option("--since", type=MomentType(), help="Entries from this time on (ISO-8601 or Unix seconds).")
@click.option("--until", type=MomentType(), help="Entries up to this time (ISO-8601 or Unix seconds).")
@click.option("--count", type=click.IntRange(min=1), help="At most this many entries (default: all).")
@click.option("--jsonl", is_flag=True, help="One JSON object per line (an export), instead of tab-separated.")
def ledger(workspace_id: str, since: float | None, until: float | None, count: int | None, jsonl: bool) -> None:
    """The workspace's holds, charges and releases, oldest first, read from
    Redis a page at a time. Entries older than LEDGER_RETENTION_SECONDS are gone."""
    require_router_queue_data()
    if _accounts().get(workspace_id) is None:
        raise click.ClickException(f"no workspace {workspace_id!r}")
    entries = itertools.islice(_accounts().ledger_entries(workspace_id, since, until), count)
    for entry in entries:
        if jsonl:
            click.echo(json.dumps({"id": entry.id, "at": entry.at, "time": _when_ms(entry.at), "type": entry.type,
                                   "request_id": entry.request_id, "amount": entry.amount,
                                   "balance": entry.balance, "held": entry.held}, separators=(",", ":")))
        else:
            click.echo(f"{entry.id}\t{entry.type}\t{entry.amount}\t{entry.request_id}\t"
                       f"balance={entry.balance}\theld={entry.held}")


@workspace.command("set-webhook")
@click.argument("workspace_id")
@click.argument("url", required=False)
@click.option("--events", metavar="LIST",
              help="The events its requests' webhooks get unless a request chooses (X-Comfy-Webhook-Events): "
                   "started,progress,completed or a subset; default completed.")
@click.option("--off", is_flag=True, help="Remove the default URL and events instead.")
def set_webhook(workspace_id: str, url: str | None, events: str | None, off: bool) -> None:
    """The URL a request's events go to when the request names none
    (X-Comfy-Webhook-Url), https, public addresses only; and which events."""
    if off == bool(url or events is not None):
        raise click.UsageError("give a URL, --events, or --off")
    if events is not None:
        try:
            events = webhook_event.parse_events(events)
        except webhook_event.UnknownEvents as exc:
            raise click.BadParameter(str(exc), param_hint="--events") from None
    if url:
        settings = services().settings
        try:
            safety.check(url, allow_loopback_http=settings.webhook_allow_loopback_http,
                         resolve_timeout_s=settings.webhook_resolve_timeout_s)
        except safety.UnsafeWebhookUrl as exc:
            raise click.BadParameter(str(exc), param_hint="URL") from None
    if off:
        _or_fail(lambda: _accounts().set_webhook_url(workspace_id, None))
        _or_fail(lambda: _accounts().set_webhook_events(workspace_id, None))
        click.echo(f"no default webhook for {workspace_id}")
        return
    if url:
        _or_fail(lambda: _accounts().set_webhook_url(workspace_id, url))
        click.echo(f"webhooks of {workspace_id} go to {url} unless a request names its own")
    if events is not None:
        _or_fail(lambda: _accounts().set_webhook_events(workspace_id, events))
        click.echo(f"webhooks of {workspace_id} get {events} unless a request chooses its own")
    if url and not _accounts().signing_secrets(workspace_id):
        click.echo(f"no signing secret yet: submits are refused (400) until it has one; run "
                   f"router-queue workspace webhook-secret {workspace_id}", err=True)


@workspace.command("webhook-secret")
@click.argument("workspace_id")
@click.option("--rotate", is_flag=True,
              help="Replace the secret; the old one keeps signing beside it for 24 h.")
def webhook_secret(workspace_id: str, rotate: bool) -> None:
    """Create the workspace's webhook signing secret and print it, once. It is
    never shown again: with one in place, --rotate makes and prints a new one."""
    if _accounts().box is None:
        raise click.ClickException("WEBHOOK_SECRETS_KEY is not set: the secret would be stored in plaintext. Set it "
                                   "(deploy/README.md, \"Webhook secrets\"; router-queue dev prints its own)")
    secret = webhook_event.new_secret()
    outcome = _or_fail(lambda: _accounts().webhook_secret(workspace_id, secret, rotate=rotate))
    if outcome == "EXISTS":
        raise click.ClickException(f"{workspace_id} has a webhook secret already and it is never shown again; "
                                   "--rotate makes a new one (the old one keeps signing for 24 h)")
    click.echo(secret)
    if outcome == "ROTATED":
        click.echo("the previous secret signs beside this one for 24 h: update your receiver within that time",
                   err=True)


@main.group()
def key() -> None:
    """Mint, list, revoke and rotate API keys. Every change is audited."""
    logs.configure_audit()


@key.command("mint")
@click.argument("workspace_id")
@click.option("--label", default="", help="What the key is for, shown by key list.")
def mint_key(workspace_id: str, label: str) -> None:
    """Mint an API key for a workspace. It is printed once (its id goes to
    stderr) and stored only hashed."""
    api_key, info = _or_fail(lambda: _api_keys().mint(workspace_id, label=label))
    click.echo(api_key)
    click.echo(f"minted {info.id} for {workspace_id}", err=True)


@key.command("mint-legacy")
@click.option("--label", default="", help="What the key is for, shown by key list -.")
def mint_legacy_key(label: str) -> None:
    """Mint a key that belongs to no workspace (queued delivery answers 403 for it)."""
    api_key, info = _api_keys().mint(None, label=label)
    click.echo(api_key)
    click.echo(f"minted {info.id} (no workspace; its own namespace {info.namespace})", err=True)


@key.command("list")
@click.argument("workspace_id")
def list_keys(workspace_id: str) -> None:
    """A workspace's live keys ("-": the legacy keys): id, label, created,
    last used, until when it works; never the key itself."""
    require_router_queue_data()
    if workspace_id != NO_WORKSPACE and _accounts().get(workspace_id) is None:
        raise click.ClickException(f"no workspace {workspace_id!r}")
    api_keys = _api_keys()
    api_keys.index_unrecorded()
    click.echo("id\tlabel\tcreated\tlast used\tworks until\tnote")
    for info in api_keys.list(workspace_id):
        note = "; ".join(filter(None, [f"rotated from {info.rotated_from}" if info.rotated_from else "",
                                       f"rotated to {info.rotated_to}" if info.rotated_to else ""]))
        click.echo(f"{info.id}\t{info.label or '-'}\t{_when(info.created_at)}\t{_when(info.last_used_at, 'never')}\t"
                   f"{_when(info.expires_at, 'no end')}\t{note or '-'}")


@key.command("revoke")
@click.argument("key_or_id")
def revoke_key(key_or_id: str) -> None:
    """Revoke a key, named by its id (key_…) or by the key itself. Every front
    door refuses it (401) within a few seconds."""
    info = _or_fail(lambda: _api_keys().revoke(key_or_id))
    click.echo(f"revoked {info.id} of {info.workspace}; every front door refuses it within "
               f"{CACHE_TTL_S:g} s")


@key.command("rotate")
@click.argument("key_or_id")
@click.option("--overlap", "overlap_s", type=click.IntRange(min=0), default=DEFAULT_OVERLAP_S, show_default=True,
              help="Seconds the old key keeps working beside the new one; 0 stops it now.")
def rotate_key(key_or_id: str, overlap_s: int) -> None:
    """Mint a successor for a key (same workspace and label) and print it,
    once; the old key works beside it for the overlap, then stops."""
    api_key, old, new = _or_fail(lambda: _api_keys().rotate(key_or_id, overlap_s=overlap_s))
    click.echo(api_key)
    click.echo(f"minted {new.id} to succeed {old.id}, which works until {_when(old.expires_at, 'now')}", err=True)


@key.command("audit")
@click.argument("workspace_id")
@click.option("--count", type=click.IntRange(min=1), default=100, show_default=True)
def key_audit(workspace_id: str, count: int) -> None:
    """A workspace's last key changes, newest first: when, what, which key, by whom."""
    require_router_queue_data()
    for line in _api_keys().audit(workspace_id, count):
        more = " ".join(f"{k}={line[k]}" for k in ("successor", "overlap_s") if k in line)
        click.echo(f"{_when(line['at'])}\t{line['action']}\t{line['key_id']}\t{line.get('label') or '-'}\t"
                   f"by={line.get('by', '?')}\t{more}".rstrip())


def _api_keys():
    return _accounts().keys


def _when(at: float | None, absent: str = "-") -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)) if at else absent


def _when_ms(at: float) -> str:
    """``at`` (Unix s) as ISO-8601 UTC, to the millisecond."""
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def _or_fail(action):
    try:
        return action()
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None


workspace.add_command(set_workspace_budget)
workspace.add_command(show_budgets)
key.add_command(set_key_budget)
main.add_command(dev)
main.add_command(ops)
workspace.add_command(set_regions)
