"""nginx (deploy/nginx/nginx.conf) in front of gunicorn, in Compose and in the
web pods with one configuration, whose limits agree with the app's (body size,
header timeout, keep-alive, the synchronous route's deadline); kustomize renders
it into the web pods when kubectl or kustomize is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from router_queue.settings import Settings
from router_queue.web import stream as sse
from router_queue.web.gunicorn_worker import header_timeout_s
from tests.deploy.deploy_support import (
    COMPOSE_FILE,
    DOCS,
    K8S,
    NGINX_CONF,
    ROOT,
    TRUSTED_PROXIES,
    _app_routes,
    _compose,
    _configmap,
    _container,
    _deployments,
    _is_kustomization,
    _nginx_block,
    _nginx_one,
    _of_kind,
    _option,
    _procfile,
    _seconds,
    _service_argv,
    _shell_words,
    _sidecar,
)

#: kustomize's copy of NGINX_CONF (it reads no file outside the kustomization's directory).
K8S_NGINX_CONF = K8S / "base" / "nginx.conf"


def _nginx_size(value: str) -> int:
    """'1m', '32k', '8190' -> bytes."""
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", value).groups()
    return int(number) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit.lower()]


def test_kubernetes_serves_the_same_nginx_conf() -> None:
    assert K8S_NGINX_CONF.read_bytes() == NGINX_CONF.read_bytes(), \
        f"run: cp {NGINX_CONF.relative_to(ROOT)} {K8S_NGINX_CONF.relative_to(ROOT)}"
    (base,) = [d for d in DOCS if _is_kustomization(d) and d.path.parent == K8S / "base"]
    generators = {g["name"]: g for g in base.body["configMapGenerator"]}
    assert generators["web-proxy"]["files"] == [K8S_NGINX_CONF.name, TRUSTED_PROXIES["kubernetes"].name]
    web = _deployments()["web"]
    volumes = {v["name"]: v for v in web["spec"]["template"]["spec"]["volumes"]}
    proxy = _sidecar(web, "proxy")
    (mount,) = [m for m in proxy["volumeMounts"] if m["mountPath"] == "/etc/nginx/nginx.conf"]
    assert volumes[mount["name"]]["configMap"]["name"] == "web-proxy" and mount["subPath"] == "nginx.conf"
    assert proxy["command"] == ["nginx", "-g", "daemon off;"]
    assert "nginx -s quit" in " ".join(proxy["lifecycle"]["preStop"]["exec"]["command"]), "a graceful stop"


def test_nginx_stands_between_callers_and_gunicorn() -> None:
    """Compose: the proxy service is published and reaches gunicorn by its
    service name, which is not published. Kubernetes: the Service targets
    nginx, whose upstream name is the pod's own gunicorn (hostAliases); the
    probes go to gunicorn itself."""
    host, port = _nginx_one("server", _nginx_block("upstream front_door")).split()[0].rsplit(":", 1)
    listen_port = int(_nginx_one("listen").split()[0])
    services = _compose()["services"]
    web_service, proxy = services[host], services["proxy"]
    assert _service_argv(web_service)[0] == "gunicorn"
    assert web_service["environment"]["PORT"] == port
    assert "ports" not in web_service, "callers reach gunicorn through the proxy only"
    assert proxy["ports"] == [f"8000:{listen_port}"]
    (conf_volume,) = [v for v in proxy["volumes"] if v.endswith(":/etc/nginx/nginx.conf:ro")]
    assert (COMPOSE_FILE.parent / conf_volume.split(":")[0]).resolve() == NGINX_CONF
    assert proxy["depends_on"][host]["condition"] == "service_healthy"
    assert proxy["stop_signal"] == "SIGQUIT", "nginx's graceful stop"
    assert _seconds(proxy["stop_grace_period"]) >= _seconds(web_service["stop_grace_period"])
    for service in (web_service, proxy):
        assert service["ulimits"]["nofile"]["hard"] >= 2 * int(_configmap()["WEB_CONNECTIONS"])

    web = _deployments()["web"]
    assert {"ip": "127.0.0.1", "hostnames": [host]} in web["spec"]["template"]["spec"]["hostAliases"]
    annotations = web["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == _container(web)["name"], "kubectl exec deploy/web"
    app_port = _container(web)["ports"][0]
    assert app_port["containerPort"] == int(port) == int(_configmap()["PORT"])
    assert _sidecar(web, "proxy")["ports"][0]["containerPort"] == listen_port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert _container(web)[probe]["httpGet"]["port"] == app_port["name"], probe


def test_nginx_limits_agree_with_the_app() -> None:
    cm = _configmap()
    settings = Settings.from_env(cm)
    web = _shell_words(_procfile()["web"])
    keep_alive = float(_option(web, "--keep-alive"))

    batches = _nginx_block("location = /v2/batches")
    body_limit = _nginx_size(_nginx_one("client_max_body_size", NGINX_CONF.read_text().replace(batches, "")))
    assert body_limit == settings.max_body_bytes == Settings().max_body_bytes
    # A batch call (POST /v2/batches) may carry up to MAX_BATCH_BYTES.
    assert _nginx_size(_nginx_one("client_max_body_size", batches)) == settings.max_batch_bytes \
        == Settings().max_batch_bytes
    assert f"the body is larger than {body_limit} bytes" in NGINX_CONF.read_text(), "the 413's detail"
    ingresses = {d.name: d.body for d in _of_kind("Ingress")}
    limits = {name: _nginx_size(i["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"])
              for name, i in ingresses.items()}
    # The controller's limit is per Ingress: POST /v2/batches alone may carry MAX_BATCH_BYTES.
    assert limits == {"web": body_limit, "web-batches": settings.max_batch_bytes}

    assert _seconds(_nginx_one("client_header_timeout")) == header_timeout_s(cm)
    upstream = _nginx_block("upstream front_door")
    assert _seconds(_nginx_one("keepalive_timeout", NGINX_CONF.read_text().replace(upstream, ""))) == keep_alive
    # nginx drops an idle upstream connection before gunicorn would close it.
    assert _seconds(_nginx_one("keepalive_timeout", upstream)) < keep_alive
    # A request line or header field gunicorn refuses still reaches it, so the
    # refusal is gunicorn's, in the contract's shape.
    buffer = _nginx_size(_nginx_one("large_client_header_buffers").split()[1])
    assert buffer > int(_option(web, "--limit-request-line"))
    assert buffer > int(_option(web, "--limit-request-field_size"))
    assert int(_nginx_one("worker_rlimit_nofile")) >= 2 * int(_nginx_one("worker_connections"))

    # The synchronous route and the event stream, and only they, get long read
    # timeouts, unbuffered: one location each.
    patterns = re.findall(r"^\s*location ~ (\S+) \{", NGINX_CONF.read_text(), flags=re.M)
    routes = _app_routes()
    served = {frozenset(e for e, path in routes.items() if re.search(p, path)): p for p in patterns}
    assert set(served) == {frozenset({"queue.run"}), frozenset({"queue.events"})}, served
    sync = _nginx_block(f"location ~ {served[frozenset({'queue.run'})]}")
    read_timeout = _seconds(_nginx_one("proxy_read_timeout", sync))
    assert settings.sync_deadline_s < read_timeout < float(_option(web, "--timeout"))
    assert _nginx_one("proxy_buffering", sync) == "off"
    stream = _nginx_block(f"location ~ {served[frozenset({'queue.events'})]}")
    assert _seconds(_nginx_one("proxy_read_timeout", stream)) > sse.MAX_STREAM_S > 2 * sse.HEARTBEAT_S
    assert _nginx_one("proxy_buffering", stream) == "off"
    elsewhere = NGINX_CONF.read_text().replace(sync, "").replace(stream, "")
    assert _seconds(_nginx_one("proxy_read_timeout", elsewhere)) < settings.sync_deadline_s
    # nginx's graceful stop fits in the pod's grace period, after its preStop sleep.
    grace = _deployments()["web"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 5 + _seconds(_nginx_one("worker_shutdown_timeout")) < grace
    assert _seconds(_nginx_one("worker_shutdown_timeout")) > settings.sync_deadline_s


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("directory", [K8S, K8S / "keda"], ids=["hpa", "keda"])
def test_kustomize_renders_nginx_conf_into_the_web_pods(directory: Path) -> None:
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    result = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("web-proxy-")]
    assert config["data"]["nginx.conf"] == NGINX_CONF.read_text()
    (web,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "web"]
    volumes = web["spec"]["template"]["spec"]["volumes"]
    assert {v["configMap"]["name"] for v in volumes if "configMap" in v} == {config["metadata"]["name"]}
