"""The ``Services`` a command acts on: built once per invocation from the
environment, as the front door builds its own, without the Flask app."""

from __future__ import annotations

import click

from ..broker.celery_app import make_celery
from ..services import Services
from ..settings import Settings, SettingsError


def services() -> Services:
    """This invocation's ``Services`` (a test passes its own as the context's ``obj``)."""
    context = click.get_current_context()
    found = context.find_object(Services)
    if found is None:
        try:
            settings = Settings.from_env()
            found = context.find_root().obj = Services.build(
                settings, celery=make_celery(settings), wait_s=settings.front_door_redis_wait_s,
                write_deadline_s=settings.front_door_redis_wait_s)
        except SettingsError as exc:  # a bad variable, or no key for the store's sealed secrets
            raise click.ClickException(str(exc)) from None
    return found
