"""The README's route list is what ``kvroute serve`` serves: every route its HTTP
listener registers (``HttpApi.routes()`` and the admin API) is listed, and every listed
route is registered.

Rows whose first cell starts with ``*being added`` list routes other parts of issue 23
register (Responses, Messages): they may be missing while those parts are not merged,
and are checked like any other once they are registered.
"""

from __future__ import annotations

import re
from pathlib import Path

from support.routers import router_config

from router.app import RouterApp

README = Path(__file__).parents[2] / "README.md"
_ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`")
_PENDING = "*being added"

Route = tuple[str, str]


def documented() -> tuple[set[Route], set[Route]]:
    """(listed routes, listed routes still being added), from the README's table."""
    text = README.read_text()
    start = text.index("<!-- routes: tests/unit/test_readme_routes.py -->")
    table = text[start : text.index("<!-- /routes -->", start)]
    listed: set[Route] = set()
    pending: set[Route] = set()
    for row in table.splitlines():
        if not row.startswith("|"):
            continue
        first = row.split("|")[1].strip()
        found = set(_ROUTE.findall(first))
        (pending if first.startswith(_PENDING) else listed).update(found)
    return listed, pending


async def served() -> set[Route]:
    """(method, path) of every route of the HTTP listener of ``kvroute serve``."""
    app = RouterApp(router_config(["http://127.0.0.1:9"]))
    web = app.web_app()
    return {
        (route.method, route.resource.canonical)
        for route in web.router.routes()
        if route.method != "HEAD" and route.resource is not None  # HEAD: added beside GET
    }


async def test_every_served_route_is_in_the_readme() -> None:
    listed, pending = documented()
    missing = await served() - listed - pending
    assert not missing, f"served but not in the README's route list: {sorted(missing)}"


async def test_every_route_in_the_readme_is_served() -> None:
    listed, _ = documented()
    extra = listed - await served()
    assert not extra, f"in the README's route list but not served: {sorted(extra)}"


def test_the_list_is_found_and_names_both_generation_routes() -> None:
    listed, _ = documented()
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")} <= listed
