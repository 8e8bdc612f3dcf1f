"""The workload model: what ``kvroute bench`` sends and ``kvroute simulate`` replays.

Pure (no network, no clock, no event loop), so the simulator replays exactly what the
live benchmark sends, and neither depends on the other:

* ``spec``: :class:`~router.workloads.spec.RequestSpec`, one request to send, and the
  tokens an emulated engine sees for it;
* ``traces``: Mooncake and Azure traces read and selected (the public ones bundled in
  ``bundled_traces/``); ``expansion``: their hash ids expanded into prompts;
* ``generated``: shared-prefix, samples and multi-turn chat workloads;
* ``ceilings``: the hit rates an infinite cache would reach;
* ``flags``: the workload flags and :func:`~router.workloads.flags.build_workload`;
* ``stats`` and ``tables``: the numbers runs are judged by and their side-by-side tables.
"""
