"""Blocks pinned for a remote decode engine after a prefill-only request finished.

In disaggregated serving the prefill engine computes a prompt's KV cache and a decode
engine takes it. Between the two, the prefill engine keeps the request's blocks
referenced (vLLM's NixlConnector "delays freeing" them) until the decode engine has
read them or a timeout passes (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s). While held,
the blocks count as used and cannot be evicted.

A hold goes through ``claim`` (a decode engine starts reading: a second claim fails as
"already pulled") and ``release`` (the read is done: the blocks are freed). A hold that
is never released expires. Expiry times grow with insertion order (every hold lives
for the same timeout from its creation on one clock), so expiring is a walk from the
oldest hold that stops at the first one still valid.

Pure and clocked like the rest of the engine model: every call takes ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from router.engine_model.block_cache import BlockCache

#: Why a claim failed; also the ``reason`` label of the emulator's failure metrics.
ClaimFailure = Literal["unknown", "expired", "already_pulled", "block_mismatch"]

#: How many finished holds are remembered to tell "expired" and "already pulled" apart
#: from "unknown" in error messages.
_FATES_KEPT = 10_000


class HandoffError(Exception):
    """A KV handoff that cannot happen, with a machine-readable ``reason``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class HeldKV:
    """What a held request's blocks contain: enough for another engine to adopt them."""

    request_id: str
    block_ids: tuple[int, ...]
    #: The prompt whose KV the blocks hold (the generated token is not part of it).
    prompt_token_ids: tuple[int, ...]
    lora_name: str | None
    cache_salt: str | None


@dataclass(slots=True)
class _Hold:
    kv: HeldKV
    blocks: list[int]
    expires_at: float
    claimed: bool = False


@dataclass
class HoldTable:
    """The holds of one engine, over its block cache."""

    cache: BlockCache
    timeout_s: float
    _holds: OrderedDict[str, _Hold] = field(default_factory=OrderedDict)
    _fates: OrderedDict[str, str] = field(default_factory=OrderedDict)
    num_blocks: int = 0
    num_expired: int = 0

    def __len__(self) -> int:
        """Requests holding blocks now."""
        return len(self._holds)

    def add(
        self,
        request_id: str,
        blocks: list[int],
        prompt_token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        now: float,
    ) -> HeldKV:
        """Keep ``blocks`` (already referenced by the finished request) pinned."""
        kv = HeldKV(request_id, tuple(blocks), tuple(prompt_token_ids), lora_name, cache_salt)
        self._holds[request_id] = _Hold(kv, blocks, now + self.timeout_s)
        self.num_blocks += len(blocks)
        return kv

    def peek(self, request_id: str, now: float) -> HeldKV | None:
        """The blocks a request holds at ``now``, without claiming them."""
        self.expire(now)
        hold = self._holds.get(request_id)
        return None if hold is None else hold.kv

    def claim(self, request_id: str, block_ids: Sequence[int] | None, now: float) -> HeldKV:
        """Start a remote read of a held request; raises ``HandoffError`` if impossible.

        ``block_ids``, when given, must be exactly the blocks the request holds: a decode
        engine reads the block ids its parameters name, and any others would be garbage.
        """
        self.expire(now)
        hold = self._holds.get(request_id)
        if hold is None:
            fate = self._fates.get(request_id)
            if fate == "expired":
                raise HandoffError(
                    "expired",
                    f"the KV blocks of request {request_id!r} expired after being held "
                    f"{self.timeout_s:g} s without a decode engine pulling them",
                )
            if fate == "pulled":
                raise HandoffError(
                    "already_pulled", f"the KV blocks of request {request_id!r} were already pulled"
                )
            raise HandoffError(
                "unknown", f"this engine holds no KV blocks for request {request_id!r}"
            )
        if hold.claimed:
            raise HandoffError(
                "already_pulled",
                f"the KV blocks of request {request_id!r} are already being pulled",
            )
        if block_ids is not None and tuple(block_ids) != hold.kv.block_ids:
            raise HandoffError(
                "block_mismatch",
                f"request {request_id!r} holds blocks {list(hold.kv.block_ids)}, "
                f"not {list(block_ids)}",
            )
        hold.claimed = True
        return hold.kv

    def release(self, request_id: str) -> bool:
        """Free a hold's blocks (its read is complete, or it will never be read)."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self._free(request_id, hold, "pulled" if hold.claimed else "released")
        return True

    def expire(self, now: float) -> int:
        """Free every hold whose timeout has passed; returns how many."""
        count = 0
        holds = self._holds
        while holds:
            request_id, hold = next(iter(holds.items()))
            if hold.expires_at > now:
                break
            del holds[request_id]
            self._free(request_id, hold, "expired")
            count += 1
        self.num_expired += count
        return count

    def next_expiry(self) -> float | None:
        """Model time at which the oldest hold expires (None without holds)."""
        for hold in self._holds.values():
            return hold.expires_at
        return None

    def _free(self, request_id: str, hold: _Hold, fate: str) -> None:
        self.cache.release(hold.blocks)
        self.num_blocks -= len(hold.blocks)
        self._fates[request_id] = fate
        if len(self._fates) > _FATES_KEPT:
            self._fates.popitem(last=False)
