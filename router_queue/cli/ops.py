"""``router-queue ops``: what an operator does to the queue by hand."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..requests.outcomes import Cancel
from ..settings import without_password
from ..states import COMPLETED, IN_PROGRESS, IN_QUEUE
from ..store.migrate import legacy_keys_present, migrate, seal_webhook_secrets
from ..store.migrate_data import urgent_heads
from ..store.webhooks import FailingEndpoint
from ..urls import origin
from ..web.operations import recent_failures, summary
from .context import services as _services


def require_router_queue_data() -> None:
    """Refuse to report on a Redis that holds no router-queue data: zeros and
    "no request" from the wrong server read like a healthy empty queue."""
    services = _services()
    where = without_password(services.settings.redis_url)
    if legacy_keys_present(services.redis, consistency=services.consistency):
        raise click.ClickException(
            f"the Redis at {where} holds router-queue data in an earlier key layout: "
            "stop the service and run `router-queue ops migrate-keys`")
    if not services.accounts.any_exist():
        raise click.ClickException(
            f"the Redis at {where} holds no "
            "router-queue data (no workspace was ever created there). Set REDIS_URL to the Redis the service "
            "uses; `router-queue dev` prints its own.")


@click.group("ops")
@click.pass_context
def ops(ctx: click.Context) -> None:
    """Inspect and steer the queues."""
    if ctx.invoked_subcommand != "migrate-keys":  # its store holds data only under the earlier layout
        require_router_queue_data()


@ops.command("depths")
def depths() -> None:
    """Per provider: waiting, in flight, cap, oldest waiting age, and the
    live workers consuming its queue (0: nothing will run what waits)."""
    click.echo("provider\twaiting\tin_flight\tcap\toldest_wait_s\tdraining\tworkspaces_waiting\tlargest\tworkers")
    for row in summary(_services())["providers"]:
        largest = ",".join(f"{w['workspace']}:{w['waiting']}" for w in row["largest"]) or "-"
        click.echo(f"{row['provider']}\t{row['queued']}\t{row['in_flight']}\t{row['cap']}\t"
                   f"{row['oldest_wait_s']}\t{'yes' if row['draining'] else 'no'}\t"
                   f"{row['waiting_workspaces']}\t{largest}\t{row['workers']}")


@ops.command("members")
def members() -> None:
    """Per provider pool member: slots in flight, its catalog cap and the cap
    learned from its 429s, seconds still paused (a 429) or out (a refused
    key), generations sent, 429s and refused keys (docs/POOLS.md)."""
    click.echo("provider\tmember\tin_flight\tcap\tlearned_cap\tpaused_s\tout_s\tsent\t429s\trefused")
    for m in summary(_services())["members"]:
        click.echo(f"{m['provider']}\t{m['member']}\t{m['in_flight']}\t{m['cap']}\t{m['learned_cap']}\t"
                   f"{m['paused_s']}\t{m['out_s']}\t{m['taken']}\t{m['rate_limited']}\t{m['revoked']}")


@ops.command("pins")
def pins() -> None:
    """Per group of regions pinned workspaces wait in: requests waiting,
    requests holding a slot, and the room its members have now; a full group
    waits whole while the rest of the pool is granted (docs/POOLS.md)."""
    click.echo("provider\tgroup\twaiting\tin_flight\troom")
    for row in summary(_services())["pins"]:
        click.echo(f"{row['provider']}\t{row['group']}\t{row['waiting']}\t{row['in_flight']}\t{row['room']}")


@ops.command("failures")
def failures() -> None:
    """Recent failures by model and error_type: counts in the last hour and
    the last 24 h, as the ops page lists them (``store/failures.py``)."""
    services = _services()
    click.echo("model\terror_type\tlast_hour\tlast_24h")
    for row in recent_failures(services, time.time()):
        click.echo(f"{row['model']}\t{row['error_type']}\t{row['last_hour']}\t{row['last_24h']}")


def _record(request_id: str) -> dict[str, Any]:
    """The stored fields, and ``ttl_s``: values of ``Any`` type, since the
    fields are text, ``ttl_s`` an int and ``inspect``'s ``position`` an int or None."""
    record, ttl_s = _services().store.dump(request_id)
    if not record:
        raise click.ClickException(f"no request {request_id} (never admitted, or past retention)")
    return {**record, "ttl_s": ttl_s}


@ops.command("inspect")
@click.argument("request_id")
def inspect(request_id: str) -> None:
    """Everything stored about one request (its body summarised)."""
    record = _record(request_id)
    body = record.pop("body", "")
    record["body"] = f"<{len(body)} bytes>"
    if record.get("webhook_url"):  # its path and query may be the receiver's credential
        record["webhook_url"] = origin(record["webhook_url"]) + "/…"
    record["position"] = _services().store.status_view(request_id, record["provider"]).position
    click.echo(json.dumps(record, indent=2, sort_keys=True))


@ops.command("cancel")
@click.argument("request_id")
def cancel(request_id: str) -> None:
    """Cancel a request as its owner would."""
    record = _record(request_id)
    services = _services()
    outcome = services.store.cancel(request_id=request_id, workspace=record["workspace"],
                                    model=record["model"], provider=record["provider"])
    if outcome is Cancel.EXPIRED:
        raise click.ClickException("Redis answered too late; nothing was cancelled; try again")
    if outcome is Cancel.CANCELLED:
        services.metrics.completed(record["provider"], record["model"], "cancelled")
    click.echo(outcome.lower())


@ops.command("requeue")
@click.argument("request_id")
def requeue(request_id: str) -> None:
    """Publish a request again: a granted one whose message was lost, or a
    running one whose worker is stuck (its lease is ended so another resumes
    it). A request still waiting for a slot has no message; its turn comes."""
    record = _record(request_id)
    services = _services()
    if record["status"] == COMPLETED:
        raise click.ClickException("the request is COMPLETED; there is nothing to requeue")
    if record["status"] == IN_QUEUE and "granted_at" not in record:
        click.echo(f"{request_id} waits for a {record['provider']} slot: it has no message to lose; "
                   "the schedule grants it in its turn")
        return
    if record["status"] == IN_PROGRESS and record.get("token"):
        services.store.renew(request_id, record["provider"], record["token"], 0, hand_back=True)
    assert services.dispatcher is not None, "the CLI's Services are built with its Celery app"
    services.dispatcher.publish(request_id, record["provider"])
    click.echo(f"published {request_id} to {record['provider']}")


@ops.command("drain")
@click.argument("provider")
@click.option("--off", is_flag=True, help="Admit again.")
def drain(provider: str, off: bool) -> None:
    """Stop admitting for a provider (503 service_unavailable); in-flight work finishes."""
    if provider not in _services().catalog.providers():
        raise click.ClickException(f"no provider {provider!r}")
    _services().store.set_draining(provider, not off)
    click.echo(f"{provider} {'admitting' if off else 'draining'}")


def _circuit(row: FailingEndpoint, now: float) -> str:
    if row.open_until is None:
        return "closed"
    if row.open_until > now:
        return f"open until {time.strftime('%H:%M:%SZ', time.gmtime(row.open_until))}"
    return "open, probing"


@ops.command("webhooks")
@click.argument("workspace_id", required=False)
@click.option("--count", type=click.IntRange(min=1), default=20, show_default=True)
def webhooks(workspace_id: str | None, count: int) -> None:
    """Failing webhook endpoints (URL origins) and their circuits; with a
    workspace, its own and its recent attempts, newest first."""
    services = _services()
    if workspace_id is not None and services.accounts.get(workspace_id) is None:
        raise click.ClickException(f"no workspace {workspace_id!r}")
    now = time.time()
    if workspace_id is None:
        click.echo(f"pending events: {services.webhooks.pending()}\tattempts in flight: "
                   f"{services.webhooks.in_flight(now)}")
    click.echo("failing endpoints (failed attempts in a row):")
    failing = services.webhooks.failing(workspace_id)[:count]
    for row in failing:
        who = "" if workspace_id is not None else f"{row.workspace}\t"
        click.echo(f"  {row.failures}\t{who}{row.origin}\t{_circuit(row, now)}")
    if not failing:
        click.echo("  none")
    if workspace_id is None:
        return
    click.echo("recent attempts:")
    click.echo("  at\trequest_id\tattempt\toutcome\tstatus\tseconds\torigin\terror")
    for a in services.webhooks.attempts(workspace_id, count):
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.at))
        click.echo(f"  {at}\t{a.request_id}\t{a.attempt}\t{a.outcome}\t{a.status or '-'}\t{a.seconds:.3f}\t"
                   f"{a.origin}\t{a.error or '-'}")


@ops.command("purge-expired")
def purge_expired() -> None:
    """Drop index entries whose request record has expired (waiting, running)."""
    services = _services()
    purged = services.store.purge_expired(services.catalog.providers())
    click.echo(f"purged {purged} index entries of expired requests")


#: The flag that deletes the requests minted before ids carried their provider's code.
DROP_VERSION_8 = "--drop-version-8"


@ops.command("migrate-keys")
@click.option(DROP_VERSION_8, "drop_version_8", is_flag=True,
              help="Delete the requests minted before ids carried their provider's code (version-8 ids): "
                   "this version no longer reads them, and the migration does not finish while any is left.")
def migrate_keys(drop_version_8: bool) -> None:
    """Move a store's keys from an earlier layout (before the hash tags, or
    one tag for everything) to today's, a hash tag per family, and rewrite
    what an earlier version wrote in a shape only it read (its shared
    draining and webhook due sets, costs not yet kept), with every process of
    the service stopped, and rebuild each schedule's urgent heads (which
    workspaces may take the slots kept from low work); requests minted before ids carried their provider's
    code (version 8) are no longer read: counted, and deleted with
    --drop-version-8. Then seal the webhook secrets with the newest
    WEBHOOK_SECRETS_KEY (plaintext ones, and those of an older key: safe
    while the service runs, and rerun after each key rotation)."""
    services = _services()
    done = migrate(services.redis, consistency=services.consistency, drop_version_8=drop_version_8)
    click.echo(f"moved {done.renamed} keys to today's layout")
    old = done.version_8
    if old.dropped:
        click.echo(f"deleted {old.requests} requests minted before ids carried their provider's code "
                   f"(version 8), {old.keys} keys")
    rewritten = done.rewritten
    click.echo(f"rewrote {rewritten.draining} draining marks, {rewritten.due} due webhook events, "
               f"{rewritten.records} completed records' costs and {rewritten.events} webhook events "
               "an earlier version wrote")
    if rewritten.opened is not None:
        click.echo(f"opened {rewritten.opened} requests admitted before the store was split")
    providers = services.catalog.providers()
    click.echo(f"rebuilt the urgent heads of {len(providers)} providers' schedules: "
               f"{urgent_heads(services.redis, providers)} workspaces may take a slot kept from low work")
    box = services.accounts.box
    if box is None:
        click.echo("WEBHOOK_SECRETS_KEY is not set: webhook secrets left as they are (plaintext)", err=True)
    else:
        click.echo(f"sealed {seal_webhook_secrets(services.redis, box)} webhook secrets with the newest "
                   "WEBHOOK_SECRETS_KEY")
    if done.clashes:
        raise click.ClickException(f"{len(done.clashes)} keys were left: their new name is taken "
                                   f"(first: {', '.join(done.clashes[:5])})")
    if old.left:
        raise click.ClickException(
            f"{old.requests} requests minted before ids carried their provider's code (version 8) are still "
            f"in the store ({old.keys} keys, {_last_expiry(old.last_expiry)}); this version no longer reads "
            f"them, and the layout is not marked migrated while they are left: run `router-queue ops "
            f"migrate-keys {DROP_VERSION_8}` to delete them")


def _last_expiry(at: float | None) -> str:
    if at is None:
        return "none of them expires"
    return "the last expiring at " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
