"""Which tokenizer each model's pool uses, how ``auto`` settles it, and the guard that
catches a wrong one.

``auto`` settles once per pool, at discovery, off the request path (requests meanwhile
use approximate keys): it asks one engine of the pool what it serves (vLLM's
``/v1/models`` ``root``; SGLang's ``/model_info``) and sends one probe to its
``/tokenize``, then takes the first of

1. the model's own tokenizer files (:mod:`router.tokenization.locate`: a path the engine
   reports, ``tokenizer.model_dirs``, the Hugging Face cache) whose ids for the probe (and
   for a one-message chat) are the engine's: ``hf``, exact with no round trip;
2. the emulator's word tokenizer, if the engine tokenized the probe as it does: ``words``;
3. the files fetched from the Hugging Face hub, in the background (``tokenizer.download``),
   checked the same way: ``hf``;
4. ``approximate``: text-prefix pseudo-tokens, whose characters per token are calibrated
   from the engines' ``usage.prompt_tokens`` (so match depths in tokens are right).

``engine`` (a round trip to a busy engine per new prompt) is never chosen; it stays
available when configured. An engine that cannot answer (unreachable, 5xx, 429) leaves
the pool approximate and is asked again later, the wait doubling. The choice and its
reason (:class:`Choice`) are logged once, shown by ``kvroute status`` and exported.

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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from router.config import Config, TokenizerConfig
from router.metric_catalogue import (
    TOKENIZER_CHARS_PER_TOKEN,
    TOKENIZER_MISMATCHES,
    TOKENIZER_MODE,
    TOKENIZER_SOURCE,
)
from router.tokenization.base import PromptTokenizer, TokenizeError
from router.tokenization.locate import (
    Reported,
    TokenizerFiles,
    downloadable,
    fetch,
    hub_offline,
    on_disk,
)
from router.tokenization.modes import (
    ApproximateTokenizer,
    EngineTokenizer,
    HFTokenizer,
    WordsTokenizer,
)
from router.tokenization.words import WordTokenizer

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.tokenizer")

PoolPost = Callable[[str, str, bytes], Awaitable[tuple[int, bytes]]]
"""POST (model, path, JSON body) to a healthy engine serving the model."""
PoolGet = Callable[[str, str], Awaitable[tuple[int, bytes]]]
"""GET (model, path) from a healthy engine serving the model."""

#: ``auto`` mode's probe: the emulator tokenizes it exactly as the words tokenizer does,
#: and a tokenizer found on disk must tokenize it exactly as the engine does.
PROBE = "kvroute tokenizer probe: alpha beta gamma"
#: The chat a found tokenizer must render and tokenize as the engine does (its template).
CHAT_PROBE: list[dict[str, Any]] = [{"role": "user", "content": PROBE}]
#: After a failed probe (a busy engine, a timeout), ``auto`` is probed again by the next
#: request this long after, the wait doubling to ``MAX_RETRY_S``.
FIRST_RETRY_S = 5.0
MAX_RETRY_S = 60.0
#: Answers with usage an ``auto`` pool in approximate mode reads before it sets its
#: characters per token to theirs.
CALIBRATION_ANSWERS = 20


@dataclass(frozen=True, slots=True)
class Choice:
    """The tokenizer a pool uses and why (``kvroute status``, the log, the metrics)."""

    mode: str
    source: str
    """``configured``; ``engine`` (a path the engine reports), ``model_dirs``, ``hf_cache``,
    ``hub`` (hf); ``probe`` (words); ``none``, ``pending`` or ``guard`` (approximate)."""
    detail: str
    path: str | None = None
    """The tokenizer.json in use (hf)."""

    def describe(self) -> str:
        """One line: ``hf: /models/llama/tokenizer.json (engine root)``."""
        if self.path:
            return f"{self.mode}: {self.path} ({self.detail})"
        return f"{self.mode}: {self.detail}"


class _Unanswered(Exception):
    """The engine cannot answer now (busy, failing, unreachable): ask again later."""


@dataclass(slots=True)
class _Calibration:
    """Approximate mode's characters per token, measured against the engines' usage."""

    chars: int = 0
    """Characters the pool's pseudo-tokens stood for, over the answers read."""
    tokens: int = 0
    """The engines' prompt tokens for the same answers."""
    answers: int = 0
    chars_per_token: int | None = None
    """The measured value, once ``CALIBRATION_ANSWERS`` answers were read."""


@dataclass(slots=True)
class _Pool:
    tokenizer: PromptTokenizer
    settings: TokenizerConfig
    resolved: bool
    """No more questions to the engines: the choice is made (or the hub is being asked)."""
    choice: Choice
    checks: deque[bool] = field(default_factory=deque)
    mismatches: int = 0
    fell_back: bool = False
    retry_at: float | None = None
    """When a request may probe ``auto`` again (None: no probe has failed)."""
    retry_s: float = FIRST_RETRY_S
    probing: asyncio.Future[None] | None = None
    fetching: asyncio.Future[None] | None = None
    """The hub download in flight."""
    calibration: _Calibration = field(default_factory=_Calibration)


@dataclass(slots=True)
class _Probes:
    """One engine's answers to the probes of one attempt (the chat one asked lazily)."""

    prompt: list[int] | None
    """The engine's ids for ``PROBE``; None when it has no /tokenize."""
    chat: list[int] | None = None
    """The engine's ids for ``CHAT_PROBE``; None when unknown or refused (400: an engine
    without a chat template refuses every chat, so any rendering of ours will do)."""
    chat_asked: bool = False


class Tokenizers:
    """Per-model tokenizers, resolved at discovery and guarded."""

    def __init__(
        self,
        config: Config,
        post: PoolPost,
        clock: Callable[[], float] = time.monotonic,
        get: PoolGet | None = None,
    ) -> None:
        """``post`` and ``get`` reach an engine of a model's pool (``get``, for what the
        engine serves: without it only the served name is looked up)."""
        self.config = config
        self.post = post
        self.get = get
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
            if settings.mode == "auto":
                # Until ``auto`` is resolved, approximate keys are the safe choice.
                mode = "approximate"
                choice = Choice(mode, "pending", "not settled yet")
            else:
                mode = settings.mode
                choice = Choice(mode, "configured", "configured", settings.path)
            pool = _Pool(
                self._build(model, settings, mode),
                settings,
                resolved=settings.mode != "auto",
                choice=choice,
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
                pool.probing = asyncio.ensure_future(self._attempt(model, pool))
        return pool.tokenizer

    async def resolve(self, model: str) -> str:
        """Settle ``auto`` for a model by asking one of its engines; returns the mode
        (``approximate`` while a hub download or a later attempt is pending)."""
        pool = self._pool(model)
        if not (pool.resolved or pool.fell_back):
            if pool.probing is None:
                pool.probing = asyncio.ensure_future(self._attempt(model, pool))
            await asyncio.shield(pool.probing)
        return pool.tokenizer.mode

    async def stop(self) -> None:
        """Stop the attempts and hub downloads in flight (a download's daemon thread is
        left to end by itself)."""
        tasks = [t for p in self._pools.values() for t in (p.probing, p.fetching) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _attempt(self, model: str, pool: _Pool) -> None:
        try:
            settled = await self._settle(model, pool)
        except Exception as exc:  # any failure leaves the safe mode in place
            log.warning(
                "model %s: tokenizer probe failed (%s); approximate mode, probing again in %.0f s",
                model,
                exc,
                pool.retry_s,
            )
            pool.choice = Choice(
                "approximate",
                "pending",
                f"the engines did not answer ({exc}); asking again in {pool.retry_s:.0f} s",
            )
            pool.retry_at = self.clock() + pool.retry_s
            pool.retry_s = min(pool.retry_s * 2, MAX_RETRY_S)
            return
        finally:
            pool.probing = None
        pool.resolved = True
        if settled is not None:
            self._use(model, pool, *settled)

    def _use(self, model: str, pool: _Pool, choice: Choice, tokenizer: PromptTokenizer) -> None:
        if pool.fell_back:  # the guard has spoken since
            return
        pool.tokenizer, pool.choice = tokenizer, choice
        log.info("model %s: tokenizer %s", model, choice.describe())

    async def _settle(self, model: str, pool: _Pool) -> tuple[Choice, PromptTokenizer] | None:
        """The pool's choice; None when it waits for the hub (a background task then
        makes it). Raises when an engine cannot answer now."""
        settings = pool.settings
        names = await self._reported(model)
        probes = _Probes(await self._probe(model))
        looked: list[str] = []
        found = await asyncio.to_thread(lambda: list(on_disk(names, settings.model_dirs, looked)))
        rejected: list[str] = []
        for files in found:
            tokenizer = await self._checked(model, files, probes, rejected)
            if tokenizer is not None:
                return Choice("hf", files.source, files.detail, str(files.tokenizer)), tokenizer
        if probes.prompt is not None and probes.prompt == self.words.encode(PROBE):
            detail = "; ".join(["emulator probe", *rejected])
            return Choice("words", "probe", detail), self._build(model, settings, "words")
        repos = downloadable(names)
        if repos and not settings.download:
            looked.append("not the hub (tokenizer.download is off)")
        elif repos and hub_offline():
            looked.append("not the hub (HF_HUB_OFFLINE)")
        elif repos:
            pool.choice = Choice(
                "approximate",
                "pending",
                f"fetching the tokenizer of {', '.join(repos)} from the Hugging Face hub "
                f"(not found in {', '.join(looked)})",
            )
            log.info("model %s: tokenizer %s", model, pool.choice.describe())
            pool.fetching = asyncio.ensure_future(
                self._fetch(model, pool, repos, probes, looked, rejected)
            )
            return None
        return self._none_found(pool, looked, rejected)

    def _none_found(
        self, pool: _Pool, looked: Sequence[str], rejected: Sequence[str]
    ) -> tuple[Choice, PromptTokenizer]:
        where = ", ".join(looked) or "nothing the engine reports"
        detail = "; ".join([f"no tokenizer found (looked in {where})", *rejected])
        return Choice("approximate", "none", detail), self._approximate(pool)

    async def _fetch(
        self,
        model: str,
        pool: _Pool,
        repos: Sequence[str],
        probes: _Probes,
        looked: list[str],
        rejected: list[str],
    ) -> None:
        """The hub step, in the background: each hub id in turn, bounded in time."""
        timeout = pool.settings.download_timeout_s
        try:
            for repo in repos:
                looked.append(f"the Hugging Face hub ({repo})")
                try:
                    files = await fetch(repo, timeout)
                except asyncio.TimeoutError:
                    rejected.append(f"{repo}: the hub did not answer within {timeout:g} s")
                    continue
                except Exception as exc:  # not found, gated, offline, refused
                    rejected.append(f"{repo}: {type(exc).__name__}: {_first_line(exc)}")
                    continue
                tokenizer = await self._checked(model, files, probes, rejected)
                if tokenizer is not None:
                    choice = Choice("hf", files.source, files.detail, str(files.tokenizer))
                    self._use(model, pool, choice, tokenizer)
                    return
            self._use(model, pool, *self._none_found(pool, looked, rejected))
        finally:
            pool.fetching = None

    def _hf(self, files: TokenizerFiles, settings: TokenizerConfig) -> HFTokenizer:
        """A found tokenizer (blocking: tokenizer.json is parsed and probed)."""
        template_file = settings.chat_template or files.chat_template
        template = None
        if template_file is not None:
            with open(template_file) as f:
                template = f.read()
        return HFTokenizer(files.tokenizer, files.config, template, settings.recent_prompt_tokens)

    async def _checked(
        self, model: str, files: TokenizerFiles, probes: _Probes, rejected: list[str]
    ) -> HFTokenizer | None:
        """The found tokenizer if it tokenizes the probes as the engine does (unchecked
        when the engine has no /tokenize; the guard watches it then); else None, with
        the reason appended to ``rejected``."""
        settings = self._pool(model).settings
        try:
            tokenizer = await asyncio.to_thread(self._hf, files, settings)
        except Exception as exc:  # a corrupt or foreign file
            rejected.append(f"{files.tokenizer} cannot be read ({_first_line(exc)})")
            return None
        if probes.prompt is None:
            return tokenizer
        if list(await tokenizer.prompt(PROBE)) != probes.prompt:
            rejected.append(f"{files.tokenizer} tokenizes differently from the engine")
            return None
        await self._probe_chat(model, probes)
        if probes.chat is not None:
            try:
                ours: list[int] | None = await tokenizer.chat(CHAT_PROBE)
            except TokenizeError:
                ours = None
            if ours != probes.chat:
                rejected.append(f"{files.tokenizer}'s chat template renders differently")
                return None
        return tokenizer

    async def _reported(self, model: str) -> list[Reported]:
        """What the engine says its model is (vLLM's ``root``; SGLang's paths), then
        the served name."""
        names: list[Reported] = []
        if self.get is not None:
            status, body = await self._ask(self.get(model, "/v1/models"))
            card = _card(body, model) if status == 200 else None
            vllm = card is not None and card.get("owned_by", "vllm") == "vllm"
            root = card.get("root") if card else None
            # vLLM's root is its --model; SGLang's is the served name again.
            if isinstance(root, str) and root and (vllm or root != model):
                names.append(Reported(root, "root"))
            if not vllm:
                # SGLang reports its paths here (``/get_model_info`` before 0.5).
                for path in ("/model_info", "/get_model_info"):
                    status, body = await self._ask(self.get(model, path))
                    if status == 200:
                        names += _sglang_paths(body)
                        break
        names.append(Reported(model, "served name"))
        unique: dict[str, Reported] = {}
        for reported in names:
            unique.setdefault(reported.name, reported)
        return list(unique.values())

    @staticmethod
    async def _ask(call: Awaitable[tuple[int, bytes]]) -> tuple[int, bytes]:
        status, body = await call
        if status >= 500 or status == 429:  # busy or failing: not an answer
            raise _Unanswered(f"answered {status}")
        return status, body

    async def _probe(self, model: str) -> list[int] | None:
        """The engine's ids for ``PROBE`` (None: it has no /tokenize)."""
        probe = msgspec.json.encode({"model": model, "prompt": PROBE})
        status, body = await self._ask(self.post(model, "/tokenize", probe))
        return _tokens(body) if status == 200 else None

    async def _probe_chat(self, model: str, probes: _Probes) -> None:
        """The engine's ids for ``CHAT_PROBE``, asked once per attempt; left unknown when
        the engine cannot answer now (the prompt probe has already agreed)."""
        if probes.chat_asked:
            return
        probes.chat_asked = True
        body = msgspec.json.encode(
            {"model": model, "messages": CHAT_PROBE, "add_generation_prompt": True}
        )
        try:
            status, answer = await self._ask(self.post(model, "/tokenize", body))
        except Exception as exc:
            log.debug("model %s: chat probe unanswered (%s)", model, exc)
            return
        if status == 200:
            probes.chat = _tokens(answer)

    def _approximate(self, pool: _Pool) -> ApproximateTokenizer:
        chars = pool.calibration.chars_per_token or pool.settings.chars_per_token
        return ApproximateTokenizer(chars, pool.settings.recent_prompt_tokens)

    def _calibrate(self, model: str, pool: _Pool, router_tokens: int, engine_tokens: int) -> None:
        """Read one answer's usage into an approximate pool's characters per token; at
        ``CALIBRATION_ANSWERS``, use the measured value (once: a change re-keys the
        pool, whose blocks are then known from new decisions only)."""
        calibration = pool.calibration
        tokenizer = pool.tokenizer
        if (
            calibration.chars_per_token is not None
            or pool.settings.mode == "approximate"  # configured: its chars_per_token rules
            or not isinstance(tokenizer, ApproximateTokenizer)
            or router_tokens <= 0
            or engine_tokens <= 0
        ):
            return
        calibration.chars += router_tokens * tokenizer.chars
        calibration.tokens += engine_tokens
        calibration.answers += 1
        if calibration.answers < CALIBRATION_ANSWERS:
            return
        measured = min(max(round(calibration.chars / calibration.tokens), 1), 64)
        calibration.chars_per_token = measured
        if measured != tokenizer.chars:
            pool.tokenizer = self._approximate(pool)
        log.info(
            "model %s: approximate mode at %d characters per token, measured over %d "
            "answers (%d characters, %d engine tokens)",
            model,
            measured,
            calibration.answers,
            calibration.chars,
            calibration.tokens,
        )

    def observe(
        self, model: str, router_tokens: int, engine_tokens: int, media: bool = False
    ) -> bool:
        """Compare one answer's prompt tokens; True if this switched the pool to approximate.

        A chat with ``media`` parts is compared only by tokenizers that count its
        placeholder tokens as the engine does (``media_exact``)."""
        pool = self._pool(model)
        if not media:
            self._calibrate(model, pool, router_tokens, engine_tokens)
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
            wrong = pool.tokenizer.mode
            pool.tokenizer = self._approximate(pool)
            pool.choice = Choice(
                "approximate",
                "guard",
                f"the {wrong} tokenizer ({pool.choice.describe()}) disagreed with the "
                f"engines on {bad} of the last {len(pool.checks)} prompts",
            )
            log.error(
                "model %s: the router's %s tokenizer disagrees with the engines on %d of the "
                "last %d prompts (e.g. %d tokens here, %d at the engine); routing this pool "
                "in approximate mode until restart or reload",
                model,
                wrong,
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

    def describe(self) -> list[dict[str, Any]]:
        """Each pool's tokenizer, the path it is on and why, as ``/admin/engines`` shows
        it (``kvroute status``)."""
        out = []
        for model, pool in sorted(self._pools.items()):
            tokenizer = pool.tokenizer
            approximate = isinstance(tokenizer, ApproximateTokenizer)
            out.append(
                {
                    "model": model,
                    "mode": tokenizer.mode,
                    "source": pool.choice.source,
                    "path": pool.choice.path,
                    "detail": pool.choice.detail,
                    "description": pool.choice.describe(),
                    "chars_per_token": tokenizer.chars if approximate else None,
                    "calibrated": pool.calibration.chars_per_token is not None,
                    "mismatches": pool.mismatches,
                }
            )
        return out

    def metric_families(self) -> Iterator[StateFamily]:
        """Each pool's guard mismatches, tokenizer mode and source, and the characters
        per token of approximate ones."""
        yield TOKENIZER_MISMATCHES.labelled(((m,), n) for m, n in sorted(self.mismatches().items()))
        yield TOKENIZER_MODE.labelled(((m, mode), 1) for m, mode in sorted(self.modes().items()))
        pools = self.describe()
        yield TOKENIZER_SOURCE.labelled(((p["model"], p["source"]), 1) for p in pools)
        yield TOKENIZER_CHARS_PER_TOKEN.labelled(
            ((p["model"],), p["chars_per_token"]) for p in pools if p["chars_per_token"] is not None
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _tokens(body: bytes) -> list[int] | None:
    """The ``tokens`` of a /tokenize answer (None for any other shape)."""
    try:
        answer = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return tokens if isinstance(tokens, list) else None


def _card(body: bytes, model: str) -> dict[str, Any] | None:
    """The ``/v1/models`` entry of ``model``, if the answer has one."""
    try:
        data = msgspec.json.decode(body).get("data")
    except (msgspec.DecodeError, AttributeError):
        return None
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict) and card.get("id") == model:
            return card
    return None


def _sglang_paths(body: bytes) -> list[Reported]:
    """SGLang's ``/model_info``: where its tokenizer and model come from."""
    try:
        info = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return []
    if not isinstance(info, dict):
        return []
    return [
        Reported(info[key], key)
        for key in ("tokenizer_path", "model_path")
        if isinstance(info.get(key), str) and info[key]
    ]
