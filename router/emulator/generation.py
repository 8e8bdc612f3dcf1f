"""One completion or chat request on one rank: its sequences, its handoff, its answer.

A request becomes one engine sequence per prompt and choice. When it takes part in a
KV handoff (``kv_transfer_params``, or SGLang's bootstrap fields on a prefill or decode
engine) it must have exactly one sequence, and the handoff runs around it: ``start``
lets the handoff prepare (a decode leg obtains its KV) and then submits.

Answers are built as vLLM builds them. A non-streaming answer's ``x-kvroute-handoff``
header says what the decode leg of a handoff did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from router.emulator.handoff.base import Handoff, Leg
from router.emulator.handoff.nixl import NixlDecode, NixlPrefill
from router.emulator.handoff.sglang import SglangDecode, SglangPrefill
from router.emulator.protocol import (
    APIError,
    ChoiceResult,
    GenerationRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    encode_json,
    usage,
    usage_chunk,
)
from router.emulator.state import EmulatorState, Rank
from router.engine_model import RequestOutput, RequestSpec

HANDOFF_HEADER = "x-kvroute-handoff"


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body`` as JSON."""
    return b"data: " + encode_json(body) + b"\n\n"


def _handoff(state: EmulatorState, leg: Leg, req: GenerationRequest) -> Handoff | None:
    """The dialect a request's fields and the engine's role call for, if any."""
    params = req.kv_transfer_params
    if params:
        to_decode, from_prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
        if to_decode and from_prefill:
            raise APIError(
                400,
                "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill",
                "kv_transfer_params",
            )
        if to_decode:
            return NixlPrefill(leg)
        if from_prefill:
            return NixlDecode(leg, params)
    if req.bootstrap is not None:
        if state.config.role == "prefill" and state.rooms is not None:
            return SglangPrefill(leg, req.bootstrap, state.rooms)
        if state.config.role == "decode":
            return SglangDecode(leg, req.bootstrap)
    return None


class Generation:
    """A request's sequences on one rank, the answer they build, and its handoff."""

    def __init__(
        self, state: EmulatorState, rank: Rank, req: GenerationRequest, base_id: str, chat: bool
    ) -> None:
        self.state = state
        self.rank = rank
        self.req = req
        self.chat = chat
        self.base_id = base_id
        self.response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        serial = next(state.serial)
        self.specs = [
            RequestSpec(
                request_id=f"{base_id}-{serial}-{p}-{j}",
                prompt_token_ids=ids,
                max_tokens=req.max_tokens,
                lora_name=req.lora_name,
                lora_id=req.lora_id,
                cache_salt=req.cache_salt,
                sample_seed=req.seed + j,
                stop_token_ids=req.stop_token_ids,
                min_tokens=req.min_tokens,
                media=req.media,
            )
            for p, ids in enumerate(req.prompts)
            for j in range(req.n)
        ]
        leg = Leg(rank, state.config, self.specs[0], state.spawn)
        self.handoff = _handoff(state, leg, req)
        if self.handoff is not None and len(self.specs) != 1:
            raise APIError(400, "a request taking part in a KV handoff needs one prompt and n=1")
        self.cached = [0] * len(self.specs)
        self.counts = [0] * len(self.specs)
        self.ends: list[RequestOutput | None] = [None] * len(self.specs)
        self._submitted = False
        self._started = False

    @property
    def finished(self) -> bool:
        """Whether every sequence has produced its last token."""
        return all(end is not None for end in self.ends)

    @property
    def num_tokens(self) -> int:
        """Output tokens produced so far, all sequences together."""
        return sum(self.counts)

    async def start(self) -> None:
        """Run the handoff's preparation, then submit. Raises ``HandoffFailed``."""
        handoff = self.handoff
        if handoff is not None:
            remote_prefill = await handoff.prepare()
            spec = self.specs[0]
            self.specs[0] = dataclasses.replace(
                spec,
                max_tokens=handoff.max_tokens or spec.max_tokens,
                remote_decode=handoff.remote_decode,
                remote_prefill=remote_prefill,
            )
        driver = self.rank.driver
        for i, spec in enumerate(self.specs):
            driver.submit(spec, (self.queue, i))
        self._submitted = True

    def close(self, client_gone: bool) -> None:
        """End the request however it went: abort what still runs, let the peer go."""
        if self._submitted:
            for spec in self.specs:
                self.rank.driver.abort(spec.request_id)
        if client_gone and not self.finished:
            self.rank.metrics.aborted()
        if self.handoff is not None:
            self.handoff.close()

    def headers(self) -> dict[str, str]:
        """Response headers: the request id, and what a handoff did once known."""
        headers = {"x-request-id": self.base_id}
        value = self.handoff.header() if self.handoff is not None else None
        if value is not None:
            headers[HANDOFF_HEADER] = value
        return headers

    def usage(self) -> dict[str, Any]:
        """The answer's ``usage`` so far."""
        n = self.req.n
        prompt_tokens = sum(len(p) for p in self.req.prompts)
        # Per prompt, as vLLM: the cache hit of its first choice.
        cached = sum(self.cached[p * n] for p in range(len(self.req.prompts)))
        return usage(prompt_tokens, sum(self.counts), cached)

    def _text(self, index: int, token_ids: list[int]) -> str:
        if self.req.echo_only:
            return "" if self.counts[index] else self._prompt_text(index // self.req.n)
        words = " ".join(map(self.state.tokenizer.token_str, token_ids))
        if self.counts[index]:
            return " " + words
        if self.req.echo:
            return self._prompt_text(index // self.req.n) + " " + words
        return words

    def _prompt_text(self, prompt_index: int) -> str:
        text = self.req.prompt_texts[prompt_index]
        if text is None:
            text = self.state.tokenizer.decode(self.req.prompts[prompt_index])
        return text

    def _take(self, index: int, out: RequestOutput) -> str:
        if not self._started:
            self._started = True
            if self.handoff is not None:
                self.handoff.first_output(out)
        text = self._text(index, out.new_token_ids)
        self.counts[index] += len(out.new_token_ids)
        self.cached[index] = out.num_cached_tokens
        if out.finished:
            self.ends[index] = out
            if self.handoff is not None:
                self.handoff.finished(out)
        return text

    async def next_output(self) -> tuple[int, str, RequestOutput]:
        """The next step's output of some sequence: (its index, its text, the output)."""
        index, out = await self.queue.get()
        return index, self._take(index, out), out

    async def collect(self) -> dict[str, Any]:
        """The whole non-streaming answer."""
        texts = [""] * len(self.specs)
        while not self.finished:
            index, out = await self.queue.get()
            texts[index] += self._take(index, out)
        choices = []
        for text, end in zip(texts, self.ends, strict=True):
            assert end is not None and end.finish_reason is not None
            choices.append(ChoiceResult(text, end.finish_reason, end.stop_reason))
        build = chat_response if self.chat else completion_response
        params = self.handoff.params() if self.handoff is not None else None
        return build(self.response_id, self.created, self.req.model, choices, self.usage(), params)

    async def events(self) -> AsyncIterator[tuple[bytes, int]]:
        """The streamed answer as (SSE chunk, output tokens in it), from the first token."""
        rid, created, model = self.response_id, self.created, self.req.model
        extra = {"usage": None} if self.req.include_usage else {}
        # As vLLM, the first chunk (a chat's role) waits for the first token.
        index, out = await self.queue.get()
        text = self._take(index, out)
        if self.chat:
            for choice in range(len(self.specs)):
                delta = {"role": "assistant", "content": ""}
                yield sse({**chat_chunk(rid, created, model, choice, delta, None), **extra}), 0
        while True:
            if self.chat:
                delta = {"content": text}
                chunk = chat_chunk(
                    rid, created, model, index, delta, out.finish_reason, out.stop_reason
                )
            else:
                chunk = completion_chunk(
                    rid, created, model, index, text, out.finish_reason, out.stop_reason
                )
            yield sse({**chunk, **extra}), len(out.new_token_ids)
            if self.finished:
                break
            index, out = await self.queue.get()
            text = self._take(index, out)
        if self.req.include_usage:
            yield sse(usage_chunk(rid, created, model, self.chat, self.usage())), 0
        yield b"data: [DONE]\n\n", 0
