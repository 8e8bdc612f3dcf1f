"""The OpenAPI 3.1 document of the router's HTTP API (``GET /openapi.json``).

The request bodies are described by the pydantic models below; they are not used per
request (the hot path parses with msgspec, :mod:`router.serving.parsing`). The engine
routes passed through are listed from :data:`~router.frontends.http.engine_routes.ENGINE_ROUTES`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.frontends.http.anthropic import COUNT_TOKENS_PATH, MESSAGES_PATH
from router.frontends.http.engine_routes import ENGINE_ROUTES, EngineRoute

_JSON = "application/json"


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class CompletionRequest(_Body):
    """POST /v1/completions. Fields beyond these pass through to the engine."""

    model: str | None = Field(None, description="Served model or LoRA adapter name.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, texts, token ids, or lists of token ids (non-empty)."
    )
    max_tokens: int | None = Field(
        None, ge=0, description="At least 1, unless `echo` is true (the prompt alone)."
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    cache_salt: str | None = Field(None, description="Isolates prefix caching per tenant.")
    user: str | None = Field(None, description="Also the session key of the session policy.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(description="system, user, assistant, tool, developer, or a custom role.")
    content: str | list[Any] | None = None


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions. Fields beyond these pass through to the engine."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    cache_salt: str | None = None
    user: str | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI Responses). Only what routing reads is checked; the
    engine validates the rest (fields beyond these pass through)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        description="Text, or a non-empty list of input items (messages, function calls "
        "and their outputs)."
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    previous_response_id: str | None = Field(
        None, description="Continues that response's conversation on the engine holding it."
    )
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    user: str | None = None


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(description="text, image, tool_use, tool_result, ...")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class MessagesRequest(_Body):
    """POST /v1/messages (Anthropic Messages). Only what routing reads is checked; the
    engine validates the rest (fields beyond these pass through)."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[ContentBlock] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = Field(
        None, description="metadata.user_id is the session key of the session policy."
    )
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: a Messages body's model, system and messages."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 description of the router's HTTP API."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema(
        [
            (CompletionRequest, "validation"),
            (ChatCompletionRequest, "validation"),
            (ResponsesRequest, "validation"),
            (MessagesRequest, "validation"),
            (CountTokensRequest, "validation"),
        ],
        ref_template="#/components/schemas/{model}",
    )
    error = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "integer", "null"]},
                },
            }
        },
    }
    schemas = {**defs.get("$defs", {}), "Error": error}
    errors = {
        str(code): {
            "description": text,
            "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code, text in (
            (400, "Invalid request"),
            (404, "Unknown model"),
            (408, "The request body did not arrive within server.body_timeout_s"),
            (413, "Body too large"),
            (429, "Too many requests in flight (see Retry-After)"),
            (502, "An engine failed"),
            (503, "No healthy engine"),
            (504, "An engine timed out"),
        )
    }

    def generate(model: str, summary: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{model}"}}},
                },
                "responses": {
                    "200": {
                        "description": "The engine's answer (JSON, or SSE when streaming)",
                        "content": {
                            _JSON: {"schema": {"type": "object"}},
                            "text/event-stream": {
                                "schema": {
                                    "description": "One server-sent event: `data` holds a "
                                    "JSON chunk, an error object, or [DONE]",
                                    "type": "object",
                                    "required": ["data"],
                                    "properties": {"data": {"type": "string"}},
                                }
                            },
                        },
                    },
                    **errors,
                },
            }
        }

    def plain(summary: str, codes: tuple[str, ...] = ("200",)) -> dict[str, Any]:
        return {
            "get": {"summary": summary, "responses": {c: {"description": summary} for c in codes}}
        }

    def held_response(method: str, summary: str) -> dict[str, Any]:
        return {
            method: {
                "summary": summary,
                "parameters": [
                    {
                        "name": "response_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "The holding engine's answer",
                        "content": {_JSON: {"schema": {}}, "text/event-stream": {"schema": {}}},
                    },
                    **errors,
                },
            }
        }

    def passthrough(route: EngineRoute) -> dict[str, Any]:
        kinds: dict[str, Any] = {_JSON: {"schema": {}}}  # the engine's JSON, whatever it is
        if route.streams:
            kinds["text/event-stream"] = {"schema": {}}
        body = {"type": "object", "properties": {"model": {"type": "string"}}}
        return {
            "post": {
                "summary": f"Passed through to an engine serving the model ({route.label}); "
                "the engine's refusals are relayed as they are",
                "requestBody": {"required": True, "content": {_JSON: {"schema": body}}},
                "responses": {
                    "200": {"description": "The engine's answer", "content": kinds},
                    **errors,
                },
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvroute", "version": __import__("router").__version__},
        "paths": {
            "/v1/completions": generate("CompletionRequest", "Create a completion"),
            "/v1/chat/completions": generate("ChatCompletionRequest", "Create a chat completion"),
            "/v1/responses": generate("ResponsesRequest", "Create a response (OpenAI Responses)"),
            "/v1/responses/{response_id}": held_response(
                "get", "Retrieve a stored response from the engine holding it"
            ),
            "/v1/responses/{response_id}/cancel": held_response(
                "post", "Cancel a background response on the engine holding it"
            ),
            MESSAGES_PATH: generate("MessagesRequest", "Create a message (Anthropic Messages)"),
            COUNT_TOKENS_PATH: generate(
                "CountTokensRequest", "Count a message's input tokens (on the least busy engine)"
            ),
            "/v1/models": plain("List served models"),
            "/v1/models/{model}": {
                "get": {
                    "summary": "Retrieve a served model (404 model_not_found if none serves it)",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {"description": "The model's entry of /v1/models"},
                        **errors,
                    },
                }
            },
            "/health": plain("Liveness"),
            "/ready": plain("Readiness", ("200", "503")),
            "/metrics": plain("Prometheus metrics"),
            **{route.path: passthrough(route) for route in ENGINE_ROUTES},
        },
        "components": {"schemas": schemas},
    }
