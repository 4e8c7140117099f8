"""What each deployment exposes, and to whom: the operator listener scraped and
published nowhere, forwarded addresses believed from the configured proxies only
(nginx and the app alike), operator tokens beyond loopback, the webhook secrets'
key in every process, Redis behind a password and a network policy, each
worker's metrics where Prometheus looks, Flower behind basic auth.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import yaml

from router_queue.settings import Settings
from tests.deploy.deploy_support import (
    COMPOSE_FILE,
    DEPLOY,
    K8S,
    NGINX_CONF,
    TRUSTED_PROXIES,
    _app_routes,
    _compose,
    _configmap,
    _container,
    _deployments,
    _nginx,
    _nginx_block,
    _nginx_one,
    _of_kind,
    _procfile,
    _shell_words,
    _sidecar,
)


def _network_policies() -> dict[str, dict]:
    return {d.name: d.body["spec"] for d in _of_kind("NetworkPolicy")}


def test_the_operator_listener_is_scraped_and_published_nowhere() -> None:
    """/metrics and /ops answer on OPS_PORT only (router_queue/web/operations.py):
    the Procfile binds it, Prometheus scrapes it, no Service, Ingress, proxy or
    published port leads to it, and the NetworkPolicy opens it to monitoring only."""
    from router_queue.web.operations import OPERATOR_ENDPOINTS

    cm = _configmap()
    web_words = _shell_words(_procfile()["web"])
    binds = [web_words[i + 1] for i, word in enumerate(web_words) if word == "--bind"]
    assert binds == ["0.0.0.0:8000", f"127.0.0.1:{Settings().ops_port}"], "loopback unless OPS_HOST says otherwise"
    assert _shell_words(_procfile()["web"], {"OPS_HOST": cm["OPS_HOST"], "OPS_PORT": cm["OPS_PORT"]})[-4] == \
        f"{cm['OPS_HOST']}:{cm['OPS_PORT']}"
    ops_port = Settings.from_env(cm).ops_port
    assert ops_port not in (0, int(cm["PORT"]))

    web = _deployments()["web"]
    ports = {p["name"]: p["containerPort"] for p in _container(web)["ports"]}
    assert ports["ops"] == ops_port and ports["app"] == int(cm["PORT"])
    assert web["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ops_port)
    for service in _of_kind("Service"):
        targets = {p.get("targetPort") for p in service.body["spec"]["ports"]}
        assert not targets & {"ops", ops_port, "app", int(cm["PORT"])}, service.name
    policy = _network_policies()["web"]
    assert policy["podSelector"]["matchLabels"].items() <= web["spec"]["template"]["metadata"]["labels"].items()
    rules = {tuple(p["port"] for p in rule["ports"]): rule.get("from") for rule in policy["ingress"]}
    assert set(rules) == {("http",), ("ops",)}, "gunicorn's own port is reached through nginx in the pod only"
    assert rules[("http",)] is None
    assert rules[("ops",)] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]

    services = _compose()["services"]
    assert services["web"]["environment"]["OPS_PORT"] == str(ops_port) and "ports" not in services["web"]
    published = [str(p) for service in services.values() for p in service.get("ports", [])]
    assert not [p for p in published if p.rsplit(":", 1)[-1] == str(ops_port)], published

    # nginx answers the operator paths itself (404), never passing them on.
    text = NGINX_CONF.read_text()
    for prefix in ("/ops", "/metrics"):
        block = _nginx_block(f"location ^~ {prefix}")
        assert block.split() == ["return", "404;"], block
    assert "error_page 404 =404 /_front_door/not_found;" in text
    assert 'add_header X-Comfy-Error-Type model_not_found always;' in _nginx_block("location = /_front_door/not_found")
    routes = _app_routes()
    for endpoint in OPERATOR_ENDPOINTS:
        assert routes[endpoint].startswith(("/ops", "/metrics")), endpoint


def _trusted(path: Path) -> tuple[list[str], list[str]]:
    """(set_real_ip_from values, the geo block's trusted entries) of ``path``."""
    text = path.read_text()
    geo = re.search(r"geo \$realip_remote_addr \$from_a_proxy \{(.*?)\}", text, flags=re.S).group(1)
    entries = [line.split()[0] for line in geo.strip().splitlines() if line.strip() and line.split()[0] != "default"]
    assert re.search(r"^\s*default 0;", geo, flags=re.M)
    return _nginx("set_real_ip_from", text), entries


def test_nginx_believes_forwarded_addresses_from_one_configured_range_only() -> None:
    """Not every private address: loopback and, in Kubernetes, one range (the
    ingress controller's), the same for X-Forwarded-For and X-Forwarded-Proto."""
    assert not _nginx("set_real_ip_from") and not re.search(r"^\s*geo\s", NGINX_CONF.read_text(), flags=re.M)
    assert _nginx("include") == ["trusted-proxies.conf"] and _nginx_one("real_ip_header") == "X-Forwarded-For"
    loopback = {"127.0.0.1", "::1"}
    private = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")]
    for where, path in TRUSTED_PROXIES.items():
        real_ip, geo = _trusted(path)
        assert real_ip == geo, f"{path}: set_real_ip_from and the geo block must list the same addresses"
        assert loopback <= set(real_ip), path
        others = [ipaddress.ip_network(n) for n in real_ip if n not in loopback]
        assert len(others) <= 1, f"{path}: one load balancer range, got {others}"
        for network in others:
            # the ingress controller's range, never the pod network (kubeadm's 10.244.0.0/16)
            assert network.prefixlen >= (24 if network.version == 4 else 64), f"{path}: {network} is too wide"
            assert not any(network == wide or wide.subnet_of(network) for wide in private
                           if wide.version == network.version), f"{path}: {network} is a whole private range"
        assert bool(others) == (where == "kubernetes"), f"{path}: compose has no load balancer in front"
    (proxy_volume,) = [v for v in _compose()["services"]["proxy"]["volumes"] if "trusted-proxies.conf" in v]
    assert (COMPOSE_FILE.parent / proxy_volume.split(":")[0]).resolve() == TRUSTED_PROXIES["compose"]
    assert proxy_volume.endswith(":/etc/nginx/trusted-proxies.conf:ro")
    mounts = {m["mountPath"]: m for m in _sidecar(_deployments()["web"], "proxy")["volumeMounts"]}
    assert mounts["/etc/nginx/trusted-proxies.conf"]["subPath"] == TRUSTED_PROXIES["kubernetes"].name


def _networks(values) -> set:
    return {ipaddress.ip_network(value, strict=False) for value in values}


def test_the_app_believes_forwarded_addresses_from_the_proxies_nginx_does():
    """FORWARDED_ALLOW_IPS (the app's and gunicorn's one list) is nginx's
    set_real_ip_from plus where nginx reaches gunicorn from: loopback in the
    Kubernetes pod, the proxy service's fixed address in compose."""
    k8s_allowed = Settings.from_env(_configmap()).forwarded_allow_ips
    real_ip, _ = _trusted(TRUSTED_PROXIES["kubernetes"])
    assert _networks(k8s_allowed) == _networks(real_ip), "ConfigMap FORWARDED_ALLOW_IPS vs trusted-proxies.conf"
    assert _deployments()["web"]["spec"]["template"]["spec"]["hostAliases"] == [
        {"ip": "127.0.0.1", "hostnames": ["web"]}], "nginx reaches gunicorn over loopback in the pod"

    services = _compose()["services"]
    given = {name: value for name, value in services["web"]["environment"].items()
             if not str(value).startswith("${")}  # compose's required secrets, not values
    compose_allowed = Settings.from_env(given).forwarded_allow_ips
    proxy_address = services["proxy"]["networks"]["default"]["ipv4_address"]
    real_ip, _ = _trusted(TRUSTED_PROXIES["compose"])
    assert _networks(compose_allowed) == _networks([*real_ip, proxy_address])
    (subnet,) = [c["subnet"] for c in _compose()["networks"]["default"]["ipam"]["config"]]
    assert ipaddress.ip_address(proxy_address) in ipaddress.ip_network(subnet)


def test_operator_listeners_beyond_loopback_ask_for_a_token_prometheus_sends():
    """OPS_HOST binds them on 0.0.0.0: each process serving one gets OPS_TOKEN
    (required, no default), and every way Prometheus is told to scrape sends it."""
    cm = _configmap()
    assert Settings.from_env(cm).ops_host == "0.0.0.0" and "OPS_TOKEN" not in cm
    (template,) = [d.body for d in _of_kind("Secret") if d.name == "router-queue-ops"]
    assert set(template["stringData"]) == {"OPS_TOKEN"}
    for name, deployment in _deployments().items():
        env = {e["name"]: e for e in _container(deployment).get("env", [])}
        serves = name == "web" or "metrics" in {p["name"] for p in _container(deployment).get("ports", [])}
        if serves:
            assert env["OPS_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "router-queue-ops", "key": "OPS_TOKEN"}, \
                name
            assert not env["OPS_TOKEN"]["valueFrom"]["secretKeyRef"].get("optional"), name

    web = _compose()["services"]["web"]["environment"]
    assert web["OPS_HOST"] == "0.0.0.0" and web["OPS_TOKEN"].startswith("${OPS_TOKEN:?")

    monitor = yaml.safe_load((DEPLOY / "monitoring" / "podmonitor.yaml").read_text())
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"ops", "metrics"}
    for endpoint in endpoints.values():
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "router-queue-ops",
                                                                               "key": "OPS_TOKEN"}}
    (job,) = yaml.safe_load((DEPLOY / "monitoring" / "scrape-configs.yaml").read_text())["scrape_configs"]
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]


def test_every_process_gets_the_webhook_secrets_key_and_compose_has_no_default() -> None:
    """Once a secret is sealed no process starts without WEBHOOK_SECRETS_KEY:
    compose refuses to start without one, and every pod reads it from its Secret."""
    for name, service in _compose()["services"].items():
        if "router_queue" in str(service.get("command", "")) or service.get("environment", {}).get("REDIS_URL"):
            assert service["environment"]["WEBHOOK_SECRETS_KEY"].startswith("${WEBHOOK_SECRETS_KEY:?"), name
    assert "WEBHOOK_SECRETS_KEY" not in _configmap(), "a key: the Secret router-queue-webhook-secrets holds it"
    (template,) = [d.body for d in _of_kind("Secret") if d.name == "router-queue-webhook-secrets"]
    assert set(template["stringData"]) == {"WEBHOOK_SECRETS_KEY"}
    for name, deployment in _deployments().items():
        refs = [e["secretRef"]["name"] for e in _container(deployment)["envFrom"] if "secretRef" in e]
        assert "router-queue-webhook-secrets" in refs, name


def test_redis_asks_for_a_password_and_admits_only_our_pods() -> None:
    services = _compose()["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?"), "no default password"
    assert "ports" not in services["redis"]
    assert "PONG" in " ".join(services["redis"]["healthcheck"]["test"])
    assert services["redis"]["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")

    assert "REDIS_URL" not in _configmap(), "it carries the password: the Secret router-queue-redis holds it"
    (template,) = [d.body for d in _of_kind("Secret") if d.name == "router-queue-redis"]
    assert re.match(r"rediss?://:[^@]+@", template["stringData"]["REDIS_URL"])
    for name, deployment in _deployments().items():
        refs = [e["secretRef"] for e in _container(deployment)["envFrom"] if "secretRef" in e]
        assert [r["name"] for r in refs] == ["router-queue-redis", "router-queue-webhook-secrets"], name
        assert not any(r.get("optional") for r in refs), name
    (redis_set,) = [d.body for d in _of_kind("StatefulSet") if d.name == "redis"]
    (container,) = redis_set["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert secret_env["REDIS_PASSWORD"] == secret_env["REDISCLI_AUTH"] == {"name": "redis-auth", "key": "password"}
    for probe in ("readinessProbe", "livenessProbe"):
        assert "PONG" in " ".join(container[probe]["exec"]["command"]), probe

    policies = _network_policies()
    redis_policy = policies["redis"]
    assert _selects(redis_policy["podSelector"], redis_set["spec"]["template"]["metadata"]["labels"])
    (rule,) = redis_policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "router-queue"}}}]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    for name, deployment in _deployments().items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "router-queue", f"{name} would be refused by Redis"
        covering = [p for p, spec in policies.items() if _selects(spec["podSelector"], labels)]
        assert len(covering) == 1, f"{name}: one NetworkPolicy decides who reaches it, got {covering}"
    # the workers and beat admit Prometheus alone, on a worker's metrics port
    assert policies["workers-and-beat"]["ingress"] == [{
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"port": "metrics", "protocol": "TCP"}]}]


def test_every_worker_serves_its_own_metrics_where_prometheus_is_told_to_look():
    port = int(_configmap()["WORKER_METRICS_PORT"])
    for path in [*K8S.glob("base/worker-*.yaml"), K8S / "base" / "webhooks.yaml"]:
        deployment = next(d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "Deployment")
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"], path
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port), path


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        present = labels.get(expression["key"])
        if expression["operator"] == "In" and present not in expression["values"]:
            return False
        if expression["operator"] == "NotIn" and present in expression["values"]:
            return False
    return True


def test_flower_is_published_only_behind_basic_auth() -> None:
    flower = _compose()["services"]["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?"), "no default credentials"
    assert all(str(p).startswith("127.0.0.1:") for p in flower.get("ports", [])), flower.get("ports")
