"""deploy/docker-compose.yml: it validates against the Compose Specification
schema check-jsonschema ships (``vendor.compose-spec``), its services run
modules that exist, each worker consumes one provider, Redis is durable and the
web service healthchecked.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from router_queue.broker.celery_app import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from router_queue.dev.stack import WEB_WORKER_CLASS
from tests.deploy.deploy_support import (
    CATALOG,
    COMPOSE_FILE,
    DOCKERFILE,
    PROVIDERS,
    _compose,
    _deployments,
    _option,
    _seconds,
    _service_argv,
    _worker_deployments,
)


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
