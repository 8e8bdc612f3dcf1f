"""SGLang's bootstrap dialect: both legs share a room; the prefill engine pushes the KV.

A router picks a prefill and a decode engine, adds ``bootstrap_host``,
``bootstrap_port`` (the prefill engine's bootstrap listener) and ``bootstrap_room`` (a
random integer) to the body, and sends it to both engines at once. The engine's
``--role`` decides which leg it runs: ``prefill`` and ``decode`` engines take part,
``both`` ignores the fields and serves the request whole.

* The prefill leg registers its room and waits for a decode engine to join it (at most
  ``--bootstrap-timeout`` wall seconds), then prefills (one output token) and keeps its
  blocks for the decode engine.
* The decode leg joins the room at ``bootstrap_host:bootstrap_port`` and waits (the
  same timeout) for the prefill leg to arrive, then for its KV. It then imports the KV,
  paying the transfer time, and decodes. After its first token it releases the room,
  which frees the prefill engine's blocks.

The bootstrap listener speaks ``wire.py``::

    {"op": "join", "room", "digest", "num_tokens", "decode"}
      -> {"ok": true, "num_tokens"}     (when the prefill is done)
    {"op": "release", "room"} -> {"ok": true}

Any failure fails the request (HTTP 500), as SGLang does: a room nobody joins or
nobody prefills, a room used twice, another prompt's KV (``digest``), an unreachable or
foreign bootstrap address, a prefill leg that was aborted. ``--handoff-failure`` does
not apply (SGLang never recomputes).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from router.emulator.driver import EngineDriver
from router.emulator.handoff import wire
from router.emulator.handoff.base import RPC_TIMEOUT_S, Handoff, Leg
from router.emulator.protocol import Bootstrap
from router.engine_model import HandoffError, HeldKV, RequestOutput

log = logging.getLogger(__name__)

DIALECT = "sglang"


@dataclass(eq=False)
class _Room:
    room: int
    #: A prefill leg registered the room.
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    #: A decode engine joined the room.
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    #: The prefill is over: ``held`` is set, or ``error`` says why not.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    held: HeldKV | None = None
    driver: EngineDriver | None = None
    error: tuple[str, str] | None = None
    #: The decode engine left before the KV was ready: free it when it is.
    abandoned: bool = False


class RoomRegistry:
    """The bootstrap rooms of one prefill engine (all of its ranks)."""

    def __init__(self, timeout_s: float, hold_timeout_wall_s: float) -> None:
        self.timeout_s = timeout_s
        self._hold_timeout = hold_timeout_wall_s
        self._rooms: dict[int, _Room] = {}
        #: Rooms whose KV was handed over, oldest first, with the loop time after which
        #: the prefill engine's hold has expired anyway (a decode that never released).
        self._delivered: deque[tuple[float, _Room]] = deque()

    def __len__(self) -> int:
        """Rooms open now."""
        return len(self._rooms)

    def _room(self, room: int) -> _Room:
        self._sweep()
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = _Room(room)
        return entry

    def _sweep(self) -> None:
        now = asyncio.get_running_loop().time()
        while self._delivered and self._delivered[0][0] <= now:
            _, entry = self._delivered.popleft()
            if self._rooms.get(entry.room) is entry:
                del self._rooms[entry.room]

    # -------------------------------------------------------------- prefill side

    def open(self, room: int) -> None:
        """A prefill leg claims ``room``; raises ValueError if another already did."""
        entry = self._room(room)
        if entry.arrived.is_set():
            raise ValueError(f"bootstrap room {room} is already used by another prefill request")
        entry.arrived.set()

    async def wait_for_decode(self, room: int) -> bool:
        """Wait until a decode engine joins ``room``; False after the timeout."""
        entry = self._rooms[room]
        try:
            await asyncio.wait_for(entry.joined.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            self._rooms.pop(room, None)
            return False
        return True

    def ready(self, room: int, held: HeldKV, driver: EngineDriver) -> None:
        """The prefill leg finished and holds ``held`` for the room's decode engine."""
        entry = self._rooms.get(room)
        if entry is None or entry.abandoned:
            self._rooms.pop(room, None)
            driver.release_hold(held.request_id)
            if entry is not None:
                # Wake the join still waiting for a decode engine that has left.
                entry.error = ("abandoned", f"the decode engine left bootstrap room {room}")
                entry.done.set()
            return
        entry.held, entry.driver = held, driver
        entry.done.set()

    def failed(self, room: int, reason: str, message: str) -> None:
        """The prefill leg ended without KV for the room."""
        entry = self._rooms.get(room)
        if entry is None or entry.done.is_set():
            return
        entry.error = (reason, message)
        entry.done.set()
        if not entry.joined.is_set() or entry.abandoned:
            self._rooms.pop(room, None)

    # -------------------------------------------------------------- decode side

    async def join(self, room: int, digest: Any, decode: str) -> dict[str, Any]:
        """Serve a decode engine's join: the reply once the KV is ready, or a failure."""
        entry = self._room(room)
        if entry.joined.is_set():
            return wire.failure("room_in_use", f"bootstrap room {room} already has a decode engine")
        entry.joined.set()
        try:
            await asyncio.wait_for(entry.arrived.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            self._rooms.pop(room, None)
            return wire.failure(
                "no_prefill",
                f"no prefill request with bootstrap_room {room} reached this engine "
                f"within {self.timeout_s:g} s",
            )
        try:
            await entry.done.wait()
        except asyncio.CancelledError:
            entry.abandoned = True
            raise
        if entry.error is not None:
            self._rooms.pop(room, None)
            return wire.failure(*entry.error)
        held, driver = entry.held, entry.driver
        assert held is not None and driver is not None
        if digest != wire.prompt_digest(held.prompt_token_ids, held.lora_name, held.cache_salt):
            self._rooms.pop(room, None)
            driver.release_hold(held.request_id)
            return wire.failure(
                "prompt_mismatch",
                f"bootstrap room {room} holds the KV of another prompt "
                f"({len(held.prompt_token_ids)} tokens): the legs do not belong together",
            )
        try:
            driver.claim_hold(held.request_id, None)
        except HandoffError as exc:
            self._rooms.pop(room, None)
            return wire.failure(exc.reason, exc.message)
        log.debug("room %d handed to %s", room, decode)
        self._delivered.append((asyncio.get_running_loop().time() + self._hold_timeout, entry))
        return {"ok": True, "num_tokens": len(held.prompt_token_ids)}

    def release(self, room: int) -> bool:
        """The decode engine is done with the room (or gave up on it)."""
        entry = self._rooms.get(room)
        if entry is None:
            return False
        if entry.held is None or entry.driver is None:
            entry.abandoned = True
            return True
        del self._rooms[room]
        return entry.driver.release_hold(entry.held.request_id)


class BootstrapServer:
    """The prefill engine's bootstrap listener, over its room registry."""

    def __init__(self, rooms: RoomRegistry) -> None:
        self.rooms = rooms
        self.listener = wire.Listener("bootstrap listener", self._handle)

    async def _handle(self, message: dict[str, Any]) -> dict[str, Any]:
        room = message.get("room")
        if isinstance(room, bool) or not isinstance(room, int):
            return wire.failure("bad_request", "room must be an integer")
        op = message.get("op")
        if op == "join":
            return await self.rooms.join(room, message.get("digest"), str(message.get("decode")))
        if op == "release":
            return {"ok": True, "released": self.rooms.release(room)}
        return wire.failure("bad_request", f"not a join or release request: {op!r}")


class SglangPrefill(Handoff):
    """The prefill leg: wait for the decode engine, prefill, hold the KV for it."""

    dialect = DIALECT
    remote_decode = True
    max_tokens = 1

    def __init__(self, leg: Leg, bootstrap: Bootstrap, rooms: RoomRegistry) -> None:
        super().__init__(leg)
        self._room = bootstrap.room
        self._rooms = rooms
        self._opened = False
        self._over = False

    async def prepare(self) -> bool:
        room = self._room
        try:
            self._rooms.open(room)
        except ValueError as exc:
            raise self.fail("room_in_use", str(exc)) from None
        self._opened = True
        if not await self._rooms.wait_for_decode(room):
            self._over = True
            raise self.fail(
                "no_decode",
                f"no decode engine joined bootstrap room {room} within {self._rooms.timeout_s:g} s",
            )
        return False

    def finished(self, out: RequestOutput) -> None:
        if out.held is not None:
            self._over = True
            self._rooms.ready(self._room, out.held, self.leg.rank.driver)

    def close(self) -> None:
        if self._opened and not self._over:
            self._rooms.failed(
                self._room, "prefill_aborted", f"the prefill request of room {self._room} ended"
            )


class SglangDecode(Handoff):
    """The decode leg: join the room, receive the KV, decode; release the room."""

    dialect = DIALECT

    def __init__(self, leg: Leg, bootstrap: Bootstrap) -> None:
        super().__init__(leg)
        self._bootstrap = bootstrap
        self._joined = False
        self._released = False

    async def prepare(self) -> bool:
        b = self._bootstrap
        if b.host is None or b.port is None:
            raise self.fail(
                "invalid_params", "a decode leg needs bootstrap_host and bootstrap_port"
            )
        spec = self.leg.spec
        where = f"bootstrap listener {b.host}:{b.port}"
        message = {
            "op": "join",
            "room": b.room,
            "digest": wire.prompt_digest(spec.prompt_token_ids, spec.lora_name, spec.cache_salt),
            "num_tokens": len(spec.prompt_token_ids),
            "decode": self.leg.rank.kv_engine_id,
        }
        # The listener answers when the prefill is done, or when a timeout of its own
        # has passed: no deadline here beyond the connection's.
        try:
            conn = await wire.Connection.open(b.host, b.port, RPC_TIMEOUT_S)
        except wire.WireError as exc:
            raise self.fail("unreachable", f"joining room {b.room} at {where}: {exc}") from None
        # From here on, leaving (a client gone) must tell the listener to free the room.
        self._joined = True
        try:
            reply = await conn.request(message, None)
        except wire.WireError as exc:
            self._joined = False
            raise self.fail("unreachable", f"joining room {b.room} at {where}: {exc}") from None
        finally:
            await conn.close()
        if not reply["ok"]:
            self._joined = False  # the listener already dropped the room
            raise self.fail(
                str(reply.get("reason")),
                f"joining room {b.room} at {where} failed: {reply.get('error')}",
            )
        return True

    def first_output(self, out: RequestOutput) -> None:
        self._header = f"pulled={out.num_transferred_tokens}"
        self._release()

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        if not self._joined or self._released:
            return
        self._released = True
        b = self._bootstrap
        assert b.host is not None and b.port is not None
        host, port = b.host, b.port

        async def send() -> None:
            try:
                await wire.call(host, port, {"op": "release", "room": b.room}, RPC_TIMEOUT_S)
            except wire.WireError as exc:
                log.warning("releasing room %d at %s:%d failed: %s", b.room, host, port, exc)

        self.leg.spawn(send())
