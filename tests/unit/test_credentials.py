"""Provider credentials from the catalog's configuration, and the Vertex AI
token: fetched with google-auth from a fake OAuth2 token endpoint (a real HTTP
server on 127.0.0.1), reused while fresh, fetched again before it expires.

No live Google endpoint is contacted: every HTTP request these tests make
goes through ``LocalOnly``, which refuses any host but 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.auth import _helpers, jwt

from router_queue.catalog import DEFAULT_MAX_IN_FLIGHT, Catalog, CatalogError
from router_queue.settings import DEFAULT_CATALOG, Settings, SettingsError
from workers.credentials import GOOGLE_SCOPES, Credentials
from workers.providers import ProviderCall, ProviderFailure, vertexai
from workers.providers.hosts import ProviderHosts

GEMINI = "vertexai/gemini-3.1-flash-image"
GOOGLE_TOKEN_AUDIENCE = "https://oauth2.googleapis.com/token"
#: How long a fake token stays fresh: google-auth counts a token stale this
#: long before its expiry, so expires_in is the threshold plus FRESH_S.
FRESH_S = 2.0


class LocalOnly(requests.Session):
    """A session that refuses to leave this machine, and logs where it went."""

    def __init__(self):
        super().__init__()
        self.trust_env = False
        self.urls: list[str] = []

    def request(self, method, url, *args, **kwargs):
        assert urlsplit(url).hostname == "127.0.0.1", f"a test tried to reach {url}"
        self.urls.append(url)
        return super().request(method, url, *args, **kwargs)


@dataclass
class FakeGoogle:
    """Plays Google's OAuth2 token endpoint (``POST /token``, a JWT-bearer
    grant signed by the service account's key) and Vertex AI's
    ``generateContent`` (records the bearer token it was called with)."""

    origin: str = ""
    public_pem: bytes = b""
    client_email: str = "router@test-project.iam.gserviceaccount.com"
    expires_in: float = 3600
    #: Answer the next token requests with this status (400: invalid_grant).
    token_status: int = 200
    issued: list[str] = field(default_factory=list)
    bearers: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def token_uri(self) -> str:
        return f"{self.origin}/token"

    def token(self, form: dict[str, list[str]]) -> tuple[int, dict]:
        assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
        # Signed by the file's key; addressed, as google-auth always addresses
        # it, to Google's endpoint (a claim inside the JWT, not a connection).
        claims = jwt.decode(form["assertion"][0], certs=self.public_pem, audience=GOOGLE_TOKEN_AUDIENCE)
        assert claims["iss"] == self.client_email
        assert claims["scope"].split() == list(GOOGLE_SCOPES)
        time.sleep(0.1)  # long enough for concurrent callers to pile up behind one refresh
        if self.token_status != 200:
            return self.token_status, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
        with self.lock:
            token = f"ya29.fake-{len(self.issued) + 1}"
            self.issued.append(token)
        return 200, {"access_token": token, "expires_in": self.expires_in, "token_type": "Bearer"}

    def generate(self, authorization: str) -> tuple[int, dict]:
        scheme, _, token = authorization.partition(" ")
        assert scheme == "Bearer"
        with self.lock:
            self.bearers.append(token)
        return 200, {"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]},
                                     "finishReason": "STOP"}]}


@pytest.fixture
def google():
    fake = FakeGoogle()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/token":
                status, payload = fake.token(parse_qs(body.decode()))
            else:
                status, payload = fake.generate(self.headers.get("Authorization", ""))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    fake.origin = f"http://127.0.0.1:{server.server_port}"
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture
def service_account_file(google, tmp_path):
    """A service-account key file, as the console downloads it, whose
    ``token_uri`` is the fake endpoint."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    google.public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo)
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
    path = tmp_path / "service-account.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "test-project", "private_key_id": "key-1",
        "private_key": private_pem, "client_email": google.client_email, "client_id": "1",
        "token_uri": google.token_uri,
    }))
    return path


def catalog_with(tmp_path, providers: dict) -> str:
    raw = json.loads(DEFAULT_CATALOG.read_text())
    raw["providers"].update(providers)
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(raw))
    return str(path)


def credentials_for(environ: dict[str, str], session: requests.Session | None = None) -> Credentials:
    settings = Settings.from_env(environ)
    return Credentials(Catalog.load(settings.catalog_path), settings.provider_credentials, session=session)


def vertex_call(credentials: Credentials, origin: str, session: requests.Session) -> ProviderCall:
    entry = Catalog.load(DEFAULT_CATALOG).by_id(GEMINI)
    return ProviderCall(entry=entry, body=json.dumps({"contents": [{"parts": [{"text": "a teapot"}]}]}).encode(),
                        url=entry.upstream(origin), credential=credentials.for_provider("vertexai"),
                        session=session, interruption=lambda: None,
                        hosts=ProviderHosts((), ("http", origin.removeprefix("http://"))))


# -- configuration ------------------------------------------------------------------


def test_each_provider_reads_the_variable_its_catalog_entry_names():
    credentials = credentials_for({"BFL_API_KEY": "bfl-key", "OPENAI_API_KEY": "sk-openai",
                                   "VERTEXAI_ACCESS_TOKEN": "ya29.static", "UNNAMED_KEY": "not read"})
    assert [credentials.current(p) for p in ("bfl", "openai", "vertexai")] == ["bfl-key", "sk-openai", "ya29.static"]
    settings = Settings.from_env({"BFL_API_KEY": "bfl-key", "UNNAMED_KEY": "not read"})
    assert set(settings.provider_credentials) == {"BFL_API_KEY"}
    assert "bfl-key" not in repr(settings)


def test_a_new_provider_or_second_account_needs_only_configuration(tmp_path):
    path = Path(catalog_with(tmp_path, {
        "bfl-eu": {"credentials": {"kind": "api_key", "env": "BFL_EU_API_KEY"}},
        "vertexai-eu": {"credentials": {"kind": "google", "env": "VERTEXAI_EU_ACCESS_TOKEN"}},
    }))
    raw = json.loads(path.read_text())
    raw["models"]["bfl-eu/flux-2-pro"] = raw["models"]["bfl/flux-2-pro"]
    raw["models"]["vertexai-eu/gemini-3.1-flash-image"] = raw["models"][GEMINI]
    path.write_text(json.dumps(raw))
    credentials = credentials_for({"CATALOG_PATH": str(path), "BFL_API_KEY": "us", "BFL_EU_API_KEY": "eu",
                                   "VERTEXAI_ACCESS_TOKEN": "ya29.us", "VERTEXAI_EU_ACCESS_TOKEN": "ya29.eu"})
    assert [credentials.current(p) for p in ("bfl", "bfl-eu", "vertexai", "vertexai-eu")] == \
        ["us", "eu", "ya29.us", "ya29.eu"]
    catalog = Catalog.load(path)
    assert catalog.by_id("bfl-eu/flux-2-pro").adapter == "bfl"
    assert catalog.max_in_flight("bfl-eu") == DEFAULT_MAX_IN_FLIGHT


def test_a_missing_key_is_a_retryable_provider_error_and_named_at_start(caplog):
    credentials = credentials_for({"OPENAI_API_KEY": "sk-openai"})
    with pytest.raises(ProviderFailure) as failure, caplog.at_level("ERROR", logger="workers.credentials"):
        credentials.current("bfl")
    assert (failure.value.error_type, failure.value.retryable) == ("provider_error", True)
    assert "BFL_API_KEY" not in failure.value.detail and "BFL_API_KEY is not set" in caplog.text
    assert credentials.problems(["bfl", "openai"]) == ["bfl: BFL_API_KEY is not set"]
    assert credentials.problems(["nobody"]) == ["nobody: the catalog names no credentials for it"]


@pytest.mark.parametrize("spec,message", [
    ({"kind": "password", "env": "X"}, "kind"),
    ({"kind": "api_key"}, "env"),
    ({"kind": "api_key", "env": "X", "file_env": "Y"}, "env"),
    ({"kind": "google", "env": 3}, "names"),
    ({"kind": "api_key", "env": "X", "secret": "inline"}, "object"),
    ("BFL_API_KEY", "object"),
])
def test_a_malformed_credentials_entry_names_its_provider(tmp_path, spec, message):
    path = catalog_with(tmp_path, {"bfl": {"max_in_flight": 1, "credentials": spec}})
    with pytest.raises(CatalogError, match=f"'bfl'.*{message}"):
        Catalog.load(path)
    with pytest.raises(SettingsError, match="CATALOG_PATH"):
        Settings.from_env({"CATALOG_PATH": path})


# -- Vertex AI through google-auth, against the fake token endpoint -----------------------


def test_the_vertex_token_is_fetched_reused_while_fresh_and_fetched_again_before_expiry(
        google, service_account_file, tmp_path):
    google.expires_in = _helpers.REFRESH_THRESHOLD.total_seconds() + FRESH_S
    path = catalog_with(tmp_path, {"vertexai": {"credentials": {
        "kind": "google", "env": "VERTEXAI_ACCESS_TOKEN", "file_env": "VERTEXAI_CREDENTIALS_FILE"}}})
    session = LocalOnly()
    credentials = credentials_for({"CATALOG_PATH": path, "VERTEXAI_CREDENTIALS_FILE": str(service_account_file)},
                                  session)
    call = vertex_call(credentials, google.origin, session)

    vertexai.run(call)
    fetched_at = time.monotonic()
    assert google.issued == ["ya29.fake-1"] and google.bearers == ["ya29.fake-1"]

    vertexai.run(call)  # well before expiry: the same token, no second fetch
    assert time.monotonic() - fetched_at < FRESH_S, "too slow to see a fresh token reused"
    assert google.issued == ["ya29.fake-1"] and google.bearers == ["ya29.fake-1"] * 2

    time.sleep(max(0.0, fetched_at + FRESH_S + 0.3 - time.monotonic()))
    vertexai.run(call)  # inside google-auth's refresh margin: a new token first
    assert google.issued == ["ya29.fake-1", "ya29.fake-2"]
    assert google.bearers == ["ya29.fake-1", "ya29.fake-1", "ya29.fake-2"]
    assert all(url.startswith(google.origin) for url in session.urls)


def test_application_default_credentials_are_the_fallback(google, service_account_file, monkeypatch):
    """The shipped catalog: with no VERTEXAI_ACCESS_TOKEN, google-auth's ADC
    (here the GOOGLE_APPLICATION_CREDENTIALS file; workload identity in a
    cluster)."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_file))
    session = LocalOnly()
    credentials = credentials_for({}, session)
    assert credentials.problems(["vertexai"]) == []
    assert credentials.current("vertexai") == credentials.current("vertexai") == "ya29.fake-1"
    assert google.issued == ["ya29.fake-1"]
    assert credentials_for({"VERTEXAI_ACCESS_TOKEN": "ya29.static"}, session).current("vertexai") == "ya29.static"
    assert google.issued == ["ya29.fake-1"], "a token in the environment wins; nothing is fetched"


def test_threads_that_need_a_token_at_once_share_one_fetch(google, service_account_file, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_file))
    credentials = credentials_for({}, LocalOnly())
    with ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(lambda _: credentials.current("vertexai"), range(32)))
    assert set(tokens) == {"ya29.fake-1"} and google.issued == ["ya29.fake-1"]


def test_a_refused_token_request_is_a_retryable_provider_error(google, service_account_file, monkeypatch, caplog):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_file))
    google.token_status = 400
    credentials = credentials_for({}, LocalOnly())
    with pytest.raises(ProviderFailure) as failure, caplog.at_level("ERROR", logger="workers.credentials"):
        credentials.current("vertexai")
    assert (failure.value.error_type, failure.value.retryable) == ("provider_error", True)
    assert "invalid_grant" in caplog.text
    google.token_status = 200  # the endpoint recovers: the next call fetches
    assert credentials.current("vertexai") == "ya29.fake-1"


def test_a_stale_token_is_still_sent_while_its_refresh_fails(google, service_account_file, monkeypatch, caplog):
    """Inside the refresh margin the token has minutes left: an endpoint
    failing then costs no request; the next call tries it again."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_file))
    google.expires_in = _helpers.REFRESH_THRESHOLD.total_seconds() - 60  # stale as it arrives
    credentials = credentials_for({}, LocalOnly())
    assert credentials.current("vertexai") == "ya29.fake-1"
    google.token_status = 400
    with caplog.at_level("WARNING", logger="workers.credentials"):
        assert credentials.current("vertexai") == "ya29.fake-1"
    assert "could not refresh" in caplog.text
    google.token_status = 200
    assert credentials.current("vertexai") == "ya29.fake-2"


def test_a_starting_worker_names_the_credentials_its_queues_lack(caplog):
    """Only the providers it consumes for: a Kubernetes worker holds its own key alone."""
    from router_queue.broker.celery_app import make_celery
    from workers.tasks import _name_missing_credentials

    app = make_celery(Settings.from_env({"OPENAI_API_KEY": "sk-openai"}, redis_url="redis://unused"))
    app.amqp.queues.select(["provider.bfl", "provider.openai"])  # what --queues does
    with caplog.at_level("ERROR", logger="workers.tasks"):
        _name_missing_credentials(sender=SimpleNamespace(app=app))
    assert [r.getMessage() for r in caplog.records] == ["no credential: bfl: BFL_API_KEY is not set"]
