"""Which tokenizer each model's pool uses, and the guard that catches a wrong one.

A router whose tokenizer disagrees with the engine's computes keys that never match the
engine's KV events, and cache-aware routing silently degrades into random routing. The
guard compares the router's prompt-token count with the engine's ``usage.prompt_tokens``
on answers that carry it; when more than ``max_mismatch_ratio`` of the last ``window``
disagree, the model's pool switches to approximate mode (tracked from routing decisions,
never from mismatched keys), with a log line and a metric, until restart or reload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from router.config import Config, TokenizerConfig
from router.tokenization.base import PromptTokenizer
from router.tokenization.modes import (
    ApproximateTokenizer,
    EngineTokenizer,
    HFTokenizer,
    WordsTokenizer,
)
from router.tokenization.words import WordTokenizer

log = logging.getLogger("kvroute.tokenizer")

PoolPost = Callable[[str, str, bytes], Awaitable[tuple[int, bytes]]]
"""POST (model, path, JSON body) to a healthy engine serving the model."""

#: ``auto`` mode's probe: the emulator tokenizes it exactly as the words tokenizer does.
PROBE = "kvroute tokenizer probe: alpha beta gamma"
#: After a failed probe (a busy engine, a timeout), ``auto`` is probed again by the next
#: request this long after, the wait doubling to ``MAX_RETRY_S``.
FIRST_RETRY_S = 5.0
MAX_RETRY_S = 60.0


@dataclass(slots=True)
class _Pool:
    tokenizer: PromptTokenizer
    settings: TokenizerConfig
    resolved: bool
    checks: deque[bool] = field(default_factory=deque)
    mismatches: int = 0
    fell_back: bool = False
    retry_at: float | None = None
    """When a request may probe ``auto`` again (None: no probe has failed)."""
    retry_s: float = FIRST_RETRY_S
    probing: asyncio.Task[str] | None = None


class Tokenizers:
    """Per-model tokenizers, resolved lazily and guarded."""

    def __init__(
        self, config: Config, post: PoolPost, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.post = post
        self.clock = clock
        self.words = WordTokenizer(decodes=False)
        self._pools: dict[str, _Pool] = {}

    def _build(self, model: str, settings: TokenizerConfig, mode: str) -> PromptTokenizer:
        if mode == "words":
            return WordsTokenizer(self.words, settings.mm_placeholder_tokens)
        if mode == "hf":
            assert settings.path is not None
            template = None
            if settings.chat_template:
                with open(settings.chat_template) as f:
                    template = f.read()
            return HFTokenizer(
                settings.path, settings.config_path, template, settings.recent_prompt_tokens
            )
        if mode == "engine":

            async def post(path: str, body: bytes) -> tuple[int, bytes]:
                return await self.post(model, path, body)

            return EngineTokenizer(model, post, settings.cache_size)
        return ApproximateTokenizer(settings.chars_per_token, settings.recent_prompt_tokens)

    def _pool(self, model: str) -> _Pool:
        pool = self._pools.get(model)
        if pool is None:
            settings, _ = self.config.model_settings(model)
            # Until ``auto`` is resolved, approximate keys are the safe choice.
            mode = "approximate" if settings.mode == "auto" else settings.mode
            pool = _Pool(
                self._build(model, settings, mode),
                settings,
                resolved=settings.mode != "auto",
                checks=deque(maxlen=self.config.tokenizer_guard.window),
            )
            self._pools[model] = pool
        return pool

    def for_model(self, model: str) -> PromptTokenizer:
        """The tokenizer of a (base) model's pool (starting ``auto``'s probe again, in
        the background, once a failed one's wait is over)."""
        pool = self._pool(model)
        if pool.retry_at is not None and self.clock() >= pool.retry_at:
            if pool.probing is None and not (pool.resolved or pool.fell_back):
                pool.retry_at = None
                pool.probing = asyncio.ensure_future(self.resolve(model))
        return pool.tokenizer

    async def resolve(self, model: str) -> str:
        """Settle ``auto`` for a model by probing one of its engines; returns the mode."""
        pool = self._pool(model)
        if pool.resolved or pool.fell_back:
            return pool.tokenizer.mode
        mode = "approximate"
        try:
            probe = msgspec.json.encode({"model": model, "prompt": PROBE})
            status, body = await self.post(model, "/tokenize", probe)
            if status >= 500 or status == 429:  # busy or failing: not an answer
                raise RuntimeError(f"/tokenize answered {status}")
            if status == 200:
                tokens = msgspec.json.decode(body).get("tokens")
                mode = "words" if tokens == self.words.encode(PROBE) else "engine"
        except Exception as exc:  # any failure leaves the safe mode in place
            log.warning(
                "model %s: tokenizer probe failed (%s); approximate mode, probing again in %.0f s",
                model,
                exc,
                pool.retry_s,
            )
            pool.retry_at = self.clock() + pool.retry_s
            pool.retry_s = min(pool.retry_s * 2, MAX_RETRY_S)
            return pool.tokenizer.mode
        finally:
            pool.probing = None
        pool.tokenizer = self._build(model, pool.settings, mode)
        pool.resolved = True
        log.info("model %s: tokenizer mode %s", model, mode)
        return mode

    def observe(
        self, model: str, router_tokens: int, engine_tokens: int, media: bool = False
    ) -> bool:
        """Compare one answer's prompt tokens; True if this switched the pool to approximate.

        A chat with ``media`` parts is compared only by tokenizers that count its
        placeholder tokens as the engine does (``media_exact``)."""
        pool = self._pool(model)
        if not pool.tokenizer.exact or pool.fell_back:
            return False
        if media and not pool.tokenizer.media_exact:
            return False
        agree = router_tokens == engine_tokens
        pool.checks.append(agree)
        if not agree:
            pool.mismatches += 1
        window = self.config.tokenizer_guard.window
        bad = pool.checks.count(False)
        if len(pool.checks) >= min(window, 10) and bad / len(pool.checks) > (
            self.config.tokenizer_guard.max_mismatch_ratio
        ):
            pool.fell_back = True
            pool.tokenizer = ApproximateTokenizer(
                pool.settings.chars_per_token, pool.settings.recent_prompt_tokens
            )
            log.error(
                "model %s: the router's %s tokenizer disagrees with the engines on %d of the "
                "last %d prompts (e.g. %d tokens here, %d at the engine); routing this pool "
                "in approximate mode until restart or reload",
                model,
                pool.settings.mode,
                bad,
                len(pool.checks),
                router_tokens,
                engine_tokens,
            )
            return True
        return False

    def mismatches(self) -> dict[str, int]:
        return {m: p.mismatches for m, p in self._pools.items()}

    def modes(self) -> dict[str, str]:
        return {m: p.tokenizer.mode for m, p in self._pools.items()}
