"""The configuration in force, and who applies which section of it when it changes.

:class:`LiveConfig` holds the running :class:`~router.config.Config`. Code that reads a
value where it uses it (a request handler reading ``limits.max_n``) reads
:attr:`LiveConfig.current` (``RouterApp.config``) and needs nothing more. A component that
keeps something built from a section (the policy object from ``policy``, the proxy's
timeouts from ``proxy``) subscribes to that section with a callback and rebuilds it
there. :mod:`router.reload` validates a new configuration, keeps the keys that need a
restart at their running values, and publishes the result: ``current`` changes first,
then every subscriber of a changed section is called, in the order they subscribed.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from router.config import Config

Apply = Callable[[Config, Config], Awaitable[None] | None]
"""A subscriber's callback: (the new configuration, the previous one)."""

#: The configuration's top-level keys: the sections one can subscribe to.
SECTIONS: frozenset[str] = frozenset(Config.model_fields)


@dataclass(frozen=True, slots=True)
class Subscription:
    name: str
    """Who applies the sections (shown in errors and tests)."""
    sections: frozenset[str]
    apply: Apply


class LiveConfig:
    """The running configuration and the subscribers of its sections."""

    def __init__(self, config: Config) -> None:
        self._current = config
        self._subscriptions: list[Subscription] = []

    @property
    def current(self) -> Config:
        """The configuration in force (a new object after each published change)."""
        return self._current

    def subscribe(self, name: str, sections: Iterable[str], apply: Apply) -> None:
        """Call ``apply`` whenever one of ``sections`` (top-level keys) changes."""
        wanted = frozenset(sections)
        if not wanted or not wanted <= SECTIONS:
            raise ValueError(f"{name}: no configuration section {sorted(wanted - SECTIONS)}")
        self._subscriptions.append(Subscription(name, wanted, apply))

    def subscribers(self, section: str) -> list[str]:
        """The names of the subscribers of ``section``, in call order."""
        return [s.name for s in self._subscriptions if section in s.sections]

    async def publish(self, config: Config) -> list[str]:
        """Make ``config`` current and call the subscribers of the sections that changed;
        returns the names of those called."""
        previous = self._current
        changed = {s for s in SECTIONS if getattr(config, s) != getattr(previous, s)}
        self._current = config
        called = []
        for subscription in self._subscriptions:
            if subscription.sections & changed:
                result = subscription.apply(config, previous)
                if inspect.isawaitable(result):
                    await result
                called.append(subscription.name)
        return called
