"""Requests-per-window and tokens-per-window limits: token buckets per key and tenant.

Each limit is a bucket that refills at ``limit / window_s`` per second and holds at
most ``limit * burst`` (at least one request; a request costlier than a whole bucket
passes when the bucket is full and leaves it in debt). A request takes from every
bucket that applies to it, or from none: the first short bucket refuses it with 429,
``Retry-After`` (when that bucket will hold enough) and an OpenAI error body naming
the limit.

``backend: redis`` keeps the buckets in Redis, shared by every router replica: one Lua
script per admission checks and takes all of a request's buckets atomically, on Redis's
clock (``TIME``), so replicas' clocks do not matter; the keys share one hash tag
(``{<namespace>:rl}``) so a Redis Cluster runs the script on one node. When Redis does
not answer within ``timeout_s`` the local buckets decide, and the fallback is counted
(``kvroute_rate_limit_fallbacks_total``): while Redis is down each replica enforces
each limit on its own. Output tokens are charged from ``max_tokens`` at admission and
corrected from the answer's usage at the end (one more script call, off the
request's path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.serving.errors import ApiError

if TYPE_CHECKING:
    from router.flow.config import FlowRateLimitConfig

log = logging.getLogger("kvroute.flow")


@dataclass(slots=True, frozen=True)
class Limit:
    """One bucket a request takes from."""

    bucket: str
    """Its name: ``key:<name>:rpm``, ``tenant:<name>:tpm``, ..."""
    limit: int
    """Requests or tokens per window."""
    cost: int
    what: str
    """``requests`` or ``tokens``."""
    owner: str
    """``key 'name'`` or ``tenant 'name'``, for the error message."""


class RateLimited(ApiError):
    """429: a rate limit of the request's key or tenant is used up."""

    def __init__(self, limit: Limit, window_s: float, retry_after: float) -> None:
        kind = "rpm" if limit.what == "requests" else "tpm"
        per = "minute" if window_s == 60 else f"{window_s:g} s"
        super().__init__(
            429,
            f"rate limit reached for {limit.owner}: {limit.limit} {limit.what} per {per} "
            f"({kind}); retry after {retry_after:.1f} s",
            code="rate_limit_exceeded",
            param=kind,
            retry_after=max(retry_after, 1.0),
        )
        self.limit = limit


class LocalBuckets:
    """Token buckets in this process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        """name -> (tokens, when they were counted)."""

    def _level(self, name: str, rate: float, cap: float, now: float) -> float:
        tokens, at = self._buckets.get(name, (cap, now))
        return min(cap, tokens + max(0.0, now - at) * rate)

    def take(self, limits: Sequence[tuple[Limit, float, float]]) -> tuple[int, float]:
        """Take from every bucket ((limit, rate per second, capacity)) or none: (index of
        the short bucket or -1, seconds until it holds enough)."""
        now = self.clock()
        levels = [self._level(lim.bucket, rate, cap, now) for lim, rate, cap in limits]
        worst, failing = 0.0, -1
        for i, ((lim, rate, cap), level) in enumerate(zip(limits, levels, strict=True)):
            need = min(lim.cost, cap)
            if level < need and (wait := (need - level) / rate) >= worst:
                worst, failing = wait, i
        if failing >= 0:
            return failing, worst
        for (lim, _, _), level in zip(limits, levels, strict=True):
            self._buckets[lim.bucket] = (level - lim.cost, now)
        return -1, 0.0

    def __len__(self) -> int:
        return len(self._buckets)

    def forget_full(self, rate: float, cap: float) -> None:
        """Drop the buckets that have refilled to ``cap`` at ``rate`` (a full bucket is
        the same as none): what keeps buckets per caller bounded."""
        now = self.clock()
        self._buckets = {
            name: (tokens, at)
            for name, (tokens, at) in self._buckets.items()
            if tokens + (now - at) * rate < cap
        }

    def add(self, limits: Sequence[tuple[Limit, float, float]]) -> None:
        """Charge ``cost`` more (a negative cost gives tokens back), whatever the level."""
        now = self.clock()
        for lim, rate, cap in limits:
            level = self._level(lim.bucket, rate, cap, now)
            self._buckets[lim.bucket] = (min(cap, level - lim.cost), now)
        if len(self._buckets) > 65536:  # full buckets hold nothing worth keeping
            self._buckets = {
                k: v for k, v in self._buckets.items() if v[0] < 0 or now - v[1] < 3600
            }


# KEYS: the buckets. ARGV: mode ("take" or "add"), then per bucket: rate per second,
# capacity, cost. Returns {1} when taken (or added), {0, index, wait seconds} when short.
SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local take = ARGV[1] == 'take'
local levels = {}
local worst, failing = 0, 0
for i = 1, #KEYS do
  local rate = tonumber(ARGV[i * 3 - 1])
  local cap = tonumber(ARGV[i * 3])
  local cost = tonumber(ARGV[i * 3 + 1])
  local v = redis.call('HMGET', KEYS[i], 'tokens', 'at')
  local tokens = tonumber(v[1]) or cap
  local at = tonumber(v[2]) or now
  local level = math.min(cap, tokens + math.max(0, now - at) * rate)
  levels[i] = level
  if take then
    local need = math.min(cost, cap)
    if level < need then
      local wait = (need - level) / rate
      if wait >= worst then worst = wait; failing = i end
    end
  end
end
if failing > 0 then return {0, failing, tostring(worst)} end
for i = 1, #KEYS do
  local rate = tonumber(ARGV[i * 3 - 1])
  local cap = tonumber(ARGV[i * 3])
  local cost = tonumber(ARGV[i * 3 + 1])
  local level = math.min(cap, levels[i] - cost)
  redis.call('HSET', KEYS[i], 'tokens', tostring(level), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((cap - level) / rate * 1000) + 1000)
end
return {1}
"""


class RateLimiter:
    """The buckets of ``flow.keys`` and ``flow.tenants``, local or in Redis."""

    def __init__(
        self,
        config: FlowRateLimitConfig,
        redis_url: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.local = LocalBuckets(clock)
        self.fallbacks = 0
        """Admissions the local buckets decided because Redis did not answer."""
        self.refused: dict[str, int] = {}
        """``rpm`` / ``tpm`` -> requests refused."""
        self._client: Any = None
        self._script: Any = None
        self._url = config.redis_url or redis_url if config.backend == "redis" else None
        self._warned_at = -1e9

    @property
    def shared(self) -> bool:
        return self._url is not None

    def _client_script(self) -> Any:
        if self._script is None:
            from router.redis.client import client_from_url

            self._client = client_from_url(self._url or "")
            self._script = self._client.register_script(SCRIPT)
        return self._script

    def _shaped(self, limits: Sequence[Limit]) -> list[tuple[Limit, float, float]]:
        window, burst = self.config.window_s, self.config.burst
        return [(lim, lim.limit / window, max(1.0, lim.limit * burst)) for lim in limits]

    def _key(self, bucket: str) -> str:
        return f"{{{self.config.namespace}:rl}}:{bucket}"

    async def _redis(self, mode: str, shaped: Sequence[tuple[Limit, float, float]]) -> Any:
        script = self._client_script()
        args: list[str] = [mode]
        for lim, rate, cap in shaped:
            args += [repr(rate), repr(cap), str(lim.cost)]
        keys = [self._key(lim.bucket) for lim, _, _ in shaped]
        return await asyncio.wait_for(script(keys=keys, args=args), self.config.timeout_s)

    def _fell_back(self, exc: BaseException) -> None:
        self.fallbacks += 1
        now = time.monotonic()
        if now - self._warned_at > 10:
            self._warned_at = now
            log.warning("rate limits: Redis unavailable (%s); limiting locally", exc)

    async def take(self, limits: Sequence[Limit]) -> None:
        """Take from every bucket of ``limits`` (raises :class:`RateLimited`)."""
        if not limits:
            return
        shaped = self._shaped(limits)
        failing, wait = -1, 0.0
        if self.shared:
            try:
                answer = await self._redis("take", shaped)
                if int(answer[0]) == 0:
                    failing, wait = int(answer[1]) - 1, float(answer[2])
                else:  # the local buckets follow, for when Redis goes away
                    self.local.add(shaped)
            except Exception as exc:  # unreachable, timed out, or refusing the script
                self._fell_back(exc)
                failing, wait = self.local.take(shaped)
        else:
            failing, wait = self.local.take(shaped)
        if failing >= 0:
            lim = limits[failing]
            kind = "rpm" if lim.what == "requests" else "tpm"
            self.refused[kind] = self.refused.get(kind, 0) + 1
            raise RateLimited(lim, self.config.window_s, wait)

    async def add(self, limits: Sequence[Limit]) -> None:
        """Charge each bucket its ``cost`` more (negative: give back); never refuses."""
        limits = [lim for lim in limits if lim.cost]
        if not limits:
            return
        shaped = self._shaped(limits)
        self.local.add(shaped)
        if self.shared:
            try:
                await self._redis("add", shaped)
            except Exception as exc:  # unreachable, timed out, or refusing the script
                self._fell_back(exc)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = self._script = None
