"""A pure, clocked model of one vLLM-style engine: scheduler, block cache and step timing.

Nothing here reads a clock, sleeps or touches a socket: every call takes ``now`` (model
seconds), and a driver decides how model time maps to wall time. The real-time emulator
sleeps ``duration x time_scale`` between ``start_step`` and ``finish_step``; a
discrete-event simulator jumps its virtual clock instead. Both get the same behaviour::

    engine.submit(request, now)
    duration = engine.start_step(now)        # None: nothing to run
    result = engine.finish_step(now + duration)

Scheduling follows vLLM V1 with chunked prefill. Each step has a token budget
(``max_num_batched_tokens``): running sequences are served first (a decode costs one
token, an unfinished prefill takes the next chunk), then waiting sequences are admitted
first come, first served while the budget, ``max_num_seqs`` and free blocks allow. A
sequence whose last computed token completes its known tokens samples one new token.

When a running sequence needs a block and none is free, the most recently admitted
running sequence is preempted by recompute: its blocks are released (they stay cached
until evicted, so it usually gets them back as prefix hits), and it returns to the
front of the waiting queue with the tokens it already generated.

Blocks are registered in the prefix cache (and announced with ``BlockStored``) when a
step that fills them is scheduled, as vLLM's ``allocate_slots`` does: a request admitted
later in the same scheduling pass already hits them, because within one forward pass
every layer writes its KV before attention reads it. Generated tokens fill and register
blocks too, so a follow-up turn that repeats an answer hits it.

Disaggregated serving has two legs, each an ordinary request with one flag:

* ``remote_decode`` (the prefill leg): when it finishes, its blocks stay referenced in
  ``holds`` until a decode engine claims and releases them, or until
  ``kv_hold_timeout_s`` passes (see ``holds.py``).
* ``remote_prefill`` (the decode leg): at admission it takes its local prefix hits and
  blocks for the whole prompt, then waits ``transfer_time(tokens not cached locally)``
  without computing (vLLM's ``WAITING_FOR_REMOTE_KVS``). When the transfer is done, its
  prompt counts as computed except the last token, which it computes to sample its
  first output, as vLLM does after a NIXL read.

Timed events that are not steps (a transfer ending, a hold expiring) are reported by
``next_wakeup`` so that a driver can sleep until then when no step is runnable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from router.engine_model.block_cache import BlockCache
from router.engine_model.holds import HeldKV, HoldTable
from router.engine_model.params import EngineParams
from router.engine_model.sampling import output_token_ids
from router.events.types import KVEvent
from router.hashing import block_keys, cacheable_blocks, chain
from router.media import MediaKey, MediaSpan, block_extra_keys
from router.tokenization.words import WordTokenizer

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What a driver submits: one sequence to prefill and decode.

    ``sample_seed`` selects among answers to the same prompt (choice index of ``n > 1``
    or a client ``seed``); 0 gives the canonical answer. A sampled token in
    ``stop_token_ids`` ends the request (``finish_reason`` "stop") once ``min_tokens``
    tokens exist; otherwise it runs to ``max_tokens`` (EOS is ignored).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None
    sample_seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    #: Prefill leg: keep the blocks after finishing, for a decode engine to take.
    remote_decode: bool = False
    #: Decode leg: the prompt's KV arrives from a prefill engine instead of being computed.
    remote_prefill: bool = False
    #: Decode leg: bytes per second of its transfer's link (None: the engine's
    #: ``kv_transfer_bandwidth``) and the link's fixed seconds; the cluster simulator
    #: sets them by the pair's locality and the contention on its racks' uplinks.
    transfer_bandwidth: float | None = None
    transfer_latency_s: float = 0.0
    #: Media items' placeholder tokens in the prompt: their blocks' hashes and events'
    #: ``extra_keys`` carry ``(identifier, offset)`` pairs, as vLLM's do.
    media: tuple[MediaSpan, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    num_prompt_tokens: int
    #: Prompt tokens served from the prefix cache at first admission (usage.cached_tokens).
    num_cached_tokens: int
    #: Model seconds from arrival to the first token, set in the step that produced it.
    ttft: float | None = None
    #: Model seconds from arrival to the last token, set when finished.
    e2e: float | None = None
    #: "length" (``max_tokens`` reached) or "stop" (a stop token), set when finished.
    finish_reason: str | None = None
    #: The stop token that ended the request.
    stop_reason: int | None = None
    #: Prompt tokens whose KV was transferred from a remote prefill engine.
    num_transferred_tokens: int = 0
    #: The blocks a finished ``remote_decode`` request keeps for a decode engine.
    held: HeldKV | None = None


@dataclass(slots=True)
class StepResult:
    """Everything a completed step changed that a driver must pass on."""

    now: float
    outputs: list[RequestOutput]
    #: KV-cache events since the previous step, in order.
    events: list[KVEvent]
    #: Requests preempted by recompute while this step was scheduled.
    preempted: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Point-in-time load and cumulative counters, named after vLLM's metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    #: Finished prefill-only requests whose blocks are pinned for a decode engine.
    num_held_requests: int = 0
    num_held_blocks: int = 0
    #: Holds freed by their timeout rather than by a decode engine.
    num_expired_holds: int = 0
    #: Prompt tokens of decode legs whose KV came from a remote prefill engine.
    kv_transferred_tokens: int = 0


@dataclass(eq=False, slots=True)
class _Sequence:
    spec: RequestSpec
    arrival: float
    tokens: list[int]
    output: list[int]
    root: int
    #: Engine block hashes of the full blocks of ``tokens`` computed so far (a prefix).
    hashes: list[int]
    #: Media extra keys per block index (blocks holding media placeholder tokens).
    extras: dict[int, list[MediaKey]] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    registered: int = 0
    generated: int = 0
    num_cached_tokens: int = -1
    first_token_at: float | None = None
    aborted: bool = False
    #: Tokens a ``remote_prefill`` sequence took from the remote engine (set at admission).
    transferred: int = 0
    #: Model time at which its transfer completes.
    ready_at: float = 0.0


class EngineModel:
    """One engine (one data-parallel rank): its queues, its cache and its step timing."""

    def __init__(
        self,
        params: EngineParams,
        hash_seed: int,
        emit_events: bool = True,
        vocabulary: Sequence[int] | None = None,
    ) -> None:
        """``hash_seed`` roots the engine's own block hashes (opaque to routers, like
        vLLM's random ``NONE_HASH``); ``vocabulary`` is what outputs are drawn from."""
        self.params = params
        self.hash_seed = hash_seed & _MASK64
        self.cache = BlockCache(
            params.num_gpu_blocks, params.block_size, emit_events, params.num_cpu_blocks
        )
        self._vocabulary = list(vocabulary or WordTokenizer().generation_ids)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        #: Decode legs admitted and waiting for their KV transfer, in admission order.
        self._transferring: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        #: Blocks of finished prefill-only requests, pinned for decode engines.
        self.holds = HoldTable(self.cache, params.kv_hold_timeout_s)
        self._inflight: list[tuple[_Sequence, int]] | None = None
        #: Model time of the latest step scheduled (a request arriving later waits).
        self._scheduled_at = float("-inf")
        self._preempted: list[str] = []
        self._queries = 0
        self._hits = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._transferred_tokens = 0

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError when a request can never run on this engine."""
        if prompt_len < 1:
            raise ValueError("the prompt must hold at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        limit = self.params.max_model_len
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt "
                "or completion."
            )

    def submit(self, spec: RequestSpec, now: float) -> None:
        """Queue a request. Raises ValueError for a duplicate id or an impossible request."""
        if spec.request_id in self._by_id:
            raise ValueError(f"request {spec.request_id!r} is already in the engine")
        prompt = list(spec.prompt_token_ids)
        self.validate(len(prompt), spec.max_tokens)
        root = self._root(spec.lora_name, spec.cache_salt)
        bs = self.params.block_size
        extras = block_extra_keys(spec.media, bs)
        seq = _Sequence(
            spec=spec,
            arrival=now,
            tokens=prompt,
            output=output_token_ids(prompt, spec.max_tokens, self._vocabulary, spec.sample_seed),
            root=root,
            hashes=block_keys(prompt, bs, root, extra=extras),
            extras=extras,
        )
        self._by_id[spec.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request wherever it is and release its blocks; False if unknown."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        seq.aborted = True
        if seq.blocks:
            self.cache.release(seq.blocks)
            seq.blocks = []
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._transferring:
            self._transferring.remove(seq)
        else:
            self._waiting.remove(seq)
        return True

    def claim_hold(self, request_id: str, block_ids: Sequence[int] | None, now: float) -> HeldKV:
        """A decode engine starts reading a held request's blocks (see ``HoldTable.claim``).

        Raises ``HandoffError`` when the request holds nothing (never held, expired,
        already pulled) or holds other blocks than ``block_ids``.
        """
        return self.holds.claim(request_id, block_ids, now)

    def peek_hold(self, request_id: str, now: float) -> HeldKV | None:
        """What a held request holds, without claiming it (None: nothing held)."""
        return self.holds.peek(request_id, now)

    def release_hold(self, request_id: str, now: float) -> bool:
        """Free a held request's blocks (read complete, or never to be read)."""
        self.holds.expire(now)
        return self.holds.release(request_id)

    def next_wakeup(self) -> float | None:
        """The next model time at which something happens without a step: a transfer
        completing, a hold expiring or a queued request arriving after the latest step
        was scheduled (None: nothing timed is pending)."""
        times = [seq.ready_at for seq in self._transferring]
        expiry = self.holds.next_expiry()
        if expiry is not None:
            times.append(expiry)
        if self._waiting and self._waiting[0].arrival > self._scheduled_at:
            times.append(self._waiting[0].arrival)
        return min(times) if times else None

    def reset_prefix_cache(self, now: float) -> bool:
        """Forget all cached blocks; refused (False) while requests hold blocks."""
        return self.cache.reset()

    def take_events(self) -> list[KVEvent]:
        """KV events produced outside steps (a reset) or not yet taken."""
        return self.cache.take_events()

    # ------------------------------------------------------------------ stepping

    @property
    def has_work(self) -> bool:
        """Whether requests are queued, running or waiting for a KV transfer."""
        return bool(self._running or self._waiting or self._transferring)

    def start_step(self, now: float) -> float | None:
        """Schedule one step and return its duration, or None when there is nothing to run."""
        if self._inflight is not None:
            raise RuntimeError("start_step called twice without finish_step")
        self._scheduled_at = now
        self.holds.expire(now)
        if self._transferring:
            self._complete_transfers(now)
        p = self.params
        bs = p.block_size
        budget = p.max_num_batched_tokens
        scheduled: list[tuple[_Sequence, int]] = []
        preempted_now = False
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.tokens) - seq.computed, budget)
            need = -(-(seq.computed + n) // bs) - len(seq.blocks)
            victim = None
            while need > 0 and victim is not seq and not self.cache.can_allocate(need):
                victim = running[-1]
                self._preempt(victim)
                preempted_now = True
            if victim is seq:
                break
            if need > 0:
                seq.blocks.extend(self.cache.allocate(need))
            scheduled.append((seq, n))
            self._register_full_blocks(seq, seq.computed + n)
            budget -= n
            i += 1
        # Like vLLM, a step that had to preempt admits nobody new. A request submitted
        # with a later time than the step's (a driver that woke late for an earlier one)
        # waits for the next step: the queue is in arrival order.
        transferring = self._transferring
        while (
            not preempted_now
            and self._waiting
            and self._waiting[0].arrival <= now
            and budget > 0
            and len(running) + len(transferring) < p.max_num_seqs
        ):
            seq = self._waiting[0]
            if seq.spec.remote_prefill and seq.num_cached_tokens < 0:
                # A decode leg's first admission starts its transfer and computes nothing.
                if not self._admit_remote(seq, now):
                    break
                self._waiting.popleft()
                transferring.append(seq)
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break
            self._waiting.popleft()
            running.append(seq)
            scheduled.append((seq, n))
            self._register_full_blocks(seq, seq.computed + n)
            budget -= n
        if not scheduled:
            return None
        self._inflight = scheduled
        return self._duration(scheduled)

    def finish_step(self, now: float) -> StepResult:
        """Apply the step started last: advance sequences, sample tokens, cache blocks."""
        if self._inflight is None:
            raise RuntimeError("finish_step called without start_step")
        scheduled, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        for seq, n in scheduled:
            if seq.aborted:
                continue
            seq.computed += n
            if seq.computed < len(seq.tokens):
                continue  # a prefill chunk that did not reach the end
            spec = seq.spec
            token = seq.output[seq.generated]
            seq.tokens.append(token)
            seq.generated += 1
            self._generation_tokens += 1
            stopped = token in spec.stop_token_ids and seq.generated >= spec.min_tokens
            out = RequestOutput(
                request_id=spec.request_id,
                new_token_ids=[token],
                finished=stopped or seq.generated >= spec.max_tokens,
                num_prompt_tokens=len(spec.prompt_token_ids),
                num_cached_tokens=seq.num_cached_tokens,
                num_transferred_tokens=seq.transferred,
            )
            if seq.first_token_at is None:
                seq.first_token_at = now
                out.ttft = now - seq.arrival
                self._prompt_tokens += out.num_prompt_tokens
            if out.finished:
                out.e2e = now - seq.arrival
                out.finish_reason = "stop" if stopped else "length"
                out.stop_reason = token if stopped else None
                out.held = self._finish(seq, now)
            outputs.append(out)
        preempted, self._preempted = self._preempted, []
        events = self.cache.take_events()
        return StepResult(now=now, outputs=outputs, events=events, preempted=preempted)

    # ------------------------------------------------------------------ queries

    def stats(self) -> EngineStats:
        cache = self.cache
        holds = self.holds
        return EngineStats(
            num_running=len(self._running),
            # vLLM keeps requests waiting for remote KV in its waiting queues too.
            num_waiting=len(self._waiting) + len(self._transferring),
            kv_cache_usage=cache.usage,
            num_free_blocks=cache.num_free,
            num_cached_blocks=cache.num_cached,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_preemptions=self._preemptions,
            num_held_requests=len(holds),
            num_held_blocks=holds.num_blocks,
            num_expired_holds=holds.num_expired,
            kv_transferred_tokens=self._transferred_tokens,
        )

    def step_duration(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """The step-time model (see EngineParams) for one batch composition."""
        p = self.params
        return (
            p.step_overhead_s
            + prefill_tokens * p.prefill_token_s
            + decode_seqs * p.decode_seq_s
            + context_tokens * p.context_token_s
        )

    # ------------------------------------------------------------------ internals

    def _root(self, lora_name: str | None, cache_salt: str | None) -> int:
        # vLLM folds the LoRA name into every block's extra keys and the salt into the
        # first block's; chaining makes folding both into the root equivalent.
        if lora_name is None and cache_salt is None:
            return self.hash_seed
        material = f"{lora_name or ''}\x00{cache_salt or ''}".encode()
        return xxhash.xxh3_64_intdigest(material, self.hash_seed)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.params.block_size)

    def _ensure_hashes(self, seq: _Sequence, count: int) -> None:
        """Extend ``seq.hashes`` to cover ``count`` full blocks of its tokens."""
        bs = self.params.block_size
        hashes = seq.hashes
        while len(hashes) < count:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.root
            hashes.append(chain(parent, seq.tokens[i * bs : (i + 1) * bs], seq.extras.get(i, ())))

    def _admit(self, seq: _Sequence, budget: int) -> int:
        """Give a waiting sequence its prefix hits and first chunk; 0 if it does not fit."""
        bs = self.params.block_size
        total = len(seq.tokens)
        cap = cacheable_blocks(total, bs)
        self._ensure_hashes(seq, cap)
        hits = self.cache.match(seq.hashes, cap)
        # Blocks the offload tier holds past the GPU hits are loaded back, not computed:
        # they get GPU blocks like computed ones and are registered with them.
        loaded = self.cache.match_offloaded(seq.hashes, len(hits), cap)
        hit_tokens = (len(hits) + loaded) * bs
        n = min(total - hit_tokens, budget)
        need = self._blocks_for(hit_tokens + n) - len(hits)
        if not self.cache.can_allocate(need, hits):
            return 0
        self.cache.touch(hits)
        seq.blocks = hits + self.cache.allocate(need)
        seq.computed = hit_tokens
        seq.registered = len(hits)
        if seq.num_cached_tokens < 0:
            # vLLM counts prefix-cache queries and hits at first admission only.
            seq.num_cached_tokens = hit_tokens
            self._queries += total
            self._hits += hit_tokens
        return n

    def _admit_remote(self, seq: _Sequence, now: float) -> bool:
        """Admit a decode leg: local prefix hits, blocks for the whole prompt, and the
        transfer of the rest; False if the blocks do not fit."""
        bs = self.params.block_size
        total = len(seq.tokens)
        cap = cacheable_blocks(total, bs)
        self._ensure_hashes(seq, cap)
        hits = self.cache.match(seq.hashes, cap)
        need = self._blocks_for(total) - len(hits)
        if not self.cache.can_allocate(need, hits):
            return False
        self.cache.touch(hits)
        seq.blocks = hits + self.cache.allocate(need)
        hit_tokens = len(hits) * bs
        seq.computed = hit_tokens
        seq.registered = len(hits)
        # The local prefix-cache counters see only the local hit, as in vLLM; the
        # request's cached tokens are everything it will not compute.
        self._queries += total
        self._hits += hit_tokens
        seq.num_cached_tokens = total - 1
        seq.transferred = total - hit_tokens
        self._transferred_tokens += seq.transferred
        spec = seq.spec
        seq.ready_at = (
            now
            + self.params.transfer_time(seq.transferred, spec.transfer_bandwidth)
            + spec.transfer_latency_s
        )
        return True

    def _complete_transfers(self, now: float) -> None:
        """Move decode legs whose KV has arrived to the running set."""
        still: list[_Sequence] = []
        for seq in self._transferring:
            if seq.ready_at > now:
                still.append(seq)
                continue
            # The transferred blocks become this engine's own cache, as vLLM caches a
            # request's blocks once its remote KV has arrived.
            seq.computed = len(seq.tokens) - 1
            self._register_full_blocks(seq, seq.computed)
            self._running.append(seq)
        self._transferring = still

    def _preempt(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.cache.release(seq.blocks)
        seq.blocks = []
        seq.computed = 0
        seq.registered = 0
        self._waiting.appendleft(seq)
        self._preemptions += 1
        self._preempted.append(seq.spec.request_id)

    def _register_full_blocks(self, seq: _Sequence, upto_tokens: int) -> None:
        """Register the blocks that ``upto_tokens`` computed tokens fill."""
        bs = self.params.block_size
        full = upto_tokens // bs
        start = seq.registered
        if full <= start:
            return
        self._ensure_hashes(seq, full)
        spec = seq.spec
        extra: list[list[object] | None] | None = None
        if spec.lora_name is not None or spec.cache_salt is not None or seq.extras:
            # Per block, what vLLM hashes besides tokens, in its order: the adapter name on
            # every block, the media pairs of the items overlapping the block, the cache
            # salt on the first block.
            lora: list[object] = [spec.lora_name] if spec.lora_name is not None else []
            salt: list[object] = [spec.cache_salt] if spec.cache_salt is not None else []
            extra = [
                (lora + list(seq.extras.get(i, ())) + (salt if i == 0 else [])) or None
                for i in range(start, full)
            ]
        self.cache.store(
            seq.blocks[start:full],
            seq.hashes[start:full],
            seq.hashes[start - 1] if start else None,
            seq.tokens[start * bs : full * bs],
            lora_id=spec.lora_id,
            lora_name=spec.lora_name,
            extra_keys=extra,
        )
        seq.registered = full

    def _finish(self, seq: _Sequence, now: float) -> HeldKV | None:
        """Retire a finished sequence: free its blocks, or hold them for a decode engine."""
        self._running.remove(seq)
        spec = seq.spec
        del self._by_id[spec.request_id]
        blocks, seq.blocks = seq.blocks, []
        if spec.remote_decode:
            return self.holds.add(
                spec.request_id, blocks, spec.prompt_token_ids, spec.lora_name, spec.cache_salt, now
            )
        self.cache.release(blocks)
        return None

    def _duration(self, scheduled: list[tuple[_Sequence, int]]) -> float:
        prefill = decode = context = 0
        for seq, n in scheduled:
            if n == 1 and seq.generated and seq.computed == len(seq.tokens) - 1:
                decode += 1
                context += seq.computed
            else:
                prefill += n
        return self.step_duration(prefill, decode, context)
