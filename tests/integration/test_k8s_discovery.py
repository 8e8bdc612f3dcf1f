"""Engine discovery from Kubernetes pods, against emulated engines on 127.0.0.x.

No real API server can run here, so the router's kubernetes-asyncio client talks to
``support.kube.FakeKubeAPI``: a small HTTP server that speaks the list/watch protocol
(resourceVersion, chunked watch streams, BOOKMARK events, 410 Gone). The pods' IPs are
loopback addresses where real emulated engines listen, all on one port like pods do, so
discovered engines serve the requests the tests send.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics, post, post_reply
from support.docs import documented_metrics
from support.engines import poll, start_test_engine
from support.kube import FakeKubeAPI, pod
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.fleet.registry import EngineState
from router.topology import Topology, locality
from router.types import EngineKey

IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest_asyncio.fixture(scope="module")
async def pods_engines(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    """One emulated engine per pod IP, every one on the same port."""
    engines: list[EmulatedEngine] = []
    port = 0
    for i, ip in enumerate(IPS):
        engine = await start_test_engine(
            host=ip,
            port=port,
            engine_id=f"pod{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/pod{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        port = int(engine.url.rsplit(":", 1)[1])
        engines.append(engine)
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def kube() -> AsyncIterator[FakeKubeAPI]:
    api = FakeKubeAPI()
    await api.start()
    yield api
    await api.stop()


@pytest_asyncio.fixture
async def fresh_engines(
    pods_engines: list[EmulatedEngine], http: aiohttp.ClientSession
) -> list[EmulatedEngine]:
    for engine in pods_engines:
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200
    return pods_engines


def port_of(engine: EmulatedEngine) -> int:
    return int(engine.url.rsplit(":", 1)[1])


async def discovering_router(
    kube: FakeKubeAPI,
    tmp_path: Path,
    engines: list[EmulatedEngine],
    token: str = "test-token",
    **changes: Any,
) -> RouterApp:
    settings = {
        "enabled": True,
        "kubeconfig": str(kube.kubeconfig(tmp_path, token)),
        "namespace": kube.namespace,
        "port": port_of(engines[0]),
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.2,
        "sync_timeout_s": 5,
        **changes,
    }
    return await start_router(
        [], discovery={"kubernetes": settings}, policy={"name": "round_robin"}
    )


def key(engine: EmulatedEngine) -> EngineKey:
    return EngineKey(engine.url.removeprefix("http://"))


def candidates(app: RouterApp) -> set[str]:
    models = app.registry.models()
    return {k.endpoint for m in models for k in app.registry.candidates(m)}


async def served_by(http: aiohttp.ClientSession, app: RouterApp, n: int) -> set[str]:
    engines = set()
    for i in range(n):
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": f"pod traffic {i} " * 20, "max_tokens": 2}
        )
        assert reply.status == 200, reply.body
        engines.add(reply.headers["x-kvroute-engine"])
    return engines


async def test_ready_pods_become_engines_that_serve_requests(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    http: aiohttp.ClientSession,
) -> None:
    a, b, c = fresh_engines
    await kube.put(pod("vllm-a", IPS[0]))
    await kube.put(pod("vllm-b", IPS[1], ready=False))
    await kube.put(pod("not-serving", IPS[2], labels={"llm-d.ai/inference-serving": "false"}))
    app = await discovering_router(kube, tmp_path, fresh_engines)
    try:
        await poll(lambda: candidates(app) == {key(a).endpoint})
        assert app.registry.get(key(b).endpoint) is None  # not Ready: not an engine yet
        assert app.registry.get(key(c).endpoint) is None  # outside the selector
        assert await served_by(http, app, 3) == {key(a).label}
        # The engine's own KV events are followed, as for a configured engine.
        await poll(lambda: app.subscriber.stream_state(key(a)) is not None)

        await kube.put(pod("vllm-b", IPS[1], ready=True))
        await poll(lambda: candidates(app) == {key(a).endpoint, key(b).endpoint})
        assert await served_by(http, app, 4) == {key(a).label, key(b).label}
        assert kube.lists()[0]["labelSelector"] == "llm-d.ai/inference-serving=true"
        assert len(kube.lists()) == 1
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_discovery_engines", state="ready") == 2
        assert metric_sum(samples, "kvroute_discovery_lists_total") == 1
        exposed = {
            re.sub(r"_(total|bucket|sum|count)$", "", n)
            for n in samples
            if n.startswith("kvroute_")
        }
        assert exposed <= documented_metrics(), exposed - documented_metrics()
    finally:
        await app.stop()


async def test_pods_outside_the_allowed_networks_are_skipped(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """auth.engine_cidrs holds for discovered pods too: a pod whose IP is outside is
    never an engine (whoever can create pods cannot point the router elsewhere)."""
    inside, outside, _ = fresh_engines
    await kube.put(pod("inside", IPS[0]))
    await kube.put(pod("outside", IPS[1]))  # a real engine listens there, but not allowed
    await kube.put(pod("metadata", "169.254.169.254"))
    caplog.set_level(logging.WARNING, logger="kvroute.discovery")
    app = await start_router(
        [],
        discovery={
            "kubernetes": {
                "enabled": True,
                "kubeconfig": str(kube.kubeconfig(tmp_path, "test-token")),
                "namespace": kube.namespace,
                "port": port_of(inside),
                "sync_timeout_s": 5,
            }
        },
        auth={"engine_cidrs": [f"{IPS[0]}/32"]},
    )
    try:
        skipped = {
            name: f"pod {kube.namespace}/{name}: not an engine" for name in ("outside", "metadata")
        }
        await poll(lambda: all(line in caplog.text for line in skipped.values()))
        assert "engine_cidrs" in caplog.text
        await poll(lambda: candidates(app) == {key(inside).endpoint})
        assert app.registry.get(key(outside).endpoint) is None
        assert [e.endpoint for e in app.registry] == [key(inside).endpoint]
        assert await served_by(http, app, 3) == {key(inside).label}
        await kube.put(pod("outside", IPS[1], labels={"changed": "yes"}))  # a later event
        await poll(lambda: caplog.text.count(skipped["outside"]) == 2)  # checked again
        assert await served_by(http, app, 3) == {key(inside).label}
        assert app.registry.get(key(outside).endpoint) is None
    finally:
        await app.stop()


async def test_labels_and_annotations_set_role_models_and_port(
    kube: FakeKubeAPI, tmp_path: Path, fresh_engines: list[EmulatedEngine]
) -> None:
    b = fresh_engines[1]
    await kube.put(pod("prefill-0", IPS[0], labels={"llm-d.ai/role": "prefill"}))
    await kube.put(
        pod(
            "decode-0",
            IPS[1],
            labels={"llm-d.ai/role": "decode"},
            annotations={"kvroute.io/models": "emulated-model", "kvroute.io/port": str(port_of(b))},
        )
    )
    await kube.put(pod("odd", IPS[2], labels={"llm-d.ai/role": "encode"}))
    app = await discovering_router(kube, tmp_path, fresh_engines, port=1)
    try:
        await poll(lambda: app.registry.get(key(b).endpoint) is not None)
        decode = app.registry.get(key(b).endpoint)
        assert decode.role == "decode"
        assert decode.models_configured
        # Without the port annotation the configured port (1 here) is used.
        assert app.registry.get(f"{IPS[0]}:1").role == "prefill"
        assert app.registry.get(key(fresh_engines[2]).endpoint) is None
    finally:
        await app.stop()


async def test_topology_comes_from_the_pods_node_and_its_labels(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pod's node (spec.nodeName) and that node's zone and rack labels become the
    engine's topology; a node the router may not read leaves the node name and the pod's
    own labels; nodes are read once each, not per event."""
    kube.put_node("gpu-1", {"topology.kubernetes.io/zone": "zone-a", "example.com/rack": "r1"})
    kube.put_node("gpu-2", {"topology.kubernetes.io/zone": "zone-a", "example.com/rack": "r2"})
    await kube.put(pod("p0", IPS[0], node="gpu-1", labels={"llm-d.ai/role": "prefill"}))
    await kube.put(pod("d0", IPS[1], node="gpu-2", labels={"llm-d.ai/role": "decode"}))
    await kube.put(pod("d1", IPS[2], node="hidden", labels={"example.com/rack": "r9"}))
    caplog.set_level(logging.WARNING, logger="kvroute.discovery")
    app = await discovering_router(kube, tmp_path, fresh_engines, rack_label="example.com/rack")
    try:
        await poll(lambda: len(list(app.registry)) == 3)
        by_ip = {e.endpoint.split(":")[0]: e.topology for e in app.registry}
        assert by_ip[IPS[0]] == Topology("gpu-1", "r1", "zone-a")
        assert by_ip[IPS[1]] == Topology("gpu-2", "r2", "zone-a")
        assert by_ip[IPS[2]] == Topology("hidden", "r9", None)
        assert 'get node hidden: HTTP 404: nodes "hidden" not found' in caplog.text
        # What the router does with it: the pair's link is priced by its locality.
        assert locality(by_ip[IPS[0]], by_ip[IPS[1]]) == "same_zone"
        # A later event of the same pod reads no node again.
        reads = len(kube.node_reads)
        await kube.put(
            pod("p0", IPS[0], node="gpu-1", labels={"llm-d.ai/role": "prefill", "changed": "yes"})
        )
        assert app.discovery is not None
        await poll(lambda: app.discovery.stats.events.get("MODIFIED", 0) >= 1)
        assert len(kube.node_reads) == reads
        assert sorted(kube.node_reads) == ["gpu-1", "gpu-2", "hidden"]
    finally:
        await app.stop()


async def test_a_pod_that_stops_being_ready_gets_no_new_requests(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    http: aiohttp.ClientSession,
) -> None:
    a, b, _ = fresh_engines
    await kube.put(pod("vllm-a", IPS[0]))
    await kube.put(pod("vllm-b", IPS[1]))
    app = await discovering_router(kube, tmp_path, fresh_engines)
    try:
        await poll(lambda: len(candidates(app)) == 2)
        await kube.put(pod("vllm-b", IPS[1], ready=False))
        await poll(lambda: app.registry.get(key(b).endpoint).state is EngineState.DRAINING)
        assert await served_by(http, app, 3) == {key(a).label}
        # Still known (its index entries and event stream stay for its return).
        assert app.subscriber.stream_state(key(b)) is not None
        await kube.put(pod("vllm-b", IPS[1], ready=True))
        await poll(lambda: app.registry.get(key(b).endpoint).state is EngineState.HEALTHY)
        assert await served_by(http, app, 4) == {key(a).label, key(b).label}
        # A terminating pod is drained too, before its DELETED event.
        terminating = pod("vllm-a", IPS[0])
        terminating["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        await kube.put(terminating)
        await poll(lambda: app.registry.get(key(a).endpoint).state is EngineState.DRAINING)
    finally:
        await app.stop()


async def test_deleted_pods_drop_their_engine_and_its_index_entries(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    http: aiohttp.ClientSession,
) -> None:
    a = fresh_engines[0]
    await kube.put(pod("vllm-a", IPS[0]))
    app = await discovering_router(kube, tmp_path, fresh_engines)
    try:
        await poll(lambda: candidates(app) == {key(a).endpoint})
        await poll(lambda: app.subscriber.stream_state(key(a)) is not None)
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": "kept " * 100, "max_tokens": 2}
        )
        assert reply.status == 200

        async def indexed() -> bool:
            return (await app.index.stats()).entries > 0

        await poll(indexed)
        model = app.registry.models()[0]
        await kube.delete("vllm-a")
        await poll(lambda: app.registry.get(key(a).endpoint) is None)

        # The registry forgets the engine first (no request is routed to it from that
        # moment), then the removal awaits its event stream's end and the index's clear:
        # on a busy machine the test can look in between, so it waits for the end state.
        async def index_emptied() -> bool:
            return (await app.index.stats()).entries == 0

        await poll(index_emptied, timeout=10)
        assert app.subscriber.stream_state(key(a)) is None
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"model": model, "prompt": "gone", "max_tokens": 2}
        )
        assert reply.status == 503  # no engine serves any model any more: retry later
    finally:
        await app.stop()


async def test_a_broken_watch_resumes_from_its_resource_version(
    kube: FakeKubeAPI, tmp_path: Path, fresh_engines: list[EmulatedEngine]
) -> None:
    a, b, _ = fresh_engines
    await kube.put(pod("vllm-a", IPS[0]))
    app = await discovering_router(kube, tmp_path, fresh_engines)
    try:
        await poll(lambda: candidates(app) == {key(a).endpoint})
        await poll(lambda: len(kube.watches()) == 1)
        seen = app.discovery.stats.resource_version
        kube.break_watches()
        added = await kube.put(pod("vllm-b", IPS[1]))  # happens while nobody watches
        await poll(lambda: app.registry.get(key(b).endpoint) is not None)
        resumed = kube.watches()[1]
        assert resumed["resourceVersion"] == seen
        assert resumed["allowWatchBookmarks"].lower() == "true"
        assert len(kube.lists()) == 1  # resumed, not relisted
        assert app.discovery.stats.errors >= 1
        await poll(lambda: app.discovery.stats.resource_version == str(added))
    finally:
        await app.stop()


async def test_bookmarks_move_the_resource_version_forward(
    kube: FakeKubeAPI, tmp_path: Path, fresh_engines: list[EmulatedEngine]
) -> None:
    await kube.put(pod("vllm-a", IPS[0]))
    app = await discovering_router(kube, tmp_path, fresh_engines)
    try:
        # Deadlines, not measurements: a watch (re)opens after the discovery's backoff.
        await poll(lambda: len(kube.watches()) == 1, timeout=30)
        await kube.put(pod("other", IPS[2], labels={"llm-d.ai/inference-serving": "false"}))
        await kube.bookmark()
        await poll(lambda: app.discovery.stats.events.get("BOOKMARK") == 1, timeout=30)
        assert app.discovery.stats.resource_version == str(kube.version)
        kube.break_watches()
        await poll(lambda: len(kube.watches()) == 2, timeout=30)
        assert kube.watches()[1]["resourceVersion"] == str(kube.version)
    finally:
        await app.stop()


async def test_410_gone_relists_and_reconciles(
    kube: FakeKubeAPI, tmp_path: Path, fresh_engines: list[EmulatedEngine]
) -> None:
    a, b, c = fresh_engines
    await kube.put(pod("vllm-a", IPS[0]))
    await kube.put(pod("vllm-b", IPS[1]))
    app = await discovering_router(kube, tmp_path, fresh_engines)
    try:
        await poll(lambda: len(candidates(app)) == 2)
        await poll(lambda: len(kube.watches()) == 1)
        kube.break_watches()
        # While the router is away: a is deleted, c appears, and history is compacted.
        await kube.delete("vllm-a")
        await kube.put(pod("vllm-c", IPS[2]))
        kube.compact()
        await poll(lambda: candidates(app) == {key(b).endpoint, key(c).endpoint})
        assert app.registry.get(key(a).endpoint) is None
        assert app.discovery.stats.expired == 1
        assert len(kube.lists()) == 2
        # Watching goes on from the new list's version.
        await poll(lambda: kube.watches()[-1]["resourceVersion"] == str(kube.version))
    finally:
        await app.stop()


async def test_a_refused_pod_list_is_retried_and_says_why(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvroute.discovery")
    app = await discovering_router(
        kube, tmp_path, fresh_engines, token="wrong-token", sync_timeout_s=0
    )
    try:
        await poll(lambda: app.discovery.stats.errors >= 2)
        assert "HTTP 401" in caplog.text and "RBAC" in caplog.text
        assert not app.discovery.synced.is_set()
    finally:
        await app.stop()


async def test_pods_whose_kv_events_annotation_points_outside_the_allowed_networks_are_skipped(
    kube: FakeKubeAPI,
    tmp_path: Path,
    fresh_engines: list[EmulatedEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whoever can annotate a pod chooses its KV-event endpoint: one outside
    auth.engine_cidrs keeps the pod out, as an IP outside does."""
    inside = fresh_engines[0]
    await kube.put(pod("inside", IPS[0]))
    await kube.put(
        pod("aimed", IPS[1], annotations={"kvroute.io/kv-events": "tcp://10.9.9.9:5557"})
    )
    caplog.set_level(logging.WARNING, logger="kvroute.discovery")
    app = await start_router(
        [],
        discovery={
            "kubernetes": {
                "enabled": True,
                "kubeconfig": str(kube.kubeconfig(tmp_path, "test-token")),
                "namespace": kube.namespace,
                "port": port_of(inside),
                "sync_timeout_s": 5,
            }
        },
        auth={"engine_cidrs": ["127.0.0.0/8"]},
    )
    try:
        await poll(lambda: f"pod {kube.namespace}/aimed: not an engine" in caplog.text)
        assert "kv_events" in caplog.text and "10.9.9.9" in caplog.text
        assert [e.endpoint for e in app.registry] == [key(inside).endpoint]
    finally:
        await app.stop()
