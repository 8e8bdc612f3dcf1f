"""Intake without a transport: what every front end does with a body it has read."""

from __future__ import annotations

import pytest

from router.app import RouterApp
from router.serving.errors import ApiError
from router.serving.intake import Prepared, prepare
from router.serving.parsing import parse_chat, parse_completion

PARSERS = {"completions": parse_completion, "chat": parse_chat}


async def intake(app: RouterApp, endpoint: str, body: bytes) -> tuple[bytes, Prepared]:
    """Decode ``body`` and take out the router-owned fields (:mod:`router.serving.owned`),
    then prepare it (:func:`router.serving.intake.prepare`): the bytes a front end
    forwards, and the request ready to plan."""
    services = app.services
    body, payload = services.owned.body(body, services.config.limits.max_json_depth)
    return body, await prepare(services, "intake-test", payload, PARSERS[endpoint], {})


async def refusal(app: RouterApp, endpoint: str, body: bytes) -> ApiError:
    """The error intake refuses ``body`` with (the test fails if it passes)."""
    with pytest.raises(ApiError) as caught:
        await intake(app, endpoint, body)
    return caught.value
