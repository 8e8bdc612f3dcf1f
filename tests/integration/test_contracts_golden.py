"""The router's observable contracts over one mixed run, pinned by golden files before
issue 45 moves the request pipeline: every metric family ``/metrics`` exports (name,
type, label names) and the shape of ``x-kvroute-reason`` (and ``x-kvroute-mode``) on
every front end.

One router in front of emulated engines serving two models: ``agg`` on two colocated
engines, ``pd`` on a prefill and a decode engine (NIXL handoff). Its HTTP, gRPC and
ext_proc front ends are all on. The run, in order, each request after the KV events of
the previous one reached the index (so its reason does not depend on timing):

- HTTP ``/v1/completions`` on ``agg``: a new prompt (``no_prefix``), then the same prompt
  longer and streamed (``prefix_hit``);
- HTTP on ``pd``: a long prompt (split), the same streamed, a short one (``local``);
- gRPC ``Pick`` (then ``Release``) on ``agg`` and ``pd``, ``Generate`` on both;
- ext_proc on ``agg`` and ``pd``: request headers and body, then the response's headers
  and body as Envoy sends them.

Golden files (``tests/fixtures/golden/``):

- ``metric_families.txt``: one line per family, sorted: the name as exported (counters
  with ``_total``), its type, its label names sorted (histograms' ``le`` left out), ``-``
  for none. A family without a series in the run (a retry counter when nothing retried)
  shows the label names it declares. The values of the labels in ``ENUM_LABELS`` follow
  (``name=v1|v2``): enums that are a contract, whose values this run determines. No
  family depends on timing: the collector yields every family its configuration has,
  series or not. Families of other configurations (Redis index, replicas, flow control,
  discovery, ``kvroute serve``'s reloader) are not in this run. The file is the router's
  with its compiled helper (``setup.py build_ext``): on the pure-Python path
  (``KVROUTE_PURE_PYTHON=1``) the index has no compiled tables and exports no
  ``kvroute_index_bytes``.
- ``reason_formats.txt``: one line per path and header, sorted, every number as ``#`` and
  every engine (``host:port``, a URL) as ``<engine>``. ``Pick`` gives no headers: its
  line holds ``decision.summary``, the string the HTTP path sends as
  ``x-kvroute-reason``.

A change to either is a change of contract. When it is meant, rewrite the files and
commit them with the change::

    REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/integration/test_contracts_golden.py
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from prometheus_client.registry import CollectorRegistry
from support.clients import post_reply, stream_reply
from support.engines import poll, start_test_engine
from support.extproc import header_map, request_messages
from support.golden import check_golden
from support.grpc_clients import connect, generate
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.grpc.gen.kvroute.v1 import router_pb2 as pb

#: Labels whose values are pinned besides their names: documented enums (docs/metrics.md)
#: whose values in this run are fixed, by the collector (it exports every value on every
#: scrape) or by the run (every request succeeds, each path once).
ENUM_LABELS: dict[str, tuple[str, ...]] = {
    "kvroute_decisions_total": ("policy", "reason"),
    "kvroute_disagg_decisions_total": ("mode", "reason"),
    "kvroute_extproc_requests_total": ("outcome", "status"),
    "kvroute_grpc_requests_total": ("code", "method"),
    "kvroute_handoffs_total": ("dialect", "outcome"),
    "kvroute_index_evictions_total": ("reason",),
    "kvroute_kv_event_replays_total": ("outcome",),
    "kvroute_kv_events_total": ("type",),
    "kvroute_picks_ended_total": ("how",),
    "kvroute_picks_total": ("api", "mode"),
    "kvroute_requests_total": ("outcome", "route", "status"),
}

LONG = 2_000
"""Words of a prompt the ``pd`` pool splits (each word one token)."""

_ENGINE = re.compile(r"(?:https?://)?(?:127\.0\.0\.1|localhost|\[::1\]):\d+(?:#dp\d+)?")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def shape(value: str) -> str:
    """A header's format: engines as ``<engine>``, then every number as ``#``."""
    return _NUMBER.sub("#", _ENGINE.sub("<engine>", value))


@dataclass
class MixedRun:
    """What the run saw: the header formats per path, ``/metrics`` at the end, and the
    label names each family declares."""

    formats: set[str] = field(default_factory=set)
    exposition: str = ""
    declared: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def saw(self, path: str, headers: dict[str, str], *names: str) -> None:
        for name in ("x-kvroute-reason", *names):
            self.formats.add(f"{path} | {name}: {shape(headers[name])}")


def declared_labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Label names each family declares, by its exported name: what a family shows
    when it has no series (prometheus_client keeps them in ``_labelnames``)."""
    out: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):
        labels = getattr(collector, "_labelnames", None)
        for family in collector.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            out[name] = tuple(labels if labels is not None else getattr(family, "_labelnames", ()))
    return out


async def settled(app: RouterApp) -> None:
    """Wait until the KV events of the requests so far are in the index: the same
    counts at two looks in a row, and no request in flight."""
    previous: list[tuple[int, int]] = []

    def steady() -> bool:
        counters = app.ingestor.counters
        now = (counters.blocks_stored, counters.blocks_removed)
        same = previous == [now]
        previous[:] = [now]
        return same and app.loads.in_flight == 0

    await poll(steady, interval=0.05)


# --------------------------------------------------------------------------- the run


async def http_requests(app: RouterApp, http: aiohttp.ClientSession, run: MixedRun) -> None:
    url = f"{app.url}/v1/completions"
    shared = words("agg", 600)
    reply = await post_reply(http, url, {"model": "agg", "prompt": shared, "max_tokens": 4})
    assert reply.status == 200, reply.body
    run.saw("http aggregated", reply.headers)
    await poll(lambda: app.ingestor.counters.blocks_stored >= 600 // 16)  # the prefix is known
    await settled(app)
    body = {"model": "agg", "prompt": f"{shared} more", "max_tokens": 4, "stream": True}
    reply = await stream_reply(http, url, body)
    run.saw("http aggregated stream", reply.headers)
    await settled(app)

    reply = await post_reply(
        http, url, {"model": "pd", "prompt": words("split", LONG), "max_tokens": 4}
    )
    assert reply.status == 200, reply.body
    assert reply.headers["x-kvroute-mode"] == "split"
    run.saw("http split", reply.headers, "x-kvroute-mode")
    await settled(app)
    body = {"model": "pd", "prompt": words("streamed", LONG), "max_tokens": 4, "stream": True}
    reply = await stream_reply(http, url, body)
    assert reply.headers["x-kvroute-mode"] == "split"
    run.saw("http split stream", reply.headers, "x-kvroute-mode")
    await settled(app)
    reply = await post_reply(http, url, {"model": "pd", "prompt": "short", "max_tokens": 4})
    assert reply.status == 200, reply.body
    assert reply.headers["x-kvroute-mode"].startswith("local:")
    run.saw("http local", reply.headers, "x-kvroute-mode")
    await settled(app)


async def grpc_requests(app: RouterApp, run: MixedRun) -> None:
    assert app.grpc_port is not None
    async with connect(app.grpc_port) as stubs:
        for model, prompt, mode in (
            ("agg", words("pick", 300), pb.MODE_AGGREGATED),
            ("pd", words("pdpick", LONG), pb.MODE_SPLIT),
        ):
            rid = f"golden-pick-{model}"
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 3}).encode()
            pick = await stubs.router.Pick(pb.PickRequest(request_id=rid, body=body))
            await stubs.router.Release(pb.ReleaseRequest(request_id=rid))
            assert pick.mode == mode
            path = f"grpc Pick {pb.Mode.Name(mode)}"
            run.formats.add(
                f"{path} | decode.decision.summary: {shape(pick.decode.decision.summary)}"
            )
            if pick.HasField("prefill"):
                summary = shape(pick.prefill.decision.summary)
                run.formats.add(f"{path} | prefill.decision.summary: {summary}")
            await settled(app)
        for model, prompt, path in (
            ("agg", words("gen", 300), "grpc Generate aggregated"),
            ("pd", words("pdgen", LONG), "grpc Generate split"),
        ):
            answer = await generate(
                stubs.router, {"model": model, "prompt": prompt, "max_tokens": 3}
            )
            assert answer.status == 200, answer.data
            extra = ("x-kvroute-mode",) if model == "pd" else ()
            run.saw(path, answer.headers, *extra)
            await settled(app)


def _set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def extproc_requests(app: RouterApp, run: MixedRun) -> None:
    """Each request as Envoy sends it: headers, body, then the engine's answer."""
    answer_head = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=header_map({":status": "200", "content-type": "application/json"})
        )
    )
    answer_body = ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))
    async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for model, prompt, path in (
            ("agg", words("xp", 300), "extproc aggregated"),
            ("pd", words("pdxp", LONG), "extproc split"),
        ):
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 3}).encode()
            call = stub.Process()
            for message in request_messages({"x-request-id": f"golden-{model}"}, body):
                await call.write(message)
            routed = await call.read()
            assert routed.WhichOneof("response") == "request_headers", routed
            await call.read()  # the body, echoed
            await call.write(answer_head)
            head = await call.read()
            run.saw(
                path, _set_headers(head.response_headers.response.header_mutation), "x-kvroute-mode"
            )
            await call.write(answer_body)
            await call.read()
            await call.done_writing()
            while await call.read() is not aio.EOF:
                pass
            await settled(app)


@pytest_asyncio.fixture(scope="module")
async def mixed_run(ipc_dir: Path) -> MixedRun:
    def events(name: str) -> dict[str, str]:
        return {
            "engine_id": f"golden-{name}",
            "kv_events_endpoint": f"ipc://{ipc_dir}/golden-{name}",
            "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
        }

    engines: list[EmulatedEngine] = []
    app: RouterApp | None = None
    # A client of its own: the session's ``http`` fixture cannot be had from a module
    # fixture that runs after another module's tests (pytest-asyncio 1.5 reports it
    # torn down).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        try:
            for name in ("a0", "a1"):
                engines.append(await start_test_engine(model="agg", **events(name)))
            engines.append(await start_test_engine(model="pd", role="prefill", **events("p0")))
            engines.append(
                await start_test_engine(
                    model="pd", role="decode", handoff_failure="error", **events("d0")
                )
            )
            roles: list[dict[str, Any]] = [{"url": e.url, "role": e.config.role} for e in engines]
            app = await start_router(roles, grpc={"port": 0}, extproc={"port": 0})
            await poll(
                lambda: app.subscriber and app.subscriber.stats.replays["ok"] >= len(engines)
            )
            run = MixedRun()
            await http_requests(app, http, run)
            await grpc_requests(app, run)
            await extproc_requests(app, run)
            await poll(lambda: app.picks.open_count == 0)
            async with http.get(f"{app.url}/metrics") as resp:
                assert resp.status == 200
                run.exposition = await resp.text()
            run.declared = declared_labels(app.metrics.registry)
        finally:
            if app is not None:
                await app.stop()
            for engine in engines:
                await engine.stop()
    return run


# --------------------------------------------------------------------------- the files


def metric_families(exposition: str, declared: dict[str, tuple[str, ...]]) -> str:
    """``metric_families.txt``: one line per family of ``exposition``, sorted."""
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = defaultdict(set)
    values: dict[tuple[str, str], set[str]] = defaultdict(set)
    family = ""
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            family, kind = line.split()[2:4]
            types[family] = kind
        elif line and not line.startswith("#"):
            assert line.startswith(family), f"a sample outside its family: {line}"
            for name, value in _LABEL.findall(line.partition("{")[2].rpartition("}")[0]):
                if name != "le":
                    labels[family].add(name)
                    values[(family, name)].add(value)
    lines = []
    for family, kind in sorted(types.items()):
        names = sorted(labels[family]) if family in labels else sorted(declared[family])
        text = f"{family} {kind} {','.join(names) or '-'}"
        for name in ENUM_LABELS.get(family, ()):
            text += f" {name}={'|'.join(sorted(values[(family, name)]))}"
        lines.append(text)
    return "\n".join(lines) + "\n"


def test_every_metric_family_keeps_its_name_type_and_labels(mixed_run: MixedRun) -> None:
    text = metric_families(mixed_run.exposition, mixed_run.declared)
    check_golden("metric_families.txt", text)


def test_every_front_end_keeps_its_reason_format(mixed_run: MixedRun) -> None:
    check_golden("reason_formats.txt", "\n".join(sorted(mixed_run.formats)) + "\n")
