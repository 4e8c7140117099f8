"""``router-queue workspace set-regions``: pin a workspace's generations to
regions, or clear the pin (``docs/POOLS.md``, "Region pins")."""

from __future__ import annotations

import click

from ..store import regions as pins
from .context import services


@click.command("set-regions")
@click.argument("workspace_id")
@click.argument("regions", required=False, default="")
@click.option("--clear", is_flag=True, help="Unpin it: any member may run its generations again.")
def set_regions(workspace_id: str, regions: str, clear: bool) -> None:
    """Pin WORKSPACE_ID's generations to REGIONS (us-central1,europe-west4):
    members elsewhere are never used for it, nor members without a region
    unless the catalog marks them any_region. Prints the members that serve it."""
    if clear == bool(regions):
        raise click.UsageError("name the regions (us-central1,europe-west4), or --clear")
    try:
        pinned = () if clear else pins.parse(regions)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="REGIONS") from None
    found = services()
    assert found.regions is not None  # Services.build makes it
    try:
        found.regions.set(workspace_id, pinned)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    if not pinned:
        click.echo(f"{workspace_id} is not pinned: any member may run its generations")
        return
    click.echo(f"{workspace_id} is pinned to {', '.join(pinned)}")
    for provider in found.catalog.providers():
        serving = [m.name for m in found.catalog.members(provider) if m.serves(pinned)]
        click.echo(f"  {provider}: {', '.join(serving) if serving else 'no member serves it: its requests fail'}")
