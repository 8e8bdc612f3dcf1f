"""The settings of engine discovery from Kubernetes (router/fleet/k8s.py): the
``discovery.kubernetes`` section of the configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.config_section import Section


class KubernetesDiscoveryConfig(Section):
    """Engines from the pods of a Kubernetes namespace (docs/operations.md).

    Defaults follow llm-d's conventions: pods labelled ``llm-d.ai/inference-serving=true``,
    their role in ``llm-d.ai/role`` (``prefill``, ``decode`` or ``both``).
    """

    enabled: bool = Field(False, description="Watch pods and route to the Ready ones.")
    namespace: str | None = Field(
        None,
        description="Namespace to watch (default: the router's own, from its service "
        "account; `default` outside a cluster).",
    )
    label_selector: str = Field(
        "llm-d.ai/inference-serving=true",
        description="Kubernetes label selector of the engine pods (`key=value,...`).",
    )
    port: int = Field(8000, ge=1, le=65535, description="The engines' HTTP port on each pod.")
    port_annotation: str = Field(
        "kvroute.io/port",
        description="Pod annotation that overrides `port` (e.g. decode pods whose engine "
        "sits behind a sidecar on another port).",
    )
    scheme: Literal["http", "https"] = Field("http", description="Scheme of engine URLs.")
    role_label: str = Field(
        "llm-d.ai/role",
        description="Pod label holding the engine's role: `prefill`, `decode` or `both`.",
    )
    default_role: Literal["both", "prefill", "decode"] = Field(
        "both", description="Role of pods without the role label."
    )
    models_annotation: str = Field(
        "kvroute.io/models",
        description="Pod annotation listing served models (comma-separated); without it "
        "the engine's /v1/models says.",
    )
    model_label: str | None = Field(
        None,
        description="Pod label whose value is the served model name (llm-d's `llm-d.ai/model` "
        "often names a deployment instead, and label values cannot hold `/`: off by default).",
    )
    dp_size_annotation: str = Field(
        "kvroute.io/dp-size",
        description="Pod annotation with the engine's data-parallel size (default 1, or what "
        "its /server_info reports).",
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Subscribe to KV events at tcp://<pod IP>:<this port> (llm-d uses 5557); "
        "unset: ask each engine's /server_info.",
    )
    kv_events_replay_port: int | None = Field(
        None, ge=1, le=65535, description="The engines' KV-event replay port (e.g. 5558)."
    )
    kv_events_annotation: str = Field(
        "kvroute.io/kv-events",
        description="Pod annotation that overrides KV events per pod: `none`, `auto`, or "
        "`tcp://host:port` (`{ip}` is replaced by the pod IP).",
    )
    node_topology: bool = Field(
        True,
        description="Read each engine pod's node (`spec.nodeName`) and that node's labels "
        "into `engines[].topology` (needs RBAC to get nodes; without it, the node name "
        "and the pod's own labels are used).",
    )
    zone_label: str = Field(
        "topology.kubernetes.io/zone",
        description="Node (or pod) label holding the engine's zone.",
    )
    rack_label: str = Field(
        "topology.kubernetes.io/rack",
        description="Node (or pod) label holding the engine's rack. Kubernetes defines "
        "no rack label: set the one the cluster has (GKE: "
        "`cloud.google.com/gce-topology-subblock`, EKS: `topology.k8s.aws/network-node-layer-3`).",
    )
    kubeconfig: str | None = Field(
        None,
        description="kubeconfig file (default: the in-cluster service account, else "
        "$KUBECONFIG or ~/.kube/config).",
    )
    watch_timeout_s: int = Field(
        300,
        gt=0,
        description="Server-side length of one watch request; the next resumes from the "
        "last resourceVersion.",
    )
    sync_timeout_s: float = Field(
        10.0,
        ge=0,
        description="At start-up, wait this long for the first pod list before serving "
        "(discovery goes on in the background after).",
    )
    backoff_initial_s: float = Field(
        0.5, gt=0, description="First wait after a failed list or watch."
    )
    backoff_max_s: float = Field(30.0, gt=0, description="Longest wait (doubles up to it).")
