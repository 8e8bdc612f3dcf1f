"""The settings of the Redis index backend (router/index/redis.py) and of the Redis
connection the replicated mode shares decisions over: the ``index.redis`` section of
the configuration."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_serializer, field_validator, model_validator

from router.config_section import Section
from router.redaction import redacted


class RedisIndexConfig(Section):
    """The Redis backend of the shared index (``index.backend: redis``; docs/redis-schema.md)."""

    url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis URL (`redis://` or `rediss://`)."
    )

    @field_validator("url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        scheme, sep, _ = url.partition("://")
        if not sep or scheme.lower() not in ("redis", "rediss", "unix"):
            got = f"{scheme}://" if sep else "no scheme"  # never the URL: it may hold a password
            raise ValueError(f"must be a redis://, rediss:// or unix:// URL, not {got}")
        return url

    # The URL's password is masked wherever the configuration is shown: repr() and JSON
    # (model_dump_json, model_dump(mode="json"): config check). The attribute and
    # model_dump() keep it, for the Redis client and reloads.
    @field_serializer("url", when_used="json")
    def _url_shown(self, url: str) -> str:
        return redacted(url)

    def __repr_args__(self) -> list[tuple[str | None, Any]]:
        return [(k, redacted(v) if k == "url" else v) for k, v in super().__repr_args__()]

    namespace: str = Field("kvroute", min_length=1, description="Prefix of every Redis key.")
    budget_ms: float = Field(
        5.0,
        gt=0,
        description="A Redis call slower than this is abandoned; routing goes on "
        "without the index for that request.",
    )
    slow_calls_to_outage: int = Field(
        3,
        ge=1,
        description="Consecutive calls over `budget_ms` that mark Redis unavailable (until "
        "its probe answers). One slow answer only sends that request to the local shadow; an "
        "error reaching Redis marks it unavailable at once.",
    )
    share_load: bool = Field(
        True,
        description="Publish this replica's in-flight work per engine and count the other "
        "replicas' in every decision.",
    )
    load_interval_s: float = Field(
        0.1,
        gt=0,
        description="Seconds between exchanges of in-flight load with the other replicas "
        "(in the background, never on the request path).",
    )
    load_ttl_s: float = Field(
        1.0,
        gt=0,
        description="A replica's published load counts this long without a refresh (a "
        "replica that died stops counting after it).",
    )
    load_push: bool = Field(
        True,
        description="Between exchanges, send each change of this replica's in-flight work "
        "(a request sent, its first token, its end) to the other replicas at once, on the "
        "decision stream (paced by `index.replicated.sync_interval_s`; in the `redis` mode "
        "every replica then follows the stream). A conversation's next turn through "
        "another replica then no longer finds the previous turn counted on its engine for "
        "up to `load_interval_s`. Needs `share_load`; figures from a host whose clock is "
        "more than `load_ttl_s` behind are left to the exchange.",
    )

    @model_validator(mode="after")
    def _ttl_outlives_interval(self) -> RedisIndexConfig:
        if self.load_ttl_s <= self.load_interval_s:
            raise ValueError("load_ttl_s must be longer than load_interval_s")
        return self
