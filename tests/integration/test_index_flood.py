"""A runaway engine cannot grow the router past ``index.max_entries`` (issue 24).

``kvroute serve`` runs in its own process (its memory is what is measured) with
``index.max_entries: 50000`` and a bound KV-event socket (``events.bind_endpoint``,
llm-d's central mode). A publisher naming the router's one engine in its topic floods
500,000 distinct blocks (10x the cap) over real ZMQ while clients keep sending
requests; the router's resident memory must stay within what 50,000 records cost,
and every request must be served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import zmq.asyncio
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.vllm_publisher import Publisher

from router.events.types import BlockStored
from router.index.memory import COMPACT
from router.process import ServerProcess

MODEL = "kvroute-emulated"
CAP = 50_000
FLOOD = 10 * CAP
BLOCKS_PER_EVENT = 128
EVENTS_PER_ROUND = 20
BLOCK_SIZE = 16
BUDGET_BYTES = CAP * 1_000
"""What the router may grow by over the flood: 1 KB per record the cap allows, about
3x what a record costs with its engine-hash map (docs/benchmarks.md). Without the cap
the same flood grows it by about 300 bytes x 500,000 = 150 MB."""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def stored(first_block: int) -> BlockStored:
    """A root BlockStored of BLOCKS_PER_EVENT new blocks (their tokens are unique)."""
    hashes = list(range(first_block + 1, first_block + BLOCKS_PER_EVENT + 1))
    start = first_block * BLOCK_SIZE
    tokens = list(range(start, start + BLOCKS_PER_EVENT * BLOCK_SIZE))
    return BlockStored(hashes, None, tokens, BLOCK_SIZE, medium="GPU")


async def test_a_flood_from_one_engine_stays_within_the_index_budget(
    ipc_dir: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    engine = await start_test_engine(engine_id="flooded")
    bind = f"ipc://{ipc_dir}/flood-bind"
    config = tmp_path / "router.yaml"
    config.write_text(
        f"index:\n  max_entries: {CAP}\nevents:\n  bind_endpoint: {bind}\n"
        "server:\n  log_level: warning\n"
    )
    router = await asyncio.to_thread(
        ServerProcess, "serve", ["--port", "0", "--config", str(config), "--engine", engine.url]
    )
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx, bind, f"ipc://{ipc_dir}/flood-replay", connect=True)
    pub.topic = f"kv@127.0.0.1:{engine.port}@{MODEL}".encode()
    pid = router.proc.pid

    async def applied() -> float:
        return metric_sum(
            await metrics(http, router.url), "kvroute_kv_events_total", type="BlockStored"
        )

    async def served(i: int) -> None:
        body = {"prompt": f"still routing {i} " + "word " * 40, "max_tokens": 1}
        status, _ = await post(http, f"{router.url}/v1/completions", body)
        assert status == 200

    try:
        # The first event lands once the engine's block size is known and the
        # publisher's connection is up: resend it until it is counted.
        async def first_applied() -> bool:
            pub.restart()
            await pub.publish([stored(0)])
            await asyncio.sleep(0.05)
            return await applied() >= 1

        await poll(first_applied, timeout=30)
        for i in range(5):
            await served(i)
        baseline = peak = rss_bytes(pid)
        sent_events = 1
        for first in range(BLOCKS_PER_EVENT, FLOOD, BLOCKS_PER_EVENT * EVENTS_PER_ROUND):
            for j in range(EVENTS_PER_ROUND):
                await pub.publish([stored(first + j * BLOCKS_PER_EVENT)])
            sent_events += EVENTS_PER_ROUND
            # Pace the flood to the router's ingestion, so no message is dropped at
            # ZMQ's high-water mark and every block reaches the index.
            await poll(lambda n=sent_events: _at_least(applied, n), timeout=60, interval=0.02)
            await served(first)
            peak = max(peak, rss_bytes(pid))
        samples = await metrics(http, router.url)
        assert metric_sum(samples, "kvroute_kv_events_total", type="BlockStored") == sent_events
        assert peak - baseline <= BUDGET_BYTES, (
            f"the router grew by {(peak - baseline) / 2**20:.0f} MiB over a flood of "
            f"{FLOOD} blocks with index.max_entries {CAP}"
        )

        async def evicted() -> bool:  # index stats are refreshed every 5 s
            samples = await metrics(http, router.url)
            return (
                metric_sum(samples, "kvroute_index_evictions_total", reason="index_cap")
                >= FLOOD - CAP
            )

        await poll(evicted, timeout=15, interval=0.25)
        samples = await metrics(http, router.url)
        assert metric_sum(samples, "kvroute_index_entries") <= CAP + 1_000  # + provisional
        if COMPACT:  # the compiled tables count their bytes: about 30 a record
            assert 0 < metric_sum(samples, "kvroute_index_bytes") <= CAP * 64
        assert metric_sum(samples, "kvroute_kv_event_hashes_forgotten_total") >= FLOOD - CAP
        assert router.proc.poll() is None
    finally:
        await pub.close()
        ctx.destroy(linger=0)
        await asyncio.to_thread(router.stop)
        await engine.stop()


async def _at_least(applied: object, n: int) -> bool:
    return await applied() >= n  # type: ignore[operator]
