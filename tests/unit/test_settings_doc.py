"""docs/CONFIGURATION.md is what ``router_queue.settings_doc`` generates from
settings.py, so a setting added or changed there cannot be missing from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from router_queue import settings, settings_doc

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_reference_is_generated_from_the_settings():
    document = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    assert document == settings_doc.render(), \
        "docs/CONFIGURATION.md differs: run `python -m router_queue.settings_doc > docs/CONFIGURATION.md`"


def test_every_variable_has_a_row_with_its_default_and_a_meaning():
    document = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ") for line in document.splitlines()
            if line.startswith("| `")}
    assert set(settings._ENV) <= set(rows), sorted(set(settings._ENV) - set(rows))
    assert rows["LEASE_SECONDS"][1] == "`30`" and "heartbeat" in rows["LEASE_SECONDS"][2]
    assert rows["MAX_BODY_BYTES"][1] == "`20000000`"
    assert all(cells[2].strip(" |") for cells in rows.values()), "a setting without its #: comment"
    assert len(rows) == len(dataclasses.fields(settings.Settings))
