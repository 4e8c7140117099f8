"""The autoscalers (deploy/k8s's HPAs and deploy/k8s/keda's ScaledObjects):
each targets a worker Deployment that exists, on its own provider's backlog,
with bounds that reach the provider caps; the KEDA triggers mirror the HPAs and
their PromQL parses.
"""

from __future__ import annotations

import math

import pytest
import yaml

from tests.deploy.deploy_support import (
    CATALOG,
    DEPLOY,
    PROVIDERS,
    _configmap,
    _deployments,
    _of_kind,
    _worker_deployments,
)


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
