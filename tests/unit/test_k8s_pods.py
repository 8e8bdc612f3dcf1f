"""What a pod's labels, annotations and status mean to discovery (engine_of_pod)."""

from __future__ import annotations

import pytest
from support.kube import pod

from router.config import EventEndpoints, KubernetesDiscoveryConfig
from router.fleet.k8s import PodProblem, engine_of_pod

CFG = KubernetesDiscoveryConfig(enabled=True)


def test_an_llm_d_decode_pod() -> None:
    state = engine_of_pod(pod("d", "10.1.2.3", labels={"llm-d.ai/role": "decode"}), CFG)
    assert state.ready
    assert state.engine is not None
    assert state.engine.url == "http://10.1.2.3:8000"
    assert state.engine.role == "decode"
    assert state.engine.models == []  # asked from the engine's /v1/models
    assert state.engine.kv_events == "auto"


def test_a_pod_without_a_role_label_takes_the_default_role() -> None:
    assert engine_of_pod(pod("p", "10.0.0.1"), CFG).engine.role == "both"
    cfg = CFG.model_copy(update={"default_role": "prefill"})
    assert engine_of_pod(pod("p", "10.0.0.1"), cfg).engine.role == "prefill"


def test_annotations_set_port_models_dp_size_and_kv_events() -> None:
    notes = {
        "kvroute.io/port": "8200",
        "kvroute.io/models": "meta-llama/Llama-3.1-8B, sql-lora",
        "kvroute.io/dp-size": "4",
        "kvroute.io/kv-events": "tcp://{ip}:5557",
    }
    engine = engine_of_pod(pod("p", "10.0.0.9", annotations=notes), CFG).engine
    assert engine.url == "http://10.0.0.9:8200"
    assert engine.models == ["meta-llama/Llama-3.1-8B", "sql-lora"]
    assert engine.dp_size == 4
    assert engine.kv_events == EventEndpoints(endpoint="tcp://10.0.0.9:5557")


def test_kv_events_from_the_configured_ports_unless_a_pod_says_none() -> None:
    cfg = CFG.model_copy(update={"kv_events_port": 5557, "kv_events_replay_port": 5558})
    engine = engine_of_pod(pod("p", "10.0.0.9"), cfg).engine
    assert engine.kv_events == EventEndpoints(
        endpoint="tcp://10.0.0.9:5557", replay_endpoint="tcp://10.0.0.9:5558"
    )
    quiet = pod("p", "10.0.0.9", annotations={"kvroute.io/kv-events": "none"})
    assert engine_of_pod(quiet, cfg).engine.kv_events == "none"


def test_the_model_label_is_used_only_when_configured() -> None:
    labelled = pod("p", "10.0.0.1", labels={"llm-d.ai/model": "qwen3-8b"})
    assert engine_of_pod(labelled, CFG).engine.models == []
    cfg = CFG.model_copy(update={"model_label": "llm-d.ai/model"})
    assert engine_of_pod(labelled, cfg).engine.models == ["qwen3-8b"]


def test_ipv6_pod_addresses_are_bracketed() -> None:
    assert engine_of_pod(pod("p", "fd00::5"), CFG).engine.url == "http://[fd00::5]:8000"


def test_readiness_comes_from_the_ready_condition_and_deletion() -> None:
    assert not engine_of_pod(pod("p", "10.0.0.1", ready=False), CFG).ready
    terminating = pod("p", "10.0.0.1")
    terminating["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    assert not engine_of_pod(terminating, CFG).ready
    no_conditions = pod("p", "10.0.0.1")
    del no_conditions["status"]["conditions"]
    assert not engine_of_pod(no_conditions, CFG).ready


def test_a_pod_without_an_ip_is_no_engine_yet() -> None:
    state = engine_of_pod(pod("p", None), CFG)
    assert state.engine is None and not state.ready


@pytest.mark.parametrize(
    ("labels", "notes", "message"),
    [
        (
            {"llm-d.ai/role": "encode"},
            {},
            "llm-d.ai/role='encode' is none of both, prefill, decode",
        ),
        ({}, {"kvroute.io/port": "http"}, "kvroute.io/port='http' is not a port"),
        ({}, {"kvroute.io/port": "70000"}, "is not a port"),
        ({}, {"kvroute.io/dp-size": "0"}, "kvroute.io/dp-size='0' is not a positive integer"),
        ({}, {"kvroute.io/kv-events": "zmq"}, "use none, auto or tcp://host:port"),
    ],
)
def test_pods_that_cannot_be_engines_say_why(
    labels: dict[str, str], notes: dict[str, str], message: str
) -> None:
    with pytest.raises(PodProblem, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine_of_pod(pod("p", "10.0.0.1", labels=labels, annotations=notes), CFG)


def test_topology_from_the_node_name_and_the_nodes_zone_and_rack_labels() -> None:
    node = {"topology.kubernetes.io/zone": "us-east-1a", "topology.kubernetes.io/rack": "r7"}
    state = engine_of_pod(pod("d", "10.0.0.1", node="gpu-3"), CFG, node)
    assert state.engine is not None
    assert state.engine.topology.model_dump() == {
        "node": "gpu-3",
        "rack": "r7",
        "zone": "us-east-1a",
    }


def test_without_node_labels_the_pods_own_labels_and_a_configured_rack_label_are_used() -> None:
    cfg = CFG.model_copy(update={"rack_label": "example.com/rack"})
    labelled = pod("d", "10.0.0.1", node="gpu-3", labels={"example.com/rack": "r2"})
    topology = engine_of_pod(labelled, cfg).engine.topology
    assert (topology.node, topology.rack, topology.zone) == ("gpu-3", "r2", None)
    # The node's label wins over the pod's.
    assert engine_of_pod(labelled, cfg, {"example.com/rack": "r5"}).engine.topology.rack == "r5"
    assert engine_of_pod(pod("p", "10.0.0.2"), CFG).engine.topology.model_dump() == {
        "node": None,
        "rack": None,
        "zone": None,
    }
