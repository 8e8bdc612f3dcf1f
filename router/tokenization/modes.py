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

Media parts of chats (images, audio, video; ``router.media``) are placed as follows:
``words`` renders ``placeholder_tokens`` marker tokens per item in place, exactly as the
emulator does. The other modes cannot know where the engine's processor puts an item's
placeholder tokens, nor how many there are, so they place every item at the first token
of the message that holds it (never later than the engine does, so a text-identical
chat with another image never shares the item's block): ``hf`` renders media parts as
``{"type": "image"}`` (audio, video) parts, which templates that draw images turn into
their placeholder, and finds the message's first token by rendering the messages before
it; ``engine`` asks the engine for those messages' tokens; ``approximate`` counts their
characters.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from router.media import DEFAULT_MM_PLACEHOLDER_TOKENS, MediaItem, MediaSpan, media_item
from router.tokenization.base import (
    ChatPrompt,
    PromptTokenizer,
    RecentPrompts,
    TokenizeError,
    TokenizerUnavailable,
    common_prefix,
    media_by_message,
)
from router.tokenization.responses_input import chat_tools
from router.tokenization.words import (
    WordTokenizer,
    message_text,
    render_chat_media,
)

ChatTokens = Callable[
    [Sequence[Mapping[str, Any]], bool, Mapping[str, Any] | None], Awaitable[list[int]]
]


async def _message_starts(
    media: Mapping[int, list[MediaItem]],
    tokens: list[int],
    messages: Sequence[Mapping[str, Any]],
    chat: ChatTokens,
    template_kwargs: Mapping[str, Any] | None,
) -> dict[int, int]:
    """Per message holding media, where it starts in ``tokens``: the tokens that the
    messages before it share with the whole chat, less one (the last may merge with
    what follows). 0 when the shorter chat cannot be tokenized."""
    starts: dict[int, int] = {}
    for index in media:
        before: list[int] = []
        if index:
            try:
                before = await chat(messages[:index], False, template_kwargs)
            except TokenizeError:  # e.g. a template that refuses the shorter chat
                pass
        starts[index] = common_prefix(before, tokens) - 1
    return starts


async def _placed_chat_prompt(
    self: PromptTokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatPrompt:
    """``chat_prompt`` of the modes that tokenize a whole chat (hf, engine): each media
    item at the first token of the message that holds it."""
    media = media_by_message(messages)
    tokens = await self.chat(messages, add_generation_prompt, template_kwargs)
    starts = await _message_starts(media, tokens, messages, self.chat, template_kwargs)
    return ChatPrompt(tokens, _spans_at(media, starts))


def _spans_at(media: Mapping[int, list[MediaItem]], offsets: Mapping[int, int]) -> list[MediaSpan]:
    """One single-token span per item, at the offset of the message that holds it."""
    return [
        MediaSpan(item.identifier, max(offsets[index], 0), 1)
        for index, items in sorted(media.items())
        for item in items
    ]


class WordsTokenizer(PromptTokenizer):
    """The emulator's deterministic word tokenizer."""

    mode = "words"

    def __init__(
        self,
        words: WordTokenizer | None = None,
        placeholder_tokens: int = DEFAULT_MM_PLACEHOLDER_TOKENS,
    ) -> None:
        self.words = words or WordTokenizer()
        self.placeholder_tokens = placeholder_tokens

    async def prompt(self, text: str) -> Sequence[int]:
        return self.words.ids(text)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return (await self.chat_prompt(messages, add_generation_prompt, template_kwargs)).tokens

    async def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        try:
            text, spans = render_chat_media(
                messages, add_generation_prompt, self.placeholder_tokens
            )
        except ValueError as exc:
            raise TokenizeError(str(exc)) from None
        return ChatPrompt(self.words.encode(text), spans)


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


def _uses_clock(environment: Any, template: str) -> bool:
    """Whether a chat template reads the clock (its text then changes with the day)."""
    from jinja2 import TemplateSyntaxError, nodes

    try:
        names = environment.parse(template).find_all(nodes.Name)
        return any(name.name == "strftime_now" for name in names)
    except TemplateSyntaxError:
        return True


THREAD_MIN_CHARS = 2_048
"""hf mode tokenizes texts at least this long on a worker thread (shorter ones cost less
than the hand-over)."""
_ENCODERS: ThreadPoolExecutor | None = None


def _encoders() -> ThreadPoolExecutor:
    """The threads hf mode tokenizes long texts on (one per core, at most four)."""
    global _ENCODERS
    if _ENCODERS is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        workers = min(4, cores or os.cpu_count() or 1)
        _ENCODERS = ThreadPoolExecutor(workers, thread_name_prefix="kvroute-tokenize")
    return _ENCODERS


class HFTokenizer(PromptTokenizer):
    """A Hugging Face tokenizer and chat template, from local files only."""

    mode = "hf"
    media_exact = False  # the engine's processor expands a placeholder to many tokens

    def __init__(
        self,
        tokenizer_json: str | Path,
        tokenizer_config: str | Path | None = None,
        chat_template: str | None = None,
        recent_tokens: int = 0,
    ) -> None:
        from tokenizers import Tokenizer

        self.recent = RecentPrompts(recent_tokens)
        """Recent prompts' and chats' ids (``tokenizer.recent_prompt_tokens``)."""
        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        # The engine's tokenizer (transformers' fast tokenizer) neither truncates nor
        # pads a prompt whatever tokenizer.json says: nor does the router.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
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
        environment = _template_environment()
        self.template = environment.from_string(template) if template else None
        self.remembers_chats = bool(template) and not _uses_clock(environment, template)
        """Whether a chat's ids may be remembered by its messages: not when the template
        reads the clock (``strftime_now``: Llama 3.2's date line), whose text changes
        with the day. Conversation prefixes are remembered by their rendered text, so
        they stay exact either way."""
        self._cuts = self._cut_tokens()
        """Special tokens after which a chat's text is tokenized as two independent parts
        (empty: a chat is always tokenized whole)."""
        self._cut_ids = frozenset(self._cuts.values())

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
                messages=[_template_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
                **dict(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise TokenizeError(f"chat template: {exc}") from None

    async def prompt(self, text: str) -> list[int]:
        key = self.recent.text_key(b"p", text) if self.recent.max_tokens else None
        ids = self.recent.get(key)
        if ids is None:
            ids = (await self._encode(text, add_special_tokens=True)).ids
            self.recent.put(key, ids)
        return ids

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        key = None
        if self.recent.max_tokens and self.remembers_chats:
            key = self.recent.chat_key(b"c", messages, add_generation_prompt, template_kwargs)
        ids = self.recent.get(key)
        if ids is None:
            text = self.render(messages, add_generation_prompt, template_kwargs)
            ids = await self._encode_chat(text)
            self.recent.put(key, ids)
        return ids

    # A chat's rendered text is the conversation so far, so the next turn's text starts
    # with this turn's up to its last special token. A Hugging Face tokenizer splits its
    # input at added tokens first and tokenizes the parts between them independently, so
    # the ids of a text cut right after a special token are those of the part before the
    # cut followed by those of the part after it: the ids of the conversation so far are
    # remembered up to its last special tokens, and the next turn tokenizes only what is
    # new. Only tokens that cut that way are used (special, matched on the raw text, no
    # whitespace stripping), and only when a probe shows the tokenizer agrees (a
    # pre-tokenizer that treats an input's first part differently, as Metaspace's
    # ``prepend_scheme: first`` does, does not).

    _PROBES = ("hello world", " hello", "\n\nhello there, 123", "1 2 3")
    _FULLY_PROBED = 4
    _REMEMBERED_CUTS = 4

    def _cut_tokens(self) -> dict[str, int]:
        """content -> id of the special tokens a chat may be cut after."""
        added = self.tokenizer.get_added_tokens_decoder()
        if any(token.single_word for token in added.values()):
            # A single-word token after a cut would see the start of a word there.
            return {}
        contents = [token.content for token in added.values()]
        candidates = {
            token.content: tid
            for tid, token in added.items()
            if token.special
            and not (token.normalized or token.lstrip or token.rstrip or token.single_word)
            and token.content
            # no other added token may match across the cut
            and not any(token.content in other and other != token.content for other in contents)
        }
        encode = self.tokenizer.encode
        pairs = [(before, after) for before in self._PROBES for after in self._PROBES]
        try:
            # Every pair for a few tokens (how the tokenizer treats a part is the same
            # for all of them), one for each of the others (Llama 3 has 256).
            for n, content in enumerate(candidates):
                for before, after in pairs if n < self._FULLY_PROBED else pairs[1:2]:
                    whole = encode(before + content + after, add_special_tokens=False).ids
                    parts = encode(before + content, add_special_tokens=False).ids
                    parts += encode(after, add_special_tokens=False).ids
                    if whole != parts:
                        return {}
        except Exception:  # a tokenizer that cannot encode the probe: chats stay whole
            return {}
        return candidates

    async def _encode(self, text: str, add_special_tokens: bool) -> Any:
        """The tokenizer's Encoding of ``text``. A long text is tokenized on a worker
        thread through ``encode_batch``, which releases the GIL (``encode`` does not), so
        the event loop goes on routing other requests meanwhile, on another core."""
        if len(text) < THREAD_MIN_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        loop = asyncio.get_running_loop()
        work = functools.partial(
            self.tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens
        )
        return (await loop.run_in_executor(_encoders(), work))[0]

    async def _encode_chat(self, text: str) -> list[int]:
        if not self._cuts or not self.recent.max_tokens:
            return (await self._encode(text, add_special_tokens=False)).ids
        # Where the text could be cut, and the hash of the text up to each such place.
        cuts: list[int] = []
        for content in self._cuts:
            at = text.find(content)
            while at >= 0:
                cuts.append(at + len(content))
                at = text.find(content, at + len(content))
        cuts.sort()
        digests: dict[int, bytes] = {}
        running = xxhash.xxh3_128()
        done = 0
        for cut in cuts:
            running.update(text[done:cut].encode("utf-8", "surrogatepass"))
            digests[cut] = b"x" + running.digest()
            done = cut
        start, ids = 0, []
        for cut in reversed(cuts):
            known = self.recent.get(digests[cut])
            if known is not None:
                start, ids = cut, known
                break
        rest = await self._encode(text[start:], add_special_tokens=False)
        rest_ids = rest.ids  # each read of an Encoding's ids or offsets builds a new list
        offsets = None
        # Remember the text up to its last few cuts, as the tokenizer placed them.
        kept = 0
        cut_ids = self._cut_ids
        for index in range(len(rest_ids) - 1, -1, -1):
            if kept == self._REMEMBERED_CUTS:
                break
            if rest_ids[index] in cut_ids:
                offsets = offsets or rest.offsets
                digest = digests.get(start + offsets[index][1])
                if digest is not None:
                    self.recent.put(digest, ids + rest_ids[: index + 1])
                    kept += 1
        ids += rest_ids
        return ids

    chat_prompt = _placed_chat_prompt  # media at the start of the message holding it

    async def requires_system_first(self) -> bool:
        # vLLM's test: a template that cannot render [system, user, system, user].
        try:
            self.render(SYSTEM_ORDER_PROBE, add_generation_prompt=False)
        except TokenizeError:
            return True
        return False

    async def responses(
        self,
        request: Mapping[str, Any],
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # vLLM's Responses renderer encodes the rendered chat with the tokenizer's
        # special tokens (unlike chat completions): a template that writes its own BOS
        # gets a second one.
        text = self.render(messages, True, template_kwargs)
        return (await self._encode(text, add_special_tokens=True)).ids


def _template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message as vLLM gives it to a chat template: media parts become
    ``{"type": "image"}`` (``"audio"``, ``"video"``) parts."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    changed = False
    for part in content:
        try:
            item = media_item(part)
        except ValueError:
            item = None
        if item is None:
            parts.append(part)
        else:
            parts.append({"type": item.modality})
            changed = True
    return {**message, "content": parts} if changed else message


SYSTEM_ORDER_PROBE: list[dict[str, Any]] = [
    {"role": role, "content": "t"} for role in ("system", "user", "system", "user")
]
"""The conversation vLLM renders to learn whether a template takes inline system messages."""


class ApproximateTokenizer(PromptTokenizer):
    """Fixed-size character chunks as pseudo-tokens."""

    mode = "approximate"
    exact = False

    def __init__(self, chars_per_token: int = 4, recent_tokens: int = 0) -> None:
        self.chars = chars_per_token
        self.recent = RecentPrompts(recent_tokens)
        """Recent prompts' pseudo-token ids (``tokenizer.recent_prompt_tokens``)."""

    async def prompt(self, text: str) -> list[int]:
        key = self.recent.text_key(b"p", text) if self.recent.max_tokens else None
        ids = self.recent.get(key)
        if ids is None:
            ids = self._chunks(text.encode("utf-8", "surrogatepass"))
            self.recent.put(key, ids)
        return ids

    def _chunks(self, data: bytes) -> list[int]:
        step = self.chars
        return [xxhash.xxh32_intdigest(data[i : i + step]) for i in range(0, len(data), step)]

    def _lines(self, messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
        lines = []
        for msg in messages:
            try:
                line = f"{msg.get('role')}: {message_text(msg.get('content'))}\n"
            except ValueError as exc:
                raise TokenizeError(str(exc)) from None
            lines.append(line.encode("utf-8", "surrogatepass"))
        return lines

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self._chunks(b"".join(self._lines(messages)))

    async def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        lines = self._lines(messages)
        media = media_by_message(messages)
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line))
        offsets = {index: starts[index] // self.chars for index in media}
        return ChatPrompt(self._chunks(b"".join(lines)), _spans_at(media, offsets))


PostJson = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]
"""POST a JSON body to a path of some healthy engine of the pool; (status, body)."""


#: What an engine without the Responses renderer answers ``/v1/responses/render``:
#: vLLM 0.32 serves it only with ``--enable-scale-out`` (403 otherwise); older engines
#: do not know the path.
_NO_RENDERER = frozenset((403, 404, 405, 501))


class EngineTokenizer(PromptTokenizer):
    """Asks an engine (vLLM's ``/tokenize``), remembering recent answers."""

    mode = "engine"

    def __init__(self, model: str, post: PostJson, cache_size: int = 2048) -> None:
        self.model = model
        self.post = post
        self.cache_size = cache_size
        self._cache: OrderedDict[int, list[int]] = OrderedDict()
        self._system_first: bool | None = None
        self.renders_responses: bool | None = None
        """Whether the pool's engines serve ``/v1/responses/render`` (None: not asked yet)."""

    async def _tokenize(
        self, body: dict[str, Any], path: str = "/tokenize", field: str = "tokens"
    ) -> list[int]:
        raw = msgspec.json.encode(body)
        key = xxhash.xxh3_64_intdigest(path.encode() + raw)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        status, answer = await self.post(path, raw)
        if status == 400:
            raise TokenizeError(f"the engine could not tokenize the prompt: {answer[:200]!r}")
        if status != 200:
            raise TokenizerUnavailable(f"{path} answered {status}", status)
        try:
            tokens = msgspec.json.decode(answer)[field]
        except (msgspec.DecodeError, KeyError, TypeError):
            raise TokenizerUnavailable(f"{path} answered without {field}") from None
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

    chat_prompt = _placed_chat_prompt  # media at the start of the message holding it

    async def requires_system_first(self) -> bool:
        """Asked once: whether the engine's ``/tokenize`` refuses the probe (400)."""
        if self._system_first is None:
            try:
                await self.chat(SYSTEM_ORDER_PROBE, add_generation_prompt=False)
                self._system_first = False
            except TokenizeError:
                self._system_first = True
        return self._system_first

    async def responses(
        self,
        request: Mapping[str, Any],
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The engine's own rendering (``/v1/responses/render``) where it serves one;
        else ``/tokenize`` over the equivalent chat, with the special tokens vLLM's
        Responses renderer adds."""
        if self.renders_responses is not False:
            try:
                tokens = await self._tokenize(
                    {**request, "model": self.model}, "/v1/responses/render", "token_ids"
                )
            except TokenizerUnavailable as exc:
                if exc.status not in _NO_RENDERER:
                    raise
                self.renders_responses = False
            else:
                self.renders_responses = True
                return tokens
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "add_generation_prompt": True,
            "add_special_tokens": True,
        }
        tools = chat_tools(request.get("tools"))
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = dict(template_kwargs)
        return await self._tokenize(body)
