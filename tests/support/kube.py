"""A Kubernetes API server in miniature: pods of one namespace, list and watch.

No real API server can run here (no cluster, no kube-apiserver binary), so discovery
tests talk to this one through the real ``kubernetes-asyncio`` client. It speaks the
parts of the protocol an informer relies on:

* ``GET /api/v1/namespaces/NS/pods?labelSelector=...``: a ``PodList`` whose
  ``metadata.resourceVersion`` is the store's current version;
* ``...&watch=true&resourceVersion=V&allowWatchBookmarks=true&timeoutSeconds=T``: a
  chunked stream of JSON lines, every change after ``V`` then new ones as they happen,
  ``BOOKMARK`` events on request, the end of the stream after ``T`` seconds;
* a version older than the retained history (:meth:`compact`) gets the API server's
  answer: HTTP 200 and one ``ERROR`` event holding a ``Status`` with code 410;
* ``GET /api/v1/nodes/NAME``: a node with its labels (:meth:`put_node`), 404 for others.

Selectors support ``k=v``, ``k==v``, ``k!=v``, ``k`` and ``!k`` terms joined by commas.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

from aiohttp import web


def pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "inference",
    node: str | None = None,
) -> dict[str, Any]:
    """A pod object as the API server returns it (the fields discovery reads); ``node``:
    the node it is scheduled on (``spec.nodeName``)."""
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": {"llm-d.ai/inference-serving": "true", **(labels or {})},
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}],
            **({"nodeName": node} if node else {}),
        },
        "status": status,
    }


def _true(value: str | None) -> bool:
    """A boolean query parameter as the API server parses it (Go's ParseBool)."""
    return (value or "").lower() in ("1", "t", "true")


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeKubeAPI:
    """Pods in one namespace behind list and watch; tests change them and watch the router."""

    def __init__(self, namespace: str = "inference") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest = 100
        """Watches from a version below this get 410 Gone."""
        self.requests: list[dict[str, str]] = []
        """Query parameters of every list and watch request, in order."""
        self.nodes: dict[str, dict[str, str]] = {}
        """Node name -> its labels."""
        self.node_reads: list[str] = []
        """Names of the nodes read, in order."""
        self._changed = asyncio.Condition()
        self._streams: set[web.StreamResponse] = set()
        self._bookmarks = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------------ server

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{self.namespace}/pods", self._pods)
        app.router.add_get("/api/v1/nodes/{name}", self._node)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self.break_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, directory: Path, token: str = "test-token") -> Path:
        """A kubeconfig file whose current context points at this server."""
        path = directory / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": token}}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {
                                "cluster": "fake",
                                "user": "fake",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    # ------------------------------------------------------------------ what tests change

    async def put(self, obj: dict[str, Any]) -> int:
        """Create or replace a pod; returns its new resourceVersion."""
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        return await self._record(kind, obj)

    def put_node(self, name: str, labels: dict[str, str]) -> None:
        """Create or replace a node (nodes are read, not watched)."""
        self.nodes[name] = dict(labels)

    async def delete(self, name: str) -> int:
        return await self._record("DELETED", self.pods[name])

    async def _record(self, kind: str, obj: dict[str, Any]) -> int:
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.version)
        name = stored["metadata"]["name"]
        if kind == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = stored
        self.history.append((self.version, kind, stored))
        async with self._changed:
            self._changed.notify_all()
        return self.version

    def compact(self) -> None:
        """Forget the change history: watches from any earlier version get 410 Gone."""
        self.history.clear()
        self.oldest = self.version + 1

    async def bookmark(self) -> None:
        """Send a BOOKMARK (the current version) on every open watch."""
        self._bookmarks += 1
        async with self._changed:
            self._changed.notify_all()

    def break_watches(self) -> None:
        """Cut every open watch connection mid-stream, as a failing load balancer would."""
        for stream in list(self._streams):
            transport = stream._req.transport if stream._req is not None else None  # type: ignore[attr-defined]
            if transport is not None:
                transport.abort()
        self._streams.clear()

    def watches(self) -> list[dict[str, str]]:
        return [r for r in self.requests if _true(r.get("watch"))]

    def lists(self) -> list[dict[str, str]]:
        return [r for r in self.requests if not _true(r.get("watch"))]

    # ------------------------------------------------------------------ protocol

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        params = dict(request.query)
        self.requests.append(params)
        if request.headers.get("Authorization") != "Bearer test-token":
            return web.json_response(
                {"kind": "Status", "status": "Failure", "code": 401, "message": "Unauthorized"},
                status=401,
            )
        selector = params.get("labelSelector", "")
        if _true(params.get("watch")):
            return await self._watch(request, selector, int(params.get("resourceVersion") or 0))
        items = [
            p for p in self.pods.values() if _matches(selector, p["metadata"].get("labels") or {})
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.node_reads.append(name)
        if request.headers.get("Authorization") != "Bearer test-token":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if name not in self.nodes:
            return web.json_response(
                {"kind": "Status", "status": "Failure", "code": 404, "reason": "NotFound",
                 "message": f'nodes "{name}" not found'},
                status=404,
            )  # fmt: skip
        return web.json_response(
            {
                "kind": "Node",
                "apiVersion": "v1",
                "metadata": {"name": name, "labels": self.nodes[name]},
            }
        )

    async def _watch(self, request: web.Request, selector: str, since: int) -> web.StreamResponse:
        timeout = float(request.query.get("timeoutSeconds") or 3600)
        bookmarks = _true(request.query.get("allowWatchBookmarks"))
        # Bookmarks sent from now on reach this watch: read before the first await, in
        # the step that listed the request in `watches()` (a test that saw it there and
        # sent a bookmark before the stream was ready lost it, on a loaded machine).
        seen_bookmarks = self._bookmarks
        stream = web.StreamResponse(headers={"Content-Type": "application/json"})
        stream.enable_chunked_encoding()
        await stream.prepare(request)
        self._streams.add(stream)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await stream.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        try:
            if since < self.oldest - 1:
                await send(
                    "ERROR",
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"too old resource version: {since} ({self.oldest})",
                        "reason": "Expired",
                        "code": 410,
                    },
                )
                return stream
            await asyncio.wait_for(
                self._follow(send, selector, since, bookmarks, seen_bookmarks), timeout
            )
        except (asyncio.TimeoutError, ConnectionResetError):
            pass
        finally:
            self._streams.discard(stream)
        return stream

    async def _follow(
        self, send: Any, selector: str, sent: int, bookmarks: bool, seen_bookmarks: int
    ) -> None:
        while True:
            snapshot = list(self.history)
            for version, kind, obj in snapshot:
                if version > sent and _matches(selector, obj["metadata"].get("labels") or {}):
                    await send(kind, obj)
            if snapshot:
                sent = max(sent, snapshot[-1][0])
            sent = max(sent, self.oldest - 1)  # what compaction dropped is not replayed
            if bookmarks and self._bookmarks != seen_bookmarks:
                seen_bookmarks = self._bookmarks
                await send(
                    "BOOKMARK",
                    {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(self.version)},
                    },
                )
            async with self._changed:
                await self._changed.wait_for(
                    lambda sent=sent, seen=seen_bookmarks: (
                        self.version > sent or (bookmarks and self._bookmarks != seen)
                    )
                )
