"""Block keys: chained xxh3_64 hashes of a prompt's full token blocks.

Key *i* identifies the whole prefix up to and including block *i*::

    key[-1] = seed(namespace, cache_salt)
    key[i]  = XXH3_64bits_withSeed(le_u32(tokens of block i), seed=key[i-1])

The previous key enters as XXH3's 64-bit seed, so each block costs one C call on a
zero-copy slice and no concatenation. The namespace is the model name, or the LoRA
adapter name when the request names an adapter; ``cache_salt`` (vLLM's per-tenant
isolation) is folded in too, so salted prompts never share keys with unsalted ones.
Only full blocks are hashed: a partial trailing block is never cached by an engine.

A block that holds media placeholder tokens (``router.media``) also folds in its extra
keys, the ``(identifier, offset)`` pairs of the items overlapping it (vLLM's per-block
``extra_keys``)::

    key[i]  = XXH3_64bits_withSeed(extra(block i), seed=XXH3_64(le_u32(block i), key[i-1]))

where ``extra`` encodes each pair as ``"mm" le_u32(len) identifier le_i64(offset)`` (and a
prompt-embedding digest as ``"pe" le_u32(len) digest``). Blocks without extra keys, and so
every block of a text-only prompt and every block before a prompt's first media item,
keep the plain key; every block from the first media item on depends on the item.

The chain of a prompt without extra keys runs in one call of the compiled helper
``router._native`` (router/native/native.c, xxHash compiled in) when the install
built it: 8,192 tokens from a list in ~33 µs instead of ~160 µs. Without it (no C
compiler at install, or ``KVROUTE_PURE_PYTHON=1`` in the environment) the pure-Python
loop below runs; both give the same keys (tests/unit/test_native_hashing.py).
"""

from __future__ import annotations

import functools
import importlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest

assert array("I").itemsize == 4, "array('I') must hold 32-bit unsigned ints"
_NATIVE_LE = sys.byteorder == "little"

ExtraKey = tuple[str, int] | bytes
"""A block's extra key: a media item's (identifier, offset in the block), or the digest of
the block's prompt embeddings (which no request the router tokenizes can reproduce)."""
BlockExtras = Mapping[int, Sequence[ExtraKey]]
"""Extra keys per block index; blocks not in the map have none."""


def native_helper() -> ModuleType | None:
    """The compiled helper ``router._native``, or None where the install did not build
    it or ``KVROUTE_PURE_PYTHON=1`` asks for the pure-Python paths."""
    if os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module("router._native")
    except ImportError:
        return None


_helper = native_helper()
_native_block_keys: Callable[[object, int, int, int], list[int]] | None = getattr(
    _helper, "block_keys", None
)
NATIVE = _native_block_keys is not None
"""Whether block keys are computed by the compiled helper (else the pure-Python path)."""
_NATIVE_KINDS = (list, tuple, bytes)

_LEN = struct.Struct("<I")
_OFFSET = struct.Struct("<q")


@functools.lru_cache(maxsize=4096)
def seed_for(namespace: str, cache_salt: str | None = None) -> int:
    """The chain's starting value for a model (or LoRA adapter) and optional cache salt
    (the last 4,096 pairs are remembered: every request asks)."""
    material = f"kvroute-v1\x00{namespace}\x00{cache_salt or ''}".encode()
    return _xxh3(material)


def tokens_to_bytes(tokens: Sequence[int] | array) -> bytes:
    """Little-endian uint32 encoding of token ids.

    Raises OverflowError for ids outside [0, 2**32), which callers turn into 400s.
    """
    buf = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if not _NATIVE_LE:
        buf = array("I", buf)
        buf.byteswap()
    return buf.tobytes()


def fold_extra(key: int, extra: Sequence[ExtraKey]) -> int:
    """A block's key with its extra keys folded in (``key`` unchanged when there are none)."""
    if not extra:
        return key
    parts: list[bytes] = []
    for item in extra:
        if isinstance(item, bytes):
            parts += (b"pe", _LEN.pack(len(item)), item)
        else:
            ident = item[0].encode("utf-8", "surrogatepass")
            parts += (b"mm", _LEN.pack(len(ident)), ident, _OFFSET.pack(item[1]))
    return _xxh3(b"".join(parts), key)


def block_keys(
    tokens: Sequence[int] | array | bytes,
    block_size: int,
    seed: int,
    max_blocks: int | None = None,
    extra: BlockExtras | None = None,
) -> list[int]:
    """Chained keys of every full block of ``tokens`` (at most ``max_blocks`` of them),
    with ``extra`` keys folded into the blocks that have some."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    native = _native_block_keys
    if native is not None and not extra:
        kind = type(tokens)
        if kind in _NATIVE_KINDS or (kind is array and tokens.typecode == "I"):  # type: ignore[union-attr]
            limit = -1 if max_blocks is None else max(max_blocks, 0)
            return native(tokens, block_size, seed, limit)
    return _block_keys_python(tokens, block_size, seed, max_blocks, extra)


def _block_keys_python(
    tokens: Sequence[int] | array | bytes,
    block_size: int,
    seed: int,
    max_blocks: int | None = None,
    extra: BlockExtras | None = None,
) -> list[int]:
    """:func:`block_keys` in Python alone (the path without the compiled helper)."""
    data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    step = block_size * 4
    nblocks = len(data) // step
    if max_blocks is not None:
        nblocks = min(nblocks, max_blocks)
    view = memoryview(data)
    keys: list[int] = []
    append = keys.append
    key = seed
    if not extra:
        for off in range(0, nblocks * step, step):
            key = _xxh3(view[off : off + step], key)
            append(key)
        return keys
    for i in range(nblocks):
        off = i * step
        key = _xxh3(view[off : off + step], key)
        block_extra = extra.get(i)
        if block_extra:
            key = fold_extra(key, block_extra)
        append(key)
    return keys


def chain(parent_key: int, block_tokens: Sequence[int], extra: Sequence[ExtraKey] = ()) -> int:
    """The key of one block that follows a block whose key is ``parent_key``."""
    return fold_extra(_xxh3(tokens_to_bytes(block_tokens), parent_key), extra)


def extend_keys(parent_key: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """Keys of consecutive full blocks of ``tokens`` chained after ``parent_key``."""
    return block_keys(tokens, block_size, parent_key)


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading blocks an engine can serve from cache: never the last token."""
    if prompt_len <= 1:
        return 0
    return (prompt_len - 1) // block_size
