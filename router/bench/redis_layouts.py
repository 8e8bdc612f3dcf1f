"""Redis memory per index entry under candidate layouts (issue "The index at fleet scale").

``python -m router.bench.redis_layouts`` starts a throw-away ``redis-server`` (never the
machine's own) and writes the same fleet into it three ways, reading ``used_memory``
before and after each:

* **v2** (layout 2, the one before this release's; docs/redis-schema.md): one hash of
  every block (8-byte key -> holders: ``uint16 n`` + one ``uint16`` per holder) and one
  hash per engine and tier of the keys it holds (8-byte key -> its 8-byte engine hash);
* **bucketed**: the same fields split into many small hashes by the key's top bits, each
  small enough (``--bucket`` fields, under Redis's ``hash-max-listpack-entries``, 128 by
  default) to stay a listpack, which stores a field in a few bytes instead of a hash
  table entry's ~70;
* **bucketed, holders only**: the bucketed blocks hash and no per-engine hashes, as a
  layout would be if the engine-hash map stayed with the event writer (the floor).

Then it times a lookup of a 512-block prompt as a Lua script would do it in each layout
(one ``HMGET`` of the big hash, or one ``HGET`` per bucketed key), one call at a time,
to show what bucketing costs the lookup. Prints a table; writes JSON with ``--output``.
These are the alternatives measured before choosing layout 3, which buckets only blocks
with one holder and the engines' hash maps (``router.bench.redis_index`` measures it).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from router.bench.throwaway_redis import RedisServer
from router.workloads.stats import percentile

_KEY = struct.Struct("<Q")
LOOKUP_BLOCKS = 512

_HMGET = "return redis.call('HMGET', KEYS[1], unpack(ARGV))"
_BUCKETED_GET = """
local buckets = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local field = ARGV[i]
  local top = string.byte(field, 7) + 256 * string.byte(field, 8)
  out[i - 1] = redis.call('HGET', KEYS[1] .. (top % buckets), field)
end
return out
"""


def fleet(engines: int, blocks: int, shared_share: int) -> tuple[dict[int, list[int]], list[int]]:
    """Each engine's block keys: one block in ``shared_share`` is held by every engine."""
    rng = random.Random(7)
    shared = [rng.getrandbits(64) for _ in range(blocks // shared_share)]
    held = {
        e: shared + [rng.getrandbits(64) for _ in range(blocks - len(shared))]
        for e in range(engines)
    }
    return held, shared


def _top(packed: bytes) -> int:
    """A little-endian key's top 16 bits."""
    return packed[6] + 256 * packed[7]


def holders_value(ids: list[int]) -> bytes:
    return struct.pack(f"<H{len(ids)}H", len(ids), *(i * 8 + 1 for i in ids))


def write(
    client: redis.Redis,
    held: dict[int, list[int]],
    blocks_key: Callable[[bytes], str],
    held_key: Callable[[int, bytes], str] | None,
) -> None:
    holders: dict[int, list[int]] = {}
    for engine, keys in held.items():
        for key in keys:
            holders.setdefault(key, []).append(engine)
    pipe = client.pipeline(transaction=False)
    n = 0
    for key, ids in holders.items():
        packed = _KEY.pack(key)
        pipe.hset(blocks_key(packed), packed, holders_value(ids))
        n += 1
        if n % 5_000 == 0:
            pipe.execute()
    if held_key is not None:
        for engine, keys in held.items():
            for key in keys:
                packed = _KEY.pack(key)
                pipe.hset(held_key(engine, packed), packed, _KEY.pack(key ^ 0x5EED))
                n += 1
                if n % 5_000 == 0:
                    pipe.execute()
    pipe.execute()


def time_lookup(
    client: redis.Redis, script: str, key: str, fields: list[bytes], repeat: int
) -> float:
    sha = client.script_load(script)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        client.evalsha(sha, 1, key, *fields)
        samples.append(time.perf_counter() - t0)
    return percentile(samples, 50) * 1e6


def measure(engines: int, blocks: int, bucket: int, repeat: int) -> dict[str, Any]:
    held, shared = fleet(engines, blocks, 4)
    entries = sum(len(k) for k in held.values())
    distinct = len({k for keys in held.values() for k in keys})
    # Buckets by the key's top 16 bits (the last two bytes of its little-endian form),
    # so a Lua script finds a key's bucket without arithmetic on 64-bit integers.
    block_buckets = max(1, min(65_536, distinct // bucket))
    held_buckets = max(1, min(65_536, blocks // bucket))
    layouts: dict[str, tuple[Callable[[bytes], str], Callable[[int, bytes], str] | None]] = {
        "v2": (lambda k: "{ns}:blocks", lambda e, k: f"{{ns}}:held:{e}:0"),
        "bucketed": (
            lambda k: f"{{ns}}:blocks:{_top(k) % block_buckets}",
            lambda e, k: f"{{ns}}:held:{e}:0:{_top(k) % held_buckets}",
        ),
        "bucketed, holders only": (lambda k: f"{{ns}}:blocks:{_top(k) % block_buckets}", None),
    }
    server = RedisServer()
    rows: dict[str, Any] = {}
    try:
        client = redis.Redis.from_url(server.url)
        # A prompt whose first half every engine holds, then blocks nobody holds.
        prompt = [_KEY.pack(k) for k in shared[: LOOKUP_BLOCKS // 2]]
        unknown = random.Random(9)
        prompt += [_KEY.pack(unknown.getrandbits(64)) for _ in range(LOOKUP_BLOCKS - len(prompt))]
        for name, (blocks_key, held_key) in layouts.items():
            client.flushall()
            before = client.info("memory")["used_memory"]
            write(client, held, blocks_key, held_key)
            used = client.info("memory")["used_memory"] - before
            encoding = client.object("encoding", blocks_key(prompt[0]))
            if name == "v2":
                lookup = time_lookup(client, _HMGET, "{ns}:blocks", prompt, repeat)
            else:
                args = [str(block_buckets).encode(), *prompt]
                lookup = time_lookup(client, _BUCKETED_GET, "{ns}:blocks:", args, repeat)
            rows[name] = {
                "bytes_per_entry": used / entries,
                "blocks_encoding": encoding.decode() if isinstance(encoding, bytes) else encoding,
                "lookup_512_p50_us": lookup,
            }
        client.close()
    finally:
        server.kill()
    return {
        "engines": engines,
        "blocks_per_engine": blocks,
        "entries": entries,
        "distinct_blocks": distinct,
        "bucket_fields": bucket,
        "layouts": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=20_000, help="blocks each engine holds")
    parser.add_argument("--bucket", type=int, default=64, help="fields per bucketed hash")
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--output", default="bench-results/redis_layouts.json")
    args = parser.parse_args(argv)
    result = measure(args.engines, args.blocks, args.bucket, args.repeat)
    print(
        f"{result['engines']} engines x {result['blocks_per_engine']:,} blocks "
        f"({result['entries']:,} entries, {result['distinct_blocks']:,} distinct blocks, "
        "a quarter held by every engine)"
    )
    print(f"{'layout':<26}{'bytes/entry':>12}{'blocks hash':>14}{'lookup 512 p50':>16}")
    for name, row in result["layouts"].items():
        print(
            f"{name:<26}{row['bytes_per_entry']:>12.1f}{row['blocks_encoding']:>14}"
            f"{row['lookup_512_p50_us']:>14.0f}us"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
