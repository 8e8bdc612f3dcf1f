"""The pooling routes of a vLLM server: ``/v1/embeddings``, ``/pooling``, ``/score``,
``/rerank``, answered in vLLM 0.32's shapes.

A real vLLM serves these only for a pooling model (``--runner pooling``) and answers a
generation model's with 404 ``{"detail": "Not Found"}``; the emulator serves them beside
generation so that the router's passthrough can be tested on one kind of engine. The
vectors and scores are a deterministic function of the input's token ids (the shared
word tokenizer): the same input gets the same answer from every emulated engine. No
request touches the engine model: pooling fills no prefix cache here.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.emulator.protocol import APIError, check_token_ids, encode_json, parse_body
from router.emulator.state import EmulatorState

DIMENSIONS = 8
"""Length of every embedding and pooling vector."""
_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"))
"""The two sides of a ``/score`` body, in the spellings vLLM accepts."""


def _inputs(value: Any, param: str) -> list[Any]:
    """A string, a list of strings, token ids, or lists of token ids: one item each."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(t, int) for t in value)
    ):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise APIError(400, f"`{param}` must be a string, token ids, or a non-empty list", param)


def _vector(ids: list[int]) -> list[float]:
    """A unit-free deterministic vector of ``ids``."""
    if not ids:
        return [0.0] * DIMENSIONS
    return [
        round(sum((t * (d + 1) * 2654435761) % 1000 for t in ids) / (1000 * len(ids)), 6)
        for d in range(DIMENSIONS)
    ]


def _score(a: list[int], b: list[int]) -> float:
    """Share of ``b``'s distinct tokens that ``a`` holds too."""
    return round(len(set(a) & set(b)) / max(len(set(b)), 1), 6)


def routes(state: EmulatorState) -> list[Route]:
    """The routes, bound to ``state``'s model names and tokenizer."""
    tokenizer = state.tokenizer

    def ids(item: Any, param: str) -> list[int]:
        if isinstance(item, str):
            return tokenizer.encode(item)
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            return tokenizer.encode(item["text"])
        return check_token_ids(item, param)

    def answer(prefix: str, model: str, tokens: int, **fields: Any) -> Response:
        """A list answer (embeddings, pooling, score); rerank's has no object or created."""
        head = {"id": f"{prefix}-{uuid.uuid4().hex}"}
        if prefix != "rerank":
            head.update(object="list", created=int(time.time()))
        body = {
            **head,
            "model": model,
            **fields,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
        return Response(encode_json(body), media_type="application/json")

    async def vectors(request: Request, prefix: str, kind: str, field: str) -> Response:
        body = parse_body(await request.body())
        model, _, _ = state.models.resolve(body.get("model"))
        items = [ids(item, "input") for item in _inputs(body.get("input"), "input")]
        data = [{"index": i, "object": kind, field: _vector(item)} for i, item in enumerate(items)]
        return answer(prefix, model, sum(map(len, items)), data=data)

    async def embeddings(request: Request) -> Response:
        return await vectors(request, "embd", "embedding", "embedding")

    async def pooling(request: Request) -> Response:
        return await vectors(request, "pool", "pooling", "data")

    async def score(request: Request) -> Response:
        body = parse_body(await request.body())
        model, _, _ = state.models.resolve(body.get("model"))
        pair = next((p for p in _SCORE_PAIRS if p[0] in body), None)
        if pair is None:
            raise APIError(400, "`queries` and `documents` (or `text_1`, `text_2`) are required")
        first, second = pair
        left = [ids(x, first) for x in _inputs(body.get(first), first)]
        right = [ids(x, second) for x in _inputs(body.get(second), second)]
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise APIError(400, f"`{first}` and `{second}` must pair up one to one", first)
        data = [
            {"index": i, "object": "score", "score": _score(a, b)}
            for i, (a, b) in enumerate(zip(left, right, strict=True))
        ]
        return answer("score", model, sum(map(len, left + right)), data=data)

    async def rerank(request: Request) -> Response:
        body = parse_body(await request.body())
        model, _, _ = state.models.resolve(body.get("model"))
        query = ids(body.get("query"), "query")
        documents = _inputs(body.get("documents"), "documents")
        scored = [(_score(query, ids(doc, "documents")), i, doc) for i, doc in enumerate(documents)]
        scored.sort(key=lambda s: (-s[0], s[1]))
        top_n = body.get("top_n") or len(scored)
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise APIError(400, "`top_n` must be a non-negative integer", "top_n")
        results = [
            {
                "index": i,
                "document": {"text": doc if isinstance(doc, str) else None},
                "relevance_score": s,
            }
            for s, i, doc in scored[:top_n]
        ]
        tokens = len(query) + sum(len(ids(d, "documents")) for d in documents)
        return answer("rerank", model, tokens, results=results)

    return [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/pooling", pooling, methods=["POST"]),
        Route("/score", score, methods=["POST"]),
        Route("/v1/score", score, methods=["POST"]),
        Route("/rerank", rerank, methods=["POST"]),
        Route("/v1/rerank", rerank, methods=["POST"]),
    ]
