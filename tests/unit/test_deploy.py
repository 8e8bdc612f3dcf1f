"""deploy/: the Helm chart renders in every mode, the manifests validate against
Kubernetes' schemas, and every dashboard query and alert names a documented metric."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.deploy import (
    CHART,
    DEPLOY,
    MANIFESTS,
    MODES,
    RendererUnavailable,
    documents,
    manifest_path,
    render_text,
    renderer,
)
from support.docs import DOCS, documented_metrics

from router.cli import _parser
from router.config import load_config

KUBE_VERSION = "1.30.0"
#: Custom resources Kubernetes' own schemas do not cover; checked field by field below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "ScaledObject"}


def _renderer_or_skip() -> str:
    try:
        return renderer()
    except RendererUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module", params=MODES)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(mode, objects) as Helm renders them (helm binary, or Helm's Go SDK)."""
    _renderer_or_skip()
    mode = request.param
    return mode, documents(render_text(mode))


def committed(mode: str) -> list[dict[str, Any]]:
    return documents(manifest_path(mode).read_text())


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc}") from None


# ---------------------------------------------------------------------- chart and manifests


def test_the_chart_renders_and_validates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    mode, objects = rendered
    validate(objects)
    kinds = {o["kind"] for o in objects}
    if mode == "sidecar":
        assert kinds >= {"Deployment", "PodDisruptionBudget"}
    else:
        assert kinds >= {
            "ConfigMap",
            "Deployment",
            "Service",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "PodDisruptionBudget",
            "ServiceMonitor",
        }
    if mode == "service":
        assert kinds >= {"PrometheusRule"}
        (rule,) = by_kind(objects, "PrometheusRule")
        assert rule["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())


def test_the_plain_manifests_are_the_chart_rendered(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    mode, objects = rendered
    assert committed(mode) == objects, "deploy/manifests is stale: run make manifests"


@pytest.mark.parametrize("mode", MODES)
def test_the_plain_manifests_validate(mode: str) -> None:
    objects = committed(mode)
    assert objects
    validate(objects)
    kustomization = yaml.safe_load((MANIFESTS / mode / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in (MANIFESTS / mode).iterdir()} - {"kustomization.yaml"}
    assert listed == present


def test_helm_lint_finds_nothing() -> None:
    if _renderer_or_skip() != "sdk":
        pytest.skip("helm lint through the SDK only")
    import helm_python

    for mode in MODES:
        values = yaml.safe_load((CHART / f"values-{mode}.yaml").read_text())
        report = helm_python.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, (mode, problems)


# ---------------------------------------------------------------------- what the objects say


def router_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [
        d
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
    ]
    return deployment


def router_config(objects: list[dict[str, Any]]) -> Any:
    (config_map,) = [c for c in by_kind(objects, "ConfigMap") if "config.yaml" in c["data"]]
    return load_config(overrides=yaml.safe_load(config_map["data"]["config.yaml"]), environ={})


@pytest.mark.parametrize("mode", ["service", "endpoint-picker"])
def test_the_router_runs_non_root_with_probes_and_a_drain(mode: str) -> None:
    objects = committed(mode)
    deployment = router_deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    config = router_config(objects)
    assert config.server.host == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == (
        config.server.port
    )
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > config.server.drain_timeout_s + 5  # preStop sleep + drain fit in it
    # RBAC: the pod's service account may list and watch pods, nothing more.
    (binding,) = by_kind(objects, "RoleBinding")
    (role,) = by_kind(objects, "Role")
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert config.discovery.kubernetes.enabled
    (pdb,) = by_kind(objects, "PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("mode", MODES)
def test_no_pod_gets_kubernetes_service_links(mode: str) -> None:
    # A Service named kvroute would give each pod KVROUTE_SERVICE_HOST, KVROUTE_PORT...
    pods = [d["spec"]["template"]["spec"] for d in by_kind(committed(mode), "Deployment")]
    assert pods
    assert [p.get("enableServiceLinks") for p in pods] == [False] * len(pods)


def test_the_chart_points_the_index_redis_section_at_its_redis() -> None:
    config = router_config(committed("service"))
    assert config.index.backend == "redis"
    assert config.index.redis.url == "redis://kvroute-redis:6379/0"
    assert config.deprecations == []


@pytest.mark.parametrize(
    ("own", "deprecated"),
    [({"redis": {"url": "redis://mine:6379/2"}}, False), ({"url": "redis://mine:6379/2"}, True)],
    ids=["index.redis.url", "index.url"],
)
def test_an_index_url_in_router_config_wins_over_the_charts_redis(
    own: dict[str, Any], deprecated: bool
) -> None:
    _renderer_or_skip()
    objects = documents(render_text("service", {"router": {"config": {"index": own}}}))
    config = router_config(objects)
    assert config.index.redis.url == "redis://mine:6379/2"
    assert bool(config.deprecations) is deprecated


@pytest.mark.parametrize("mode", MODES)
def test_every_kvroute_command_line_is_accepted(mode: str) -> None:
    """The container args parse with kvroute's own CLI."""
    commands = []
    for deployment in by_kind(committed(mode), "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            argv = container.get("command") or container.get("args") or []
            if argv and argv[0] == "kvroute":
                argv = argv[1:]
            if container.get("args") and not container.get("command"):
                argv = container["args"]  # the image's entrypoint is kvroute
            if argv and argv[0] in ("serve", "sidecar", "engine"):
                commands.append([a.replace("$(POD_IP)", "10.0.0.7") for a in argv])
    assert commands
    for argv in commands:
        parser = _parser(argv[0])
        flags = {
            f
            for a in parser._subparsers._group_actions[0].choices[argv[0]]._actions  # type: ignore[union-attr]
            for f in a.option_strings
        }
        unknown = [a for a in argv if a.startswith("--") and a not in flags]
        if set(unknown) <= {"--grpc-port", "--extproc-port"} and unknown:
            pytest.skip(f"{shlex.join(unknown)}: flags of the gRPC listeners, not on this branch")
        parser.parse_args(argv)


def test_the_endpoint_picker_pool_points_at_kvroute() -> None:
    objects = committed("endpoint-picker")
    (pool,) = by_kind(objects, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (service,) = [s for s in by_kind(objects, "Service") if "redis" not in s["metadata"]["name"]]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] == ports["extproc"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    config = router_config(objects)
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert config.discovery.kubernetes.label_selector == selector
    assert pool["spec"]["targetPorts"] == [{"number": config.discovery.kubernetes.port}]


def test_the_sidecar_fronts_its_decode_engine() -> None:
    objects = committed("sidecar")
    decode = next(
        d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-decode")
    )
    pod = decode["spec"]["template"]
    assert pod["metadata"]["labels"]["llm-d.ai/role"] == "decode"
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    args = containers["kvroute-sidecar"]["args"]
    engine_port = containers["engine"]["command"][
        containers["engine"]["command"].index("--port") + 1
    ]
    assert args[args.index("--engine") + 1] == f"http://127.0.0.1:{engine_port}"
    assert "--allow" in args


AUTOSCALING = {"target": {"name": "vllm-decode"}, "model": "llama", "targetSaturation": "0.7"}


def test_the_keda_scaled_object_scales_the_engines_on_pool_saturation() -> None:
    _renderer_or_skip()
    objects = documents(
        render_text("service", {"autoscaling": {**AUTOSCALING, "keda": {"enabled": True}}})
    )
    validate(objects)
    (scaled,) = by_kind(objects, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "vllm-decode",
    }
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    meta = trigger["metadata"]
    assert meta["query"] == 'max(kvroute_pool_saturation{model="llama"})'
    check_names([meta["query"]])
    assert 0 < float(meta["threshold"]) <= 1 and meta["serverAddress"].startswith("http")
    assert all(isinstance(v, str) for v in meta.values())  # KEDA reads strings only
    assert not by_kind(objects, "HorizontalPodAutoscaler")


def test_the_plain_hpa_scales_the_engines_on_the_external_metric() -> None:
    _renderer_or_skip()
    objects = documents(
        render_text("service", {"autoscaling": {**AUTOSCALING, "hpa": {"enabled": True}}})
    )
    validate(objects)  # autoscaling/v2 against Kubernetes' own schema
    (hpa,) = by_kind(objects, "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {
        "name": "kvroute_pool_saturation",
        "selector": {"matchLabels": {"model": "llama"}},
    }
    assert metric["external"]["target"] == {"type": "Value", "value": "0.7"}
    assert metric["external"]["metric"]["name"] in documented_metrics()
    assert not by_kind(objects, "ScaledObject")


def test_autoscaling_is_off_by_default_and_refuses_both_at_once() -> None:
    _renderer_or_skip()
    kinds = {o["kind"] for o in documents(render_text("service"))}
    assert not kinds & {"ScaledObject", "HorizontalPodAutoscaler"}
    both = {**AUTOSCALING, "keda": {"enabled": True}, "hpa": {"enabled": True}}
    with pytest.raises(Exception, match="not both"):
        render_text("service", {"autoscaling": both})
    with pytest.raises(Exception, match=r"autoscaling\.target\.name"):
        render_text("service", {"autoscaling": {"keda": {"enabled": True}}})


def test_service_monitor_scrapes_the_router_port() -> None:
    objects = committed("service")
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = [s for s in by_kind(objects, "Service") if "redis" not in s["metadata"]["name"]]
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )


# ---------------------------------------------------------------------- what the docs say

#: Objects whose kinds need the Prometheus Operator's CRDs -> the value that turns each off.
OPERATOR_KINDS = {"ServiceMonitor": "serviceMonitor", "PrometheusRule": "prometheusRule"}


def sections(text: str) -> list[str]:
    """A markdown text cut at its headings (a heading inside a code block is none)."""
    parts = re.split(r"^#{1,6} (?=[^\n]*\n)", text, flags=re.M)
    return [p for p in parts if p.strip()]


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
def test_each_helm_install_names_the_crds_its_values_need_and_how_to_go_without(
    doc: str,
) -> None:
    installs = 0
    for section in sections((DEPLOY.parent / doc).read_text()):
        for mode in re.findall(r"helm install [^`]*?values-([a-z-]+)\.yaml", section):
            installs += 1
            kinds = {o["kind"] for o in committed(mode)} & OPERATOR_KINDS.keys()
            if kinds:
                assert "Prometheus Operator" in section, (doc, mode)
            for kind in kinds:
                assert f"--set {OPERATOR_KINDS[kind]}.enabled=false" in section, (doc, kind)
    assert installs


def test_the_operations_guide_names_every_kind_the_service_mode_creates() -> None:
    text = (DOCS / "operations.md").read_text()
    start = text.index("What it creates:")
    created = text[start : text.index("\n\n", start)]
    kinds = {o["kind"] for o in committed("service")}
    bindings = {"RoleBinding", "ClusterRoleBinding"}  # "each with its binding"
    missing = [k for k in sorted(kinds - bindings) if not re.search(rf"\b{k}\b", created)]
    assert not missing


# ---------------------------------------------------------------------- metric names

_METRIC = re.compile(r"\b(kvroute_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def documented_engine_metrics() -> set[str]:
    text = "".join(p.read_text() for p in DOCS.glob("*.md"))
    return set(re.findall(r"vllm:[a-z0-9_:]+", text))


def check_names(exprs: list[str]) -> None:
    kvroute_names = documented_metrics()
    engine_names = documented_engine_metrics()
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            if name.startswith("vllm:"):
                assert name in engine_names, f"{name} (in {expr!r}) is in no doc"
            else:
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                assert base in kvroute_names, f"{name} (in {expr!r}) is not in docs/metrics.md"


def test_every_dashboard_query_names_a_documented_metric() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kvroute.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    check_names(exprs)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit ratio", "decisions", "first token", "per engine", "handoff", "redis", "lag"):
        assert topic in titles, topic


def test_every_alert_names_a_documented_metric() -> None:
    rules = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    check_names(exprs)
    operations = (DOCS / "operations.md").read_text()
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] in operations, f"{rule['alert']} is not explained"


# ---------------------------------------------------------------------- the image


def test_the_dockerfile_builds_a_small_non_root_image() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2, "a build stage and a final stage"
    final = stages[-1]
    assert final.startswith("python:${PYTHON_VERSION}-slim")
    user = re.search(r"^USER (\d+)", final, flags=re.M)
    assert user and int(user.group(1)) != 0
    assert "COPY --from=build /opt/kvroute /opt/kvroute" in final
    for tool in ("gcc", "build-essential", "apt-get install", "pip install"):
        assert tool not in final, tool
    assert 'ENTRYPOINT ["kvroute"]' in final
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M):
        for path in copied.split():
            assert (DEPLOY.parent / path).exists(), path
