"""The router's gRPC listeners, on the router's own event loop (grpc.aio).

* the API listener (``grpc.port``, ``--grpc-port``): ``kvroute.v1.Router`` and
  ``kvroute.v1.Admin``;
* the ext_proc listener (``extproc.port``, ``--extproc-port``):
  ``envoy.service.ext_proc.v3.ExternalProcessor``.

Each serves ``grpc.health.v1`` and server reflection; on the API listener, reflection
needs a client (or admin) key when ``auth.api_keys`` are set. A request that is not a
valid protobuf message of its method's type ends INVALID_ARGUMENT, on every service
(grpc.aio's own answer was UNKNOWN, quoting the decoder's exception class, with an
ERROR traceback per message). Health, per service: ``liveness``
(ext_proc listener) is SERVING while the process runs; every other service, and the
server as a whole (``""``), is SERVING while the router is not draining and has a
healthy engine, NOT_SERVING otherwise. A drain listener and engine state changes update
it at once; a one-second refresh catches engines added or removed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from router.frontends.extproc import SERVICE_NAME as EXTPROC_SERVICE
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.security import AuthError, grpc_credentials
from router.serving.headers import repeated

if TYPE_CHECKING:
    from router.config import Config
    from router.drain import Drain
    from router.fleet.registry import Engine, EngineState, Registry
    from router.metrics import RouterMetrics
    from router.security import Credentials
    from router.serving.picks import PickLedger
    from router.serving.services import Services

log = logging.getLogger("kvroute.grpc")

ROUTER_SERVICE = pb.DESCRIPTOR.services_by_name["Router"].full_name
_KVROUTE = f"/{pb.DESCRIPTOR.package}."
"""The method prefix of kvroute's own services (Router, Admin)."""
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
#: Health services of the ext_proc listener (the Gateway API Inference Extension's names).
LIVENESS, READINESS = "liveness", "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_STOP_GRACE_S = 2.0


class Listener:
    """One grpc.aio server: some services, their health, reflection."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        services: dict[str, Callable[[aio.Server], None]],
        health: tuple[str, ...],
        always_serving: tuple[str, ...],
        max_message_bytes: int,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: tuple[aio.ServerInterceptor, ...] = (),
    ) -> None:
        """``services``: full name -> adds its servicer; ``health``: health service names
        that follow the router's readiness (with ``""``); ``always_serving``: the rest."""
        self.name = name
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = 0
        self.health = health_aio.HealthServicer()
        self.always_serving = always_serving
        self.followers = ("", *health)
        self.credentials = credentials
        self.server = aio.server(
            interceptors=(*interceptors, MalformedMessages()),
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        for add in services.values():
            add(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self.server)

    async def start(self) -> int:
        if self.credentials is not None:
            port = self.server.add_secure_port(self.address, self.credentials)
        else:
            port = self.server.add_insecure_port(self.address)
        if not port:
            raise OSError(f"{self.name}: cannot listen on {self.address}")
        self.port = port
        await self.server.start()
        return port

    async def set_ready(self, ready: bool) -> None:
        for service in self.always_serving:
            await self.health.set(service, _SERVING)
        for service in self.followers:
            await self.health.set(service, _SERVING if ready else _NOT_SERVING)

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(_STOP_GRACE_S)


class ClientKeys(aio.ServerInterceptor):
    """The client key (``auth.api_keys``; an admin key does too) on every call of
    ``kvroute.v1.Router`` and of server reflection, from the ``authorization`` metadata;
    refused calls end UNAUTHENTICATED before the servicer runs. Reflection describes
    the whole API, so it asks for a key wherever the API does (grpcurl: ``-H
    'authorization: Bearer KEY'``). Admin calls are checked by the admin layer; health
    stays open for probes. A call of Router or Admin whose ``authorization`` (or
    ``x-api-key``) metadata comes twice ends INVALID_ARGUMENT, keys or not."""

    def __init__(self, credentials: Credentials, metrics: RouterMetrics) -> None:
        self.credentials = credentials
        self.metrics = metrics
        self.prefixes = (f"/{ROUTER_SERVICE}/", f"/{reflection.SERVICE_NAME}/")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        twice = repeated(k.lower() for k, _ in details.invocation_metadata or ())
        if handler is not None and twice is not None and details.method.startswith(_KVROUTE):
            message = f"metadata {twice} was sent more than once; send it once"
            return _refusal(handler, message, grpc.StatusCode.INVALID_ARGUMENT)
        credentials = self.credentials
        if (
            handler is None
            or credentials.client_open
            or not details.method.startswith(self.prefixes)
        ):
            return handler
        metadata = {
            k.lower(): v for k, v in details.invocation_metadata or () if isinstance(v, str)
        }
        try:
            credentials.check_client(metadata.get("authorization"))
        except AuthError as exc:
            service, method = details.method[1:].split("/", 1)
            if service == ROUTER_SERVICE:  # kvroute_grpc_requests_total counts kvroute.v1
                self.metrics.grpc_requests.labels(method, "UNAUTHENTICATED").inc()
            self.metrics.auth_refusals.labels("grpc", "client", str(exc.status)).inc()
            return _refusal(handler, exc.message)
        return handler


def _refusal(
    handler: grpc.RpcMethodHandler,
    message: str,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with ``code``."""

    async def refuse(request: Any, context: aio.ServicerContext) -> None:
        await context.abort(code, message)

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for kind, make in kinds.items():
        if getattr(handler, kind) is not None:
            return make(
                refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


_MALFORMED = object()
"""What a request that did not decode becomes, for the handler to refuse."""


class MalformedMessages(aio.ServerInterceptor):
    """Requests that are not valid protobuf messages of their method's type end
    INVALID_ARGUMENT with a message naming the method, before the servicer sees them."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _checking(
            handler, f"the request is not a valid protobuf message for {details.method}"
        )


def _checking(handler: grpc.RpcMethodHandler, refusal: str) -> grpc.RpcMethodHandler:
    """``handler`` with requests that do not decode refused with ``refusal``."""
    decode = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return decode(data)
        except DecodeError:
            return _MALFORMED

    async def check(request: Any, context: aio.ServicerContext) -> None:
        if request is _MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)

    async def checked(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
        async for request in requests:
            await check(request, context)
            yield request

    def wrap(behaviour: Callable[..., Any], streamed_requests: bool) -> Callable[..., Any]:
        # The wrapper keeps the behaviour's kind: grpc.aio tells coroutines (which may
        # write to the context) from async generators (which yield their responses).
        if inspect.isasyncgenfunction(behaviour):

            async def generator(request: Any, context: aio.ServicerContext) -> Any:
                if streamed_requests:
                    request = checked(request, context)
                else:
                    await check(request, context)
                async for response in behaviour(request, context):
                    yield response

            return generator

        async def coroutine(request: Any, context: aio.ServicerContext) -> Any:
            if streamed_requests:
                request = checked(request, context)
            else:
                await check(request, context)
            return await behaviour(request, context)

        return coroutine

    kinds = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, False),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, False),
        "stream_unary": (grpc.stream_unary_rpc_method_handler, True),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, True),
    }
    for kind, (make, streamed_requests) in kinds.items():
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return make(
                wrap(behaviour, streamed_requests),
                request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )
    return handler


@dataclass(frozen=True, slots=True)
class Servicers:
    """Builds the servicers the listeners serve (their handlers are the API layer's:
    :mod:`router.frontends.grpc.api` and :mod:`router.frontends.extproc`)."""

    router: Callable[[], pb_grpc.RouterServicer]
    admin: Callable[[], pb_grpc.AdminServicer]
    extproc: Callable[[], ep_grpc.ExternalProcessorServicer]


class GrpcServers:
    """The gRPC listeners a router's configuration asks for, and their health."""

    def __init__(
        self,
        config: Config,
        servicers: Servicers,
        *,
        registry: Registry,
        picks: PickLedger,
        credentials: Credentials,
        metrics: RouterMetrics,
        draining: Callable[[], bool],
        drain_listeners: list[Callable[[], None]],
    ) -> None:
        """``config``: the listeners' settings (``grpc``, ``extproc``, ``tls``: they need a
        restart); ``draining`` and ``drain_listeners``: the router's drain state, which
        turns health NOT_SERVING."""
        self.config = config
        self.servicers = servicers
        self.registry = registry
        self.picks = picks
        self.credentials = credentials
        self.metrics = metrics
        self.draining = draining
        self.drain_listeners = drain_listeners
        self.grpc_port: int | None = None
        """The API listener's bound port, once started."""
        self.extproc_port: int | None = None
        """The ext_proc listener's bound port, once started."""
        self.listeners: list[Listener] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._expirer: asyncio.Task[None] | None = None

    @classmethod
    def serving(cls, services: Services, drain: Drain) -> GrpcServers:
        """A router's listeners: the ``kvroute.v1`` and ext_proc servicers over its
        ``services``, their health following its ``drain``."""
        from router.frontends.extproc import ExtProcService
        from router.frontends.grpc.api import AdminService, RouterService

        return cls(
            services.config,
            Servicers(
                router=lambda: RouterService(services),
                admin=lambda: AdminService(services),
                extproc=lambda: ExtProcService(services),
            ),
            registry=services.registry,
            picks=services.picks,
            credentials=services.credentials,
            metrics=services.metrics,
            draining=lambda: drain.draining,
            drain_listeners=drain.listeners,
        )

    def _ready(self) -> bool:
        return not self.draining() and self.registry.healthy_count() > 0

    async def refresh(self) -> None:
        ready = self._ready()
        for listener in self.listeners:
            await listener.set_ready(ready)

    def _refresh_soon(self, *_: Any) -> None:
        task = asyncio.ensure_future(self.refresh())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_engine(self, engine: Engine, previous: EngineState) -> None:
        self._refresh_soon()

    async def start(self) -> None:
        cfg = self.config
        servicers = self.servicers
        limit = cfg.limits.max_body_bytes + 65_536
        if cfg.grpc.port is not None:
            services = {
                ROUTER_SERVICE: lambda s: pb_grpc.add_RouterServicer_to_server(
                    servicers.router(), s
                ),
                ADMIN_SERVICE: lambda s: pb_grpc.add_AdminServicer_to_server(servicers.admin(), s),
            }
            api = Listener(
                "gRPC API",
                cfg.grpc.host or cfg.server.host,
                cfg.grpc.port,
                services,
                (ROUTER_SERVICE, ADMIN_SERVICE),
                (),
                limit,
                grpc_credentials(cfg.tls) if cfg.tls.on("grpc") else None,
                (ClientKeys(self.credentials, self.metrics),),
            )
            self.grpc_port = await api.start()
            self.listeners.append(api)
            self._expirer = asyncio.ensure_future(self._expire())
        if cfg.extproc.port is not None:
            services = {
                EXTPROC_SERVICE: lambda s: ep_grpc.add_ExternalProcessorServicer_to_server(
                    servicers.extproc(), s
                ),
            }
            extproc = Listener(
                "ext_proc",
                cfg.extproc.host or cfg.server.host,
                cfg.extproc.port,
                services,
                (EXTPROC_SERVICE, READINESS),
                (LIVENESS,),
                limit,
                grpc_credentials(cfg.tls) if cfg.tls.on("extproc") else None,
            )
            self.extproc_port = await extproc.start()
            self.listeners.append(extproc)
        self.drain_listeners.append(self._refresh_soon)
        self.registry.listeners.append(self._on_engine)
        await self.refresh()
        self._refresher = asyncio.ensure_future(self._refresh_every(1.0))

    async def _refresh_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self.refresh()

    async def _expire(self) -> None:
        """Expire picks that were never released, soon after their deadline."""
        picks = self.picks
        while True:
            deadline = picks.next_deadline()
            wait = picks.ttl_s if deadline is None else deadline - picks.clock()
            await asyncio.sleep(min(max(wait, 0.01), 1.0, picks.ttl_s))
            if picks.sweep(picks.clock()):
                log.info("expired picks that were never released")

    async def stop(self) -> None:
        for task in (self._refresher, self._expirer, *self._tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in (self._refresher, self._expirer, *self._tasks) if t is not None),
            return_exceptions=True,
        )
        if self._on_engine in self.registry.listeners:
            self.registry.listeners.remove(self._on_engine)
        if self._refresh_soon in self.drain_listeners:
            self.drain_listeners.remove(self._refresh_soon)
        await asyncio.gather(*(listener.stop() for listener in self.listeners))
        self.listeners = []


__all__ = ["ADMIN_SERVICE", "LIVENESS", "READINESS", "ROUTER_SERVICE", "GrpcServers", "Servicers"]
