"""Handoff dialects by name: what ``disaggregation.handoff``, ``models[].handoff`` and
``kvroute serve --handoff`` accept, and the :class:`~router.handoff.base.Handoff` each
name stands for.

A built-in dialect is one line below (``name: "module:Class"``, imported on first use,
so the configuration can list the names without importing the front ends). Another
one registers at run time with :func:`register`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.handoff.base import Handoff

_DIALECTS: dict[str, str | Handoff] = {
    "nixl": "router.handoff.nixl:NixlHandoff",
    "sglang": "router.handoff.sglang:SGLangHandoff",
    "sidecar": "router.handoff.sidecar:SidecarHandoff",
}


class UnknownDialect(KeyError):
    """No handoff dialect has this name."""


def names() -> tuple[str, ...]:
    """Every dialect's name, built-in first."""
    return tuple(_DIALECTS)


def register(name: str, handoff: Handoff) -> None:
    """Make ``handoff`` the dialect called ``name`` (replacing one of that name)."""
    _DIALECTS[name] = handoff


def unregister(name: str) -> None:
    """Forget a dialect :func:`register` added."""
    _DIALECTS.pop(name, None)


def get(name: str) -> Handoff:
    """The dialect called ``name`` (:class:`UnknownDialect` if none)."""
    try:
        entry = _DIALECTS[name]
    except KeyError:
        known = ", ".join(names())
        raise UnknownDialect(f"unknown handoff dialect {name!r} (known: {known})") from None
    if isinstance(entry, str):
        module, _, cls = entry.partition(":")
        entry = _DIALECTS[name] = getattr(import_module(module), cls)()
    return entry
