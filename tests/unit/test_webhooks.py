"""Signed webhooks: URL safety, the Standard Webhooks signature (checked with
the ``standardwebhooks`` package, not our code), the retry policy, the
events' life in Redis (fakeredis and real Redis), and one worker attempt
against a receiver on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import random
import re
import socket
import time

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from router_queue.store import keys
from router_queue.webhooks import event as webhook_event, retry_policy, safety
from tests.unit.support import cli_runner, context_of, deliver_webhook, record_of
from tests.unit.webhook_support import Receiver
from workers.sweeper import sweep

FLUX = "bfl/flux-2-pro"
BODY = {"prompt": "a teapot"}


def resolver(*addresses: str):
    def resolve(host, port, type=0):
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in addresses]
    return resolve


# -- URL safety ---------------------------------------------------------------------


def test_a_public_https_url_passes():
    assert [str(a) for a in safety.check("https://hooks.example.com/x", allow_loopback_http=False,
                                         resolve=resolver("93.184.216.34"))] == ["93.184.216.34"]


@pytest.mark.parametrize("address, kind", [
    ("10.1.2.3", "private"), ("192.168.0.10", "private"), ("172.16.5.5", "private"),
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("169.254.1.1", "link-local"),
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
    ("::ffff:10.0.0.1", "private"), ("100.64.0.1", "not a public address"),
])
def test_non_public_addresses_are_refused(address, kind):
    with pytest.raises(safety.UnsafeWebhookUrl, match=kind):
        safety.check("https://hooks.example.com/x", allow_loopback_http=False, resolve=resolver(address))


def test_one_private_address_among_public_ones_is_enough_to_refuse():
    with pytest.raises(safety.UnsafeWebhookUrl, match="private"):
        safety.check("https://h.example.com", allow_loopback_http=False, resolve=resolver("93.184.216.34", "10.0.0.1"))


def test_http_and_other_schemes_are_refused():
    for url in ("http://hooks.example.com/x", "ftp://hooks.example.com/x", "hooks.example.com", ""):
        with pytest.raises(safety.UnsafeWebhookUrl):
            safety.check(url, allow_loopback_http=True, resolve=resolver("93.184.216.34"))


def test_loopback_http_only_with_the_setting():
    with pytest.raises(safety.UnsafeWebhookUrl):
        safety.check("http://127.0.0.1:9000/hook", allow_loopback_http=False)
    assert safety.check("http://127.0.0.1:9000/hook", allow_loopback_http=True)
    # the setting never opens private or metadata addresses
    with pytest.raises(safety.UnsafeWebhookUrl, match="metadata"):
        safety.check("http://169.254.169.254/latest", allow_loopback_http=True)
    with pytest.raises(safety.UnsafeWebhookUrl):
        safety.check("http://h.example.com/", allow_loopback_http=True, resolve=resolver("10.0.0.1"))


def test_credentials_in_the_url_and_unresolvable_hosts_are_refused():
    with pytest.raises(safety.UnsafeWebhookUrl, match="credentials"):
        safety.check("https://user:pw@hooks.example.com/", allow_loopback_http=False, resolve=resolver("93.184.216.34"))

    def fails(*_a, **_k):
        raise socket.gaierror("no such host")
    with pytest.raises(safety.UnsafeWebhookUrl, match="does not resolve"):
        safety.check("https://nowhere.invalid/", allow_loopback_http=False, resolve=fails)


# -- the signature, verified by the standardwebhooks package ---------------------------


def test_the_signature_verifies_with_standardwebhooks():
    secret = webhook_event.new_secret()
    body = webhook_event.event_body(request_id="r1", model=FLUX, status="COMPLETED", error_type=None,
                           response_url="https://x/r1", created_at=1.0, started_at=None, completed_at=2.5,
                                    cost={"credits": 60, "state": "charged"})
    headers = webhook_event.signed_headers("msg_r1", body, [secret], int(time.time()))
    event = Webhook(secret).verify(body, headers)
    assert event["request_id"] == "r1" and event["error_type"] is None and event["started_at"] is None
    assert event["completed_at"] == "1970-01-01T00:00:02.500Z"
    with pytest.raises(WebhookVerificationError):
        Webhook(webhook_event.new_secret()).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body + b" ", headers)


def test_during_a_rotation_both_secrets_sign():
    old, new = webhook_event.new_secret(), webhook_event.new_secret()
    body = b'{"request_id":"r"}'
    headers = webhook_event.signed_headers("msg_r", body, [new, old], int(time.time()))
    assert len(headers["webhook-signature"].split(" ")) == 2
    Webhook(old).verify(body, headers)
    Webhook(new).verify(body, headers)


# -- the retry policy ----------------------------------------------------------------------


def test_the_retry_policy_backs_off_with_jitter_and_stops_after_24_hours():
    rand = random.Random(7)
    for attempt, base in enumerate(retry_policy.DEFAULT_DELAYS_S, start=1):
        delay = retry_policy.delay_after(attempt, rand=rand)
        assert base * 0.8 <= delay <= base * 1.2
    assert 7200 * 0.8 <= retry_policy.delay_after(40, rand=rand) <= 7200 * 1.2
    # attempts made in 24 h, the first at 0
    now, attempts = 0.0, 1
    while (at := retry_policy.next_attempt_at(attempts, now, 0.0, rand=rand)) is not None:
        now, attempts = at, attempts + 1
    assert now <= retry_policy.DEFAULT_WINDOW_S
    assert 15 <= attempts <= 19


# -- events in Redis -------------------------------------------------------------------------


@pytest.fixture
def hooked(services, workspace, settings):
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True, webhook_lease_s=30)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    return services


def submit(http, auth, url=None, model=FLUX):
    headers = dict(auth)
    if url is not None:
        headers["X-Comfy-Webhook-Url"] = url
    return http.post(f"/v2/models/{model}/requests", json=BODY, headers=headers)


def test_submit_refuses_an_unsafe_webhook_url(http, auth):
    for url in ("http://hooks.example.com/x", "https://169.254.169.254/", "https://10.0.0.1/", "not a url"):
        response = submit(http, auth, url)
        assert response.status_code == 400, url
        assert response.json["error_type"] == "invalid_input"
        assert "X-Comfy-Webhook-Url" in response.json["detail"]


def test_loopback_http_is_refused_at_submit_without_the_setting(http, auth):
    assert submit(http, auth, "http://127.0.0.1:9/hook").status_code == 400


def test_completion_and_the_owed_event_are_one_step(hooked, http, auth, workspace):
    request_id = submit(http, auth, "http://127.0.0.1:9/hook").json["request_id"]
    assert hooked.webhooks.event(request_id) == {}
    record = record_of(hooked, request_id, "bfl")
    hooked.store.complete(record, output=b"{}", content_type="application/json")
    event = hooked.webhooks.event(request_id)
    assert event["state"] == "pending" and event["url"] == "http://127.0.0.1:9/hook"
    assert event["response_url"] == f"http://router.test/v2/models/{FLUX}/requests/{request_id}"
    assert event["workspace"] == workspace and event["error_type"] == ""
    assert hooked.webhooks.owed(request_id)
    # the sweeper's pick pushes it back a lease, so the next sweep does not publish it again
    now = time.time()
    assert hooked.webhooks.due(now=now + 1, again_at=now + 31) == [request_id]
    assert hooked.webhooks.due(now=now + 2, again_at=now + 32) == []


def test_no_url_no_event(hooked, http, auth):
    request_id = submit(http, auth).json["request_id"]
    hooked.store.complete(record_of(hooked, request_id, "bfl"), output=b"{}", content_type="application/json")
    assert hooked.webhooks.event(request_id) == {} and hooked.webhooks.pending() == 0


def test_a_cancel_while_queued_owes_the_event_and_the_workspace_default_applies(hooked, http, auth, workspace):
    hooked.accounts.set_webhook_url(workspace, "http://127.0.0.1:9/default")
    request_id = submit(http, auth).json["request_id"]
    assert http.put(f"/v2/models/{FLUX}/requests/{request_id}/cancel", headers=auth).status_code == 202
    event = hooked.webhooks.event(request_id)
    assert event["url"] == "http://127.0.0.1:9/default" and event["error_type"] == "cancelled"
    # the request's own header wins over the default
    own = submit(http, auth, "http://127.0.0.1:9/own").json["request_id"]
    http.put(f"/v2/models/{FLUX}/requests/{own}/cancel", headers=auth)
    assert hooked.webhooks.event(own)["url"] == "http://127.0.0.1:9/own"


def owe(services, http, auth, url):
    request_id = submit(http, auth, url).json["request_id"]
    services.store.complete(record_of(services, request_id, "bfl"), error_type="provider_error", detail="x")
    return request_id


def test_one_attempt_at_a_time_and_the_outcomes(hooked, http, auth, workspace):
    request_id = owe(hooked, http, auth, "http://127.0.0.1:9/hook")
    webhooks, now = hooked.webhooks, time.time()
    taken = webhooks.take(request_id, now=now, lease_s=30, token="a")
    assert taken.outcome == "TAKEN" and taken.event.attempt == 1 and taken.event.error_type == "provider_error"
    assert webhooks.take(request_id, now=now + 1, lease_s=30, token="b").outcome == "BUSY"
    assert webhooks.record(taken.event, token="a", now=now + 2, outcome="failed", status=500, error="HTTP 500",
                           seconds=0.1, next_at=now + 10) == "RETRY"
    assert webhooks.take(request_id, now=now + 5, lease_s=30, token="c").outcome == "NOT_DUE"
    assert webhooks.due(now=now + 5, again_at=now + 35) == []
    assert webhooks.due(now=now + 10, again_at=now + 40) == [request_id]
    second = webhooks.take(request_id, now=now + 11, lease_s=30, token="d")
    assert second.event.attempt == 2 and second.event.first_attempt_at == pytest.approx(now)
    assert [(f.workspace, f.origin, f.failures) for f in webhooks.failing(workspace)] == [
        (workspace, "http://127.0.0.1:9", 1)]
    assert webhooks.record(second.event, token="d", now=now + 12, outcome="delivered", status=204, error="",
                           seconds=0.1, next_at=None) == "DELIVERED"
    assert webhooks.failing(workspace) == [] and webhooks.pending() == 0
    assert webhooks.take(request_id, now=now + 13, lease_s=30, token="e").outcome == "DONE"
    assert [a.outcome for a in webhooks.attempts(workspace)] == ["delivered", "failed"]


def test_a_killed_attempts_event_comes_back_after_its_lease(hooked, http, auth):
    request_id = owe(hooked, http, auth, "http://127.0.0.1:9/hook")
    now = time.time()
    first = hooked.webhooks.take(request_id, now=now, lease_s=30, token="dead")
    assert hooked.webhooks.due(now=now + 29, again_at=now + 59) == []
    assert hooked.webhooks.due(now=now + 31, again_at=now + 61) == [request_id]
    second = hooked.webhooks.take(request_id, now=now + 31, lease_s=30, token="alive")
    assert second.outcome == "TAKEN" and second.event.attempt == 2
    # the dead attempt's late failure changes nothing; the live one decides
    assert hooked.webhooks.record(first.event, token="dead", now=now + 32, outcome="failed", status=None,
                                  error="x", seconds=1, next_at=now + 40) == "STALE"


def test_410_stops_and_the_window_gives_up(hooked, http, auth):
    gone = owe(hooked, http, auth, "http://127.0.0.1:9/gone")
    taken = hooked.webhooks.take(gone, now=time.time(), lease_s=30, token="t")
    assert hooked.webhooks.record(taken.event, token="t", now=time.time(), outcome="gone", status=410, error="",
                                  seconds=0.1, next_at=None) == "GONE"
    assert hooked.webhooks.event(gone)["state"] == "gone" and hooked.webhooks.pending() == 0
    late = owe(hooked, http, auth, "http://127.0.0.1:9/late")
    taken = hooked.webhooks.take(late, now=time.time(), lease_s=30, token="t")
    assert hooked.webhooks.record(taken.event, token="t", now=time.time(), outcome="failed", status=503, error="",
                                  seconds=0.1, next_at=None) == "GAVE_UP"
    assert hooked.webhooks.event(late)["state"] == "given_up"


def test_secrets_are_created_once_and_rotated(services, workspace):
    accounts = services.accounts
    assert accounts.signing_secrets(workspace) == []
    assert accounts.webhook_secret(workspace, "whsec_AAAA") == "CREATED"
    assert accounts.webhook_secret(workspace, "whsec_BBBB") == "EXISTS"
    assert accounts.signing_secrets(workspace) == ["whsec_AAAA"]
    assert accounts.webhook_secret(workspace, "whsec_CCCC", rotate=True) == "ROTATED"
    assert accounts.signing_secrets(workspace) == ["whsec_CCCC", "whsec_AAAA"]
    assert accounts.signing_secrets(workspace, now=time.time() + 86_401) == ["whsec_CCCC"]
    with pytest.raises(LookupError):
        accounts.webhook_secret("ws_nope", "whsec_x")


# -- one worker attempt, against a receiver of our own ----------------------------------------


@pytest.fixture
def receiver():
    made = []

    def make(*statuses):
        made.append(Receiver(statuses))
        return made[-1]
    yield make
    for r in made:
        r.close()


def test_a_worker_attempt_signs_retries_and_delivers(hooked, http, auth, workspace, receiver):
    secret = webhook_event.new_secret()
    hooked.accounts.webhook_secret(workspace, secret, rotate=True)  # the fixture's is then the previous one
    hook = receiver(500, 302)
    request_id = owe(hooked, http, auth, hook.url)
    context = context_of(hooked)
    assert deliver_webhook(context, request_id) == "retry"
    assert deliver_webhook(context, request_id) == "not_due"
    hooked.redis.hset(keys.webhook_event(request_id), "next_at", 0)
    assert deliver_webhook(context, request_id) == "retry"  # a redirect is not followed
    hooked.redis.hset(keys.webhook_event(request_id), "next_at", 0)
    assert deliver_webhook(context, request_id) == "delivered"
    assert len(hook.got) == 3
    ids = {headers["webhook-id"] for headers, _ in hook.got}
    assert ids == {f"msg_{request_id}"}
    bodies = {body for _, body in hook.got}
    assert len(bodies) == 1  # the same bytes every attempt
    for headers, body in hook.got:
        event = Webhook(secret).verify(body, headers)
    assert event["request_id"] == request_id and event["error_type"] == "provider_error"
    assert [a.outcome for a in hooked.webhooks.attempts(workspace)] == ["delivered", "failed", "failed"]


def test_a_410_stops_and_an_unsafe_address_is_refused_at_delivery(hooked, http, auth, workspace, receiver):
    hooked.accounts.webhook_secret(workspace, webhook_event.new_secret())
    hook = receiver(410)
    gone = owe(hooked, http, auth, hook.url)
    assert deliver_webhook(context_of(hooked), gone) == "gone"
    # loopback was allowed at submit; a worker without the setting refuses it
    again = owe(hooked, http, auth, hook.url)
    strict = dataclasses.replace(hooked, settings=dataclasses.replace(hooked.settings,
                                                                      webhook_allow_loopback_http=False))
    assert deliver_webhook(context_of(strict), again) == "retry"
    assert hooked.webhooks.attempts(workspace)[0].error.startswith("the URL resolves to 127.0.0.1")
    assert len(hook.got) == 1


def test_the_sweeper_publishes_due_events(hooked, http, auth):
    request_id = owe(hooked, http, auth, "http://127.0.0.1:9/hook")
    context = context_of(hooked)
    report = sweep(context, now=time.time() + 1)
    assert report.webhooks == 1 and (request_id, "webhook") in context.dispatcher.published


def test_metrics_count_webhook_attempts(hooked, http, ops_http, auth, workspace, receiver):
    hooked.accounts.webhook_secret(workspace, webhook_event.new_secret())
    request_id = owe(hooked, http, auth, receiver().url)

    def counted() -> tuple[float, float]:
        text = ops_http.get("/metrics").get_data(as_text=True)
        delivered = re.search(r'^router_queue_webhook_deliveries_total\{outcome="delivered"\} (\S+)$', text, re.M)
        timed = re.search(r"^router_queue_webhook_delivery_seconds_count (\S+)$", text, re.M)
        assert delivered and timed, text
        return float(delivered.group(1)), float(timed.group(1))

    before = counted()
    deliver_webhook(context_of(hooked), request_id)
    assert [after - was for after, was in zip(counted(), before)] == [1, 1]


# -- the operator's commands ---------------------------------------------------------------------


def test_the_secret_is_shown_once_and_rotated_by_the_cli(app, services, workspace, caplog):
    from router_queue.cli import main
    runner = cli_runner(app)
    created = runner.invoke(main, ["workspace", "webhook-secret", workspace])
    assert created.exit_code == 0 and created.output.strip().startswith("whsec_")
    again = runner.invoke(main, ["workspace", "webhook-secret", workspace])
    assert again.exit_code == 1 and "whsec_" not in again.output and "--rotate" in again.output
    rotated = runner.invoke(main, ["workspace", "webhook-secret", workspace, "--rotate"])
    new = rotated.output.strip().splitlines()[0]
    assert rotated.exit_code == 0 and new.startswith("whsec_") and new != created.output.strip()
    assert services.accounts.signing_secrets(workspace) == [new, created.output.strip()]
    assert "whsec_" not in caplog.text


def test_set_webhook_checks_the_url_and_ops_webhooks_reports(app, hooked, http, ops_http, auth, workspace):
    from router_queue.cli import main
    runner = cli_runner(app)
    refused = runner.invoke(main, ["workspace", "set-webhook", workspace, "https://10.0.0.1/"])
    assert refused.exit_code == 2 and "private" in refused.output
    request_id = owe(hooked, http, auth, "http://127.0.0.1:9/hook")
    taken = hooked.webhooks.take(request_id, now=time.time(), lease_s=30, token="t")
    hooked.webhooks.record(taken.event, token="t", now=time.time(), outcome="failed", status=503,
                           error="HTTP 503", seconds=0.25, next_at=time.time() + 5)
    shown = runner.invoke(main, ["ops", "webhooks", workspace])
    assert shown.exit_code == 0, shown.output
    assert "1\thttp://127.0.0.1:9\tclosed" in shown.output and request_id in shown.output
    assert "HTTP 503" in shown.output and "/hook" not in shown.output
    page = ops_http.get("/ops").get_data(as_text=True)
    assert "http://127.0.0.1:9" in page and "/hook" not in page
