"""The tokenizer modes: the emulator's words, Hugging Face, the engine's own, approximate.

* ``words``: the emulator's word tokenizer (tests and demos; exact for the emulator).
* ``hf``: a Hugging Face ``tokenizers`` tokenizer from a local ``tokenizer.json``, with
  the chat template of ``tokenizer_config.json`` rendered the way transformers renders
  it (a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, loop
  controls, ``raise_exception``, ``strftime_now``, ``tojson`` without ASCII escaping,
  the special tokens as variables), then encoded without adding special tokens again
  (no double BOS). Completion prompts are encoded with special tokens, as vLLM does.
* ``engine``: ask an engine of the pool (``POST /tokenize``, with ``messages`` for a
  chat), caching the answers for recent prompts. Exact whatever the model, at the cost
  of one extra round trip to an engine per new prompt (docs/configuration.md).
* ``approximate``: no tokenizer. Every ``chars_per_token`` characters of text become
  one pseudo-token, so a block stands for ``block_size * chars_per_token`` characters.
  Keys then follow the text, not the engine's tokens: they never match KV events, so an
  approximate pool is tracked from routing decisions alone, like sglang-router's tree.
"""

from __future__ import annotations

import datetime
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from router.tokenization.base import PromptTokenizer, TokenizeError, TokenizerUnavailable
from router.tokenization.words import WordTokenizer, message_text, render_chat


class WordsTokenizer(PromptTokenizer):
    """The emulator's deterministic word tokenizer."""

    mode = "words"

    def __init__(self, words: WordTokenizer | None = None) -> None:
        self.words = words or WordTokenizer()

    async def prompt(self, text: str) -> list[int]:
        return self.words.encode(text)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        try:
            return self.words.encode(render_chat(messages, add_generation_prompt))
        except ValueError as exc:
            raise TokenizeError(str(exc)) from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_environment() -> Any:
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' ``{% generation %}`` marks assistant spans; rendering ignores it."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class HFTokenizer(PromptTokenizer):
    """A Hugging Face tokenizer and chat template, from local files only."""

    mode = "hf"

    def __init__(
        self,
        tokenizer_json: str | Path,
        tokenizer_config: str | Path | None = None,
        chat_template: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        config: dict[str, Any] = {}
        if tokenizer_config is not None:
            config = json.loads(Path(tokenizer_config).read_text())
        template = chat_template or config.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        self.special_tokens = {
            key: text
            for key, value in config.items()
            if key.endswith("_token") and (text := _token_text(value)) is not None
        }
        self.template = _template_environment().from_string(template) if template else None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self.template is None:
            raise TokenizeError("this model's tokenizer_config.json has no chat template")
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
                **dict(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise TokenizeError(f"chat template: {exc}") from None

    async def prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render(messages, add_generation_prompt, template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


class ApproximateTokenizer(PromptTokenizer):
    """Fixed-size character chunks as pseudo-tokens."""

    mode = "approximate"
    exact = False

    def __init__(self, chars_per_token: int = 4) -> None:
        self.chars = chars_per_token

    async def prompt(self, text: str) -> list[int]:
        step = self.chars
        data = text.encode("utf-8", "surrogatepass")
        return [xxhash.xxh32_intdigest(data[i : i + step]) for i in range(0, len(data), step)]

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        parts = []
        for msg in messages:
            try:
                parts.append(f"{msg.get('role')}: {message_text(msg.get('content'))}\n")
            except ValueError as exc:
                raise TokenizeError(str(exc)) from None
        return await self.prompt("".join(parts))


PostJson = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]
"""POST a JSON body to a path of some healthy engine of the pool; (status, body)."""


class EngineTokenizer(PromptTokenizer):
    """Asks an engine (vLLM's ``/tokenize``), remembering recent answers."""

    mode = "engine"

    def __init__(self, model: str, post: PostJson, cache_size: int = 2048) -> None:
        self.model = model
        self.post = post
        self.cache_size = cache_size
        self._cache: OrderedDict[int, list[int]] = OrderedDict()

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        raw = msgspec.json.encode(body)
        key = xxhash.xxh3_64_intdigest(raw)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        status, answer = await self.post("/tokenize", raw)
        if status == 400:
            raise TokenizeError(f"the engine could not tokenize the prompt: {answer[:200]!r}")
        if status != 200:
            raise TokenizerUnavailable(f"/tokenize answered {status}")
        try:
            tokens = msgspec.json.decode(answer)["tokens"]
        except (msgspec.DecodeError, KeyError, TypeError):
            raise TokenizerUnavailable("/tokenize answered without tokens") from None
        self._cache[key] = tokens
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return tokens

    async def prompt(self, text: str) -> list[int]:
        return await self._tokenize(
            {"model": self.model, "prompt": text, "add_special_tokens": True}
        )

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        if template_kwargs:
            body["chat_template_kwargs"] = dict(template_kwargs)
        return await self._tokenize(body)
