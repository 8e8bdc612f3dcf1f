"""Engines from Kubernetes: the pods of a namespace that match a label selector.

A small informer over ``kubernetes-asyncio``: list the pods (keeping the list's
``resourceVersion``), then watch from that version. What each event does:

* a pod that is Ready and has an IP becomes an engine (``EngineFleet.add_engine``); its
  role, models, data-parallel size and KV-event endpoint come from labels and
  annotations (:func:`engine_of_pod`, defaults after llm-d's conventions);
* a registered pod that stops being Ready, or starts terminating, is drained: no new
  requests, in-flight ones finish, its index entries stay for when it is Ready again;
* a deleted pod's engine goes, with its index entries, KV-event streams and load
  (``EngineFleet.remove_engine``);
* ``BOOKMARK`` events only move the resourceVersion forward.

A watch that ends (the server's ``timeoutSeconds``) or breaks (connection lost) resumes
from the last resourceVersion seen, so no event is missed or replayed. ``410 Gone`` (that
version was compacted away) relists and reconciles the whole set. Other failures back
off exponentially and resume. Engines from the static configuration are never touched.

The watch loop is ours rather than ``kubernetes_asyncio.watch.Watch``: that helper
retries a 410 with the same expired version, where an informer must relist.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import msgspec

from router.config import (
    Config,
    ConfigError,
    EngineConfig,
    EventEndpoints,
    TopologyConfig,
)
from router.fleet.k8s_config import KubernetesDiscoveryConfig
from router.fleet.registry import Engine, EngineState, Registry, endpoint_of
from router.metric_catalogue import (
    DISCOVERY_ENGINES,
    DISCOVERY_ERRORS,
    DISCOVERY_EVENTS,
    DISCOVERY_EXPIRED,
    DISCOVERY_LISTS,
)
from router.security import engine_refused

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.discovery")

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_ROLES = ("both", "prefill", "decode")
_decode = msgspec.json.decode


class Fleet(Protocol):
    """What discovery changes: a running router's engines (``EngineFleet``)."""

    registry: Registry
    config: Config

    def add_engine(self, cfg: EngineConfig) -> Engine: ...

    async def remove_engine(self, endpoint: str) -> Engine | None: ...


class PodProblem(ValueError):
    """A pod that matches the selector but cannot be an engine (the message says why)."""


@dataclass(frozen=True, slots=True)
class PodState:
    """What one pod means to the router."""

    engine: EngineConfig | None
    """The engine it runs, or None while it has no IP."""
    ready: bool
    """Ready condition true and not terminating: it may take new requests."""


def _ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Running"):
        return False
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def node_of_pod(pod: Mapping[str, Any]) -> str | None:
    """The node a pod is scheduled on (``spec.nodeName``), if any yet."""
    return (pod.get("spec") or {}).get("nodeName") or None


def topology_of_pod(
    pod: Mapping[str, Any],
    cfg: KubernetesDiscoveryConfig,
    node_labels: Mapping[str, str] | None = None,
) -> TopologyConfig:
    """Where a pod runs: its node, and the zone and rack labels of that node (the pod's
    own labels of the same names where the node's are not known)."""
    labels: Mapping[str, str] = (pod.get("metadata") or {}).get("labels") or {}
    node = node_labels or {}
    return TopologyConfig(
        node=node_of_pod(pod),
        rack=node.get(cfg.rack_label) or labels.get(cfg.rack_label) or None,
        zone=node.get(cfg.zone_label) or labels.get(cfg.zone_label) or None,
    )


def engine_of_pod(
    pod: Mapping[str, Any],
    cfg: KubernetesDiscoveryConfig,
    node_labels: Mapping[str, str] | None = None,
) -> PodState:
    """The engine a pod runs and whether it is ready; :class:`PodProblem` if it cannot be one.

    ``node_labels``: the labels of the pod's node, for its topology."""
    meta = pod.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    notes: Mapping[str, str] = meta.get("annotations") or {}
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return PodState(None, False)
    raw_port = notes.get(cfg.port_annotation)
    try:
        port = int(raw_port) if raw_port is not None else cfg.port
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise PodProblem(f"annotation {cfg.port_annotation}={raw_port!r} is not a port") from None
    role = labels.get(cfg.role_label, cfg.default_role)
    if role not in _ROLES:
        raise PodProblem(f"label {cfg.role_label}={role!r} is none of {', '.join(_ROLES)}")
    models = [m.strip() for m in notes.get(cfg.models_annotation, "").split(",") if m.strip()]
    if not models and cfg.model_label and labels.get(cfg.model_label):
        models = [labels[cfg.model_label]]
    raw_dp = notes.get(cfg.dp_size_annotation, "1")
    try:
        dp_size = int(raw_dp)
        if dp_size < 1:
            raise ValueError
    except ValueError:
        raise PodProblem(
            f"annotation {cfg.dp_size_annotation}={raw_dp!r} is not a positive integer"
        ) from None
    host = f"[{ip}]" if ":" in ip else ip
    kv_events: Any = "auto"
    override = notes.get(cfg.kv_events_annotation)
    if override is not None:
        override = override.strip()
        if override in ("auto", "none"):
            kv_events = override
        elif override.startswith("tcp://"):
            kv_events = EventEndpoints(endpoint=override.replace("{ip}", host))
        else:
            raise PodProblem(
                f"annotation {cfg.kv_events_annotation}={override!r}: use none, auto or "
                "tcp://host:port"
            )
    elif cfg.kv_events_port is not None:
        replay = cfg.kv_events_replay_port
        kv_events = EventEndpoints(
            endpoint=f"tcp://{host}:{cfg.kv_events_port}",
            replay_endpoint=f"tcp://{host}:{replay}" if replay else None,
        )
    engine = EngineConfig(
        url=f"{cfg.scheme}://{host}:{port}",
        role=role,
        models=models,
        dp_size=dp_size,
        kv_events=kv_events,
        topology=topology_of_pod(pod, cfg, node_labels),
    )
    return PodState(engine, _ready(pod))


@dataclass(slots=True)
class DiscoveryStats:
    """What discovery did, for metrics and ``kvroute status``."""

    lists: int = 0
    watches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    """Watch events by type (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR)."""
    expired: int = 0
    """410 Gone answers (relisted)."""
    errors: int = 0
    """Failed or broken list and watch requests (retried after a backoff)."""
    resource_version: str | None = None


@dataclass(slots=True)
class _Tracked:
    engine: EngineConfig | None
    ready: bool
    registered: bool = False
    drained: bool = False
    """Discovery drained it (not Ready); only then does Ready undrain it."""


class _Expired(Exception):
    """The resourceVersion is too old (410 Gone): relist."""


class _StatusError(Exception):
    """The API server refused a request; the message is its own."""


def default_namespace() -> str:
    """The router's own namespace in a cluster, else ``default``."""
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


async def api_client(cfg: KubernetesDiscoveryConfig) -> Any:
    """A kubernetes-asyncio ApiClient: kubeconfig when given, in-cluster when in a pod."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if cfg.kubeconfig:
        await config.load_kube_config(
            config_file=cfg.kubeconfig, client_configuration=configuration
        )
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


class KubernetesDiscovery:
    """Keeps a router's engines in step with the pods that match a selector."""

    def __init__(self, fleet: Fleet, cfg: KubernetesDiscoveryConfig) -> None:
        self.fleet = fleet
        self.cfg = cfg
        self.namespace = cfg.namespace or default_namespace()
        self.stats = DiscoveryStats()
        self.synced = asyncio.Event()
        """Set once the first list has been applied."""
        self._pods: dict[str, _Tracked] = {}
        self._nodes: dict[str, dict[str, str]] = {}
        """Labels of the nodes engine pods run on (read once per node)."""
        self._problems: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._api: Any = None
        self._client: Any = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect and start watching; waits up to ``sync_timeout_s`` for the first list."""
        from kubernetes_asyncio import client

        try:
            self._client = await api_client(self.cfg)
        except Exception as exc:  # the loaders raise several types; all mean the same here
            raise ConfigError(
                f"discovery.kubernetes: no Kubernetes API credentials ({exc}); run in a pod "
                "with a service account, or set discovery.kubernetes.kubeconfig"
            ) from None
        self._api = client.CoreV1Api(self._client)
        self._task = asyncio.ensure_future(self._run())
        log.info(
            "discovering engines: pods in namespace %s with labels %s",
            self.namespace,
            self.cfg.label_selector or "(any)",
        )
        if self.cfg.sync_timeout_s > 0:
            try:
                await asyncio.wait_for(self.synced.wait(), self.cfg.sync_timeout_s)
            except asyncio.TimeoutError:
                log.warning(
                    "no pod list within %.0f s; serving meanwhile, discovery goes on",
                    self.cfg.sync_timeout_s,
                )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    def engines(self) -> dict[str, bool]:
        """Endpoints discovery registered, and whether each is Ready."""
        return {
            endpoint_of(t.engine.url): t.ready
            for t in self._pods.values()
            if t.registered and t.engine is not None
        }

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        version: str | None = None
        backoff = self.cfg.backoff_initial_s
        while True:
            try:
                if version is None:
                    version = await self._list()
                    backoff = self.cfg.backoff_initial_s
                started, events = time.monotonic(), sum(self.stats.events.values())
                version = await self._watch(version)
                if time.monotonic() - started < 1 and sum(self.stats.events.values()) == events:
                    # A server that ends every watch at once must not make this loop spin.
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.cfg.backoff_max_s)
                else:
                    backoff = self.cfg.backoff_initial_s
            except _Expired:
                self.stats.expired += 1
                log.info("resourceVersion %s expired (410 Gone): relisting", version)
                version = None
            except asyncio.CancelledError:
                raise
            except _StatusError as exc:
                self.stats.errors += 1
                log.warning("%s; retrying in %.1f s", exc, backoff)
                version = None  # what the server refused may be the version: relist
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.backoff_max_s)
            except Exception as exc:  # connection lost, timeouts, garbage: resume
                self.stats.errors += 1
                if version is not None:  # the events applied before the break count
                    version = self.stats.resource_version or version
                log.warning(
                    "pod watch failed (%s: %s); resuming from resourceVersion %s in %.1f s",
                    type(exc).__name__,
                    exc,
                    version,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.backoff_max_s)

    async def _list(self) -> str:
        """List every matching pod (paginated), reconcile, return the list's version."""
        pods: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.cfg.label_selector, "limit": 500}
            if token:
                kwargs["_continue"] = token
            resp = await self._api.list_namespaced_pod(
                self.namespace,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(total=60),
                **kwargs,
            )
            try:
                body = await resp.read()
                if resp.status == 410:
                    raise _Expired()
                if resp.status != 200:
                    raise _StatusError(self._status_message("list pods", resp.status, body))
            finally:
                resp.release()
            page = _decode(body)
            pods.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                version = str(meta.get("resourceVersion", ""))
                break
        self.stats.lists += 1
        await self._reconcile(pods)
        self.stats.resource_version = version
        self.synced.set()
        return version

    async def _watch(self, version: str) -> str:
        """Follow events from ``version`` until the stream ends; returns the last version."""
        resp = await self._api.list_namespaced_pod(
            self.namespace,
            label_selector=self.cfg.label_selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.cfg.watch_timeout_s,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=self.cfg.watch_timeout_s + 30
            ),
        )
        self.stats.watches += 1
        try:
            if resp.status == 410:
                raise _Expired()
            if resp.status != 200:
                raise _StatusError(
                    self._status_message("watch pods", resp.status, await resp.read())
                )
            pending = b""
            async for chunk in resp.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        version = await self._on_event(_decode(line), version)
            if pending.strip():
                version = await self._on_event(_decode(pending), version)
        finally:
            resp.close()
        return version

    async def _on_event(self, event: Mapping[str, Any], version: str) -> str:
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(kind, str) or not isinstance(obj, dict):
            raise ValueError(f"not a watch event: {str(event)[:200]}")
        self.stats.events[kind] = self.stats.events.get(kind, 0) + 1
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Expired()
            raise _StatusError(f"watch pods: {code} {obj.get('reason')}: {obj.get('message')}")
        new_version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            await self._apply(obj)
        elif kind == "DELETED":
            await self._forget(_pod_key(obj))
        if new_version:
            version = str(new_version)
            self.stats.resource_version = version
        return version

    @staticmethod
    def _status_message(
        what: str, status: int, body: bytes, rights: str = "list and watch pods"
    ) -> str:
        try:
            message = _decode(body).get("message") or body[:200].decode("utf-8", "replace")
        except (msgspec.DecodeError, AttributeError):
            message = body[:200].decode("utf-8", "replace")
        hint = f" (does the router's service account have RBAC to {rights}?)"
        return f"{what}: HTTP {status}: {message}{hint if status in (401, 403) else ''}"

    # ------------------------------------------------------------------ reconciling

    async def _reconcile(self, pods: list[dict[str, Any]]) -> None:
        """Make the registered engines match a full list of pods."""
        listed = {_pod_key(p): p for p in pods}
        for key in [k for k in self._pods if k not in listed]:
            await self._forget(key)
        for pod in listed.values():
            await self._apply(pod)

    async def _node_labels(self, name: str | None) -> dict[str, str] | None:
        """A node's labels, read from the API server once per node (its zone and rack do
        not change under a running pod); None when not to be read or unreadable."""
        if name is None or not self.cfg.node_topology:
            return None
        if name in self._nodes:
            return self._nodes[name]
        resp = await self._api.read_node(
            name,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=30),
        )
        try:
            body = await resp.read()
            status = resp.status
        finally:
            resp.release()
        if status != 200:
            # Remembered as unknown: the pod's own labels stand in (no retry per event).
            log.warning(
                "%s; engine topology from the pod alone",
                self._status_message(f"get node {name}", status, body, "get nodes"),
            )
            self._nodes[name] = {}
            return None
        labels = (_decode(body).get("metadata") or {}).get("labels") or {}
        self._nodes[name] = {str(k): str(v) for k, v in labels.items()}
        return self._nodes[name]

    async def _apply(self, pod: Mapping[str, Any]) -> None:
        key = _pod_key(pod)
        try:
            scheduled = (pod.get("status") or {}).get("podIP")
            labels = await self._node_labels(node_of_pod(pod)) if scheduled else None
            state = engine_of_pod(pod, self.cfg, labels)
        except PodProblem as exc:
            if self._problems.get(key) != str(exc):
                log.warning("pod %s is not used as an engine: %s", key, exc)
                self._problems[key] = str(exc)
            await self._forget(key)
            return
        self._problems.pop(key, None)
        tracked = self._pods.get(key)
        if tracked is not None and tracked.engine != state.engine:
            await self._forget(key)  # a new IP, port, role...: a different engine
            tracked = None
        if tracked is None:
            tracked = self._pods[key] = _Tracked(state.engine, state.ready)
        tracked.ready = state.ready
        if state.engine is None:
            return
        endpoint = endpoint_of(state.engine.url)
        registry = self.fleet.registry
        if not tracked.registered:
            if not state.ready:
                return  # a starting pod joins once Ready
            existing = registry.get(endpoint)
            if existing is not None and not self._owns(endpoint):
                log.warning(
                    "pod %s: %s is already a configured engine; left as it is", key, endpoint
                )
                return
            refused = await engine_refused(state.engine, self.fleet.config.auth.engine_cidrs)
            if refused is not None:
                log.warning("pod %s: not an engine: %s", key, refused)
                return
            self.fleet.add_engine(state.engine)
            tracked.registered = True
            log.info("pod %s: engine %s (%s) added", key, state.engine.url, state.engine.role)
            return
        engine = registry.get(endpoint)
        if engine is None:
            return
        if not state.ready and engine.state is not EngineState.REFUSED:
            if engine.state is not EngineState.DRAINING:
                log.info("pod %s is not ready: no new requests to %s", key, endpoint)
            registry.drain(engine)
            tracked.drained = True
        elif state.ready and tracked.drained:
            registry.undrain(engine)
            tracked.drained = False
            log.info("pod %s is ready again: %s takes requests", key, endpoint)

    async def _forget(self, key: str) -> None:
        tracked = self._pods.pop(key, None)
        if tracked is None or not tracked.registered or tracked.engine is None:
            return
        endpoint = endpoint_of(tracked.engine.url)
        if self._owns(endpoint):
            return  # another pod (same IP and port) took it over
        await self.fleet.remove_engine(endpoint)
        log.info("pod %s gone: engine %s removed with its index entries", key, endpoint)

    def _owns(self, endpoint: str) -> bool:
        return any(
            t.registered and t.engine is not None and endpoint_of(t.engine.url) == endpoint
            for t in self._pods.values()
        )


def _pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class DiscoveryCollector:
    """``kvroute_discovery_*`` metrics, read from a discovery's counters at scrape time."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.discovery = discovery

    def collect(self) -> Iterator[StateFamily]:
        stats = self.discovery.stats
        ready = list(self.discovery.engines().values())
        yield DISCOVERY_ENGINES.labelled(
            [(("ready",), sum(ready)), (("not_ready",), len(ready) - sum(ready))]
        )
        yield DISCOVERY_EVENTS.labelled(((kind,), n) for kind, n in sorted(stats.events.items()))
        yield DISCOVERY_LISTS.value(stats.lists)
        yield DISCOVERY_EXPIRED.value(stats.expired)
        yield DISCOVERY_ERRORS.value(stats.errors)
