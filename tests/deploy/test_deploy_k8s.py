"""The Kubernetes manifests under deploy/k8s, offline.

Every manifest (each document of a multi-document file) validates strictly
against the schemas kubernetes-validate bundles; KEDA ScaledObjects against
deploy/schemas/keda-scaledobject.schema.json; kustomizations name files that
exist. And what the manifests promise holds against the code: one worker
Deployment per provider queue, grace periods that cover a provider call,
timeouts that nest (sync deadline < gunicorn < pod grace), every setting with a
value that parses, pods as the image's user without privileges.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router_queue.broker.celery_app import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE, queue_name
from router_queue.settings import _ENV, Settings
from router_queue.web.gunicorn_worker import header_timeout_s
from tests.deploy.deploy_support import (
    CATALOG,
    DEPLOY,
    DOCS,
    IMAGE_UID,
    K8S,
    PROVIDERS,
    Doc,
    _configmap,
    _container,
    _deployments,
    _env,
    _is_kustomization,
    _of_kind,
    _option,
    _procfile,
    _shell_words,
    _sidecar,
    _worker_deployments,
)

KEDA_SCHEMA = DEPLOY / "schemas" / "keda-scaledobject.schema.json"
#: provider -> the variable holding its key or token, as the catalog names it.
PROVIDER_KEYS = {name: spec["credentials"]["env"] for name, spec in CATALOG["providers"].items()}
#: Kubernetes version the manifests are validated against (kubernetes-validate
#: ships schemas for 1.25 to 1.37).
K8S_VERSION = "1.30"
#: Files under deploy/k8s that no kustomization lists, on purpose.
NOT_IN_A_KUSTOMIZATION = {"secret.template.yaml"}


def _is_keda(doc: Doc) -> bool:
    return doc.body.get("apiVersion", "").startswith("keda.sh/")


def _longest_call_s(provider: str) -> float:
    """The longest single HTTP exchange with ``provider``: connect + read timeout."""
    policies = [m["policy"] for model_id, m in CATALOG["models"].items() if model_id.split("/")[0] == provider]
    assert policies, provider
    return max(p["connect_timeout_s"] + p["read_timeout_s"] for p in policies)


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
    ingresses = {d.name: d.body for d in _of_kind("Ingress")}
    paths = {name: [(p["path"], p["pathType"], p["backend"]["service"]["name"])
                    for rule in i["spec"]["rules"] for p in rule["http"]["paths"]] for name, i in ingresses.items()}
    assert paths == {"web": [("/v2", "Prefix", "web")], "web-batches": [("/v2/batches", "Exact", "web")]}, \
        "only the public API is routed; /metrics and /ops stay inside"
    # the batch route's Ingress differs from the API's in its body limit alone (test_deploy_nginx.py)
    hosts = {name: ([r["host"] for r in i["spec"]["rules"]], i["spec"]["ingressClassName"],
                    {k: v for k, v in i["metadata"]["annotations"].items() if not k.endswith("proxy-body-size")})
             for name, i in ingresses.items()}
    assert hosts["web-batches"] == hosts["web"]


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
