"""The deployment files as the tests in tests/deploy read them: deploy/'s paths,
every Kubernetes document (each of a multi-document file), the Deployments and
their containers, the Procfile, Compose's services, nginx's directives, and the
small parsers of their values (durations, shell words, options). Loaders only;
nothing here needs Docker, a cluster or the network.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
#: Whose X-Forwarded-For nginx believes: each deployment's own file, which NGINX_CONF includes.
TRUSTED_PROXIES = {"compose": DEPLOY / "nginx" / "trusted-proxies.conf",
                   "kubernetes": K8S / "base" / "trusted-proxies.conf"}
PROCFILE = ROOT / "Procfile"
CATALOG = json.loads((ROOT / "router_queue" / "catalog.json").read_text())
PROVIDERS = sorted(CATALOG["providers"])
#: The pods' image user (deploy/Dockerfile's USER).
IMAGE_UID = 10001
#: Containers beside our image's in a Deployment's pods.
SIDECARS = {"web": {"proxy"}}


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


def _compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _service_argv(service: dict) -> list[str]:
    """A compose service's command as the entrypoint runs it (Procfile names expanded)."""
    command = service.get("command", ["web"])
    command = shlex.split(command) if isinstance(command, str) else command
    if len(command) == 1 and command[0] in _procfile():
        return _shell_words(_procfile()[command[0]])
    return command


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
