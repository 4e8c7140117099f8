"""router-queue workspace set-budget | budgets, router-queue key set-budget:
credit budgets per UTC day, ISO week and calendar month, with the
thresholds (per cent) whose crossing is alerted (``store/budgets.py``)."""

from __future__ import annotations

import click

from ..store.budgets import PERIODS, WORKSPACE, parse_alert_at
from .context import services
from .ops import require_router_queue_data


class AlertAt(click.ParamType):
    """Thresholds as per cents of each budget: "50,80,100"."""

    name = "PERCENTS"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_alert_at(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def budget_options(command):
    """The options both set-budget commands take."""
    for option in reversed((
        click.option("--daily", type=click.IntRange(min=0), help="Credits per UTC day; 0 clears it."),
        click.option("--weekly", type=click.IntRange(min=0), help="Credits per ISO week (from Monday 00:00 UTC); "
                                                                  "0 clears it."),
        click.option("--monthly", type=click.IntRange(min=0), help="Credits per calendar month (UTC); 0 clears it."),
        click.option("--alert-at", type=AlertAt(), help="Per cents of each budget whose crossing is alerted, "
                                                        "once per period (default 80,100)."),
        click.option("--clear", is_flag=True, help="Remove every budget of it."),
    )):
        command = option(command)
    return command


def _apply(workspace: str, scope: str, daily, weekly, monthly, alert_at, clear: bool) -> str:
    budgets = services().accounts.budgets
    if clear:
        budgets.clear(workspace, scope)
        return "budgets cleared"
    if daily is None and weekly is None and monthly is None and alert_at is None:
        raise click.UsageError("name --daily, --weekly, --monthly, --alert-at or --clear")
    budgets.set(workspace, scope, {"day": daily, "week": weekly, "month": monthly}, alert_at)
    return "budgets set"


@click.command("set-budget")
@click.argument("workspace_id")
@budget_options
def set_workspace_budget(workspace_id: str, daily, weekly, monthly, alert_at, clear: bool) -> None:
    """Set a workspace's credit budgets: a submit whose hold would take the
    credits held and charged this period over one answers 402 budget_exceeded."""
    require_router_queue_data()
    if services().accounts.get(workspace_id) is None:
        raise click.ClickException(f"no workspace {workspace_id!r}")
    click.echo(f"{workspace_id}: {_apply(workspace_id, WORKSPACE, daily, weekly, monthly, alert_at, clear)}")


@click.command("set-budget")
@click.argument("key_or_id")
@budget_options
def set_key_budget(key_or_id: str, daily, weekly, monthly, alert_at, clear: bool) -> None:
    """Set an API key's own credit budgets (beside its workspace's): its
    spend counts from when it first has one."""
    try:
        info = services().accounts.keys.find(key_or_id)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    done = _apply(info.workspace, info.id, daily, weekly, monthly, alert_at, clear)
    click.echo(f"{info.id} of {info.workspace}: {done}")


@click.command("budgets")
@click.argument("workspace_id")
def show_budgets(workspace_id: str) -> None:
    """A workspace's budgets and its keys': whose ("workspace" or a key id),
    period, limit, credits held and charged this period, alert thresholds."""
    require_router_queue_data()
    if services().accounts.get(workspace_id) is None:
        raise click.ClickException(f"no workspace {workspace_id!r}")
    click.echo("whose\tperiod\tlimit\tspent\talert_at")
    for budget in services().accounts.budgets.show(workspace_id):
        whose = "workspace" if budget.scope == WORKSPACE else budget.scope
        for period in PERIODS:
            if budget.limits[period]:
                alert_at = ",".join(map(str, budget.alert_at)) or "-"
                click.echo(f"{whose}\t{period}\t{budget.limits[period]}\t{budget.spent[period]}\t{alert_at}")
