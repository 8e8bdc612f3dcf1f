"""Anthropic Messages as the chat messages an engine's template renders.

vLLM 0.32 serves ``/v1/messages`` by converting the request into a chat completion
(``vllm/entrypoints/anthropic/serving.py``), so the prompt it tokenizes is the chat
template over these messages. The router converts the same way to count and hash the
same tokens, and the emulator serves its ``/v1/messages`` through it:

* ``system`` (a string, or text blocks joined without a separator) becomes one leading
  system message; a text block starting ``x-anthropic-billing-header`` is dropped (it
  carries a per-request hash that would defeat prefix caching).
* A ``system`` message inside ``messages`` stays where it is, unless the template needs
  system-first ordering: then its text is appended to the leading system message.
* Blocks: ``text`` become text parts (one text part alone becomes a string content),
  ``image`` an ``image_url`` part, ``thinking`` the message's ``reasoning``,
  ``tool_use`` its ``tool_calls``, a user's ``tool_result`` a ``tool`` message before
  it (its images a user message), an assistant's ``tool_result`` a text part; a user
  message left without content is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header"


def _text_of(blocks: Sequence[Any]) -> list[str]:
    """The texts of a block list's non-empty text blocks, billing headers dropped."""
    return [
        text
        for block in blocks
        if isinstance(block, Mapping)
        and block.get("type") == "text"
        and isinstance(text := block.get("text"), str)
        and text
        and not text.startswith(BILLING_HEADER)
    ]


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    if isinstance(content, list):
        return "".join(_text_of(content)) or None
    return None


def has_inline_system(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``messages`` hold a system message (only then does ordering matter)."""
    return any(m.get("role") == "system" for m in messages)


def chat_messages(
    system: Any, messages: Sequence[Mapping[str, Any]], merge_inline_system: bool = False
) -> list[dict[str, Any]]:
    """The chat messages an Anthropic request renders as (see the module docstring)."""
    out: list[dict[str, Any]] = []
    parts: list[str] = []
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += _text_of(system)
    if merge_inline_system:
        for msg in messages:
            if msg.get("role") == "system" and (text := _system_text(msg.get("content"))):
                parts.append(text)
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for msg in messages:
        role = msg.get("role")
        content = msg.get("content")
        if role == "system":
            if not merge_inline_system and (text := _system_text(content)):
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        elif isinstance(content, list):
            _convert_blocks(content, str(role), converted, out)
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def _convert_blocks(
    blocks: Sequence[Any], role: str, converted: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.extend(_tool_result_messages(block))
            else:
                result = str(block.get("content")) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _tool_result_messages(block: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = block.get("content")
    texts: list[str] = []
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, list):
        for item in content:
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind == "image" and (url := image_url(item.get("source") or {})):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
    call_id = block.get("tool_use_id") or ""
    text = content if isinstance(content, str) else "\n".join(texts)
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        messages.append({"role": "user", "content": parts})
    if references:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return messages


def image_url(source: Mapping[str, Any]) -> str:
    """An Anthropic image source as an OpenAI image URL (a data URL for base64 data)."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
