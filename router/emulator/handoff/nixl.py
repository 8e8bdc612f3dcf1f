"""vLLM's NixlConnector dialect: the decode engine pulls KV the prefill engine holds.

Prefill leg: a request with ``kv_transfer_params.do_remote_decode`` runs as usual; when
it finishes length-capped, its blocks stay pinned (``EngineModel.holds``) and the
answer carries what a decode engine needs to read them::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": ..., "remote_block_ids": [[...]], "remote_request_id": ...,
     "remote_host": <side-channel host>, "remote_port": <side-channel port>, "tp_size": 1}

``remote_block_ids`` is a list per KV-cache group, as current vLLM sends it (the
emulator has one group; a flat list is accepted too, as older vLLM sent it). A leg that
finishes otherwise (a stop token) frees its blocks and answers no params, as vLLM does.

Decode leg: a request with ``kv_transfer_params.do_remote_prefill`` pulls over the side
channel named by ``remote_host``/``remote_port`` (wire protocol, ``wire.py``)::

    {"op": "pull", "engine_id", "request_id", "block_ids", "digest", "num_tokens"}
      -> {"ok": true, "num_tokens", "num_blocks"}   (the blocks are now claimed)
    {"op": "release", "engine_id", "request_id"}    (after the transfer: free them)
      -> {"ok": true, "released": bool}

``digest`` (``wire.prompt_digest``) makes a pull of another prompt's KV fail without
claiming it. The transfer itself is timed by the decode engine's model. When the params
cannot be used (invalid, unknown, expired, already pulled, unreachable side channel,
another prompt), ``--handoff-failure recompute`` logs a warning and prefills locally
(vLLM's behaviour) and ``--handoff-failure error`` fails the request (HTTP 500).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from router.emulator.driver import EngineDriver
from router.emulator.handoff import wire
from router.emulator.handoff.base import RPC_TIMEOUT_S, Handoff, HandoffFailed, Leg
from router.engine_model import HandoffError, HeldKV, RequestOutput

log = logging.getLogger(__name__)

DIALECT = "nixl"
_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def prefill_params(held: HeldKV, engine_id: str, host: str, port: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill leg answers with (vLLM's field order)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(held.block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": held.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def _block_ids(value: Any) -> list[int]:
    """``remote_block_ids`` as one group's block ids (per-group or flat form)."""
    if not isinstance(value, list) or not value:
        raise ValueError("remote_block_ids must be a non-empty list")
    if all(isinstance(v, list) for v in value):
        if len(value) != 1:
            raise ValueError(f"remote_block_ids names {len(value)} KV-cache groups; this has 1")
        value = value[0]
    if any(isinstance(b, bool) or not isinstance(b, int) for b in value):
        raise ValueError("remote_block_ids must hold integer block ids")
    return value


class NixlPrefill(Handoff):
    """The prefill leg: hold the blocks and say where they are."""

    dialect = DIALECT
    remote_decode = True

    def __init__(self, leg: Leg) -> None:
        super().__init__(leg)
        self._params: dict[str, Any] | None = None

    def finished(self, out: RequestOutput) -> None:
        held = out.held
        if held is None:
            return
        rank = self.leg.rank
        if out.finish_reason != "length":
            # vLLM hands KV over only after a length-capped finish; otherwise it frees.
            rank.driver.release_hold(held.request_id)
            return
        self._params = prefill_params(
            held, rank.kv_engine_id, self.leg.config.kv_host, rank.side_channel_port
        )

    def params(self) -> dict[str, Any] | None:
        return self._params


class NixlDecode(Handoff):
    """The decode leg: pull the KV the params name, or recompute, or fail."""

    dialect = DIALECT

    def __init__(self, leg: Leg, params: dict[str, Any]) -> None:
        super().__init__(leg)
        self._raw = params
        self._source: tuple[str, int, str, str] | None = None
        self._released = False
        self._recompute = False

    async def prepare(self) -> bool:
        try:
            await self._pull()
        except HandoffFailed as exc:
            if self.leg.config.handoff_failure == "error":
                raise
            log.warning("%s; recomputing the prefill locally", exc.message)
            self._recompute = True
            return False
        return True

    async def _pull(self) -> None:
        params = self._raw
        missing = [k for k in _REQUIRED if params.get(k) is None]
        try:
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            block_ids = _block_ids(params.get("remote_block_ids"))
            host, port = params["remote_host"], params["remote_port"]
            engine_id, request_id = params["remote_engine_id"], params["remote_request_id"]
            if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
                raise ValueError("remote_host must be a string and remote_port an integer")
            if not isinstance(engine_id, str) or not isinstance(request_id, str):
                raise ValueError("remote_engine_id and remote_request_id must be strings")
        except ValueError as exc:
            raise self.fail("invalid_params", f"unusable kv_transfer_params: {exc}") from None
        spec = self.leg.spec
        digest = wire.prompt_digest(spec.prompt_token_ids, spec.lora_name, spec.cache_salt)
        where = f"engine {engine_id!r} at {host}:{port}"
        try:
            reply = await wire.call(
                host,
                port,
                {
                    "op": "pull",
                    "engine_id": engine_id,
                    "request_id": request_id,
                    "block_ids": block_ids,
                    "digest": digest,
                    "num_tokens": len(spec.prompt_token_ids),
                },
                RPC_TIMEOUT_S,
            )
        except wire.WireError as exc:
            raise self.fail("unreachable", f"KV pull from {where} failed: {exc}") from None
        if not reply["ok"]:
            raise self.fail(
                str(reply.get("reason")), f"KV pull from {where} failed: {reply.get('error')}"
            )
        self._source = (host, port, engine_id, request_id)

    def first_output(self, out: RequestOutput) -> None:
        if self._source is not None:
            self._header = f"pulled={out.num_transferred_tokens}"
            self._release()
        elif self._recompute:
            tokens = out.num_prompt_tokens - out.num_cached_tokens
            self.leg.rank.metrics.recomputed(tokens)
            self._header = f"recomputed={tokens}"

    def close(self) -> None:
        # A decode leg that ends before its transfer did still frees the prefill's blocks.
        self._release()

    def _release(self) -> None:
        if self._source is None or self._released:
            return
        self._released = True
        host, port, engine_id, request_id = self._source
        message = {"op": "release", "engine_id": engine_id, "request_id": request_id}

        async def send() -> None:
            try:
                await wire.call(host, port, message, RPC_TIMEOUT_S)
            except wire.WireError as exc:
                log.warning("releasing KV of %s at %s:%d failed: %s", request_id, host, port, exc)

        self.leg.spawn(send())


class SideChannel:
    """A rank's side-channel listener: serves pulls of the blocks its model holds."""

    def __init__(self, engine_id: str, driver: EngineDriver) -> None:
        self.engine_id = engine_id
        self._driver = driver
        self.listener = wire.Listener(f"side channel of {engine_id}", self._handle)

    async def _handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        engine_id = message.get("engine_id")
        request_id = message.get("request_id")
        if op not in ("pull", "release") or not isinstance(request_id, str):
            return wire.failure("bad_request", f"not a pull or release request: {op!r}")
        if engine_id != self.engine_id:
            return wire.failure(
                "engine_mismatch",
                f"this side channel serves engine {self.engine_id!r}, not {engine_id!r}",
            )
        if op == "release":
            return {"ok": True, "released": self._driver.release_hold(request_id)}
        block_ids = message.get("block_ids")
        if not isinstance(block_ids, list):
            return wire.failure("bad_request", "block_ids must be a list")
        return self._pull(request_id, block_ids, message.get("digest"))

    def _pull(self, request_id: str, block_ids: Sequence[int], digest: Any) -> dict[str, Any]:
        driver = self._driver
        held = driver.peek_hold(request_id)
        if held is not None and digest != wire.prompt_digest(
            held.prompt_token_ids, held.lora_name, held.cache_salt
        ):
            return wire.failure(
                "prompt_mismatch",
                f"request {request_id!r} holds the KV of another prompt "
                f"({len(held.prompt_token_ids)} tokens): the legs do not belong together",
            )
        try:
            held = driver.claim_hold(request_id, block_ids)
        except HandoffError as exc:
            return wire.failure(exc.reason, exc.message)
        return {"ok": True, "num_tokens": len(held.prompt_token_ids), "num_blocks": len(block_ids)}
