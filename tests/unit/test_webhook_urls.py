"""Webhook URLs refused at submit for what they are (one http.client would
not send, an IPv4 inside IPv6, a site-local address, port 0), and the name
lookup's bounds: a budget at submit and at delivery, a cap on lookups at once,
and a caller past its rate refused before any lookup is made for it."""

from __future__ import annotations

import dataclasses
import http.client
import ipaddress
import socket
import string
import threading
import time
from urllib.parse import urlsplit

import pytest

from router_queue.webhooks import event as webhook_event, lookup, safety
from tests.unit.route_support import assert_refusal
from tests.unit.support import context_of, deliver_webhook, record_of

FLUX = "/v2/models/bfl/flux-2-pro"
PUBLIC = "93.184.216.34"
_real_getaddrinfo = socket.getaddrinfo


class Resolver:
    """``socket.getaddrinfo`` for every name but ``localhost`` and address
    literals (the system's: Redis): counted, answering ``address``, or hanging
    while ``hang`` is set (released at the test's end). No name leaves the
    machine."""

    def __init__(self, address: str = PUBLIC):
        self.address = address
        self.calls: list[str] = []
        self.returned: list[str] = []
        self.hang = False
        self.release = threading.Event()

    def __call__(self, host, port, *args, **kwargs):
        if host == "localhost" or _is_literal(host):
            return _real_getaddrinfo(host, port, *args, **kwargs)
        self.calls.append(host)
        try:
            if self.hang:
                self.release.wait(10)
                raise socket.gaierror("the nameserver never answered")
            family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
            return [(family, socket.SOCK_STREAM, 6, "", (self.address, port))]
        finally:
            self.returned.append(host)


def _is_literal(host) -> bool:
    try:
        ipaddress.ip_address(str(host))
        return True
    except ValueError:
        return False


@pytest.fixture
def resolver(monkeypatch):
    fake = Resolver()
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    yield fake
    fake.release.set()
    _until(lambda: lookup.running() == 0)  # the abandoned lookups end, and leave their places


def _until(done, tries: int = 250) -> None:
    for _ in range(tries):
        if done():
            return
        time.sleep(0.02)


@pytest.fixture
def hooked(services, workspace, settings):
    """Loopback allowed (as under ``router-queue dev``), a signing secret, and
    a short lookup budget."""
    services.settings = dataclasses.replace(settings, webhook_allow_loopback_http=True,
                                            webhook_resolve_timeout_s=0.3)
    services.accounts.webhook_secret(workspace, webhook_event.new_secret())
    return services


def submit(http, auth, url=None, path=f"{FLUX}/requests"):
    headers = dict(auth)
    if url is not None:
        headers["X-Comfy-Webhook-Url"] = url
    return http.post(path, json={"prompt": "a teapot"}, headers=headers)


# -- each URL form, refused with its reason -----------------------------------------------


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.1:9/a b", "contains a space"),
    ("https://hooks.example.com/hook?to=a b", "contains a space"),
    ("https://[2002:a9fe:a9fe::]/", "carries 169.254.169.254 (6to4), a cloud metadata address"),
    ("https://[2002:0a00:0001::]/", "carries 10.0.0.1 (6to4), a private address"),
    ("https://[64:ff9b::a9fe:a9fe]/", "carries 169.254.169.254 (NAT64), a cloud metadata address"),
    ("https://[64:ff9b::7f00:1]/", "carries 127.0.0.1 (NAT64), a loopback address"),
    ("https://[::ffff:169.254.169.254]/", "a cloud metadata address"),
    ("https://[fec0::1]/", "a site-local address"),
    ("https://[fec0:1:2::3]:8443/hook", "a site-local address"),
    ("https://hooks.example.com:0/hook", "has port 0"),
    ("https://hooks.example.com:65536/hook", "invalid port"),
    ("https://hooks.example.com:+443/hook", "invalid port"),
    ("https://[::1/hook", "malformed host"),
    ("https://hoo{ks.example.com/hook", "neither a DNS name nor an IP address"),
    ("https://-hooks.example.com/hook", "neither a DNS name nor an IP address"),
])
def test_each_url_form_is_refused_with_its_reason(resolver, url, reason):
    with pytest.raises(safety.UnsafeWebhookUrl, match=reason.replace("(", r"\(").replace(")", r"\)")):
        safety.check(url, allow_loopback_http=True)
    assert resolver.calls == []  # an address literal or a malformed URL needs no lookup


def test_an_ipv4_inside_6to4_is_judged_as_that_address(resolver):
    """6to4 is refused for what it carries, not as a whole: a public one passes."""
    public = safety.check("https://[2002:5db8:d822::1]/hook", allow_loopback_http=False)
    assert [str(a) for a in public] == ["2002:5db8:d822::1"]
    resolver.address = "2002:a9fe:a9fe::"  # a name that resolves to the metadata address through 6to4
    with pytest.raises(safety.UnsafeWebhookUrl, match=r"resolves to 2002:a9fe:a9fe::, which carries 169\.254"):
        safety.check("https://hooks.example.com/hook", allow_loopback_http=False)


def _http_client_sends(url: str) -> bool:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 443)
    try:
        connection.putrequest("POST", parts.path + (f"?{parts.query}" if parts.query else ""),
                              skip_host=True, skip_accept_encoding=True)
        connection.putheader("Host", parts.netloc)
        return True
    except (http.client.HTTPException, ValueError, UnicodeError):
        return False
    finally:
        connection.close()


def test_no_url_http_client_would_refuse_is_accepted(resolver):
    """Every ASCII character in the path, the query and the host: whatever
    the check accepts, http.client sends as it is (so no accepted URL fails
    every attempt for 24 h)."""
    for code in range(128):
        c = chr(code)
        for url in (f"https://hooks.example.com/a{c}b", f"https://hooks.example.com/hook?x={c}",
                    f"https://ho{c}oks.example.com/hook"):
            if _accepted(url):
                assert _http_client_sends(url), repr(url)
    assert set(string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@%/") <= {
        chr(code) for code in range(128)
        if _accepted(f"https://hooks.example.com/a{chr(code)}b")}


def _accepted(url: str) -> bool:
    try:
        safety.check(url, allow_loopback_http=False)
        return True
    except safety.UnsafeWebhookUrl:
        return False


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.1:9/a b", "contains a space"),
    ("https://[2002:a9fe:a9fe::]/", "6to4"),
    ("https://[fec0::1]/", "site-local"),
    ("https://hooks.example.com:0/", "port 0"),
])
def test_submit_refuses_them_400_naming_the_header_and_why(hooked, http, auth, dispatcher, resolver, url, reason):
    refused = submit(http, auth, url)
    assert_refusal(refused, 400, "invalid_input")
    assert refused.json["detail"].startswith("X-Comfy-Webhook-Url ") and reason in refused.json["detail"]
    assert dispatcher.published == []


def test_set_webhook_refuses_them_too(app, hooked, workspace, resolver):
    from router_queue.cli import main
    from tests.unit.support import cli_runner
    refused = cli_runner(app).invoke(main, ["workspace", "set-webhook", workspace, "https://[fec0::1]/"])
    assert refused.exit_code == 2 and "site-local" in refused.output
    assert hooked.accounts.webhook_url(workspace) is None


# -- the lookup's budget ------------------------------------------------------------------


def test_a_lookup_that_hangs_answers_the_submit_within_its_budget(hooked, http, auth, dispatcher, resolver):
    resolver.hang = True
    refused = submit(http, auth, "https://slow.example.com/hook")
    assert_refusal(refused, 400, "invalid_input")
    assert refused.json["detail"] == ("X-Comfy-Webhook-Url names a host that did not resolve within 0.3 s: "
                                      "slow.example.com")
    # answered while the lookup still hangs: abandoned, not waited for
    assert resolver.calls == ["slow.example.com"] and resolver.returned == []
    assert dispatcher.published == []


def test_a_lookup_that_hangs_at_delivery_is_a_failed_attempt_within_the_attempts_time(
        hooked, http, auth, workspace, resolver):
    resolver.address = "127.0.0.1"
    request_id = submit(http, auth, "http://hook.example.com:9/hook").json["request_id"]
    hooked.store.complete(record_of(hooked, request_id, "bfl"), error_type="provider_error", detail="x")
    resolver.hang = True  # the name's nameserver stops answering after the submit
    assert deliver_webhook(context_of(hooked), request_id) == "retry"
    attempt, = hooked.webhooks.attempts(workspace)
    assert attempt.outcome == "failed"
    assert attempt.error == "the URL names a host that did not resolve within 0.3 s: hook.example.com"
    assert len(resolver.calls) == 2 and len(resolver.returned) == 1  # the submit's returned; this one was abandoned


def test_lookups_at_once_are_capped_and_past_the_cap_a_submit_is_503(hooked, http, auth, resolver, monkeypatch):
    monkeypatch.setattr(lookup, "MAX_LOOKUPS", 1)
    resolver.hang = True
    assert submit(http, auth, "https://slow.example.com/hook").status_code == 400  # abandoned, still running
    busy = submit(http, auth, "https://other.example.com/hook")
    assert_refusal(busy, 503, "service_unavailable", retry_after=True)
    assert "lookups" in busy.json["detail"] and resolver.calls == ["slow.example.com"]
    resolver.release.set()  # the hung lookup ends: its place is free again
    resolver.hang = False
    _until(lambda: lookup.running() == 0)
    assert submit(http, auth, "https://other.example.com/hook").status_code == 201


def test_one_workspaces_lookups_take_at_most_its_share_of_the_places(hooked, http, auth, resolver, monkeypatch):
    """A tenant whose webhook host's nameserver is a tar pit holds at most
    MAX_LOOKUPS_PER_HOLDER places: its next lookup is refused (503), and
    another workspace's submit still gets its lookup and its 201."""
    monkeypatch.setattr(lookup, "MAX_LOOKUPS", 4)
    monkeypatch.setattr(lookup, "MAX_LOOKUPS_PER_HOLDER", 2)
    other = hooked.accounts.create_workspace("other", queue_enabled=True, credits=1000)
    hooked.accounts.webhook_secret(other, webhook_event.new_secret())
    other_auth = {"X-API-Key": hooked.accounts.mint_key(other)}
    resolver.hang = True
    for n in range(2):  # each abandoned at the budget, its lookup still running
        assert submit(http, auth, f"https://tarpit-{n}.example.com/hook").status_code == 400
    busy = submit(http, auth, "https://tarpit-2.example.com/hook")
    assert_refusal(busy, 503, "service_unavailable", retry_after=True)
    assert "tarpit-2.example.com" not in resolver.calls  # refused before any lookup
    resolver.hang = False
    assert submit(http, other_auth, "https://hooks.example.com/hook").status_code == 201
    assert lookup.running() == 2  # the tar pit's two, still held; the other's came and went


# -- the rate allowance, spent before any lookup ---------------------------------------


def test_a_webhook_submit_over_its_rate_is_refused_before_any_lookup(hooked, http, auth, workspace, resolver):
    hooked.accounts.set_limits(workspace, rate_limit="1/minute")
    assert submit(http, auth).status_code == 201  # the window's one call, without a webhook
    for path in (f"{FLUX}/requests", FLUX):  # the lane's submit, and the synchronous route through Flask
        limited = submit(http, auth, "https://hooks.example.com/hook", path=path)
        assert_refusal(limited, 429, "rate_limited", retry_after=True)
    assert resolver.calls == []


def test_a_webhook_submit_is_counted_once(hooked, http, auth, workspace, resolver):
    hooked.accounts.set_limits(workspace, rate_limit="2/minute")
    assert [submit(http, auth, "https://hooks.example.com/hook").status_code for _ in range(2)] == [201, 201]
    assert_refusal(submit(http, auth), 429, "rate_limited", retry_after=True)
    assert resolver.calls == ["hooks.example.com"] * 2
