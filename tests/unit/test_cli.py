"""The ``router-queue`` command as an operator meets it: its own help and
version, and a clear refusal when pointed at a Redis with no router-queue data."""

from __future__ import annotations

import socket
from importlib.metadata import version

import pytest
from click.testing import CliRunner

from router_queue.cli import main
from router_queue.dev.stack import CURL_STEPS, ROOT, WALKTHROUGH
from tests.unit.support import cli_runner


@pytest.fixture
def runner(app):
    return cli_runner(app)


def test_help_shows_our_options_and_commands_not_flasks(runner):
    shown = runner.invoke(main, ["--help"])
    assert shown.exit_code == 0
    assert {"dev", "ops", "workspace", "key"} <= set(shown.output.split())
    for flasks in ("--app", "--env-file", "--debug", "Flask"):
        assert flasks not in shown.output


def test_version_is_ours(runner):
    shown = runner.invoke(main, ["--version"])
    assert shown.exit_code == 0
    assert shown.output.strip() == f"router-queue, version {version('router-queue')}"
    assert "Flask" not in shown.output and "Werkzeug" not in shown.output


@pytest.mark.parametrize("command", [["ops", "depths"], ["ops", "inspect", "some-id"], ["workspace", "list"],
                                     ["workspace", "ledger", "ws_x"]])
def test_a_redis_with_no_router_queue_data_is_named_instead_of_reported_as_empty(app, services, command):
    assert not services.accounts.any_exist()
    shown = cli_runner(app).invoke(main, command)
    assert shown.exit_code == 1
    assert "holds no router-queue data" in shown.output and "REDIS_URL" in shown.output
    assert "redis://unused" in shown.output  # the URL it read (the unit settings')


def test_with_data_the_same_commands_report(app, services, workspace):
    runner = cli_runner(app)
    depths = runner.invoke(main, ["ops", "depths"])
    assert depths.exit_code == 0 and depths.output.startswith("provider\twaiting")
    listed = runner.invoke(main, ["workspace", "list"])
    assert listed.exit_code == 0 and workspace in listed.output
    header, *rows = [line.split("\t") for line in listed.output.splitlines()]
    assert header == ["id", "queue", "credits", "held", "queued", "weight", "max_in_flight", "queued_bytes",
                      "stored_bytes", "webhooks_pending", "name"]
    assert [len(row) for row in rows] == [len(header)] * len(rows)
    assert workspace in [row[0] for row in rows]
    unknown = runner.invoke(main, ["workspace", "ledger", "ws_nope"])
    assert unknown.exit_code == 1 and "no workspace 'ws_nope'" in unknown.output
    created = runner.invoke(main, ["workspace", "create", "another"])  # creating needs no data first
    assert created.exit_code == 0 and created.output.startswith("ws_")


@pytest.mark.parametrize("command", [["workspace", "list"], ["workspace", "create", "x"], ["ops", "depths"],
                                     ["key", "mint", "ws_x"]])
def test_an_unreachable_redis_is_one_line_naming_it_without_its_password(command):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shown = CliRunner().invoke(main, command, env={"REDIS_URL": f"redis://:hunter2@127.0.0.1:{port}/0"})
    assert shown.exit_code == 1
    assert shown.output.strip().splitlines() == [shown.output.strip()], shown.output
    assert f"cannot reach the Redis at redis://***@127.0.0.1:{port}/0" in shown.output
    assert "hunter2" not in shown.output and "Traceback" not in shown.output


def test_dev_prints_the_readmes_walkthrough_and_the_demo_workspace():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("\n## Walkthrough (cURL)\n", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    assert block.endswith(CURL_STEPS), "README's walkthrough and router-queue dev's printed one differ"
    printed = WALKTHROUGH.format(base="B", stub="S", ops="O", workspace="ws_demo", redis="R", logs="L", key="K",
                                 steps=CURL_STEPS, secrets_key="SK", objects="file:///tmp/objects")
    assert "export WEBHOOK_SECRETS_KEY=SK" in printed  # the operator's webhook-secret needs it
    assert "objects      file:///tmp/objects" in printed  # where its big results go
    assert "export WORKSPACE_ID=ws_demo" in printed and "REQUEST_ID=$(" in printed and "-X PUT" in printed
