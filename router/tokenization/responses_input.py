"""A Responses API request as the chat messages an engine renders it from.

vLLM (0.32, models without the Harmony format) renders ``POST /v1/responses`` with the
model's chat template over messages built from the request: ``instructions`` as a
system message, then each input item in order. A string ``input`` is one user message;
in a list, messages keep their role (their ``input_text``/``output_text`` parts become
text parts), an assistant output message or a ``reasoning`` item joins the assistant
message before it, ``function_call`` items become that message's tool calls and
``function_call_output`` items tool messages. The router tokenizes these messages for
routing; the engine emulator renders its prompt from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_TEXT_PARTS = ("input_text", "output_text", "text")


class InvalidInput(ValueError):
    """Input items this module cannot turn into messages (the request is a 400)."""


def _parts(content: Any) -> str | list[dict[str, Any]] | None:
    """A message's content as chat content: text parts alone become one string (joined
    by newlines, as vLLM renders text parts for string-content templates); with other
    parts (images, files) the text parts become ``text`` parts beside them."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInput("a message's 'content' must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, Mapping):
            raise InvalidInput("each content part must be an object")
        if part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        else:
            parts.append(dict(part))
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _first_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    last = messages[-1] if messages else None
    return last if last is not None and last.get("role") == "assistant" else None


def _tool_call(item: Mapping[str, Any]) -> dict[str, Any]:
    name = str(item.get("name") or "")
    if item.get("namespace"):
        name = f"{item['namespace']}__{name}"
    arguments = item.get("arguments") if item.get("type") == "function_call" else item.get("input")
    return {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": name, "arguments": str(arguments or "")},
    }


def _add(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    kind = item.get("type")
    previous = _assistant(messages)
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item)
        if previous is not None and isinstance(previous.get("tool_calls"), list):
            previous["tool_calls"].append(call)
        elif previous is not None and "tool_calls" not in previous:
            previous["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return
    if kind == "reasoning":
        content, summary = item.get("content"), item.get("summary")
        text = _first_text(content) or _first_text(summary) or ""
        if previous is not None and "reasoning" not in previous:
            previous["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
        return
    if kind in ("function_call_output", "custom_tool_call_output"):
        messages.append(
            {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
        )
        return
    role = item.get("role")
    if not isinstance(role, str):
        raise InvalidInput(f"Unsupported input item type: {kind}")
    if role == "assistant":
        text = _first_text(item.get("content"))
        if text is not None:
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
            return
    message = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
    message["content"] = _parts(item.get("content"))
    messages.append(message)


def responses_messages(
    instructions: str | None,
    input: str | Sequence[Any],
    history: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The chat messages a Responses request renders from: ``instructions`` (system),
    the ``history`` of a continued conversation (its system messages left out, as the
    previous turn's instructions do not carry over), then ``input``."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(dict(m) for m in history if m.get("role") != "system")
    if isinstance(input, str):
        messages.append({"role": "user", "content": input})
        return messages
    for item in input:
        if not isinstance(item, Mapping):
            raise InvalidInput("each input item must be an object")
        _add(messages, item)
    return messages


def output_messages(output: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A response's ``output`` items as the assistant messages a next turn continues
    from (reasoning is left out, as vLLM does)."""
    messages = []
    for item in output:
        if item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                messages.append({"role": "assistant", "content": part["text"]})
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A Responses request's function tools in the chat form its template renders
    (``{"type": "function", "function": {...}}``); None without any."""
    if not isinstance(tools, list):
        return None
    found = [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in tools
        if isinstance(tool, Mapping) and tool.get("type") == "function"
    ]
    return found or None
