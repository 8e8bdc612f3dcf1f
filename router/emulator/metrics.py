"""Prometheus metrics under vLLM's names, one registry per emulated engine.

Gauges and counters are read from the engine model at scrape time (the model keeps the
totals, so nothing is counted twice); latency histograms are observed as requests
progress. Labels follow vLLM: ``model_name`` and ``engine`` (the data-parallel rank).
Latencies are in model seconds: with ``--time-scale`` they describe the emulated GPU,
not the wall clock.

The emulator's own ``kvroute_emulator_*`` metrics prove to tests what happened inside:
KV handoffs (tokens pulled, recomputed, held; failures by reason), requests aborted by
a departing client, and injected faults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.engine_model import EngineParams, EngineStats, RequestOutput

# vLLM's bucket boundaries, so dashboards built for vLLM read the emulator unchanged.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_LABELS = ("model_name", "engine")

StatsSource = Callable[[], EngineStats]


class _StatsCollector(Collector):
    """Gauges and counters derived from each rank's ``EngineStats`` when scraped."""

    def __init__(self, model_name: str, params: EngineParams, sglang: bool = False) -> None:
        self._model_name = model_name
        self._params = params
        self._sglang = sglang
        self._ranks: list[tuple[str, StatsSource]] = []

    def add_rank(self, engine: str, stats: StatsSource) -> None:
        self._ranks.append((engine, stats))

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "vllm:num_requests_running": "Number of requests in model execution batches.",
            "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
            "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
        }
        counters = {
            "vllm:prefix_cache_queries": (
                "Prefix cache queries, in terms of number of queried tokens."
            ),
            "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
            "vllm:prompt_tokens": "Number of prefill tokens processed.",
            "vllm:generation_tokens": "Number of generation tokens processed.",
            "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
        }
        gauges.update(
            {
                "kvroute_emulator_kv_held_requests": (
                    "Finished prefill-only requests whose KV blocks wait for a decode engine."
                ),
                "kvroute_emulator_kv_held_blocks": "KV blocks pinned for decode engines.",
            }
        )
        counters.update(
            {
                "kvroute_emulator_kv_pulled_tokens": (
                    "Prompt tokens whose KV decode legs received from a prefill engine."
                ),
                "kvroute_emulator_kv_hold_expired": (
                    "Held requests freed by the hold timeout instead of a decode engine."
                ),
            }
        )
        g = {n: GaugeMetricFamily(n, d, labels=_LABELS) for n, d in gauges.items()}
        c = {n: CounterMetricFamily(n, d, labels=_LABELS) for n, d in counters.items()}
        for engine, source in self._ranks:
            s = source()
            labels = [self._model_name, engine]
            g["vllm:num_requests_running"].add_metric(labels, s.num_running)
            g["vllm:num_requests_waiting"].add_metric(labels, s.num_waiting)
            g["vllm:kv_cache_usage_perc"].add_metric(labels, s.kv_cache_usage)
            c["vllm:prefix_cache_queries"].add_metric(labels, s.prefix_cache_queries)
            c["vllm:prefix_cache_hits"].add_metric(labels, s.prefix_cache_hits)
            c["vllm:prompt_tokens"].add_metric(labels, s.prompt_tokens)
            c["vllm:generation_tokens"].add_metric(labels, s.generation_tokens)
            c["vllm:num_preemptions"].add_metric(labels, s.num_preemptions)
            g["kvroute_emulator_kv_held_requests"].add_metric(labels, s.num_held_requests)
            g["kvroute_emulator_kv_held_blocks"].add_metric(labels, s.num_held_blocks)
            c["kvroute_emulator_kv_pulled_tokens"].add_metric(labels, s.kv_transferred_tokens)
            c["kvroute_emulator_kv_hold_expired"].add_metric(labels, s.num_expired_holds)
        yield from g.values()
        yield from c.values()
        # vLLM exports its cache config as an info-style gauge whose labels carry the values.
        info_labels = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching")
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=(*info_labels, "engine"),
        )
        p = self._params
        for engine, _ in self._ranks:
            info.add_metric([str(p.block_size), str(p.num_gpu_blocks), "auto", "True", engine], 1)
        yield info
        if self._sglang:
            # SGLang's own cache-config gauge (its page size is the block size): what tells
            # a router this server picks data-parallel ranks from the body.
            page = GaugeMetricFamily(
                "sglang:cache_config_info", "SGLang cache config", labels=("page_size",)
            )
            page.add_metric([str(p.block_size)], 1)
            yield page


class RankMetrics:
    """What the HTTP layer counts for one rank."""

    def __init__(self, metrics: EngineMetrics, engine: str) -> None:
        name = metrics.model_name
        self._ttft = metrics._ttft.labels(name, engine)
        self._e2e = metrics._e2e.labels(name, engine)
        self._recomputed = metrics._recomputed.labels(name, engine)
        self._aborted = metrics._aborted.labels(name, engine)
        self._failures = metrics._handoff_failures
        self._labels = (name, engine)
        # Labelled counters appear once touched: show every rank's at zero from the start.
        self._recomputed.inc(0)
        self._aborted.inc(0)

    def observe(self, out: RequestOutput) -> None:
        """Record a request's latencies (the driver calls this for every output)."""
        if out.ttft is not None:
            self._ttft.observe(out.ttft)
        if out.e2e is not None:
            self._e2e.observe(out.e2e)

    def recomputed(self, tokens: int) -> None:
        """A decode leg computed ``tokens`` prompt tokens itself after a failed handoff."""
        self._recomputed.inc(tokens)

    def aborted(self) -> None:
        """A client left before this rank finished its request."""
        self._aborted.inc()

    def handoff_failed(self, dialect: str, reason: str) -> None:
        """A handoff of ``dialect`` failed on this rank for ``reason``."""
        self._failures.labels(*self._labels, dialect, reason).inc()


class EngineMetrics:
    """The metrics of one engine server (all of its ranks) in its own registry."""

    def __init__(self, model_name: str, params: EngineParams, sglang: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._stats = _StatsCollector(model_name, params, sglang)
        self.registry.register(self._stats)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=_LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labelnames=_LABELS,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self._recomputed = Counter(
            "kvroute_emulator_kv_recomputed_tokens",
            "Prompt tokens decode legs computed themselves because their KV handoff failed.",
            labelnames=_LABELS,
            registry=self.registry,
        )
        self._handoff_failures = Counter(
            "kvroute_emulator_handoff_failures",
            "KV handoffs that failed, by dialect (nixl, sglang) and reason.",
            labelnames=(*_LABELS, "dialect", "reason"),
            registry=self.registry,
        )
        self._aborted = Counter(
            "kvroute_emulator_aborted_requests",
            "Requests whose client disconnected before the engine finished them.",
            labelnames=_LABELS,
            registry=self.registry,
        )
        self._faults = Counter(
            "kvroute_emulator_faults_injected",
            "Faults injected into requests, by fault.",
            labelnames=("model_name", "fault"),
            registry=self.registry,
        )

    def add_rank(self, engine: str, stats: StatsSource) -> RankMetrics:
        """Export a rank's stats; returns what its requests are counted with."""
        self._stats.add_rank(engine, stats)
        return RankMetrics(self, engine)

    def fault_injected(self, fault: str) -> None:
        """A request got ``fault``."""
        self._faults.labels(self.model_name, fault).inc()
