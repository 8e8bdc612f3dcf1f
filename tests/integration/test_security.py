"""Authentication, TLS and allow-lists on real listeners (HTTP, gRPC) in front of
emulated engines; certificates are made by the test (``support.tls``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from aiohttp import web
from cryptography import x509
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.clients import metric_sum, metrics, post_reply, session
from support.engines import poll, start_test_engine
from support.grpc_clients import generate, rpc_error
from support.listeners import DialCounter, hostile_handoff
from support.routers import router_config, start_router
from support.tls import TestCA

from router.cli import main
from router.emulator import EmulatedEngine
from router.fleet.registry import EngineState
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.reload import Reloader

CLIENT_KEY = "sk-client-Zx81tQ"
ADMIN_KEY = "sk-admin-Qm44pL"
ENGINE_KEY = "sk-engine-Wr27nK"
SECRETS = (CLIENT_KEY, ADMIN_KEY, ENGINE_KEY)
REDIS_PASSWORD = "redis-pw-Hq71xZ"
BODY = {"model": "kvroute-emulated", "prompt": "secure hello", "max_tokens": 2}
CHAT = {"model": "kvroute-emulated", "messages": [{"role": "user", "content": "hi"}]}


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest_asyncio.fixture(scope="module")
async def locked_engine() -> AsyncIterator[EmulatedEngine]:
    """An engine that, like vLLM with --api-key, wants its own key on /v1/*."""
    engine = await start_test_engine(engine_id="locked", api_key=ENGINE_KEY)
    yield engine
    await engine.stop()


async def test_client_keys_guard_the_client_api_and_probes_stay_open(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router(
        [engine.url], auth={"api_keys": [CLIENT_KEY], "admin_keys": [ADMIN_KEY]}
    )
    try:
        url = f"{app.url}/v1/completions"
        for headers in ({}, bearer("wrong"), {"Authorization": CLIENT_KEY}):
            reply = await post_reply(http, url, BODY, headers)
            assert reply.status == 401, headers
            assert reply.body["error"]["type"] == "authentication_error"
            assert reply.headers["www-authenticate"].startswith("Bearer")
        assert (await post_reply(http, url, BODY, bearer(CLIENT_KEY))).status == 200
        assert (await post_reply(http, url, BODY, bearer(ADMIN_KEY))).status == 200
        async with http.get(f"{app.url}/v1/models") as resp:
            assert resp.status == 401
        for probe in ("/health", "/ready", "/metrics", "/openapi.json"):
            async with http.get(f"{app.url}{probe}") as resp:
                assert resp.status == 200, probe
    finally:
        await app.stop()


async def test_metrics_can_ask_for_a_key(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router(
        [engine.url], auth={"api_keys": [CLIENT_KEY], "metrics_need_key": True}
    )
    try:
        async with http.get(f"{app.url}/metrics") as resp:
            assert resp.status == 401
        async with http.get(f"{app.url}/metrics", headers=bearer(CLIENT_KEY)) as resp:
            assert resp.status == 200
    finally:
        await app.stop()


async def test_admin_calls_need_the_admin_key(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router(
        [engine.url], auth={"api_keys": [CLIENT_KEY], "admin_keys": [ADMIN_KEY]}
    )
    try:
        url = f"{app.url}/admin/engines"
        for headers, status in (({}, 401), (bearer("nope"), 401), (bearer(CLIENT_KEY), 403)):
            async with http.get(url, headers=headers) as resp:
                assert resp.status == status, headers
                assert "error" in await resp.json()
        async with http.get(url, headers=bearer(ADMIN_KEY)) as resp:
            assert resp.status == 200
            assert len((await resp.json())["engines"]) == 1
        async with http.post(f"{app.url}/admin/reload", headers=bearer(CLIENT_KEY)) as resp:
            assert resp.status == 403
        async with http.post(f"{app.url}/admin/reload", headers=bearer(ADMIN_KEY)) as resp:
            assert resp.status == 400  # not started by kvroute serve: nothing to re-read
    finally:
        await app.stop()


async def test_engines_added_at_run_time_must_be_in_the_allowed_networks(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router([engine.url], auth={"engine_cidrs": ["127.0.0.0/8"]})
    try:
        url = f"{app.url}/admin/engines"
        for target in ("http://169.254.169.254:80", "http://10.1.2.3:8000", "http://[::1]:9"):
            async with http.post(url, json={"url": target}) as resp:
                assert resp.status == 403, target
                assert "engine_cidrs" in (await resp.json())["error"]["message"]
        async with http.post(url, json={"url": "http://localhost:9"}) as resp:
            assert resp.status == 201  # localhost resolves to loopback only
        assert app.registry.get("localhost:9") is not None
    finally:
        await app.stop()


async def test_grpc_add_engine_must_be_in_the_allowed_networks(
    engine: EmulatedEngine,
) -> None:
    app = await start_router([engine.url], grpc={"port": 0}, auth={"engine_cidrs": ["127.0.0.0/8"]})
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            admin = pb_grpc.AdminStub(channel)
            for target in ("http://169.254.169.254:80", "http://10.1.2.3:8000", "http://[::1]:9"):
                code, message = await rpc_error(admin.AddEngine(pb.AddEngineRequest(url=target)))
                assert code == grpc.StatusCode.PERMISSION_DENIED, target
                assert "engine_cidrs" in message and target in message
                assert app.registry.get(target.removeprefix("http://")) is None
            added = await admin.AddEngine(
                pb.AddEngineRequest(url="http://localhost:9", kv_events="none")
            )
            assert added.endpoint == "localhost:9"  # localhost resolves to loopback only
        assert len(app.registry) == 2
    finally:
        await app.stop()


async def test_upstream_credentials(
    locked_engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """`token`: the router sends the engines' key (its own calls too, so discovery works);
    `pass`: the client's header goes through; `drop`: nothing, and the engine refuses."""
    token = await start_router(
        [locked_engine.url],
        auth={"api_keys": [CLIENT_KEY], "upstream": "token", "upstream_token": ENGINE_KEY},
    )
    # Without a key of their own the routers cannot list the engine's models: configured.
    static = [{"url": locked_engine.url, "models": ["kvroute-emulated"]}]
    passing = await start_router(static, auth={"upstream": "pass"})
    dropping = await start_router(static, auth={"upstream": "drop"})
    try:
        await poll(lambda: token.registry.models())
        reply = await post_reply(http, f"{token.url}/v1/completions", BODY, bearer(CLIENT_KEY))
        assert reply.status == 200
        reply = await post_reply(http, f"{passing.url}/v1/completions", BODY, bearer(ENGINE_KEY))
        assert reply.status == 200
        reply = await post_reply(http, f"{dropping.url}/v1/completions", BODY, bearer(ENGINE_KEY))
        assert reply.status == 401  # the engine's own refusal, passed on
    finally:
        for app in (token, passing, dropping):
            await app.stop()


async def test_grpc_client_and_admin_keys(engine: EmulatedEngine) -> None:
    app = await start_router(
        [engine.url],
        grpc={"port": 0},
        auth={"api_keys": [CLIENT_KEY], "admin_keys": [ADMIN_KEY]},
    )
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            router = pb_grpc.RouterStub(channel)
            admin = pb_grpc.AdminStub(channel)
            pick = pb.PickRequest(text="grpc secure", model="kvroute-emulated")
            got, message = await rpc_error(router.Pick(pick))
            assert got == grpc.StatusCode.UNAUTHENTICATED and "API key" in message
            got, _ = await rpc_error(router.Pick(pick, metadata=[("authorization", "Bearer x")]))
            assert got == grpc.StatusCode.UNAUTHENTICATED
            got, _ = await rpc_error(
                router.Generate(
                    pb.GenerateRequest(body=b'{"prompt": "x", "max_tokens": 1, "model": "m"}')
                ).read()
            )
            assert got == grpc.StatusCode.UNAUTHENTICATED
            client_md = [("authorization", f"Bearer {CLIENT_KEY}")]
            picked = await router.Pick(pick, metadata=client_md)
            await router.Release(
                pb.ReleaseRequest(request_id=picked.request_id), metadata=client_md
            )
            got, _ = await rpc_error(admin.ListEngines(pb.ListEnginesRequest(), metadata=client_md))
            assert got == grpc.StatusCode.PERMISSION_DENIED
            admin_md = [("authorization", f"Bearer {ADMIN_KEY}")]
            listed = await admin.ListEngines(pb.ListEnginesRequest(), metadata=admin_md)
            assert len(listed.engines) == 1
            got, message = await rpc_error(admin.Reload(pb.ReloadRequest(), metadata=admin_md))
            assert got == grpc.StatusCode.INVALID_ARGUMENT and "configuration" in message
    finally:
        await app.stop()


async def test_grpc_reflection_needs_a_key_when_keys_are_set(engine: EmulatedEngine) -> None:
    """Reflection describes the whole API: it answered anyone (issue 44, item 5). Health
    stays open for probes."""
    app = await start_router(
        [engine.url],
        grpc={"port": 0},
        auth={"api_keys": [CLIENT_KEY], "admin_keys": [ADMIN_KEY]},
    )
    listing = reflection_pb2.ServerReflectionRequest(list_services="")

    async def services(metadata: list[tuple[str, str]]) -> list[str]:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = [a async for a in stub.ServerReflectionInfo(iter([listing]), metadata=metadata)]
        return [s.name for s in answers[0].list_services_response.service]

    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            for metadata in ([], [("authorization", "Bearer wrong")]):
                got, message = await rpc_error(services(metadata))
                assert got == grpc.StatusCode.UNAUTHENTICATED, (got, message)
            for key in (CLIENT_KEY, ADMIN_KEY):
                listed = await services([("authorization", f"Bearer {key}")])
                assert "kvroute.v1.Router" in listed and "kvroute.v1.Admin" in listed
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await app.stop()


def test_serve_refuses_to_start_with_a_key_file_without_keys(tmp_path: Path) -> None:
    import subprocess
    import sys

    keys = tmp_path / "keys"
    keys.write_text("# every key rotated out\n")
    config = tmp_path / "router.yaml"
    config.write_text(f"engines: [{{url: 'http://127.0.0.1:{closed_port()}'}}]\n")
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--port", "0", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "KVROUTE_AUTH__API_KEYS_FILE": str(keys)},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"auth.api_keys_file: {keys} holds no keys" in lines[0], lines


async def test_a_reload_to_a_key_file_without_keys_is_refused_and_the_keys_stay(
    engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{CLIENT_KEY}\n")
    sections = {"grpc": {"port": 0}, "auth": {"api_keys_file": str(keys)}}
    app = await start_router([engine.url], **sections)
    app.reloader = Reloader(
        app.live, lambda: router_config([engine.url], **sections), app.credentials
    )
    try:
        keys.write_text("")
        async with http.post(f"{app.url}/admin/reload") as resp:
            assert resp.status == 400
        assert "holds no keys" in caplog.text and "keeping the running one" in caplog.text
        url = f"{app.url}/v1/completions"
        assert (await post_reply(http, url, BODY)).status == 401
        assert (await post_reply(http, url, BODY, bearer(CLIENT_KEY))).status == 200
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            router = pb_grpc.RouterStub(channel)
            body = b'{"prompt": "x", "max_tokens": 1, "model": "kvroute-emulated"}'
            got, _ = await rpc_error(router.Generate(pb.GenerateRequest(body=body)).read())
            assert got == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await app.stop()


# ---------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("pki"))


def client_context(ca: TestCA) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.path))


async def test_https_listener_and_certificate_reload(
    engine: EmulatedEngine, ca: TestCA, tmp_path: Path
) -> None:
    first = ca.issue("router-1")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(first.cert.read_bytes())
    key.write_bytes(first.key.read_bytes())
    app = await start_router(
        [engine.url], tls={"cert_file": str(cert), "key_file": str(key), "reload_interval_s": 0.05}
    )
    try:
        assert app.url.startswith("https://")
        context = client_context(ca)
        async with session() as https:
            async with https.post(f"{app.url}/v1/completions", json=BODY, ssl=context) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
                async with https.get(app.url.replace("https", "http") + "/health") as resp:
                    await resp.read()

        async def serial() -> int:
            host, port = app.url.removeprefix("https://").rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(port), ssl=context)
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            writer.close()
            from cryptography import x509

            return x509.load_der_x509_certificate(der).serial_number

        assert await serial() == first.serial
        second = ca.issue("router-2")
        key.write_bytes(second.key.read_bytes())
        cert.write_bytes(second.cert.read_bytes())
        os.utime(cert, (cert.stat().st_mtime + 5,) * 2)
        await poll(serial_is(serial, second.serial), timeout=5)
    finally:
        await app.stop()


def serial_is(serial: object, expected: int) -> object:
    async def check() -> bool:
        return await serial() == expected  # type: ignore[operator]

    return check


async def test_grpc_mutual_tls(engine: EmulatedEngine, ca: TestCA) -> None:
    server = ca.issue("grpc-server")
    client = ca.issue("grpc-client", client=True)
    app = await start_router(
        [engine.url],
        grpc={"port": 0},
        tls={
            "cert_file": str(server.cert),
            "key_file": str(server.key),
            "client_ca_file": str(ca.path),
            "listeners": ["grpc"],
        },
    )
    try:
        assert app.url.startswith("http://")  # only the gRPC listener was asked for
        target = f"localhost:{app.grpc_port}"
        roots = ca.path.read_bytes()
        anonymous = grpc.ssl_channel_credentials(root_certificates=roots)
        async with aio.secure_channel(target, anonymous) as channel:
            got, _ = await rpc_error(
                pb_grpc.RouterStub(channel).Pick(
                    pb.PickRequest(text="x", model="kvroute-emulated"), timeout=5
                )
            )
            assert got == grpc.StatusCode.UNAVAILABLE  # the handshake is refused
        mutual = grpc.ssl_channel_credentials(
            root_certificates=roots,
            private_key=client.key.read_bytes(),
            certificate_chain=client.cert.read_bytes(),
        )
        async with aio.secure_channel(target, mutual) as channel:
            picked = await pb_grpc.RouterStub(channel).Pick(
                pb.PickRequest(text="x", model="kvroute-emulated"), timeout=5
            )
            assert picked.decode.endpoint
        async with aio.insecure_channel(target) as channel:
            got, _ = await rpc_error(
                pb_grpc.RouterStub(channel).Pick(
                    pb.PickRequest(text="x", model="kvroute-emulated"), timeout=5
                )
            )
            assert got == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.stop()


async def test_the_extproc_and_grpc_listeners_speak_tls_and_reload_their_certificate(
    engine: EmulatedEngine, ca: TestCA, tmp_path: Path
) -> None:
    first = ca.issue("extproc-1")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(first.cert.read_bytes())
    key.write_bytes(first.key.read_bytes())
    app = await start_router(
        [engine.url],
        extproc={"port": 0},
        grpc={"port": 0},
        tls={
            "cert_file": str(cert),
            "key_file": str(key),
            "listeners": ["extproc", "grpc"],
            "reload_interval_s": 0.05,
        },
    )
    creds = grpc.ssl_channel_credentials(root_certificates=ca.path.read_bytes())

    async def health(port: int, secure: bool) -> str:
        target = f"localhost:{port}"
        channel = aio.secure_channel(target, creds) if secure else aio.insecure_channel(target)
        async with channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=3
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def served_serial(port: int) -> int:
        pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=10)
        return x509.load_pem_x509_certificate(pem.encode()).serial_number

    try:
        assert app.url.startswith("http://")  # only gRPC and ext_proc were asked for
        for port in (app.extproc_port, app.grpc_port):
            assert await health(port, secure=True) == "SERVING"
            assert await health(port, secure=False) == "UNAVAILABLE"
            assert await asyncio.to_thread(served_serial, port) == first.serial
        second = ca.issue("extproc-2")
        key.write_bytes(second.key.read_bytes())
        cert.write_bytes(second.cert.read_bytes())
        os.utime(cert, (cert.stat().st_mtime + 5,) * 2)

        def rotated(port: int) -> object:
            async def check() -> bool:
                await health(port, secure=True)  # a handshake triggers the reload check
                return await asyncio.to_thread(served_serial, port) == second.serial

            return check

        await poll(rotated(app.grpc_port), timeout=5, interval=0.1)
        await poll(rotated(app.extproc_port), timeout=5, interval=0.1)
    finally:
        await app.stop()


async def test_tls_to_engines_with_https_urls(ca: TestCA, http: aiohttp.ClientSession) -> None:
    issued = ca.issue("engine-tls")
    engine = await start_test_engine(
        engine_id="tls", tls_cert_file=str(issued.cert), tls_key_file=str(issued.key)
    )
    trusting = await start_router([engine.url], proxy={"ca_file": str(ca.path)})
    distrusting = await start_router([engine.url])
    try:
        assert engine.url.startswith("https://")
        await poll(lambda: trusting.registry.models())
        reply = await post_reply(http, f"{trusting.url}/v1/completions", BODY)
        assert reply.status == 200
        # The system trust store does not know the test CA: the engine is unreachable.
        reply = await post_reply(http, f"{distrusting.url}/v1/completions", BODY)
        assert reply.status == 503
    finally:
        await trusting.stop()
        await distrusting.stop()
        await engine.stop()


# ---------------------------------------------------------------------------- secrets


async def test_no_secret_in_logs_metrics_errors_or_admin_views(
    locked_engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    keys = tmp_path / "admin.keys"
    keys.write_text(f"# admin keys\n{ADMIN_KEY}\n")
    caplog.set_level(logging.DEBUG)
    app = await start_router(
        [locked_engine.url],
        server={"access_log": True},
        auth={
            "api_keys": [CLIENT_KEY],
            "admin_keys_file": str(keys),
            "upstream": "token",
            "upstream_token": ENGINE_KEY,
        },
    )
    try:
        seen: list[str] = []
        for headers in ({}, bearer(CLIENT_KEY), bearer(CLIENT_KEY + "x"), bearer(ADMIN_KEY)):
            async with http.post(f"{app.url}/v1/completions", json=BODY, headers=headers) as r:
                seen.append(await r.text())
                seen.append(str(r.headers))
            async with http.get(f"{app.url}/admin/engines", headers=headers) as r:
                seen.append(await r.text())
        async with http.get(f"{app.url}/metrics") as r:
            seen.append(await r.text())
        seen.append(repr(app.config))
        seen.append(app.config.model_dump_json())
        seen.append(caplog.text)
        for text in seen:
            for secret in SECRETS:
                assert secret not in text
    finally:
        await app.stop()


async def test_a_redis_password_is_never_shown(
    engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Nothing listens there: the router routes without the index and says so in its logs.
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{closed_port()}/0"
    caplog.set_level(logging.DEBUG)
    app = await start_router(
        [engine.url], index={"backend": "redis", "redis": {"url": url, "namespace": "pw-test"}}
    )
    try:
        seen: list[str] = []
        for _ in range(3):
            async with http.post(f"{app.url}/v1/completions", json=BODY) as r:
                assert r.status == 200, await r.text()
                seen.append(await r.text())
        for path in ("/metrics", "/admin/engines"):
            async with http.get(f"{app.url}{path}") as r:
                seen.append(await r.text())
        seen += [repr(app.config), str(app.config), app.config.model_dump_json()]
        # A reload that changes the URL logs the change (it waits for a restart), masked.
        moved = url.replace("/0", "/1")
        new = router_config([engine.url], index={"backend": "redis", "redis": {"url": moved}})
        result = await Reloader(app.live, lambda: new, app.credentials).reload()
        assert result is not None and "index.redis.url" in result.restart
        assert "redis://:***@127.0.0.1" in caplog.text
        seen.append(caplog.text)
        assert [text[:300] for text in seen if REDIS_PASSWORD in text] == []
    finally:
        await app.stop()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"index:\n  backend: redis\n  redis:\n    url: {url}\n")
    assert main(["config", "check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert REDIS_PASSWORD not in out and "redis://:***@127.0.0.1" in out


# ---------------------------------------------------------------------------- one credential


async def test_a_credential_header_sent_twice_is_a_400_in_the_routes_form(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """The first of two would be the key here, and a proxy in front may have checked the
    last: refused, whether or not keys are configured."""
    app = await start_router([engine.url], auth={"api_keys": [CLIENT_KEY]})
    good, other = f"Bearer {CLIENT_KEY}", "Bearer sk-someone-else"
    try:
        twice = [("Authorization", good), ("Authorization", other)]
        async with http.post(f"{app.url}/v1/completions", json=BODY, headers=twice) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "authorization"
        messages = {**CHAT, "max_tokens": 2}
        keys = [("x-api-key", CLIENT_KEY), ("x-api-key", CLIENT_KEY)]
        async with http.post(f"{app.url}/v1/messages", json=messages, headers=keys) as r:
            assert r.status == 400
            answer = await r.json()
            assert answer["type"] == "error"
            assert answer["error"]["type"] == "invalid_request_error"
            assert "x-api-key" in answer["error"]["message"]
        once = await post_reply(http, f"{app.url}/v1/completions", BODY, bearer(CLIENT_KEY))
        assert once.status == 200
    finally:
        await app.stop()
    open_app = await start_router([engine.url])
    try:
        async with http.post(f"{open_app.url}/v1/completions", json=BODY, headers=twice) as r:
            assert r.status == 400
    finally:
        await open_app.stop()


async def test_grpc_metadata_authorization_sent_twice_is_invalid_argument(
    engine: EmulatedEngine,
) -> None:
    app = await start_router(
        [engine.url], grpc={"port": 0}, auth={"api_keys": [CLIENT_KEY], "admin_keys": [ADMIN_KEY]}
    )
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            router, admin = pb_grpc.RouterStub(channel), pb_grpc.AdminStub(channel)
            for key in (CLIENT_KEY, ADMIN_KEY):
                twice = (("authorization", f"Bearer {key}"), ("authorization", "Bearer x"))
                for call in (
                    router.Pick(pb.PickRequest(text="hi"), metadata=twice),
                    admin.ListEngines(pb.ListEnginesRequest(), metadata=twice),
                ):
                    code, message = await rpc_error(call)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT
                    assert "authorization" in message
            once = (("authorization", f"Bearer {ADMIN_KEY}"),)
            assert (await admin.ListEngines(pb.ListEnginesRequest(), metadata=once)).engines
    finally:
        await app.stop()


# ---------------------------------------------------------------------------- handoff fields


@pytest_asyncio.fixture
async def dial_counter() -> AsyncIterator[tuple[DialCounter, int]]:
    counter = DialCounter()
    port = await counter.start()
    yield counter, port
    await counter.stop()


async def test_client_handoff_fields_never_reach_an_engine(
    engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    dial_counter: tuple[DialCounter, int],
) -> None:
    counter, port = dial_counter
    app = await start_router([engine.url], grpc={"port": 0})
    fields = hostile_handoff(port)
    try:
        completion = {**BODY, **fields}
        chat = {
            "model": BODY["model"],
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            **fields,
        }
        assert (await post_reply(http, f"{app.url}/v1/completions", completion)).status == 200
        assert (await post_reply(http, f"{app.url}/v1/chat/completions", chat)).status == 200
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            generated = await generate(pb_grpc.RouterStub(channel), completion)
            assert generated.status == 200, generated.data
        await asyncio.sleep(0.2)  # a pull the engine had started would have dialled by now
        assert counter.dials == 0
        samples = await metrics(http, app.url)
        for name in fields:
            assert (
                metric_sum(samples, "kvroute_client_handoff_fields_removed_total", field=name) == 3
            ), name
    finally:
        await app.stop()


MODEL = BODY["model"]
#: A body of each route that forwards to an engine.
ROUTE_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", BODY),
    "chat": ("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
    "messages": ("/v1/messages", {**CHAT, "max_tokens": 2}),
    "count_tokens": ("/v1/messages/count_tokens", CHAT),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    "generate_tokens": (
        "/inference/v1/generate",
        {"model": MODEL, "token_ids": [11, 12, 13], "sampling_params": {"max_tokens": 2}},
    ),
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": "hi"}),
}


def nested(body: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """``body`` with ``value`` at the dotted ``path`` (objects on the way kept)."""
    out = json.loads(json.dumps(body))
    *outer, name = path.split(".")
    node = out
    for key in outer:
        node = node.setdefault(key, {})
    node[name] = value
    return out


def owned_value(path: str, port: int) -> object:
    """What a hostile client puts at ``path``: a pull from the dial counter (or its
    bootstrap room)."""
    fields = hostile_handoff(port)
    return fields.get(path.rpartition(".")[2], fields["kv_transfer_params"])


@pytest.mark.parametrize(
    ("front_end", "route", "path"),
    [
        # vLLM's engine reads SamplingParams.extra_args: sent as it is on generate...
        ("http", "generate_tokens", "sampling_params.extra_args.kv_transfer_params"),
        ("http", "generate_tokens", "sampling_params.extra_args.ec_transfer_params"),
        # ...and built from vllm_xargs on the OpenAI and Anthropic routes.
        ("http", "completions", "vllm_xargs.kv_transfer_params"),
        ("http", "chat", "vllm_xargs.ec_transfer_params"),
        ("http", "messages", "vllm_xargs.kv_transfer_params"),
        ("http", "responses", "vllm_xargs.kv_transfer_params"),
        ("http", "tokenize", "vllm_xargs.kv_transfer_params"),
        ("http", "count_tokens", "kv_transfer_params"),
        ("http", "completions", "ec_transfer_params"),
        # An SDK's extra_body sent as a field, which proxies flatten.
        ("http", "chat", "extra_body.kv_transfer_params"),
        ("http", "completions", "extra_body.bootstrap_room"),
        ("http", "completions", "extra_body.vllm_xargs.kv_transfer_params"),
        ("grpc", "completions", "vllm_xargs.kv_transfer_params"),
        ("grpc", "chat", "extra_body.kv_transfer_params"),
    ],
)
async def test_nested_handoff_fields_never_reach_an_engine(
    engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    dial_counter: tuple[DialCounter, int],
    front_end: str,
    route: str,
    path: str,
) -> None:
    """A router-owned field wherever vLLM would act on it is removed and counted under its
    path: the engine never dials the host it names (generate), never sees the field (an
    object in ``vllm_xargs`` is vLLM's own 400: the answer would not be 200), and the
    request is served."""
    counter, port = dial_counter
    app = await start_router([engine.url], grpc={"port": 0})
    url, base = ROUTE_BODIES[route]
    body = nested(base, path, owned_value(path, port))
    try:
        if front_end == "http":
            reply = await post_reply(http, f"{app.url}{url}", body)
            assert reply.status == 200, reply.body
        else:
            async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
                chat = route == "chat"
                endpoint = pb.ENDPOINT_CHAT_COMPLETIONS if chat else pb.ENDPOINT_COMPLETIONS
                generated = await generate(pb_grpc.RouterStub(channel), body, endpoint=endpoint)
                assert generated.status == 200, generated.data
        assert counter.dials == 0
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_client_handoff_fields_removed_total", field=path) == 1
    finally:
        await app.stop()


async def test_trusted_clients_may_send_handoff_fields(
    engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    dial_counter: tuple[DialCounter, int],
) -> None:
    counter, port = dial_counter
    app = await start_router([engine.url], auth={"allow_client_handoff_fields": True})
    try:
        body = {**BODY, "kv_transfer_params": hostile_handoff(port)["kv_transfer_params"]}
        await post_reply(http, f"{app.url}/v1/completions", body)
        await poll(lambda: counter.dials > 0)  # the engine did as the client said
    finally:
        await app.stop()


async def test_grpc_pick_refuses_a_body_with_handoff_fields(engine: EmulatedEngine) -> None:
    app = await start_router([engine.url], grpc={"port": 0})
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            router = pb_grpc.RouterStub(channel)
            for owned, named in (
                ({"bootstrap_room": 7}, "bootstrap_room"),
                ({"vllm_xargs": {"kv_transfer_params": {}}}, "vllm_xargs.kv_transfer_params"),
            ):
                body = json.dumps({**BODY, **owned}).encode()
                code, message = await rpc_error(router.Pick(pb.PickRequest(body=body)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert named in message
            picked = await router.Pick(pb.PickRequest(body=json.dumps(BODY).encode()))
            await router.Release(pb.ReleaseRequest(request_id=picked.request_id))
        assert app.picks.open_count == 0
    finally:
        await app.stop()


# ---------------------------------------------------------------------------- event endpoints


async def test_engines_whose_kv_events_are_outside_the_allowed_networks_are_refused(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router([engine.url], auth={"engine_cidrs": ["127.0.0.0/8"]})
    try:
        url = f"{app.url}/admin/engines"
        for events in (
            {"endpoint": "tcp://10.1.2.3:5557"},
            {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://169.254.169.254:80"},
            {"endpoint": "tcp://eth0;10.1.2.3:5557"},  # ZMQ's source;destination form
            {"endpoint": "udp://127.0.0.1:5557"},
        ):
            async with http.post(url, json={"url": "http://127.0.0.1:9", "kv_events": events}) as r:
                assert r.status == 403, events
                assert "kv_events" in (await r.json())["error"]["message"]
        assert app.registry.get("127.0.0.1:9") is None
        assert len(app.registry) == 1
        ok = {"url": "http://127.0.0.1:9", "kv_events": {"endpoint": "tcp://127.0.0.5:5557"}}
        async with http.post(url, json=ok) as r:
            assert r.status == 201
    finally:
        await app.stop()


async def test_grpc_add_engine_with_kv_events_outside_the_allowed_networks_is_refused(
    engine: EmulatedEngine,
) -> None:
    app = await start_router([engine.url], grpc={"port": 0}, auth={"engine_cidrs": ["127.0.0.0/8"]})
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            admin = pb_grpc.AdminStub(channel)
            for events, replay in (("tcp://10.1.2.3:5557", ""), ("ipc:///x", "tcp://[fe80::1]:1")):
                request = pb.AddEngineRequest(
                    url="http://127.0.0.1:9", kv_events=events, kv_events_replay=replay
                )
                code, message = await rpc_error(admin.AddEngine(request))
                assert code == grpc.StatusCode.PERMISSION_DENIED, events
                assert "kv_events" in message and "engine_cidrs" in message
        assert app.registry.get("127.0.0.1:9") is None and len(app.registry) == 1
    finally:
        await app.stop()


async def test_event_endpoints_an_engine_reports_elsewhere_are_not_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine (on 127.0.0.1, allowed) says its events are on 127.0.0.2, outside
    ``auth.engine_cidrs``: the router never connects there and routes it from decisions."""
    remote = await start_test_engine(
        engine_id="elsewhere",
        kv_events_endpoint="tcp://127.0.0.2:*",
        kv_events_replay_endpoint="tcp://127.0.0.2:*",
    )
    app = await start_router([remote.url], auth={"engine_cidrs": ["127.0.0.1/32"]})
    try:
        record = app.registry.get(f"127.0.0.1:{remote.port}")
        assert record is not None and record.discovered and record.events is None
        assert app.subscriber is not None and app.subscriber.states() == []
        assert "reports KV events at tcp://127.0.0.2" in caplog.text
    finally:
        await app.stop()
        await remote.stop()


@pytest.mark.parametrize("cidrs", [["127.0.0.0/8"], ["127.0.0.1/32"]])
async def test_event_endpoints_from_kv_event_sources_are_checked_too(
    cidrs: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.32's ``/kv_event_sources`` (the engine has no ``/server_info``) is checked
    like ``/server_info``: its endpoints on 127.0.0.2 are followed only while
    ``auth.engine_cidrs`` has that host."""
    sources = {
        "0": {
            "endpoint": "tcp://127.0.0.2:5557",
            "replay_endpoint": "tcp://127.0.0.2:5558",
            "topic": "",
            "publisher": "zmq",
        }
    }

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": BODY["model"]}]})

    async def event_sources(_: web.Request) -> web.Response:
        return web.json_response(sources)

    fake = web.Application()
    fake.add_routes(
        [
            web.get("/health", health),
            web.get("/v1/models", models),
            web.get("/kv_event_sources", event_sources),
        ]
    )
    runner = web.AppRunner(fake)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    app = await start_router([f"http://127.0.0.1:{port}"], auth={"engine_cidrs": cidrs})
    try:
        record = app.registry.get(f"127.0.0.1:{port}")
        assert record is not None and record.discovered
        if "127.0.0.0/8" in cidrs:
            assert record.events is not None
            assert record.events.endpoint == "tcp://127.0.0.2:5557"
        else:
            assert record.events is None
            assert "reports KV events at tcp://127.0.0.2:5557" in caplog.text
    finally:
        await app.stop()
        await runner.cleanup()


class RankBoaster:
    """An engine (a plain HTTP server) that announces ``ranks`` data-parallel ranks in
    its ``/server_info`` or its ``/kv_event_sources``."""

    def __init__(self, ranks: int, where: str) -> None:
        self.ranks, self.where = ranks, where
        self.probes = 0

    async def start(self) -> str:
        async def health(_: web.Request) -> web.Response:
            self.probes += 1
            return web.Response()

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": BODY["model"]}]})

        async def server_info(_: web.Request) -> web.Response:
            if self.where != "server_info":
                return web.json_response({}, status=404)
            return web.json_response({"dp_size": self.ranks, "block_size": 16})

        async def event_sources(_: web.Request) -> web.Response:
            if self.where != "kv_event_sources":
                return web.json_response({}, status=404)
            endpoint = "tcp://127.0.0.1:5557"
            return web.json_response(
                {
                    str(rank): {"endpoint": endpoint, "publisher": "zmq"}
                    for rank in range(self.ranks)
                }
            )

        fake = web.Application()
        fake.add_routes(
            [
                web.get("/health", health),
                web.get("/v1/models", models),
                web.get("/server_info", server_info),
                web.get("/kv_event_sources", event_sources),
            ]
        )
        self.runner = web.AppRunner(fake)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["server_info", "kv_event_sources"])
async def test_an_engine_announcing_more_ranks_than_the_limit_is_refused_once(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A rogue engine's announced ``dp_size`` made the router build one routing target
    (load, index entries) per rank, a million of them if it said so (issue 44, item 4)."""
    boaster = RankBoaster(1_000_000 if where == "server_info" else 65, where)
    url = await boaster.start()
    caplog.set_level(logging.WARNING, logger="kvroute")
    app = await start_router([url])
    try:
        record = app.registry.get(url.removeprefix("http://"))
        assert record is not None and record.state is EngineState.REFUSED
        assert len(record.keys) == 1
        announced = "1000000" if where == "server_info" else "65"
        assert f"announces {announced} data-parallel ranks" in record.refused_reason
        assert "limits.max_dp_size 64" in record.refused_reason
        probes = boaster.probes
        await poll(lambda: boaster.probes >= probes + 5)  # probed again and again
        lines = [r.getMessage() for r in caplog.records if "data-parallel ranks" in r.getMessage()]
        assert lines == [f"refusing {record.refused_reason}"]
        assert record.state is EngineState.REFUSED
    finally:
        await app.stop()
        await boaster.runner.cleanup()


async def test_an_engine_within_the_rank_limit_is_routed_to_every_rank() -> None:
    boaster = RankBoaster(4, "server_info")
    url = await boaster.start()
    app = await start_router([url], limits={"max_dp_size": 4})
    try:
        record = app.registry.get(url.removeprefix("http://"))
        assert record is not None and record.state is EngineState.HEALTHY
        assert [key.rank for key in record.keys] == [0, 1, 2, 3]
    finally:
        await app.stop()
        await boaster.runner.cleanup()
